// Coordinators on an etcd state: a real etcd cluster of three members on loopback (Debian's
// etcd-server), the state store's contract against it, and two coordinators of which the leader is
// SIGKILLed during a CPU job: the standby leads within 5 s and the job goes on in the same worker
// processes, losing no event anyone saw and no commit; a killed etcd member changes nothing.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "common/transport_security.h"
#include "launcher/etcd_client.h"
#include "launcher/etcd_state_store.h"
#include "launcher/leader_election.h"
#include "ltrain/v1/ltrain.grpc.pb.h"
#include "tests/support/etcd_cluster.h"
#include "tests/support/job_status.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

// The events of `job_id` a follower of the coordinator at `address` gets from the first, until
// the job has ended and every event came (`*finished` OK) or `timeout` passes.
std::vector<v1::Event> WatchEvents(const std::string& address, const std::string& token_file, const std::string& job_id,
                                   std::chrono::milliseconds timeout, grpc::Status* finished = nullptr) {
  auto stub = v1::JobService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  std::string token;
  std::ifstream(token_file) >> token;
  context.AddMetadata("authorization", "Bearer " + token);
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  auto reader = stub->WatchJob(&context, request);
  std::vector<v1::Event> events;
  v1::Event event;
  while (reader->Read(&event)) events.push_back(event);
  grpc::Status status = reader->Finish();
  if (finished != nullptr) *finished = status;
  return events;
}

class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(EtcdBinary().empty()) << "etcd is not installed: apt-get install etcd-server (deploy/setup.sh --tests)";
  }

  // Two coordinators on one three-member etcd cluster, `leader` at `a` leading and `standby` at `b`
  // standing by, the licence texts prepared under dir_/data, and the environment every process of
  // the drill gets (coordinators on one etcd state require one token).
  struct Pair {
    std::unique_ptr<EtcdCluster> etcd;
    std::map<std::string, std::string> env;
    std::string a, b, both;
    std::unique_ptr<Subprocess> leader, standby;
  };
  // Fatal failures end the caller's test (check HasFatalFailure).
  void StartPair(Pair& p) {
    p.etcd = std::make_unique<EtcdCluster>(dir_, 3);
    ASSERT_TRUE(p.etcd->WaitReady()) << p.etcd->Output();
    p.env = {{"LTRAIN_HOME", dir_.Join("home")},
             {"LTRAIN_TOKEN_FILE", dir_.Write("token", NewToken() + "\n")},
             {"OMP_NUM_THREADS", "1"}};
    ProcessResult prepared = PrepareLicenseData(dir_.Join("data"));
    ASSERT_EQ(prepared.exit_code, 0) << prepared.output;
    p.a = "127.0.0.1:" + std::to_string(FreePort());
    p.b = "127.0.0.1:" + std::to_string(FreePort());
    p.both = p.a + "," + p.b;
    auto coordinator = [&](const std::string& address, const std::string& name) {
      return std::make_unique<Subprocess>(
          std::vector<std::string>{LtrainBinary(), "coordinator", "--listen", address, "--state", p.etcd->Url(),
                                   "--state-dir", dir_.Join(name), "--port-file", dir_.Join(name + ".port")},
          p.env);
    };
    p.leader = coordinator(p.a, "a");
    ASSERT_GT(WaitForPortFile(dir_.Join("a.port"), seconds(30)), 0) << p.leader->Output() << p.etcd->Output();
    p.standby = coordinator(p.b, "b");
    ASSERT_TRUE(p.standby->WaitForOutput("standing by: " + p.a + " leads", seconds(20))) << p.standby->Output();
  }
  // An agent of node n1 that reaches whichever of the pair leads.
  std::unique_ptr<Subprocess> StartAgent(const Pair& p, const std::map<std::string, std::string>& env) {
    return std::make_unique<Subprocess>(
        std::vector<std::string>{LtrainBinary(), "agent", "--coordinator", p.both, "--node-id", "n1", "--work-dir",
                                 dir_.Join("agent"), "--coordinator-grace", "60"},
        env);
  }

  TempDir dir_;
};

// The StateStore contract, as the SQLite store keeps it, on a one-member cluster.
TEST_F(EtcdTest, TheStateStoreKeepsJobsRanksEventsLogsAndCommits) {
  EtcdCluster etcd(dir_, 1);
  ASSERT_TRUE(etcd.WaitReady()) << etcd.Output();
  auto client = launcher::EtcdClient::Connect(etcd.Endpoints(), 20000);
  ASSERT_TRUE(client.ok()) << client.status().message() << etcd.Output();
  std::shared_ptr<launcher::EtcdClient> shared = std::move(client).value();
  launcher::EtcdStateStore store(shared, "test");

  auto first = store.CreateJob("tiny", "name: tiny\n", 2, 1000);
  ASSERT_TRUE(first.ok()) << first.status().message();
  EXPECT_EQ(first->id(), "tiny-1");
  auto second = store.CreateJob("other", "name: other\n", 1, 2000);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->id(), "other-1") << "job numbers count per name";

  v1::Job job = *first;
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_last_step(7);
  ASSERT_TRUE(store.UpdateJob(job).ok());
  for (int r : {1, 0}) {
    v1::RankInfo rank;
    rank.set_rank(r);
    rank.set_pid(100 + r);
    rank.set_node_id("n1");
    ASSERT_TRUE(store.UpsertRank("tiny-1", rank).ok());
  }
  auto got = store.GetJob("tiny-1");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(got->last_step(), 7);
  ASSERT_EQ(got->ranks_size(), 2);
  EXPECT_EQ(got->ranks(0).pid(), 100);
  EXPECT_EQ(got->ranks(1).pid(), 101);
  EXPECT_EQ(store.GetJob("missing-9").status().code(), StatusCode::kNotFound);

  auto listed = store.ListJobs(0);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].id(), "other-1") << "newest first";
  EXPECT_EQ((*listed)[0].ranks_size(), 0);

  for (int64_t seq : {5, 9, 12}) {
    v1::Event event;
    event.set_seq(seq);
    event.set_job_id("tiny-1");
    event.set_kind("state");
    event.set_message("event " + std::to_string(seq));
    auto stored = store.AppendEvent(event);
    ASSERT_TRUE(stored.ok());
    EXPECT_EQ(*stored, seq);
  }
  auto after = store.EventsAfter("tiny-1", 5);
  ASSERT_TRUE(after.ok());
  ASSERT_EQ(after->size(), 2u);
  EXPECT_EQ((*after)[0].message(), "event 9");

  std::vector<v1::Event> lines;
  for (int i = 0; i < 250; ++i) {  // more than one etcd transaction holds
    v1::Event& line = lines.emplace_back();
    line.set_seq(1000 + i);
    line.set_job_id("tiny-1");
    line.set_rank(i % 2);
    line.set_unix_ms(10000 + i);
    line.set_kind("log");
    line.set_message("line " + std::to_string(i));
  }
  ASSERT_TRUE(store.AppendLogs(lines).ok());
  auto tail = store.Logs("tiny-1", 1, 0, 3);
  ASSERT_TRUE(tail.ok());
  ASSERT_EQ(tail->size(), 3u);
  EXPECT_EQ((*tail)[2].message(), "line 249");
  EXPECT_EQ(store.Logs("tiny-1", -1, 10200, 0)->size(), 50u);

  ASSERT_TRUE(store.RecordCheckpoint("tiny-1", 50, 0, "/ckpt/step-50", 3000).ok());
  ASSERT_TRUE(store.RecordCheckpoint("tiny-1", 100, 1, "/ckpt dir/step-100", 4000).ok());
  auto commits = store.Checkpoints("tiny-1");
  ASSERT_TRUE(commits.ok());
  ASSERT_EQ(commits->size(), 2u);
  EXPECT_EQ((*commits)[1].step, 100);
  EXPECT_EQ((*commits)[1].generation, 1);
  EXPECT_EQ((*commits)[1].path, "/ckpt dir/step-100");

  // Retention: the ended job goes with everything of it; the running one stays, less its old lines.
  v1::Job ended = *second;
  ended.set_state(v1::JOB_STATE_SUCCEEDED);
  ended.set_updated_unix_ms(2500);
  ASSERT_TRUE(store.UpdateJob(ended).ok());
  ASSERT_TRUE(store.UpsertNode("n1", v1::NodeFacts(), 100).ok());
  auto pruned = store.PruneBefore(10100);
  ASSERT_TRUE(pruned.ok()) << pruned.status().message();
  EXPECT_EQ(pruned->jobs, 1);
  EXPECT_EQ(pruned->log_lines, 100) << "the running job's lines older than the cutoff";
  EXPECT_EQ(store.Logs("tiny-1", -1, 0, 0)->size(), 150u);
  EXPECT_EQ(store.GetJob("other-1").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(store.GetJob("tiny-1").ok());
  EXPECT_EQ(store.EventsAfter("tiny-1", 0)->size(), 3u);
  EXPECT_EQ(store.CreateJob("other", "name: other\n", 1, 20000)->id(), "other-2") << "a number is never given twice";

  // A state written while job numbers were one counter across names (P/counter/jobs): a new name
  // starts after it, so that no earlier id comes again.
  etcdserverpb::TxnRequest legacy;
  etcdserverpb::PutRequest* put = legacy.add_success()->mutable_request_put();
  put->set_key("old/counter/jobs");
  put->set_value("41");
  ASSERT_TRUE(shared->Txn(legacy).ok());
  launcher::EtcdStateStore old(shared, "old");
  EXPECT_EQ(old.CreateJob("tiny", "name: tiny\n", 1, 1000)->id(), "tiny-42");
  EXPECT_EQ(old.CreateJob("tiny", "name: tiny\n", 1, 1000)->id(), "tiny-43");
  EXPECT_EQ(old.CreateJob("other", "name: other\n", 1, 1000)->id(), "other-42");
}

// Two campaigns: one leads, the other stands by seeing its address; once the leader resigns the
// other leads, and the first one's fenced writes are refused from then on.
TEST_F(EtcdTest, OneLeadsTheOtherStandsByAndAnOldLeaderCannotWrite) {
  EtcdCluster etcd(dir_, 1);
  ASSERT_TRUE(etcd.WaitReady()) << etcd.Output();
  auto client = launcher::EtcdClient::Connect(etcd.Endpoints(), 20000);
  ASSERT_TRUE(client.ok()) << client.status().message() << etcd.Output();
  std::shared_ptr<launcher::EtcdClient> shared = std::move(client).value();

  launcher::LeaderElection first(shared, {"e/leader", "10.0.0.1:7070", 2, 50});
  auto fence = first.Campaign([](const std::string&) {});
  ASSERT_TRUE(fence.ok()) << fence.status().message();
  launcher::EtcdStateStore old_leader(shared, "e");
  std::string fenced_why;
  old_leader.SetFence("e/leader", *fence, [&](const std::string& why) { fenced_why = why; });
  ASSERT_TRUE(old_leader.CreateJob("a", "name: a\n", 1, 1).ok());

  launcher::LeaderElection second(shared, {"e/leader", "10.0.0.2:7070", 2, 50});
  std::string seen;
  std::thread resign([&] {
    std::this_thread::sleep_for(milliseconds(300));
    first.Resign();
  });
  auto second_fence = second.Campaign([&](const std::string& leader) { seen = leader; });
  resign.join();
  ASSERT_TRUE(second_fence.ok());
  EXPECT_EQ(seen, "10.0.0.1:7070");
  EXPECT_GT(*second_fence, *fence);

  Status refused = old_leader.UpdateJob(v1::Job());
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.message();
  EXPECT_NE(fenced_why.find("10.0.0.2:7070"), std::string::npos) << fenced_why;
  EXPECT_EQ(old_leader.CreateJob("b", "name: b\n", 1, 1).status().code(), StatusCode::kFailedPrecondition);
}

// etcd with TLS, client certificates (--client-cert-auth) and authentication: the coordinator reaches
// it with --etcd-ca/--etcd-cert/--etcd-key and a user's password, keeps a job there, and is refused
// (exit 3, saying why) without its certificate or with a wrong password; beyond loopback without TLS
// it does not start (exit 2).
TEST_F(EtcdTest, TheStateGoesToEtcdOverTlsWithAClientCertificateAndAUser) {
  ASSERT_EQ(access("/usr/bin/etcdctl", X_OK), 0) << "etcdctl is not installed: apt-get install etcd-client "
                                                    "(deploy/setup.sh --tests)";
  const std::string tls = dir_.Join("tls");
  ProcessResult made = RunProcess({LtrainBinary(), "coordinator", "--init-tls", tls, "--tls-hosts", "127.0.0.1", "localhost"});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  EtcdCluster etcd(dir_, 1, tls);
  ASSERT_TRUE(etcd.WaitReady()) << etcd.Output();
  // A user of its own with read and write under the deployment's prefix, then authentication on.
  for (const std::vector<std::string>& step : std::vector<std::vector<std::string>>{
           {"user", "add", "root", "--new-user-password=root-secret"},
           {"user", "grant-role", "root", "root"},
           {"role", "add", "ltrain"},
           {"role", "grant-permission", "ltrain", "--prefix=true", "readwrite", "tls-test"},
           {"user", "add", "ltrain", "--new-user-password=ltrain-secret"},
           {"user", "grant-role", "ltrain", "ltrain"},
           {"auth", "enable"}}) {
    ProcessResult done = etcd.Ctl(step);
    ASSERT_EQ(done.exit_code, 0) << done.output << etcd.Output();
  }
  const std::map<std::string, std::string> env = {{"LTRAIN_HOME", dir_.Join("home")},
                                                  {"LTRAIN_TOKEN_FILE", tls + "/token"}};
  const std::string password = dir_.Write("etcd-password", "ltrain-secret\n");
  const std::string address = "127.0.0.1:" + std::to_string(FreePort());
  const std::vector<std::string> base = {LtrainBinary(), "coordinator", "--listen", address, "--state",
                                         etcd.Url() + "/tls-test", "--state-dir", dir_.Join("state"), "--port-file",
                                         dir_.Join("port"), "--etcd-ca", tls + "/ca.pem"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  };
  const std::vector<std::string> certificate = {"--etcd-cert", tls + "/client.pem", "--etcd-key", tls + "/client.key"};
  const std::vector<std::string> user = {"--etcd-user", "ltrain", "--etcd-password-file", password};

  std::vector<std::string> no_certificate = with(user);
  ProcessResult refused = RunProcess(no_certificate, env, seconds(60));
  EXPECT_EQ(refused.exit_code, 3) << refused.output;
  const std::string wrong = dir_.Write("wrong-password", "not-it\n");
  std::vector<std::string> bad_password = with(certificate);
  bad_password.insert(bad_password.end(), {"--etcd-user", "ltrain", "--etcd-password-file", wrong});
  ProcessResult denied = RunProcess(bad_password, env, seconds(60));
  EXPECT_EQ(denied.exit_code, 3) << denied.output;
  EXPECT_NE(denied.output.find("authentication failed"), std::string::npos) << denied.output;
  ProcessResult clear = RunProcess({LtrainBinary(), "coordinator", "--listen", address, "--state",
                                    "etcd://10.255.255.1:2379", "--state-dir", dir_.Join("state")},
                                   env, seconds(30));
  EXPECT_EQ(clear.exit_code, 2) << clear.output;
  EXPECT_NE(clear.output.find("is beyond loopback, and --etcd-ca is not given"), std::string::npos) << clear.output;

  std::vector<std::string> good = with(certificate);
  good.insert(good.end(), user.begin(), user.end());
  Subprocess coordinator(good, env);
  ASSERT_GT(WaitForPortFile(dir_.Join("port"), seconds(30)), 0) << coordinator.Output() << etcd.Output();
  const std::string recipe = dir_.Write("r.yaml", "name: r\ndata: {path: /nonexistent}\ntraining: {steps: 1}\n");
  ProcessResult submitted = RunProcess({LtrainBinary(), "launch", "--coordinator", address, recipe, "--detach"}, env);
  ASSERT_EQ(submitted.exit_code, 0) << submitted.output << coordinator.Output();
  ProcessResult stored = etcd.Ctl({"get", "--prefix", "--keys-only", "tls-test/jobs/"}, "root:root-secret");
  EXPECT_EQ(stored.exit_code, 0) << stored.output;
  EXPECT_NE(stored.output.find("r-1"), std::string::npos) << "the job is kept in etcd\n" << stored.output;
  ProcessResult anonymous = etcd.Ctl({"get", "--prefix", "tls-test/"});
  EXPECT_NE(anonymous.exit_code, 0) << "without a user etcd gives nothing\n" << anonymous.output;
  coordinator.Signal(SIGTERM);
  EXPECT_EQ(coordinator.Wait(seconds(10)).exit_code, 0) << coordinator.Output();
}

// The acceptance drill: three etcd members, two coordinators, one agent and a CPU job.
TEST_F(EtcdTest, KilledLeaderIsReplacedWithinFiveSecondsAndTheJobGoesOnInTheSameProcesses) {
  Pair pair;
  StartPair(pair);
  if (HasFatalFailure()) return;
  EtcdCluster& etcd = *pair.etcd;
  const std::map<std::string, std::string>& env = pair.env;
  const std::string &a = pair.a, &b = pair.b, &both = pair.both;
  std::unique_ptr<Subprocess>& leader = pair.leader;
  std::unique_ptr<Subprocess>& standby = pair.standby;
  std::unique_ptr<Subprocess> agent = StartAgent(pair, env);
  const std::string recipe =
      dir_.Write("ha.yaml", TinyRecipe("ha", dir_.Join("data")) +
                            "training: {steps: 300, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                            "parallel: {nproc_per_node: 2}\ncheckpoint: {every: 50}\n");
  Subprocess launch({LtrainBinary(), "launch", "--coordinator", both, recipe}, env);
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 70/", seconds(90))) << launch.Output() << leader->Output();
  v1::Job before = JobStatus("ha-1", env, {"--coordinator", both});
  ASSERT_EQ(before.ranks_size(), 2);

  // What a follower has seen of the job from the leader, up to the kill.
  std::vector<v1::Event> seen = WatchEvents(a, env.at("LTRAIN_TOKEN_FILE"), "ha-1", milliseconds(700));
  ASSERT_GE(seen.size(), 4u) << "submitted, placed, rank starts, a commit";

  const auto killed = std::chrono::steady_clock::now();
  leader->Signal(SIGKILL);
  ASSERT_TRUE(standby->WaitForOutput("leading as " + b, seconds(10))) << standby->Output();
  const double takeover_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  ASSERT_GT(WaitForPortFile(dir_.Join("b.port"), seconds(5)), 0) << standby->Output();
  const double serving_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("the standby led %.2f s after the leader was killed, and served at %.2f s\n", takeover_s, serving_s);
  EXPECT_LT(serving_s, 5.0) << standby->Output();

  // An etcd member killed mid-run (the cluster keeps its quorum): nothing changes.
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 160/", seconds(90))) << launch.Output() << standby->Output();
  etcd.member(0).Signal(SIGKILL);

  ProcessResult result = launch.Wait(seconds(240));
  EXPECT_EQ(result.exit_code, 0) << result.output << "\n--- standby\n" << standby->Output();
  v1::Job job = JobStatus("ha-1", env, {"--coordinator", both});
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << "--- standby\n" << standby->Output();
  EXPECT_EQ(job.generation(), 0) << "the workers were never restarted";
  EXPECT_EQ(job.restarts(), 0);
  ASSERT_EQ(job.ranks_size(), 2);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(job.ranks(i).pid(), before.ranks(i).pid());
  EXPECT_EQ(job.last_committed_step(), 300);

  // Every event the follower saw is in the job's history as the new leader tells it.
  grpc::Status finished;
  std::vector<v1::Event> history = WatchEvents(b, env.at("LTRAIN_TOKEN_FILE"), "ha-1", seconds(10), &finished);
  EXPECT_TRUE(finished.ok()) << finished.error_message();
  for (const auto& event : seen) {
    bool found = false;
    for (const auto& kept : history) found |= kept.seq() == event.seq() && kept.message() == event.message();
    EXPECT_TRUE(found) << "lost: " << event.message();
  }
  // Every commit is in the ledger, once.
  auto client = launcher::EtcdClient::Connect({etcd.Endpoints()[1], etcd.Endpoints()[2]});
  ASSERT_TRUE(client.ok());
  launcher::EtcdStateStore store(std::move(client).value(), "ltrain");
  auto commits = store.Checkpoints("ha-1");
  ASSERT_TRUE(commits.ok()) << commits.status().message();
  std::vector<int64_t> steps;
  for (const auto& commit : *commits) steps.push_back(commit.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{50, 100, 150, 200, 250, 300})) << "--- standby\n" << standby->Output();
  EXPECT_EQ(standby->Output().find("stepping down"), std::string::npos) << "the lead stayed where it was";
  agent->Signal(SIGTERM);
  standby->Signal(SIGTERM);
  EXPECT_EQ(standby->Wait(seconds(10)).exit_code, 0);
}

// In place (fault.recovery: in_place) after a takeover: the standby that took the lead knows the
// membership the ranks run in and the generation's start command, so that a rank SIGKILLed after
// the takeover is replaced beside its running peer, in the same generation, under the new leader.
TEST_F(EtcdTest, AfterATakeoverAKilledRankIsStillReplacedInPlace) {
  Pair pair;
  StartPair(pair);
  if (HasFatalFailure()) return;
  const std::map<std::string, std::string>& env = pair.env;
  const std::string &b = pair.b, &both = pair.both;
  std::unique_ptr<Subprocess>& leader = pair.leader;
  std::unique_ptr<Subprocess>& standby = pair.standby;
  std::unique_ptr<Subprocess> agent = StartAgent(pair, env);
  const std::string recipe =
      dir_.Write("inplace.yaml", TinyRecipe("inplace", dir_.Join("data")) +
                                 "training: {steps: 1500, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                 "parallel: {nproc_per_node: 2}\ncheckpoint: {every: 0}\n"
                                 "fault: {recovery: in_place, max_restarts: 1}\n");
  Subprocess launch({LtrainBinary(), "launch", "--coordinator", both, recipe}, env);
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 30/", seconds(90))) << launch.Output() << leader->Output();
  leader->Signal(SIGKILL);
  ASSERT_TRUE(standby->WaitForOutput("leading as " + b, seconds(10))) << standby->Output();
  ASSERT_GT(WaitForPortFile(dir_.Join("b.port"), seconds(5)), 0) << standby->Output();

  // Once the agent has reported its workers to the new leader, rank 1 is killed.
  v1::Job before;
  const auto deadline = std::chrono::steady_clock::now() + seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    before = JobStatus("inplace-1", env, {"--coordinator", both});
    if (before.ranks_size() == 2 && before.ranks(0).pid() > 0 && before.ranks(1).pid() > 0 &&
        before.ranks(1).state() == "running" && before.nodes_size() > 0 && before.nodes(0).connected()) {
      break;
    }
    std::this_thread::sleep_for(milliseconds(200));
  }
  ASSERT_EQ(before.state(), v1::JOB_STATE_RUNNING) << launch.Output();
  ASSERT_EQ(before.ranks_size(), 2);
  ASSERT_GT(before.ranks(1).pid(), 0) << standby->Output();
  ASSERT_EQ(::kill(before.ranks(1).pid(), SIGKILL), 0);

  ProcessResult result = launch.Wait(seconds(240));
  EXPECT_EQ(result.exit_code, 0) << result.output << "\n--- standby\n" << standby->Output();
  EXPECT_NE(result.output.find("replacing rank 1 in place"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("rank 1 is back (membership epoch 1)"), std::string::npos) << result.output;
  v1::Job job = JobStatus("inplace-1", env, {"--coordinator", both});
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.cause();
  EXPECT_EQ(job.generation(), 0) << "no restart of the job";
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.recoveries(), 1);
  EXPECT_EQ(job.membership_epoch(), 1);
  ASSERT_EQ(job.ranks_size(), 2);
  EXPECT_EQ(job.ranks(0).pid(), before.ranks(0).pid()) << "the survivor kept its process";
  EXPECT_NE(job.ranks(1).pid(), before.ranks(1).pid());
  agent->Signal(SIGTERM);
  standby->Signal(SIGTERM);
  EXPECT_EQ(standby->Wait(seconds(10)).exit_code, 0);
}

// The leader killed while a rank is replaced in place: rank 1 is SIGKILLed, its replacement starts,
// and the survivor pauses as it begins to recover (LTRAIN_FAULT_PAUSE_RECOVERY), so that the leader
// dies with the membership still forming. The standby that takes the lead finds the replacement under
// way in the job's record, announces the next membership, and the members, whose rendezvous calls the
// agent makes again across the takeover, connect there: the recovery completes, in the same generation.
TEST_F(EtcdTest, TheLeaderKilledDuringARecoveryInPlaceAndTheStandbyCompletesIt) {
  Pair pair;
  StartPair(pair);
  if (HasFatalFailure()) return;
  const std::map<std::string, std::string>& env = pair.env;
  const std::string &a = pair.a, &b = pair.b, &both = pair.both;
  std::unique_ptr<Subprocess>& leader = pair.leader;
  std::unique_ptr<Subprocess>& standby = pair.standby;
  std::map<std::string, std::string> agent_env = env;
  agent_env["LTRAIN_FAULT_PAUSE_RECOVERY"] = "8";
  std::unique_ptr<Subprocess> agent = StartAgent(pair, agent_env);
  const std::string recipe =
      dir_.Write("inplace.yaml", TinyRecipe("inplace", dir_.Join("data")) +
                                 "training: {steps: 600, micro_batch: 4, global_batch: 8, log_every: 1}\n"
                                 "parallel: {nproc_per_node: 2}\ncheckpoint: {every: 0}\n"
                                 "fault: {recovery: in_place, max_restarts: 1}\n");
  Subprocess launch({LtrainBinary(), "launch", "--coordinator", both, recipe}, env);
  ASSERT_TRUE(launch.WaitForOutput("[rank 0] step 30/", seconds(90))) << launch.Output() << leader->Output();
  v1::Job before = JobStatus("inplace-1", env, {"--coordinator", a});
  ASSERT_EQ(before.ranks_size(), 2);
  ASSERT_GT(before.ranks(1).pid(), 0);
  ASSERT_EQ(::kill(before.ranks(1).pid(), SIGKILL), 0);
  // The replacement runs (the agent started it on the leader's command); then the leader dies.
  v1::Job replacing;
  const auto deadline = std::chrono::steady_clock::now() + seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    replacing = JobStatus("inplace-1", env, {"--coordinator", a});
    if (replacing.ranks_size() == 2 && replacing.ranks(1).pid() > 0 && replacing.ranks(1).pid() != before.ranks(1).pid() &&
        replacing.ranks(1).state() == "running") {
      break;
    }
    std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_NE(replacing.ranks(1).pid(), before.ranks(1).pid()) << launch.Output();
  ASSERT_TRUE(replacing.has_replacing_rank()) << "the recovery is still under way";
  leader->Signal(SIGKILL);
  ASSERT_TRUE(standby->WaitForOutput("leading as " + b, seconds(10))) << standby->Output();

  ProcessResult result = launch.Wait(seconds(240));
  EXPECT_EQ(result.exit_code, 0) << result.output << "\n--- standby\n" << standby->Output();
  EXPECT_NE(result.output.find("was under way when this coordinator took over"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("rank 1 is back (membership epoch 2)"), std::string::npos) << result.output;
  v1::Job job = JobStatus("inplace-1", env, {"--coordinator", both});
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.cause();
  EXPECT_EQ(job.generation(), 0) << "no restart of the job";
  EXPECT_EQ(job.recoveries(), 1);
  EXPECT_EQ(job.membership_epoch(), 2);
  EXPECT_FALSE(job.has_replacing_rank());
  ASSERT_EQ(job.ranks_size(), 2);
  EXPECT_EQ(job.ranks(0).pid(), before.ranks(0).pid()) << "the survivor kept its process";
  EXPECT_EQ(job.ranks(1).pid(), replacing.ranks(1).pid()) << "the replacement kept its process too";
  agent->Signal(SIGTERM);
  standby->Signal(SIGTERM);
  EXPECT_EQ(standby->Wait(seconds(10)).exit_code, 0);
}

}  // namespace
}  // namespace ltrain::testing
