#include "launcher/metrics.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>

#include "launcher/state_store.h"

namespace ltrain::launcher {

namespace {

// One metric family: its HELP and TYPE lines once, then its samples.
class Family {
 public:
  Family(std::string& out, const char* name, const char* type, const char* help) : out_(out), name_(name) {
    out_ += "# HELP ";
    out_ += name;
    out_ += ' ';
    out_ += help;
    out_ += "\n# TYPE ";
    out_ += name;
    out_ += ' ';
    out_ += type;
    out_ += '\n';
  }

  // `labels`: name, value, name, value, ...
  void Sample(const std::vector<std::string>& labels, double value) {
    out_ += name_;
    if (!labels.empty()) {
      out_ += '{';
      for (size_t i = 0; i + 1 < labels.size(); i += 2) {
        if (i > 0) out_ += ',';
        out_ += labels[i];
        out_ += "=\"";
        out_ += EscapeLabelValue(labels[i + 1]);
        out_ += '"';
      }
      out_ += '}';
    }
    out_ += ' ';
    out_ += Number(value);
    out_ += '\n';
  }

 private:
  static std::string Number(double value) {
    if (std::isnan(value)) return "NaN";
    if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
    if (value == std::floor(value) && std::fabs(value) < 1e15) {
      char text[32];
      std::snprintf(text, sizeof(text), "%.0f", value);
      return text;
    }
    char text[32];
    std::snprintf(text, sizeof(text), "%.9g", value);
    return text;
  }

  std::string& out_;
  const char* name_;
};

std::string StateLabel(v1::JobState state) {
  std::string name = JobStateName(state);
  for (char& c : name) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return name;
}

}  // namespace

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string PrometheusText(const std::vector<v1::Job>& jobs, const std::vector<v1::NodeStatus>& nodes) {
  std::string out;
  using JobValue = std::function<double(const v1::Job&)>;
  using JobFilter = std::function<bool(const v1::Job&)>;
  auto per_job = [&](const char* name, const char* type, const char* help, const JobValue& value,
                     const JobFilter& when = nullptr) {
    Family family(out, name, type, help);
    for (const v1::Job& job : jobs) {
      if (when && !when(job)) continue;
      family.Sample({"job_id", job.id(), "name", job.name()}, value(job));
    }
  };
  {
    Family family(out, "ltrain_job_info", "gauge", "A job the coordinator holds, with its state.");
    for (const v1::Job& job : jobs) family.Sample({"job_id", job.id(), "name", job.name(), "state", StateLabel(job.state())}, 1);
  }
  {
    std::map<std::string, int> counts;
    for (v1::JobState state : {v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING, v1::JOB_STATE_RESTARTING,
                               v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_FAILED, v1::JOB_STATE_STOPPED}) {
      counts[StateLabel(state)] = 0;
    }
    for (const v1::Job& job : jobs) ++counts[StateLabel(job.state())];
    Family family(out, "ltrain_jobs", "gauge", "Jobs the coordinator holds, by state.");
    for (const auto& [state, count] : counts) family.Sample({"state", state}, count);
  }
  auto stepped = [](const v1::Job& job) { return job.last_step() > 0; };
  // Throughput and ETA describe a job that runs; once it ended they are no figure of it.
  auto moving = [](const v1::Job& job) {
    return job.last_step() > 0 && job.state() != v1::JOB_STATE_SUCCEEDED && job.state() != v1::JOB_STATE_FAILED &&
           job.state() != v1::JOB_STATE_STOPPED;
  };
  per_job("ltrain_job_step", "gauge", "The last step rank 0 completed.", [](const v1::Job& j) { return double(j.last_step()); });
  per_job("ltrain_job_total_steps", "gauge", "The steps the job trains for.",
          [](const v1::Job& j) { return double(j.total_steps()); }, [](const v1::Job& j) { return j.total_steps() > 0; });
  per_job("ltrain_job_loss", "gauge", "The training loss of the last completed step.",
          [](const v1::Job& j) { return j.last_loss(); }, stepped);
  per_job("ltrain_job_tokens_per_second", "gauge", "Tokens a second of the whole job, over its last step.",
          [](const v1::Job& j) { return j.tokens_per_s(); }, moving);
  per_job("ltrain_job_mfu", "gauge",
          "Model FLOPs utilization of rank 0's last step (0 to 1) against its GPU's dense bf16 peak; GPU jobs.",
          [](const v1::Job& j) { return j.mfu(); }, [&](const v1::Job& j) { return moving(j) && j.mfu() > 0; });
  per_job("ltrain_job_checkpoint_save_seconds", "gauge",
          "The last checkpoint save rank 0 committed, from its snapshot to its commit.",
          [](const v1::Job& j) { return j.checkpoint_save_ms() / 1000.0; },
          [](const v1::Job& j) { return j.checkpoint_save_ms() > 0; });
  per_job("ltrain_job_checkpoint_load_seconds", "gauge", "The load of the checkpoint the job last resumed from.",
          [](const v1::Job& j) { return j.checkpoint_load_ms() / 1000.0; },
          [](const v1::Job& j) { return j.checkpoint_load_ms() > 0; });
  per_job("ltrain_job_eta_seconds", "gauge", "Remaining steps times the last step's time.",
          [](const v1::Job& j) { return j.eta_s(); }, moving);
  per_job("ltrain_job_val_loss", "gauge", "The last validation loss.", [](const v1::Job& j) { return j.val_loss(); },
          [](const v1::Job& j) { return j.val_step() > 0; });
  per_job("ltrain_job_val_step", "gauge", "The step after which the last validation loss was measured.",
          [](const v1::Job& j) { return double(j.val_step()); }, [](const v1::Job& j) { return j.val_step() > 0; });
  per_job("ltrain_job_committed_step", "gauge", "The step of the newest committed checkpoint (0: none).",
          [](const v1::Job& j) { return double(j.last_committed_step()); });
  per_job("ltrain_job_generation", "gauge", "The generation (start or restart) the job is in.",
          [](const v1::Job& j) { return double(j.generation()); });
  per_job("ltrain_job_world_size", "gauge", "Ranks of the job.", [](const v1::Job& j) { return double(j.world_size()); });
  per_job("ltrain_job_restarts_total", "counter", "Restarts after failures.",
          [](const v1::Job& j) { return double(j.restarts()); });
  per_job("ltrain_job_recoveries_total", "counter",
          "In-place recoveries completed (fault.recovery: in_place): a replaced rank back at work beside the others.",
          [](const v1::Job& j) { return double(j.recoveries()); });
  per_job("ltrain_job_lost_steps_total", "counter",
          "Completed steps trained again after in-place recoveries (going back to older copies of the state).",
          [](const v1::Job& j) { return double(j.lost_steps()); });
  {
    Family family(out, "ltrain_job_fp8_amax", "gauge",
                  "parallel.precision fp8: the largest (stat max) and smallest (stat min) amax of the operands rank 0's "
                  "FP8 products quantized in its last step, by operand (activation, weight, gradient).");
    for (const v1::Job& job : jobs) {
      if (!job.has_fp8()) continue;
      const v1::Fp8Figures& f = job.fp8();
      const std::pair<const char*, std::pair<double, double>> operands[] = {
          {"activation", {f.activation_amax_max(), f.activation_amax_min()}},
          {"weight", {f.weight_amax_max(), f.weight_amax_min()}},
          {"gradient", {f.gradient_amax_max(), f.gradient_amax_min()}}};
      for (const auto& [operand, amax] : operands) {
        family.Sample({"job_id", job.id(), "name", job.name(), "operand", operand, "stat", "max"}, amax.first);
        family.Sample({"job_id", job.id(), "name", job.name(), "operand", operand, "stat", "min"}, amax.second);
      }
    }
  }
  per_job("ltrain_job_fp8_overflow_steps_total", "counter",
          "parallel.precision fp8: steps of rank 0's run whose FP8 operands overflowed (an amax not finite).",
          [](const v1::Job& j) { return double(j.fp8().overflow_steps()); }, [](const v1::Job& j) { return j.has_fp8(); });
  {
    Family family(out, "ltrain_job_moe_load_ratio", "gauge",
                  "model.moe: the last step's load of the MoE blocks, each its busiest expert's assignments over the "
                  "mean (1: even): the worst block's (stat max) and the blocks' mean (stat mean).");
    for (const v1::Job& job : jobs) {
      if (!job.has_moe()) continue;
      family.Sample({"job_id", job.id(), "name", job.name(), "stat", "max"}, job.moe().load_max());
      family.Sample({"job_id", job.id(), "name", job.name(), "stat", "mean"}, job.moe().load_mean());
    }
  }
  {
    Family family(out, "ltrain_job_moe_layer_load_ratio", "gauge",
                  "model.moe: the last step's load of each MoE block (its busiest expert's assignments over the mean).");
    for (const v1::Job& job : jobs) {
      if (!job.has_moe()) continue;
      for (int i = 0; i < job.moe().layers_size() && i < job.moe().layer_load_size(); ++i) {
        family.Sample({"job_id", job.id(), "name", job.name(), "layer", std::to_string(job.moe().layers(i))},
                      job.moe().layer_load(i));
      }
    }
  }
  per_job("ltrain_job_moe_aux_loss", "gauge",
          "model.moe balance aux_loss: the last step's balance loss without its coefficient (1 at an even load).",
          [](const v1::Job& j) { return j.moe().aux_loss(); },
          [](const v1::Job& j) { return j.has_moe() && j.moe().aux_loss() >= 0; });
  per_job("ltrain_job_moe_drop_rate", "gauge",
          "model.moe.capacity_factor: the share of the last step's assignments dropped for want of room in their "
          "expert.",
          [](const v1::Job& j) { return j.moe().drop_rate(); },
          [](const v1::Job& j) { return j.has_moe() && j.moe().drop_rate() >= 0; });
  {
    Family step(out, "ltrain_rank_step", "gauge", "The step a rank works on.");
    for (const v1::Job& job : jobs) {
      for (const v1::RankInfo& rank : job.ranks()) {
        step.Sample({"job_id", job.id(), "rank", std::to_string(rank.rank()), "node", rank.node_id()}, double(rank.last_step()));
      }
    }
  }
  {
    Family age(out, "ltrain_rank_progress_age_seconds", "gauge",
               "Seconds since a rank's step, phase or collectives last changed.");
    for (const v1::Job& job : jobs) {
      for (const v1::RankInfo& rank : job.ranks()) {
        age.Sample({"job_id", job.id(), "rank", std::to_string(rank.rank()), "node", rank.node_id()},
                   rank.progress_age_ms() / 1000.0);
      }
    }
  }
  {
    Family phase(out, "ltrain_rank_phase", "gauge", "The phase a rank is in.");
    for (const v1::Job& job : jobs) {
      for (const v1::RankInfo& rank : job.ranks()) {
        if (rank.phase().empty()) continue;
        phase.Sample({"job_id", job.id(), "rank", std::to_string(rank.rank()), "node", rank.node_id(), "phase", rank.phase()}, 1);
      }
    }
  }
  {
    Family compute(out, "ltrain_rank_compute_seconds", "gauge",
                   "A rank's own work a step in seconds (forward and backward, without waits for the others), over "
                   "its last steps; absent where not measured.");
    for (const v1::Job& job : jobs) {
      for (const v1::RankInfo& rank : job.ranks()) {
        if (!(rank.compute_ms() > 0)) continue;
        compute.Sample({"job_id", job.id(), "rank", std::to_string(rank.rank()), "node", rank.node_id()}, rank.compute_ms() / 1000.0);
      }
    }
  }
  {
    Family memory(out, "ltrain_rank_memory_bytes", "gauge",
                  "A rank's memory at its last step: the GPU allocator's peak, or on the CPU its parameters, "
                  "gradients, optimizer state and activations' peak; absent where unknown.");
    for (const v1::Job& job : jobs) {
      for (const v1::RankInfo& rank : job.ranks()) {
        if (rank.memory_bytes() <= 0) continue;
        memory.Sample({"job_id", job.id(), "rank", std::to_string(rank.rank()), "node", rank.node_id()},
                      static_cast<double>(rank.memory_bytes()));
      }
    }
  }
  {
    Family straggler(out, "ltrain_rank_straggler", "gauge",
                     "1 while a rank's own work stays above 1.2 times the other ranks' median.");
    for (const v1::Job& job : jobs) {
      for (const v1::RankInfo& rank : job.ranks()) {
        straggler.Sample({"job_id", job.id(), "rank", std::to_string(rank.rank()), "node", rank.node_id()},
                         rank.straggler() ? 1 : 0);
      }
    }
  }
  {
    Family up(out, "ltrain_node_up", "gauge", "1 while a node's agent is connected.");
    for (const v1::NodeStatus& node : nodes) up.Sample({"node", node.node_id()}, node.connected() ? 1 : 0);
  }
  {
    Family age(out, "ltrain_node_heartbeat_age_seconds", "gauge", "Seconds since a node's last heartbeat.");
    for (const v1::NodeStatus& node : nodes) age.Sample({"node", node.node_id()}, node.heartbeat_age_ms() / 1000.0);
  }
  {
    Family gpus(out, "ltrain_node_gpus", "gauge", "GPUs a node has.");
    for (const v1::NodeStatus& node : nodes) gpus.Sample({"node", node.node_id()}, node.facts().gpus());
  }
  {
    Family cpus(out, "ltrain_node_cpus", "gauge", "CPUs a node has.");
    for (const v1::NodeStatus& node : nodes) cpus.Sample({"node", node.node_id()}, node.facts().cpus());
  }
  return out;
}

std::string ServerFiguresText(const RpcFigures& rpc, const StateWriterFigures& writer, const HeldFigures& held) {
  std::string out;
  constexpr int kKinds = static_cast<int>(RpcKind::kCount);
  {
    Family calls(out, "ltrain_coordinator_rpc_calls_total", "counter", "Calls the coordinator handled, by RPC kind.");
    for (int k = 0; k < kKinds; ++k) calls.Sample({"rpc", RpcKindName(RpcKind(k))}, double(rpc.Get(RpcKind(k)).calls));
  }
  {
    Family seconds(out, "ltrain_coordinator_rpc_seconds_total", "counter",
                   "Seconds the coordinator's handlers ran, by RPC kind (KvGetAnswered: until the answer).");
    for (int k = 0; k < kKinds; ++k) seconds.Sample({"rpc", RpcKindName(RpcKind(k))}, rpc.Get(RpcKind(k)).nanos / 1e9);
  }
  {
    Family longest(out, "ltrain_coordinator_rpc_seconds_max", "gauge", "The longest call since the start, by RPC kind.");
    for (int k = 0; k < kKinds; ++k) longest.Sample({"rpc", RpcKindName(RpcKind(k))}, rpc.Get(RpcKind(k)).max_nanos / 1e9);
  }
  Family(out, "ltrain_coordinator_state_writes_total", "counter", "Writes the state writer applied.")
      .Sample({}, double(writer.writes));
  Family(out, "ltrain_coordinator_state_write_batches_total", "counter", "The transactions they went in.")
      .Sample({}, double(writer.batches));
  Family(out, "ltrain_coordinator_state_write_seconds_total", "counter", "Seconds the state writer spent writing, failed attempts included.")
      .Sample({}, writer.nanos / 1e9);
  Family(out, "ltrain_coordinator_state_writes_queued", "gauge", "Writes waiting for the state writer.")
      .Sample({}, double(writer.queued));
  Family(out, "ltrain_coordinator_jobs_held", "gauge", "Jobs in the coordinator's memory: running, and those that ended lately.")
      .Sample({}, double(held.jobs));
  Family(out, "ltrain_coordinator_rank_records_held", "gauge",
         "Ranks' records and progress entries in memory (a job that ended has them folded).")
      .Sample({}, double(held.rank_records));
  Family(out, "ltrain_coordinator_folded_rank_bytes", "gauge", "Bytes of the folded ranks of jobs that ended.")
      .Sample({}, double(held.folded_rank_bytes));
  Family(out, "ltrain_coordinator_nodes_held", "gauge", "Nodes in memory: connected, and lost ones kept a while.")
      .Sample({}, double(held.nodes));
  Family(out, "ltrain_coordinator_rendezvous_keys", "gauge", "Rendezvous keys held.")
      .Sample({}, double(held.rendezvous_keys));
  return out;
}

}  // namespace ltrain::launcher
