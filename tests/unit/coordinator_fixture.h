// The coordinator under unit tests: a fake clock, an in-memory SQLite state, and the requests its
// agents send (included by the coordinator's unit tests).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/logging.h"
#include "launcher/coordinator.h"
#include "launcher/state_store.h"

namespace ltrain::launcher {

inline constexpr const char* kRecipe = R"(name: unit
data: {path: /data}
training: {steps: 5, micro_batch: 1, global_batch: 4}
parallel: {nodes: 2, nproc_per_node: 2}
)";

inline constexpr const char* kRestartingRecipe = R"(name: unit
data: {path: /data}
training: {steps: 5, micro_batch: 1, global_batch: 4}
parallel: {nodes: {min: 1, max: 2}, nproc_per_node: 2}
fault: {max_restarts: 2, restart_backoff_s: 1, restart_backoff_max_s: 1.5, hang_timeout_s: 10}
)";

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetLogLevel(LogLevel::kWarning);
    store_ = std::move(SqliteStateStore::Open(":memory:")).value();
    CoordinatorOptions options;
    options.state_dir = "/state";
    options.node_timeout_ms = 3000;
    coordinator_ = std::make_unique<Coordinator>(store_.get(), &clock_, options);
  }

  int64_t Connect(const std::string& node, int gpus = 0) {
    v1::NodeFacts facts;
    facts.set_hostname(node + ".example");
    facts.set_cpus(8);
    facts.set_gpus(gpus);
    return coordinator_->NodeConnected(node, facts);
  }

  static v1::HeartbeatRequest Beat(const std::string& node) {
    v1::HeartbeatRequest request;
    request.set_node_id(node);
    return request;
  }

  v1::WorkerStateReport Exit(const std::string& job, int rank, int code, int signal = 0) {
    v1::WorkerStateReport report;
    report.set_node_id(rank < 2 ? "a" : "b");
    report.set_job_id(job);
    report.set_rank(rank);
    report.set_state(signal ? "killed" : "exited");
    report.set_exit_code(code);
    report.set_signal(signal);
    report.add_log_tail("last words");
    return report;
  }

  // Rank `rank` of `job` reported running by its node (a for ranks 0-1, b for 2-3), with pid 100 + rank.
  static v1::WorkerStateReport Running(const std::string& job, int rank) {
    v1::WorkerStateReport report;
    report.set_node_id(rank < 2 ? "a" : "b");
    report.set_job_id(job);
    report.set_rank(rank);
    report.set_state("running");
    report.set_pid(100 + rank);
    return report;
  }

  // Rank `rank`'s progress report number `seq` (generation 0), in step `completed_step` + 1 after
  // completing `completed_step` of 5 (none when 0) with loss 2.5 at 100 tokens/s and 1 ms a step.
  static v1::RankProgress Report(const std::string& job, int rank, int64_t seq, int64_t completed_step = 0) {
    v1::RankProgress report;
    report.set_job_id(job);
    report.set_rank(rank);
    report.set_seq(seq);
    report.set_step(completed_step + 1);
    report.set_phase("forward");
    if (completed_step > 0) {
      v1::StepFigures* step = report.mutable_completed();
      step->set_step(completed_step);
      step->set_total_steps(5);
      step->set_loss(2.5);
      step->set_lr(1e-3);
      step->set_tokens_per_s(100);
      step->set_step_ms(1.0);
    }
    return report;
  }

  // `report` after rank 0 committed the checkpoint of `step` in /ck.
  static v1::RankProgress Committed(v1::RankProgress report, int64_t step) {
    report.set_committed_step(step);
    report.set_committed_path("/ck/step-" + std::to_string(step));
    return report;
  }

  // What an agent sends at once when a report brings a commit or a stop (AgentService.ReportProgress).
  static v1::ProgressReport Urgent(const std::string& node, const v1::RankProgress& report) {
    v1::ProgressReport request;
    request.set_node_id(node);
    *request.add_progress() = report;
    return request;
  }

  static v1::HeartbeatRequest BeatWith(const std::string& node, const v1::RankProgress& report) {
    v1::HeartbeatRequest request = Beat(node);
    *request.add_progress() = report;
    return request;
  }

  // The job's events of `kind`, oldest first.
  std::vector<v1::Event> Events(const std::string& job, const std::string& kind) {
    bool finished = false;
    std::vector<v1::Event> events = *coordinator_->WaitEvents(job, 0, true, 0, &finished);
    std::vector<v1::Event> out;
    for (auto& event : events) {
      if (event.kind() == kind) out.push_back(std::move(event));
    }
    return out;
  }

  FakeClock clock_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<Coordinator> coordinator_;
};

}  // namespace ltrain::launcher
