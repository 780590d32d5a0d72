#include "common/layout.h"

#include <algorithm>
#include <numeric>

namespace ltrain {
namespace {

std::string S(int64_t n) { return std::to_string(n); }

}  // namespace

std::vector<LayoutProblem> CheckLayout(const Recipe& recipe, int world_size) {
  const ParallelSpec& p = recipe.parallel;
  const ModelSpec& m = recipe.model;
  std::vector<LayoutProblem> problems;
  auto problem = [&](const char* key, std::string message) { problems.push_back({key, std::move(message)}); };
  if (world_size < 1) {
    problem("parallel.nproc_per_node", "world size " + S(world_size) + " must be at least 1");
    return problems;
  }
  if (world_size % (p.tp * p.pp) != 0) {
    problem("parallel.tp", "world size " + S(world_size) + " (nodes*nproc_per_node) is not a multiple of tp*pp=" +
                               S(p.tp * p.pp));
    return problems;  // the rules below need the data-parallel degree
  }
  const int dp = world_size / (p.tp * p.pp);
  if (p.tp > 1 && m.moe.experts > 0 && MoeFfnWidth(m) % p.tp != 0) {
    problem("parallel.tp", "parallel.tp=" + S(p.tp) + " does not divide the experts' width " + S(MoeFfnWidth(m)) +
                               " (model.moe.ffn): each expert is split as the MLP is");
  }
  if (p.tp > 1) {
    if (m.heads % p.tp != 0) problem("parallel.tp", "parallel.tp=" + S(p.tp) + " does not divide model.heads=" + S(m.heads));
    if (FfnWidth(m) % p.tp != 0) {
      problem("parallel.tp", "parallel.tp=" + S(p.tp) + " does not divide the MLP width " +
                                 (m.arch == Arch::kGpt2 ? "4*d_model=" : "model.ffn=") + S(FfnWidth(m)));
    }
    // Key/value heads as many as heads (GPT-2's, or a Llama's without grouped-query attention): the
    // heads' rule above has said it.
    const int kv = KvHeads(m);
    if (kv != m.heads && kv % p.tp != 0 && p.tp % kv != 0) {
      problem("parallel.tp", "parallel.tp=" + S(p.tp) + " and model.kv_heads=" + S(kv) +
                                 ": tensor parallelism splits the key/value heads (kv_heads a multiple of tp) or "
                                 "replicates them (tp a multiple of kv_heads)");
    }
    if (m.vocab % p.tp != 0) {
      problem("parallel.tp", "parallel.tp=" + S(p.tp) + " does not divide model.vocab=" + S(m.vocab) +
                                 " (the embedding is split by vocabulary); pad vocab to a multiple of tp");
    }
    if (p.nproc_per_node % p.tp != 0) {
      problem("parallel.tp", "parallel.tp=" + S(p.tp) + " must divide nproc_per_node=" + S(p.nproc_per_node) +
                                 ": a tensor-parallel group stays within one node");
    }
  }
  if (p.sequence_parallel && p.tp == 1) {
    problem("parallel.sequence_parallel", "parallel.sequence_parallel needs parallel.tp > 1");
  } else if (p.sequence_parallel && m.seq_len % p.tp != 0) {
    problem("parallel.sequence_parallel", "parallel.sequence_parallel splits the sequence: model.seq_len=" +
                                              S(m.seq_len) + " is not a multiple of tp=" + S(p.tp));
  }
  if (p.ep > 1) {
    if (m.moe.experts == 0) {
      problem("parallel.ep", "parallel.ep=" + S(p.ep) + " splits the experts of a mixture of experts; this model has "
                                 "none (model.moe): remove parallel.ep");
    } else if (m.moe.experts % p.ep != 0) {
      problem("parallel.ep", "parallel.ep=" + S(p.ep) + " does not divide model.moe.experts=" + S(m.moe.experts) +
                                 ": each expert-parallel rank holds experts/ep of them");
    }
    if (dp % p.ep != 0) {
      problem("parallel.ep", "parallel.ep=" + S(p.ep) + " does not divide the data-parallel degree " + S(dp) +
                                 " (world size " + S(world_size) + " / (tp*pp=" + S(p.tp * p.pp) +
                                 ")): expert parallelism splits the data-parallel ranks; use an ep that divides " +
                                 S(dp) + " or more ranks");
    }
  }
  if (p.cp > 1) {
    if (dp % p.cp != 0) {
      problem("parallel.cp", "parallel.cp=" + S(p.cp) + " does not divide the data-parallel degree " + S(dp) +
                                 " (world size " + S(world_size) + " / (tp*pp=" + S(p.tp * p.pp) +
                                 ")): context parallelism splits the data-parallel ranks; use a cp that divides " +
                                 S(dp) + " or more ranks");
    }
    if (m.seq_len % (2 * p.cp) != 0) {
      problem("parallel.cp", "parallel.cp=" + S(p.cp) + " splits each sequence into 2*cp=" + S(2 * p.cp) +
                                 " chunks: model.seq_len=" + S(m.seq_len) + " is not a multiple of " + S(2 * p.cp));
    } else if (p.sequence_parallel && (m.seq_len / p.cp) % p.tp != 0) {
      problem("parallel.sequence_parallel", "sequence parallelism splits each rank's seq_len/cp=" +
                                                S(m.seq_len / p.cp) + " tokens over tp=" + S(p.tp) +
                                                ": not a multiple");
    }
    if (m.moe.experts > 0) {
      problem("parallel.cp", "parallel.cp with model.moe is not supported yet (the balance is computed per "
                                 "sequence): remove parallel.cp or model.moe");
    }
    if (p.ep > 1) problem("parallel.cp", "parallel.cp and parallel.ep do not combine yet: set one of them to 1");
  }
  const int stages = p.pp * p.virtual_stages;
  if (p.pp > m.layers) {
    problem("parallel.pp", "parallel.pp=" + S(p.pp) + " is larger than model.layers=" + S(m.layers));
  } else if (stages > m.layers) {
    problem("parallel.virtual_stages",
            "pp*virtual_stages=" + S(stages) + " stages is more than model.layers=" + S(m.layers));
  }
  if (p.zero == 3 && p.pp > 1) {
    problem("parallel.zero",
            "parallel.zero=3 shards parameters across data-parallel ranks and does not combine with pp>1; "
            "use zero: 1 with pipeline parallelism");
  }
  const bool interleaved = p.pp_schedule == PpSchedule::kInterleaved;
  if (interleaved && p.pp == 1) problem("parallel.pp_schedule", "parallel.pp_schedule=interleaved needs parallel.pp > 1");
  if (interleaved && p.virtual_stages < 2) {
    problem("parallel.virtual_stages", "parallel.pp_schedule=interleaved needs parallel.virtual_stages >= 2");
  }
  if (!interleaved && p.virtual_stages != 1) {
    problem("parallel.virtual_stages", "parallel.virtual_stages > 1 needs parallel.pp_schedule: interleaved");
  }
  if (!p.pp_split.empty()) {
    const int sum = std::accumulate(p.pp_split.begin(), p.pp_split.end(), 0);
    const bool positive = std::all_of(p.pp_split.begin(), p.pp_split.end(), [](int n) { return n >= 1; });
    if (static_cast<int>(p.pp_split.size()) != stages || sum != m.layers || !positive) {
      problem("parallel.pp_split", "parallel.pp_split needs " + S(stages) +
                                       " entries (pp*virtual_stages) of at least 1 summing to model.layers=" +
                                       S(m.layers) + "; it has " + S(static_cast<int64_t>(p.pp_split.size())) +
                                       " summing to " + S(sum));
    }
  }
  // The ranks of a context-parallel group read the same sequences.
  const int replicas = p.cp > 1 && dp % p.cp == 0 ? dp / p.cp : dp;
  const int64_t per_step = static_cast<int64_t>(recipe.training.micro_batch) * replicas;
  const int64_t global_batch = recipe.training.global_batch;
  if (global_batch % per_step != 0) {
    const int64_t lower = std::max<int64_t>(per_step, global_batch / per_step * per_step);
    problem("training.global_batch", "training.global_batch=" + S(global_batch) + " is not a multiple of micro_batch*" +
                                         (replicas == dp ? std::string("dp=") : "dp/cp=") +
                                         S(recipe.training.micro_batch) + "*" + S(replicas) + "=" + S(per_step) +
                                         "; try " + S(lower));
  } else if (interleaved && p.pp > 1 && (global_batch / per_step) % p.pp != 0) {
    problem("training.global_batch", "interleaved 1F1B needs the micro-batches per step (global_batch/(micro_batch*dp)=" +
                                         S(global_batch / per_step) + ") to be a multiple of pp=" + S(p.pp));
  }
  return problems;
}

StatusOr<Layout> PlanLayout(const Recipe& recipe, int world_size) {
  std::vector<LayoutProblem> problems = CheckLayout(recipe, world_size);
  if (!problems.empty()) return InvalidArgument(problems.front().message);
  const ParallelSpec& p = recipe.parallel;
  Layout layout;
  layout.world_size = world_size;
  layout.tp = p.tp;
  layout.pp = p.pp;
  layout.dp = world_size / (p.tp * p.pp);
  layout.ep = p.ep;
  layout.cp = p.cp;
  layout.chunks = p.pp > 1 ? p.virtual_stages : 1;
  layout.stage_layers = StageLayers(recipe.model.layers, layout.pp * layout.chunks, p.pp_split);
  layout.zero = p.zero;
  layout.sequence_parallel = p.sequence_parallel;
  layout.activation_checkpointing = p.activation_checkpointing;
  layout.pp_schedule = p.pp_schedule;
  layout.micro_batch = recipe.training.micro_batch;
  layout.global_batch = recipe.training.global_batch;
  layout.accumulation = layout.global_batch / (layout.micro_batch * layout.batch_replicas());
  return layout;
}

std::string ShrinkProblem(const Recipe& recipe, int world_size, int members) {
  if (std::string problem = InPlaceRecoveryProblem(recipe, world_size); !problem.empty()) return problem;
  StatusOr<Layout> layout = PlanLayout(recipe, world_size);
  if (!layout.ok()) return layout.status().message();
  if (!layout->plain()) {
    return "only plain data parallelism (no parallel.tp, parallel.pp or parallel.zero) goes on with fewer ranks so far";
  }
  if (members < 1) return "no rank is left";
  const int micro_batches = layout->global_batch / layout->micro_batch;
  if (micro_batches % members != 0) {
    return "the global batch's " + std::to_string(micro_batches) + " micro-batches (training.global_batch " +
           std::to_string(layout->global_batch) + " / training.micro_batch " + std::to_string(layout->micro_batch) +
           ") do not divide among the " + std::to_string(members) + " ranks left";
  }
  return "";
}

std::vector<int> StageLayers(int layers, int stages, const std::vector<int>& split) {
  if (!split.empty()) return split;
  std::vector<int> out(stages, layers / stages);
  for (int i = 0; i < layers % stages; ++i) ++out[i];
  return out;
}

std::string InPlaceRecoveryProblem(const Recipe& recipe, int world_size) {
  if (recipe.fault.recovery != Recovery::kInPlace) return "fault.recovery is restart";
  if (recipe.runs_program()) return "a program of the user's own (entrypoint.command) keeps its own state";
  if (world_size < 2) return "a job of one rank has no peer to take the state from";
  StatusOr<Layout> layout = PlanLayout(recipe, world_size);
  if (!layout.ok()) return layout.status().message();
  if (layout->zero == 3) {
    return "under parallel.zero 3 the parameters' deferred updates are not taken back in place yet (zero 1 and 2 are)";
  }
  if (layout->dp < 2) return "with one data-parallel rank no peer holds a copy of a rank's part of the state";
  if (layout->pp > 1) return "pipeline stages (parallel.pp above 1) are not re-formed in place yet";
  if (layout->cp > 1) return "the ranks of a context-parallel group hold different tokens: not re-formed in place yet";
  if (layout->ep > 1) return "the experts split by parallel.ep have no copy on a data-parallel peer of another expert rank yet";
  if (recipe.model.moe.experts > 0 && recipe.model.moe.balance == MoeBalance::kBias) {
    return "the router biases of model.moe.balance: bias are not re-formed in place yet";
  }
  return "";
}

}  // namespace ltrain
