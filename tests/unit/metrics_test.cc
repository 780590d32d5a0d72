#include "launcher/metrics.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/prometheus_text.h"

namespace ltrain::launcher {
namespace {

using testing::ParsePrometheusText;
using testing::PrometheusParse;
using testing::PrometheusSample;

const PrometheusSample* Find(const PrometheusParse& parse, const std::string& name,
                             const std::map<std::string, std::string>& labels) {
  for (const PrometheusSample& sample : parse.samples) {
    if (sample.name != name) continue;
    bool all = true;
    for (const auto& [key, value] : labels) all = all && sample.labels.count(key) && sample.labels.at(key) == value;
    if (all) return &sample;
  }
  return nullptr;
}

std::vector<v1::Job> TwoJobs() {
  v1::Job running;
  running.set_id("gpt-7");
  running.set_name("gpt \"small\"\nrun\\1");  // every character the format escapes
  running.set_state(v1::JOB_STATE_RUNNING);
  running.set_world_size(2);
  running.set_generation(1);
  running.set_restarts(1);
  running.set_recoveries(3);
  running.set_lost_steps(2);
  running.set_last_step(120);
  running.set_total_steps(500);
  running.set_last_loss(2.3125);
  running.set_tokens_per_s(48213.5);
  running.set_eta_s(91.5);
  running.set_val_step(100);
  running.set_val_loss(2.5);
  running.set_last_committed_step(100);
  running.set_mfu(0.425);
  running.set_checkpoint_save_ms(2500);
  for (int r = 0; r < 2; ++r) {
    v1::RankInfo* rank = running.add_ranks();
    rank->set_rank(r);
    rank->set_node_id(r == 0 ? "node-a" : "node-b");
    rank->set_last_step(121);
    rank->set_phase(r == 0 ? "forward" : "backward");
    rank->set_progress_age_ms(250);
    rank->set_memory_bytes(r == 0 ? int64_t{40} << 30 : 0);  // rank 1's memory is unknown
    rank->set_compute_ms(r == 0 ? 99.5 : 0);  // rank 1's is not measured
  }
  v1::Job pending;
  pending.set_id("llama-2");
  pending.set_name("llama");
  pending.set_state(v1::JOB_STATE_PENDING);
  return {running, pending};
}

TEST(MetricsTest, EveryLineIsValidPrometheusText) {
  v1::NodeStatus node;
  node.set_node_id("node-a");
  node.set_connected(true);
  node.set_heartbeat_age_ms(400);
  node.mutable_facts()->set_gpus(8);
  node.mutable_facts()->set_cpus(96);
  const std::string text = PrometheusText(TwoJobs(), {node});
  const PrometheusParse parse = ParsePrometheusText(text);
  ASSERT_EQ(parse.error, "") << text;
  EXPECT_EQ(parse.types.at("ltrain_job_restarts_total"), "counter");
  EXPECT_EQ(parse.types.at("ltrain_job_loss"), "gauge");

  const PrometheusSample* loss = Find(parse, "ltrain_job_loss", {{"job_id", "gpt-7"}});
  ASSERT_NE(loss, nullptr) << text;
  EXPECT_EQ(loss->value, 2.3125);
  EXPECT_EQ(loss->labels.at("name"), "gpt \"small\"\nrun\\1") << "escaped and read back whole";
  EXPECT_EQ(Find(parse, "ltrain_job_tokens_per_second", {{"job_id", "gpt-7"}})->value, 48213.5);
  EXPECT_EQ(Find(parse, "ltrain_job_val_loss", {{"job_id", "gpt-7"}})->value, 2.5);
  EXPECT_EQ(Find(parse, "ltrain_job_restarts_total", {{"job_id", "gpt-7"}})->value, 1);
  EXPECT_EQ(parse.types.at("ltrain_job_recoveries_total"), "counter");
  EXPECT_EQ(Find(parse, "ltrain_job_recoveries_total", {{"job_id", "gpt-7"}})->value, 3);
  EXPECT_EQ(Find(parse, "ltrain_job_lost_steps_total", {{"job_id", "gpt-7"}})->value, 2);
  EXPECT_EQ(Find(parse, "ltrain_job_info", {{"job_id", "gpt-7"}, {"state", "running"}})->value, 1);
  EXPECT_EQ(Find(parse, "ltrain_jobs", {{"state", "pending"}})->value, 1);
  EXPECT_EQ(Find(parse, "ltrain_jobs", {{"state", "failed"}})->value, 0) << "every state, even when none is in it";
  EXPECT_EQ(Find(parse, "ltrain_rank_step", {{"job_id", "gpt-7"}, {"rank", "1"}, {"node", "node-b"}})->value, 121);
  EXPECT_EQ(Find(parse, "ltrain_rank_phase", {{"job_id", "gpt-7"}, {"rank", "0"}, {"phase", "forward"}})->value, 1);
  EXPECT_EQ(Find(parse, "ltrain_rank_progress_age_seconds", {{"rank", "0"}})->value, 0.25);
  EXPECT_EQ(Find(parse, "ltrain_node_up", {{"node", "node-a"}})->value, 1);
  EXPECT_EQ(Find(parse, "ltrain_node_gpus", {{"node", "node-a"}})->value, 8);
  EXPECT_EQ(Find(parse, "ltrain_job_mfu", {{"job_id", "gpt-7"}})->value, 0.425);
  EXPECT_EQ(Find(parse, "ltrain_job_checkpoint_save_seconds", {{"job_id", "gpt-7"}})->value, 2.5);
  EXPECT_EQ(Find(parse, "ltrain_job_checkpoint_load_seconds", {{"job_id", "gpt-7"}}), nullptr) << "it never resumed";
  EXPECT_EQ(Find(parse, "ltrain_rank_memory_bytes", {{"job_id", "gpt-7"}, {"rank", "0"}})->value, 42949672960.0);
  EXPECT_EQ(Find(parse, "ltrain_rank_memory_bytes", {{"job_id", "gpt-7"}, {"rank", "1"}}), nullptr) << "unknown: absent";
  EXPECT_EQ(Find(parse, "ltrain_rank_compute_seconds", {{"job_id", "gpt-7"}, {"rank", "0"}})->value, 0.0995)
      << "in seconds, Prometheus' base unit";
  EXPECT_EQ(Find(parse, "ltrain_rank_compute_seconds", {{"job_id", "gpt-7"}, {"rank", "1"}}), nullptr);
  EXPECT_EQ(Find(parse, "ltrain_job_loss", {{"job", "gpt-7"}}), nullptr)
      << "job is Prometheus' label of the scrape job: a series of ours carrying it arrives as exported_job";
}

// A job that has not completed a step has no loss, throughput or validation series yet, rather
// than zeros a chart would draw.
TEST(MetricsTest, FiguresAppearOnlyOnceMeasured) {
  const PrometheusParse parse = ParsePrometheusText(PrometheusText(TwoJobs(), {}));
  ASSERT_EQ(parse.error, "");
  EXPECT_EQ(Find(parse, "ltrain_job_loss", {{"job_id", "llama-2"}}), nullptr);
  EXPECT_EQ(Find(parse, "ltrain_job_tokens_per_second", {{"job_id", "llama-2"}}), nullptr);
  EXPECT_EQ(Find(parse, "ltrain_job_val_loss", {{"job_id", "llama-2"}}), nullptr);
  EXPECT_EQ(Find(parse, "ltrain_job_mfu", {{"job_id", "llama-2"}}), nullptr);
  EXPECT_NE(Find(parse, "ltrain_job_step", {{"job_id", "llama-2"}}), nullptr);
  EXPECT_NE(Find(parse, "ltrain_job_info", {{"job_id", "llama-2"}, {"state", "pending"}}), nullptr);

  std::vector<v1::Job> ended = TwoJobs();
  ended[0].set_state(v1::JOB_STATE_SUCCEEDED);
  const PrometheusParse after = ParsePrometheusText(PrometheusText(ended, {}));
  ASSERT_EQ(after.error, "");
  EXPECT_NE(Find(after, "ltrain_job_loss", {{"job_id", "gpt-7"}}), nullptr) << "the last loss stays";
  EXPECT_EQ(Find(after, "ltrain_job_tokens_per_second", {{"job_id", "gpt-7"}}), nullptr) << "no throughput once ended";
  EXPECT_EQ(Find(after, "ltrain_job_eta_seconds", {{"job_id", "gpt-7"}}), nullptr);
}

// model.moe: the loads (worst and mean, each block's) and the balance loss; none for a job without MoE.
TEST(MetricsTest, MoeFiguresAreSeriesByStatAndLayer) {
  std::vector<v1::Job> jobs = TwoJobs();
  v1::MoeFigures* f = jobs[0].mutable_moe();
  f->set_load_max(1.5);
  f->set_worst_layer(3);
  f->set_load_mean(1.25);
  f->set_aux_loss(1.0625);
  f->set_z_loss(-1);
  f->set_drop_rate(0.25);
  f->add_layers(1);
  f->add_layer_load(1.0);
  f->add_layers(3);
  f->add_layer_load(1.5);
  const std::string text = PrometheusText(jobs, {});
  const PrometheusParse parse = ParsePrometheusText(text);
  ASSERT_EQ(parse.error, "") << text;
  EXPECT_EQ(Find(parse, "ltrain_job_moe_load_ratio", {{"job_id", "gpt-7"}, {"stat", "max"}})->value, 1.5);
  EXPECT_EQ(Find(parse, "ltrain_job_moe_load_ratio", {{"job_id", "gpt-7"}, {"stat", "mean"}})->value, 1.25);
  EXPECT_EQ(Find(parse, "ltrain_job_moe_layer_load_ratio", {{"job_id", "gpt-7"}, {"layer", "3"}})->value, 1.5);
  EXPECT_EQ(Find(parse, "ltrain_job_moe_aux_loss", {{"job_id", "gpt-7"}})->value, 1.0625);
  EXPECT_EQ(Find(parse, "ltrain_job_moe_load_ratio", {{"job_id", "llama-2"}}), nullptr);
  EXPECT_EQ(Find(parse, "ltrain_job_moe_aux_loss", {{"job_id", "llama-2"}}), nullptr);
  EXPECT_EQ(Find(parse, "ltrain_job_moe_drop_rate", {{"job_id", "gpt-7"}})->value, 0.25);
  EXPECT_EQ(Find(parse, "ltrain_job_moe_drop_rate", {{"job_id", "llama-2"}}), nullptr);
}

// parallel.precision fp8: each operand kind's amax range over rank 0's last step, and the steps
// whose operands overflowed; no series for a job without FP8.
TEST(MetricsTest, Fp8FiguresAreSeriesByOperand) {
  std::vector<v1::Job> jobs = TwoJobs();
  v1::Fp8Figures* f = jobs[0].mutable_fp8();
  f->set_activation_amax_max(41.5);
  f->set_activation_amax_min(0.75);
  f->set_weight_amax_max(0.5);
  f->set_weight_amax_min(0.0625);
  f->set_gradient_amax_max(0.001953125);
  f->set_gradient_amax_min(0.0000152587890625);
  f->set_products(288);
  f->set_overflow_steps(2);
  const std::string text = PrometheusText(jobs, {});
  const PrometheusParse parse = ParsePrometheusText(text);
  ASSERT_EQ(parse.error, "") << text;
  EXPECT_EQ(Find(parse, "ltrain_job_fp8_amax", {{"job_id", "gpt-7"}, {"operand", "activation"}, {"stat", "max"}})->value, 41.5);
  EXPECT_EQ(Find(parse, "ltrain_job_fp8_amax", {{"job_id", "gpt-7"}, {"operand", "weight"}, {"stat", "min"}})->value, 0.0625);
  EXPECT_EQ(Find(parse, "ltrain_job_fp8_amax", {{"job_id", "gpt-7"}, {"operand", "gradient"}, {"stat", "max"}})->value,
            0.001953125);
  EXPECT_EQ(parse.types.at("ltrain_job_fp8_overflow_steps_total"), "counter");
  EXPECT_EQ(Find(parse, "ltrain_job_fp8_overflow_steps_total", {{"job_id", "gpt-7"}})->value, 2);
  EXPECT_EQ(Find(parse, "ltrain_job_fp8_amax", {{"job_id", "llama-2"}}), nullptr);
  EXPECT_EQ(Find(parse, "ltrain_job_fp8_overflow_steps_total", {{"job_id", "llama-2"}}), nullptr);
}

// The reader the tests rely on refuses what Prometheus would.
TEST(MetricsTest, TheReaderRefusesMalformedText) {
  for (const char* bad : {"x 1\n",                                  // no TYPE
                          "# TYPE x gauge\nx{a=\"1} 2\n",            // unterminated value
                          "# TYPE x gauge\nx{1a=\"b\"} 2\n",         // bad label name
                          "# TYPE x gauge\nx two\n",                 // not a number
                          "# TYPE x gauge\nx 1",                     // no final line feed
                          "# TYPE x gauge\n# TYPE y gauge\nx 1\ny 1\nx 2\n",  // interleaved
                          "# TYPE x rate\nx 1\n"}) {                 // unknown type
    EXPECT_NE(ParsePrometheusText(bad).error, "") << bad;
  }
  EXPECT_EQ(ParsePrometheusText("# TYPE x gauge\nx{a=\"q\\\"\"} -Inf 1700000000000\n").error, "");
}

}  // namespace
}  // namespace ltrain::launcher

namespace ltrain::launcher {
namespace {

// The coordinator's own time by RPC kind, its state writer's and what it holds: valid text, each kind
// its calls, seconds and longest call; the page's job and node series and these parse as one page.
TEST(MetricsTest, TheCoordinatorsOwnTimeIsSeriesByRpcKind) {
  RpcFigures rpc;
  rpc.Add(RpcKind::kHeartbeat, 2'000'000);
  rpc.Add(RpcKind::kHeartbeat, 6'000'000);
  rpc.Add(RpcKind::kKvGetAnswered, 1'500'000'000);
  StateWriterFigures writer{80000, 313, 2'500'000'000, 17};
  HeldFigures held{1, 0, 2'400'000, 3, 0};
  const std::string text = PrometheusText({}, {}) + ServerFiguresText(rpc, writer, held);
  const ltrain::testing::PrometheusParse parse = ltrain::testing::ParsePrometheusText(text);
  ASSERT_TRUE(parse.error.empty()) << parse.error << "\n" << text;
  auto value = [&](const std::string& name, const std::string& kind) {
    for (const auto& sample : parse.samples) {
      if (sample.name == name && (kind.empty() ? sample.labels.empty() : sample.labels.count("rpc") && sample.labels.at("rpc") == kind)) {
        return sample.value;
      }
    }
    ADD_FAILURE() << "no " << name << " " << kind;
    return -1.0;
  };
  EXPECT_EQ(value("ltrain_coordinator_rpc_calls_total", "Heartbeat"), 2);
  EXPECT_DOUBLE_EQ(value("ltrain_coordinator_rpc_seconds_total", "Heartbeat"), 0.008);
  EXPECT_DOUBLE_EQ(value("ltrain_coordinator_rpc_seconds_max", "Heartbeat"), 0.006);
  EXPECT_EQ(value("ltrain_coordinator_rpc_calls_total", "KvSet"), 0);
  EXPECT_DOUBLE_EQ(value("ltrain_coordinator_rpc_seconds_max", "KvGetAnswered"), 1.5);
  EXPECT_EQ(value("ltrain_coordinator_state_writes_total", ""), 80000);
  EXPECT_EQ(value("ltrain_coordinator_state_write_batches_total", ""), 313);
  EXPECT_DOUBLE_EQ(value("ltrain_coordinator_state_write_seconds_total", ""), 2.5);
  EXPECT_EQ(value("ltrain_coordinator_state_writes_queued", ""), 17);
  EXPECT_EQ(value("ltrain_coordinator_jobs_held", ""), 1);
  EXPECT_EQ(value("ltrain_coordinator_rank_records_held", ""), 0);
  EXPECT_EQ(value("ltrain_coordinator_folded_rank_bytes", ""), 2400000);
  EXPECT_EQ(value("ltrain_coordinator_nodes_held", ""), 3);
  EXPECT_EQ(value("ltrain_coordinator_rendezvous_keys", ""), 0);
  EXPECT_EQ(parse.types.at("ltrain_coordinator_rpc_calls_total"), "counter");
}

}  // namespace
}  // namespace ltrain::launcher
