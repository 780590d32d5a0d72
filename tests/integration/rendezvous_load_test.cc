// The rendezvous under load: a few hundred simulated ranks (the real protocol to a real `ltrain
// coordinator`) whose coordinator answers every rendezvous Get late (LTRAIN_FAULT_RENDEZVOUS_DELAY),
// as an overloaded one would. A rank that waits while its generation lives is never failed for it;
// one that waits with a timeout shorter than the delay is (the fault bites); and once the job ends,
// a rank still waiting is told at once why, not left to its timeout.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tests/support/simulated_agent.h"
#include "tests/support/subprocess.h"

namespace ltrain::testing {
namespace {

constexpr int kNodes = 40;
constexpr int kRanksPerNode = 8;
constexpr int kDelayMs = 1500;

class RendezvousLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    security_.token = NewToken();
    coordinator_ = std::make_unique<Subprocess>(
        std::vector<std::string>{LtrainBinary(), "coordinator", "--listen", "127.0.0.1:0", "--port-file", dir_.Join("port"),
                                 "--state-dir", dir_.Join("state"), "--node-timeout", "3", "--token-file",
                                 dir_.Write("token", security_.token + "\n")},
        std::map<std::string, std::string>{{"LTRAIN_FAULT_RENDEZVOUS_DELAY", std::to_string(kDelayMs)}});
    const int port = WaitForPortFile(dir_.Join("port"), std::chrono::seconds(20));
    ASSERT_NE(port, 0) << coordinator_->Output();
    address_ = "127.0.0.1:" + std::to_string(port);
    channel_ = NewChannel(address_, security_);
    for (int i = 0; i < kNodes; ++i) agents_.push_back(std::make_unique<Agent>("node-" + std::to_string(i), channel_));
    // Heartbeats every 500 ms for every agent while the test runs.
    heartbeats_ = std::thread([this] {
      while (!stop_) {
        for (auto& a : agents_) {
          if (a->registered()) a->Heartbeat([](double) {});
        }
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return stop_.load(); });
      }
    });
  }

  void TearDown() override {
    stop_ = true;
    cv_.notify_all();
    if (heartbeats_.joinable()) heartbeats_.join();
    for (auto& a : agents_) a->Close();
    agents_.clear();
  }

  TempDir dir_;
  SecurityMaterial security_;
  std::unique_ptr<Subprocess> coordinator_;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::vector<std::unique_ptr<Agent>> agents_;
  std::thread heartbeats_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

TEST_F(RendezvousLoadTest, NoRankFailsWhileItsGenerationLives) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<v1::StartJobCommand> starts;
  int registered = 0;
  for (auto& a : agents_) {
    a->OnStart([&](Agent*, const v1::StartJobCommand& start) {
      std::lock_guard<std::mutex> lock(mu);
      starts.push_back(start);
      cv.notify_all();
    });
    a->Register([&](Agent*) {
      std::lock_guard<std::mutex> lock(mu);
      ++registered;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return registered == kNodes; })) << registered;
  }
  auto jobs = v1::JobService::NewStub(channel_);
  grpc::ClientContext context;
  v1::SubmitJobRequest request;
  request.set_source_name("load.yaml");
  request.set_recipe_yaml("name: load\nmodel: {layers: 2, d_model: 64, heads: 2, seq_len: 32}\n"
                          "data: {path: /nonexistent}\n"
                          "training: {steps: 10, micro_batch: 1, global_batch: " + std::to_string(kNodes * kRanksPerNode) + "}\n"
                          "parallel: {nodes: " + std::to_string(kNodes) + ", nproc_per_node: " + std::to_string(kRanksPerNode) + "}\n"
                          "checkpoint: {enabled: false}\n");
  v1::SubmitJobReply reply;
  ASSERT_TRUE(jobs->SubmitJob(&context, request, &reply).ok());
  ASSERT_EQ(reply.status().code(), 0) << reply.status().message();
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return static_cast<int>(starts.size()) == kNodes; }))
        << starts.size() << " of " << kNodes << " nodes got their start command";
  }

  // Every rank twice: waiting while its generation lives (each told a 200 ms timeout, far under the
  // coordinator's delay), and the control, waiting with that timeout alone.
  int answered = 0, failed = 0, control_answered = 0, control_failed = 0;
  double slowest_ms = 0;
  std::map<std::string, int> failures;
  for (size_t i = 0; i < agents_.size(); ++i) {
    for (const v1::WorkerAssignment& w : starts[i].workers()) {
      Agent* agent = agents_[i].get();
      agent->Rendezvous(
          starts[i].rendezvous_scope(), w.rank(),
          [&](double ms, const std::string& why) {
            std::lock_guard<std::mutex> lock(mu);
            ++answered;
            if (ms < 0) {
              ++failed;
              ++failures[why];
            }
            slowest_ms = std::max(slowest_ms, ms);
            cv.notify_all();
          },
          /*while_generation_lives=*/true, /*timeout_ms=*/200);
      agent->Rendezvous(
          starts[i].rendezvous_scope(), -1,
          [&](double ms, const std::string&) {
            std::lock_guard<std::mutex> lock(mu);
            ++control_answered;
            control_failed += ms < 0 ? 1 : 0;
            cv.notify_all();
          },
          /*while_generation_lives=*/false, /*timeout_ms=*/200);
    }
  }
  const int ranks = kNodes * kRanksPerNode;
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return answered == ranks && control_answered == ranks; }))
        << answered << " and " << control_answered << " of " << ranks << " answered";
  }
  std::string reasons;
  for (const auto& [why, count] : failures) reasons += std::to_string(count) + ": " + why + "\n";
  EXPECT_EQ(failed, 0) << reasons;
  EXPECT_GE(slowest_ms, kDelayMs) << "the coordinator's delay held the answers";
  EXPECT_EQ(control_failed, ranks) << "with a timeout under the delay, every Get fails: the fault bites";

  // The job ends while ranks wait for a key nobody sets: they are told at once why.
  std::vector<std::string> reasons_after;
  int waiting = 0;
  const auto stop_at = std::chrono::steady_clock::now();
  for (int i = 0; i < 4; ++i) {
    v1::KvGetRequest get;
    get.add_keys(starts[0].rendezvous_scope() + "never");
    get.set_while_generation_lives(true);
    auto stub = v1::RendezvousService::NewStub(channel_);
    auto call = std::make_shared<std::tuple<grpc::ClientContext, v1::KvGetRequest, v1::KvGetReply>>();
    std::get<1>(*call) = get;
    stub->async()->Get(&std::get<0>(*call), &std::get<1>(*call), &std::get<2>(*call), [&, call](grpc::Status status) {
      std::lock_guard<std::mutex> lock(mu);
      reasons_after.push_back(status.ok() ? std::get<2>(*call).status().message() : status.error_message());
      cv.notify_all();
    });
    ++waiting;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  grpc::ClientContext stop_context;
  v1::StopJobRequest stop;
  stop.set_job_id(reply.job().id());
  v1::StopJobReply stopped;
  ASSERT_TRUE(jobs->StopJob(&stop_context, stop, &stopped).ok());
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return static_cast<int>(reasons_after.size()) == waiting; }));
  }
  const double told_ms = MsSince(stop_at);
  for (const std::string& why : reasons_after) EXPECT_NE(why.find("ended"), std::string::npos) << why;
  EXPECT_LT(told_ms, 10000) << "told when the job ended, not at a timeout";
  std::printf("%d ranks through a rendezvous answered %d ms late: %d failed; the slowest waited %.0f ms; "
              "with a %d ms timeout %d of %d failed; waiting ranks told of the job's end %.0f ms after the stop\n",
              ranks, kDelayMs, failed, slowest_ms, 200, control_failed, ranks, told_ms - 300);
}

}  // namespace
}  // namespace ltrain::testing
