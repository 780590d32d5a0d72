// Several hosts on one machine: network namespaces joined by veth pairs to a bridge, the
// coordinator in one, an agent in each of two others. A data-parallel job trains across them; then
// one host's link is cut, the node loss is detected, and the job goes on with the host that is left.
#include <gtest/gtest.h>
#include <google/protobuf/util/json_util.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

// Test-owned addresses, inside namespaces this test makes and removes.
constexpr const char* kSubnet = "10.213.77.";

class NetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(geteuid(), 0u) << "network namespaces need root: run the tests as root";
    ProcessResult netns = RunProcess({"/usr/sbin/ip", "netns", "list"});
    ASSERT_EQ(netns.exit_code, 0) << "`ip netns` is not available (deploy/setup.sh --tests installs iproute2): "
                                  << netns.output;
    tag_ = std::to_string(getpid() % 100000);
    hub_ = "lthub" + tag_;
    ASSERT_TRUE(Ip({"netns", "add", hub_}));
    ASSERT_TRUE(Ip({"-n", hub_, "link", "add", "br0", "type", "bridge"}));
    ASSERT_TRUE(Ip({"-n", hub_, "link", "set", "br0", "up"}));
    for (int host = 1; host <= 3; ++host) ASSERT_TRUE(AddHost(host));
  }

  void TearDown() override {
    processes_.clear();  // kills their process groups
    for (int host = 1; host <= 3; ++host) Ip({"netns", "del", Host(host)});
    if (!hub_.empty()) Ip({"netns", "del", hub_});
  }

  static bool Ip(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"/usr/sbin/ip"};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProcess(argv, {}, seconds(10)).exit_code == 0;
  }

  std::string Host(int host) const { return "lth" + std::to_string(host) + "-" + tag_; }
  std::string Address(int host) const { return kSubnet + std::to_string(host); }
  std::string HubSide(int host) const { return "v" + std::to_string(host) + "h"; }

  bool AddHost(int host) {
    std::string ns = Host(host);
    std::string inside = "v" + std::to_string(host) + "n";
    return Ip({"netns", "add", ns}) && Ip({"-n", ns, "link", "set", "lo", "up"}) &&
           Ip({"-n", hub_, "link", "add", HubSide(host), "type", "veth", "peer", "name", inside, "netns", ns}) &&
           Ip({"-n", hub_, "link", "set", HubSide(host), "master", "br0"}) &&
           Ip({"-n", hub_, "link", "set", HubSide(host), "up"}) &&
           Ip({"-n", ns, "addr", "add", Address(host) + "/24", "dev", inside}) &&
           Ip({"-n", ns, "link", "set", inside, "up"});
  }

  Subprocess* In(int host, std::vector<std::string> argv) {
    argv.insert(argv.begin(), {"/usr/sbin/ip", "netns", "exec", Host(host)});
    // The cluster's TLS and token (StartCluster makes them), as a deployment gives them to every node.
    processes_.push_back(std::make_unique<Subprocess>(argv, std::map<std::string, std::string>{
                                                                {"LTRAIN_HOME", dir_.Join("home")},
                                                                {"LTRAIN_TLS_CA", dir_.Join("tls/ca.pem")},
                                                                {"LTRAIN_TOKEN_FILE", dir_.Join("tls/token")},
                                                                {"OMP_NUM_THREADS", "1"}}));
    return processes_.back().get();
  }

  // The coordinator on host 1 and an agent on each of hosts 2 and 3 (host2, host3, bound to their
  // addresses; agents_ holds them); the coordinator's HOST:PORT, or "" after a test failure.
  std::string StartCluster() {
    const std::string port_file = dir_.Join("port");
    // Beyond loopback a coordinator serves TLS (or is told --insecure): a certificate for host 1.
    ProcessResult tls = RunProcess({LtrainBinary(), "coordinator", "--init-tls", dir_.Join("tls"), "--tls-hosts",
                                    Address(1)});
    EXPECT_EQ(tls.exit_code, 0) << tls.output;
    Subprocess* coordinator = In(1, {LtrainBinary(), "coordinator", "--listen", Address(1) + ":0", "--port-file",
                                     port_file, "--state-dir", dir_.Join("state"), "--tls-cert",
                                     dir_.Join("tls/server.pem"), "--tls-key", dir_.Join("tls/server.key")});
    const int port = WaitForPortFile(port_file);
    EXPECT_GT(port, 0) << coordinator->Output();
    if (port <= 0) return "";
    const std::string address = Address(1) + ":" + std::to_string(port);
    for (int host : {2, 3}) {
      const std::string name = "host" + std::to_string(host);
      agents_.push_back(In(host, {LtrainBinary(), "agent", "--coordinator", address, "--node-id", name, "--bind-address",
                                  Address(host), "--work-dir", dir_.Join("agent" + std::to_string(host))}));
    }
    return address;
  }

  TempDir dir_;
  std::vector<Subprocess*> agents_;
  std::string tag_, hub_;
  std::vector<std::unique_ptr<Subprocess>> processes_;
};

TEST_F(NetnsTest, TrainsAcrossHostsAndSurvivesACutLink) {
  ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  const std::string address = StartCluster();
  ASSERT_FALSE(address.empty());
  Subprocess* agent2 = agents_[0];
  Subprocess* agent3 = agents_[1];
  std::string recipe = dir_.Write("net.yaml", TinyRecipe("net", dir_.Join("data")) +
                                              "training: {steps: 300, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                              "parallel: {nodes: {min: 1, max: 2}, nproc_per_node: 1}\n"
                                              "checkpoint: {every: 10}\n"
                                              "fault: {max_restarts: 2, restart_backoff_s: 0.2}\n");
  std::this_thread::sleep_for(milliseconds(500));  // both agents registered
  Subprocess* launch = In(1, {LtrainBinary(), "launch", "--coordinator", address, recipe});
  ASSERT_TRUE(launch->WaitForOutput("placed rank 0 on host2", seconds(30))) << launch->Output() << agent2->Output();
  ASSERT_NE(launch->Output().find("rank 1 on host3"), std::string::npos) << launch->Output();
  ASSERT_TRUE(launch->WaitForOutput("[rank 0] step 15/", seconds(60))) << launch->Output() << agent3->Output();

  auto cut_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(Ip({"-n", hub_, "link", "set", HubSide(3), "down"}));
  ASSERT_TRUE(launch->WaitForOutput("node host3 lost", seconds(15))) << launch->Output();
  double detect_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - cut_at).count();
  EXPECT_LT(detect_s, 3.0 + 1.0 + 0.5) << "3 heartbeats + 1 s";
  ASSERT_TRUE(launch->WaitForOutput("generation 1: placed rank 0 on host2", seconds(30))) << launch->Output();
  ProcessResult result = launch->Wait(seconds(240));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("job SUCCEEDED"), std::string::npos) << result.output;
}

// `ltrain run --nodes 2`: a PyTorch script over Gloo on two hosts, MASTER_ADDR on rank 0's host and
// each rank's Gloo on its host's interface (GLOO_SOCKET_IFNAME from the agent's bind address).
TEST_F(NetnsTest, ProgramRunsAcrossTwoHosts) {
  ProcessResult torch = RunProcess({"/usr/bin/python3", "-c", "import torch.distributed"}, {}, seconds(60));
  ASSERT_EQ(torch.exit_code, 0) << "this test runs a PyTorch script: install Debian's python3-torch\n" << torch.output;
  dir_.Write("allreduce.py",
             "import os, torch, torch.distributed as dist\n"
             "dist.init_process_group('gloo')\n"
             "t = torch.tensor([float(dist.get_rank() + 1)])\n"
             "dist.all_reduce(t)\n"
             "print(f\"rank {dist.get_rank()} of {dist.get_world_size()} group {os.environ['GROUP_RANK']} \"\n"
             "      f\"master {os.environ['MASTER_ADDR']} ifname {os.environ['GLOO_SOCKET_IFNAME']} sum {t.item():g}\", "
             "flush=True)\n"
             "dist.destroy_process_group()\n");
  const std::string address = StartCluster();
  ASSERT_FALSE(address.empty());
  std::this_thread::sleep_for(milliseconds(500));  // both agents registered
  Subprocess* run = In(1, {LtrainBinary(), "run", "--coordinator", address, "--nodes", "2", "--workdir", dir_.path(),
                           "--", "/usr/bin/python3", "allreduce.py"});
  ProcessResult result = run->Wait(seconds(120));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("rank 0 of 2 group 0 master " + Address(2) + " ifname v2n sum 3"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("rank 1 of 2 group 1 master " + Address(2) + " ifname v3n sum 3"), std::string::npos)
      << result.output;
}

}  // namespace
}  // namespace ltrain::testing
