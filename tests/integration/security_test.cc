// TLS, mutual TLS and bearer tokens between real processes: who is let in, who is turned away, and
// that a turned-away request changes nothing.
#include <gtest/gtest.h>
#include <google/protobuf/util/json_util.h>
#include <signal.h>

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
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(list.output, &reply).ok()) << list.output;
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
      {"no client certificate (mutual TLS)",
       Replace(Replace(Good(), "--tls-cert", ""), "--tls-key", ""), "cannot reach the coordinator"},
      {"client certificate of another CA",
       Replace(Replace(Good(), "--tls-cert", dir_.Join("other/client.pem")), "--tls-key", dir_.Join("other/client.key")),
       "cannot reach the coordinator"},
      {"server not trusted (another CA)", Replace(Good(), "--tls-ca", dir_.Join("other/ca.pem")),
       "cannot reach the coordinator"},
      {"plaintext to a TLS server",
       Replace(Replace(Replace(Good(), "--tls-ca", ""), "--tls-cert", ""), "--tls-key", ""),
       "cannot reach the coordinator"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    for (const std::vector<std::string>& command :
         {std::vector<std::string>{"launch", recipe_, "--detach"}, std::vector<std::string>{"stop", "r-1"},
          std::vector<std::string>{"status"}}) {
      ProcessResult result = Ltrain(command, c.creds);
      EXPECT_EQ(result.exit_code, 3) << command[0] << "\n" << result.output;
      EXPECT_NE(result.output.find(c.message), std::string::npos) << command[0] << "\n" << result.output;
      EXPECT_EQ(result.output.find(std::string(c.what) == "wrong token" ? "0123456789abcdef" : "\x01"),
                std::string::npos)
          << "the token is never printed";
    }
  }
  ASSERT_EQ(JobCount(), 1) << "no rejected request created a job";
  ProcessResult status = Ltrain({"status", "r-1", "-o", "json"}, Good());
  EXPECT_NE(status.output.find("JOB_STATE_PENDING"), std::string::npos) << "no rejected stop stopped it\n" << status.output;
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
  EXPECT_NE(status.output.find("JOB_STATE_PENDING"), std::string::npos) << "the job was not placed on it\n" << status.output;
  agent.Signal(SIGTERM);
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

}  // namespace
}  // namespace ltrain::testing
