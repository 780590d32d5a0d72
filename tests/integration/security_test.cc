// TLS, mutual TLS and bearer tokens between real processes: who is let in, who is turned away, and
// that a turned-away request changes nothing.
#include <gtest/gtest.h>
#include <google/protobuf/util/json_util.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "ltrain/v1/ltrain.grpc.pb.h"
#include "ltrain/v1/ltrain.pb.h"
#include "tests/support/job_status.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(RunProcess({LtrainBinary(), "coordinator", "--init-tls", dir_.Join("tls")}).exit_code, 0);
    ASSERT_EQ(RunProcess({LtrainBinary(), "coordinator", "--init-tls", dir_.Join("other")}).exit_code, 0);
    std::string port_file = dir_.Join("port");
    coordinator_ = std::make_unique<Subprocess>(std::vector<std::string>{
        LtrainBinary(), "coordinator", "--listen", "127.0.0.1:0", "--port-file", port_file, "--state-dir",
        dir_.Join("state"), "--tls-cert", Tls("server.pem"), "--tls-key", Tls("server.key"), "--tls-client-ca",
        Tls("ca.pem"), "--token-file", Tls("token")});
    const int port = WaitForPortFile(port_file);
    ASSERT_GT(port, 0) << coordinator_->Output();
    address_ = "127.0.0.1:" + std::to_string(port);
    recipe_ = dir_.Write("r.yaml", "name: r\ndata: {path: /nonexistent}\ntraining: {steps: 1}\n");
  }

  void TearDown() override {
    if (coordinator_) {
      coordinator_->Signal(SIGTERM);
      coordinator_->Wait(seconds(10));
    }
  }

  std::string Tls(const std::string& name) const { return dir_.Join("tls/" + name); }

  // Everything a legitimate client presents.
  std::vector<std::string> Good() const {
    return {"--coordinator", address_, "--tls-ca", Tls("ca.pem"), "--tls-cert", Tls("client.pem"), "--tls-key",
            Tls("client.key"), "--token-file", Tls("token")};
  }

  ProcessResult Ltrain(std::vector<std::string> args, const std::vector<std::string>& creds) {
    args.insert(args.begin(), LtrainBinary());
    args.insert(args.end(), creds.begin(), creds.end());
    return RunProcess(args, {{"LTRAIN_HOME", dir_.Join("home")}}, seconds(30));
  }

  int JobCount() {
    ProcessResult list = Ltrain({"list", "-o", "json"}, Good());
    EXPECT_EQ(list.exit_code, 0) << list.output;
    v1::ListJobsReply reply;
    EXPECT_TRUE(ParseCliJson(list.output, &reply)) << list.output;
    return reply.jobs_size();
  }

  static std::vector<std::string> Replace(std::vector<std::string> creds, const std::string& flag,
                                          const std::string& value) {
    for (size_t i = 0; i + 1 < creds.size(); ++i) {
      if (creds[i] == flag) {
        if (value.empty()) {
          creds.erase(creds.begin() + static_cast<long>(i), creds.begin() + static_cast<long>(i) + 2);
        } else {
          creds[i + 1] = value;
        }
        return creds;
      }
    }
    return creds;
  }

  TempDir dir_;
  std::unique_ptr<Subprocess> coordinator_;
  std::string address_;
  std::string recipe_;
};

TEST_F(SecurityTest, RejectedRequestsSayWhyAndChangeNothing) {
  // One job exists, submitted properly (it stays PENDING: no agent).
  ProcessResult submitted = Ltrain({"launch", recipe_, "--detach"}, Good());
  ASSERT_EQ(submitted.exit_code, 0) << submitted.output;
  ASSERT_EQ(JobCount(), 1);

  std::string wrong_token = dir_.Write("wrong-token", "0123456789abcdef\n");
  struct Case {
    const char* what;
    std::vector<std::string> creds;
    const char* message;
  };
  std::vector<Case> cases = {
      {"no token", Replace(Good(), "--token-file", ""), "requires a bearer token"},
      {"wrong token", Replace(Good(), "--token-file", wrong_token), "bearer token was not accepted"},
      // A coordinator that is there but refuses the connection is not called unreachable: the
      // message names the one TLS mismatch it is, and the flags that fix it.
      {"no client certificate (mutual TLS)",
       Replace(Replace(Good(), "--tls-cert", ""), "--tls-key", ""),
       "requires a client certificate (mutual TLS) that this client did not give (give --tls-cert and --tls-key)"},
      {"client certificate of another CA",
       Replace(Replace(Good(), "--tls-cert", dir_.Join("other/client.pem")), "--tls-key", dir_.Join("other/client.key")),
       "does not accept this client's certificate"},
      {"server not trusted (another CA)", Replace(Good(), "--tls-ca", dir_.Join("other/ca.pem")),
       "its certificate is not signed by --tls-ca's CA"},
      {"plaintext to a TLS server",
       Replace(Replace(Replace(Good(), "--tls-ca", ""), "--tls-cert", ""), "--tls-key", ""),
       "serves TLS with client certificates (mutual TLS): give its CA with --tls-ca FILE"},
  };
  // What each cause says: a message holds its own and none of the others.
  const std::vector<std::string> causes = {"requires a bearer token", "bearer token was not accepted",
                                           "requires a client certificate", "does not accept this client's certificate",
                                           "is not signed by --tls-ca's CA", "serves TLS", "serves no TLS",
                                           "is not made for", "cannot reach"};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    for (const std::vector<std::string>& command :
         {std::vector<std::string>{"launch", recipe_, "--detach"}, std::vector<std::string>{"stop", "r-1"},
          std::vector<std::string>{"status"}}) {
      ProcessResult result = Ltrain(command, c.creds);
      EXPECT_EQ(result.exit_code, 3) << command[0] << "\n" << result.output;
      EXPECT_NE(result.output.find(c.message), std::string::npos) << command[0] << "\n" << result.output;
      for (const std::string& cause : causes) {
        if (std::string(c.message).find(cause) != std::string::npos) continue;
        EXPECT_EQ(result.output.find(cause), std::string::npos) << command[0] << ": only one cause\n" << result.output;
      }
      EXPECT_EQ(result.output.find("either"), std::string::npos) << command[0] << "\n" << result.output;
      EXPECT_EQ(result.output.find(std::string(c.what) == "wrong token" ? "0123456789abcdef" : "\x01"),
                std::string::npos)
          << "the token is never printed";
    }
  }
  ASSERT_EQ(JobCount(), 1) << "no rejected request created a job";
  ProcessResult status = Ltrain({"status", "r-1", "-o", "json"}, Good());
  EXPECT_NE(status.output.find("\"state\": \"PENDING\""), std::string::npos) << "no rejected stop stopped it\n" << status.output;
  std::string log = coordinator_->Output();
  std::ifstream token_file(Tls("token"));
  std::string token;
  token_file >> token;
  EXPECT_EQ(log.find(token), std::string::npos) << "the coordinator never logs the token";
}

// The keys and the token are private from their creation, and a second --init-tls over the same
// directory changes nothing: clients already trust that CA.
TEST_F(SecurityTest, InitTlsWritesPrivateKeysAndNeverOverwrites) {
  for (const char* secret : {"ca.key", "server.key", "client.key", "token"}) {
    const auto perms = fs::status(Tls(secret)).permissions();
    EXPECT_EQ(perms & (fs::perms::group_all | fs::perms::others_all), fs::perms::none) << secret;
  }
  EXPECT_NE(fs::status(Tls("ca.pem")).permissions() & fs::perms::others_read, fs::perms::none) << "a certificate is public";
  const std::string ca = ReadFile(Tls("ca.pem")), token = ReadFile(Tls("token"));
  ProcessResult again = RunProcess({LtrainBinary(), "coordinator", "--init-tls", dir_.Join("tls")});
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_NE(again.output.find("never overwrites"), std::string::npos) << again.output;
  EXPECT_EQ(ReadFile(Tls("ca.pem")), ca);
  EXPECT_EQ(ReadFile(Tls("token")), token);
}

// A token never leaves this host in clear text unless asked to.
TEST(ClearTextTokenTest, AnAgentWithATokenAndNoTlsToAnotherHostIsRefused) {
  TempDir dir;
  ProcessResult refused = RunProcess({LtrainBinary(), "agent", "--coordinator", "192.0.2.1:7070"},
                                     {{"LTRAIN_TOKEN", "secret-token"}, {"LTRAIN_HOME", dir.Join("home")}},
                                     std::chrono::seconds(20));
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("refusing to send the token to 192.0.2.1:7070 in clear text"), std::string::npos)
      << refused.output;
  EXPECT_EQ(refused.output.find("secret-token"), std::string::npos) << "the token is never printed";
}

TEST_F(SecurityTest, AgentWithAWrongTokenIsNotRegistered) {
  std::string wrong_token = dir_.Write("wrong-token", "nope\n");
  Subprocess agent({LtrainBinary(), "agent", "--coordinator", address_, "--node-id", "intruder", "--tls-ca", Tls("ca.pem"),
                    "--tls-cert", Tls("client.pem"), "--tls-key", Tls("client.key"), "--token-file", wrong_token,
                    "--work-dir", dir_.Join("agent")});
  ASSERT_TRUE(agent.WaitForOutput("bearer token was not accepted", seconds(10))) << agent.Output();
  ProcessResult submitted = Ltrain({"launch", recipe_, "--detach"}, Good());
  ASSERT_EQ(submitted.exit_code, 0) << submitted.output;
  std::this_thread::sleep_for(milliseconds(300));
  ProcessResult status = Ltrain({"status", "r-1", "-o", "json"}, Good());
  EXPECT_NE(status.output.find("\"state\": \"PENDING\""), std::string::npos) << "the job was not placed on it\n" << status.output;
  agent.Signal(SIGTERM);
}

// An agent that the coordinator will never take (no TLS against a TLS coordinator) says why, the one
// cause, and exits 3 at once instead of retrying for ever.
TEST_F(SecurityTest, AnAgentWithoutTlsToATlsCoordinatorSaysSoAndExits) {
  ProcessResult plain = RunProcess({LtrainBinary(), "agent", "--coordinator", address_, "--token-file", Tls("token"),
                                    "--work-dir", dir_.Join("agent")},
                                   {{"LTRAIN_HOME", dir_.Join("home")}}, seconds(20));
  EXPECT_FALSE(plain.timed_out) << plain.output;
  EXPECT_EQ(plain.exit_code, 3) << plain.output;
  EXPECT_NE(plain.output.find("the coordinator at " + address_ +
                              " serves TLS with client certificates (mutual TLS): give its CA with --tls-ca FILE"),
            std::string::npos)
      << plain.output;
  for (const char* other : {"either", "cannot reach", "serves no TLS", "not signed by", "is not made for",
                            "lost the coordinator"}) {
    EXPECT_EQ(plain.output.find(other), std::string::npos) << other << "\n" << plain.output;
  }
}

// A coordinator that is not there is named as such: waited for up to --connect-timeout, then exit 3,
// with nothing said about TLS or certificates.
TEST(AgentStartTest, AnAgentAgainstAStoppedCoordinatorExitsThreeSayingCannotReach) {
  TempDir dir;
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  ProcessResult result = RunProcess({LtrainBinary(), "agent", "--coordinator", address, "--connect-timeout", "2",
                                     "--work-dir", dir.Join("agent")},
                                    {{"LTRAIN_HOME", dir.Join("home")}}, seconds(20));
  EXPECT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 3) << result.output;
  EXPECT_NE(result.output.find("cannot reach the coordinator at " + address + ": connection refused (waited "),
            std::string::npos)
      << result.output;
  EXPECT_GE(result.seconds, 1.5) << "it waited for the coordinator";
  for (const char* other : {"TLS", "certificate", "either"}) {
    EXPECT_EQ(result.output.find(other), std::string::npos) << other << "\n" << result.output;
  }
}

TEST_F(SecurityTest, TrainsOverMutualTlsWithAToken) {
  ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
  ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
  std::string recipe = dir_.Write("ok.yaml", "name: ok\nmodel: {layers: 1, d_model: 32, heads: 2, seq_len: 16}\n"
                                             "data: {path: " + dir_.Join("data") + "}\n"
                                             "training: {steps: 5, micro_batch: 2, global_batch: 4}\n"
                                             "parallel: {nproc_per_node: 2}\n");
  std::vector<std::string> agent_args = {LtrainBinary(), "agent", "--node-id", "n1", "--work-dir", dir_.Join("agent")};
  for (const auto& arg : Good()) agent_args.push_back(arg);
  Subprocess agent(agent_args);
  ProcessResult launched = Ltrain({"launch", recipe}, Good());
  EXPECT_EQ(launched.exit_code, 0) << launched.output << "\n--- agent\n" << agent.Output();
  agent.Signal(SIGTERM);
  agent.Wait(seconds(10));
}

// The agent's loopback services answer only the workers it started, each only about its own job
// generation: a local user without the generation's secret cannot read or write its rendezvous keys
// (NCCL ids, Gloo addresses) or forge its progress; with it, nothing of another job.
TEST(AgentEndpointTest, OnlyAJobsOwnWorkersReachItsKeysAndProgress) {
  TempDir dir;
  ASSERT_EQ(PrepareLicenseData(dir.Join("data")).exit_code, 0);
  const std::string recipe = dir.Write("long.yaml", TinyRecipe("long", dir.Join("data")) +
                                                    "training: {steps: 100000, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                                    "parallel: {nproc_per_node: 2}\n");
  const std::map<std::string, std::string> env = {{"LTRAIN_HOME", dir.Join("home")}};
  Subprocess launch({LtrainBinary(), "launch", recipe}, env);
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 2/", std::chrono::seconds(60))) << launch.Output();
  v1::Job job = JobStatus("long-1", env);
  ASSERT_GT(job.ranks_size(), 0);
  // What the agent gave rank 0: its address, the generation's key scope and the secret's file.
  std::map<std::string, std::string> worker_env;
  {
    std::ifstream in("/proc/" + std::to_string(job.ranks(0).pid()) + "/environ");
    std::string entry;
    while (std::getline(in, entry, '\0')) worker_env[entry.substr(0, entry.find('='))] = entry.substr(entry.find('=') + 1);
  }
  ASSERT_TRUE(worker_env.count("LTRAIN_AGENT") && worker_env.count("LTRAIN_AGENT_SECRET_FILE")) << "no agent address";
  EXPECT_FALSE(worker_env.count("LTRAIN_TOKEN")) << "a worker never sees the cluster token";
  const std::string scope = worker_env["LTRAIN_RDZV_SCOPE"];
  std::string secret;
  std::ifstream(worker_env["LTRAIN_AGENT_SECRET_FILE"]) >> secret;
  ASSERT_FALSE(secret.empty());
  EXPECT_EQ(fs::status(worker_env["LTRAIN_AGENT_SECRET_FILE"]).permissions() & (fs::perms::group_all | fs::perms::others_all),
            fs::perms::none);

  auto channel = grpc::CreateChannel(worker_env["LTRAIN_AGENT"], grpc::InsecureChannelCredentials());
  auto rendezvous = v1::RendezvousService::NewStub(channel);
  auto workers = v1::WorkerService::NewStub(channel);
  auto get = [&](const std::string& key, const std::string& bearer) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!bearer.empty()) context.AddMetadata("authorization", "Bearer " + bearer);
    v1::KvGetRequest request;
    request.add_keys(key);
    request.set_timeout_ms(100);
    v1::KvGetReply reply;
    return rendezvous->Get(&context, request, &reply).error_code();
  };
  auto set = [&](const std::string& key, const std::string& bearer) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!bearer.empty()) context.AddMetadata("authorization", "Bearer " + bearer);
    v1::KvSetRequest request;
    request.set_key(key);
    request.set_value("forged");
    v1::KvSetReply reply;
    return rendezvous->Set(&context, request, &reply).error_code();
  };
  auto report = [&](const std::string& job_id, const std::string& bearer) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!bearer.empty()) context.AddMetadata("authorization", "Bearer " + bearer);
    v1::RankProgress progress;
    progress.set_job_id(job_id);
    progress.set_generation(0);
    progress.set_rank(1);
    progress.set_committed_step(1000000000);
    v1::ProgressAck ack;
    return workers->ReportProgress(&context, progress, &ack).error_code();
  };
  // No secret, or a wrong one: refused, whatever is asked.
  EXPECT_EQ(get(scope + "probe", ""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(set(scope + "probe", ""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(report("long-1", ""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(get(scope + "probe", std::string(secret.size(), '0')), grpc::StatusCode::UNAUTHENTICATED);
  // The secret: only its own generation's keys and progress.
  EXPECT_EQ(get("other-1/0/nccl", secret), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(set("other-1/0/nccl", secret), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(report("other-1", secret), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(set(scope + "probe", secret), grpc::StatusCode::OK);
  EXPECT_EQ(get(scope + "probe", secret), grpc::StatusCode::OK);
  EXPECT_EQ(JobStatus("long-1", env).state(), v1::JOB_STATE_RUNNING) << "the refused calls changed nothing";

  // The launch's own coordinator, on loopback, wants the token the launch made: it is in the
  // address file, which only this user can read; a caller without it is refused.
  const std::string address_file = dir.Join("home/run/long-1.addr");
  EXPECT_EQ(fs::status(address_file).permissions() & (fs::perms::group_all | fs::perms::others_all), fs::perms::none);
  std::string coordinator, token;
  std::ifstream(address_file) >> coordinator >> token;
  ASSERT_EQ(token.size(), 40u) << coordinator;
  auto jobs = v1::JobService::NewStub(grpc::CreateChannel(coordinator, grpc::InsecureChannelCredentials()));
  for (const std::string& bearer : {std::string(), std::string(40, 'f')}) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!bearer.empty()) context.AddMetadata("authorization", "Bearer " + bearer);
    v1::StopJobRequest stop;
    stop.set_job_id("long-1");
    v1::StopJobReply reply;
    EXPECT_EQ(jobs->StopJob(&context, stop, &reply).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(JobStatus("long-1", env).state(), v1::JOB_STATE_RUNNING);
  launch.Signal(SIGINT);
  launch.Wait(std::chrono::seconds(30));
}

}  // namespace
}  // namespace ltrain::testing
