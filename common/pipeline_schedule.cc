#include "common/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace ltrain {
namespace {

struct Compute {
  bool forward;
  int microbatch;
  int chunk;
};

// Wraps each compute op with the receives before it and the sends after it.
void Emit(const PipelinePlan& plan, int rank, const Compute& c, std::vector<PipeOp>& out) {
  const int vs = VirtualStage(plan.pp, rank, c.chunk);
  const int last = plan.virtual_stages() - 1;
  if (c.forward) {
    if (vs > 0) out.push_back({PipeOpKind::kRecvActivation, c.microbatch, c.chunk, (vs - 1) % plan.pp});
    out.push_back({PipeOpKind::kForward, c.microbatch, c.chunk, -1});
    if (vs < last) out.push_back({PipeOpKind::kSendActivation, c.microbatch, c.chunk, (vs + 1) % plan.pp});
  } else {
    if (vs < last) out.push_back({PipeOpKind::kRecvGrad, c.microbatch, c.chunk, (vs + 1) % plan.pp});
    out.push_back({PipeOpKind::kBackward, c.microbatch, c.chunk, -1});
    if (vs > 0) out.push_back({PipeOpKind::kSendGrad, c.microbatch, c.chunk, (vs - 1) % plan.pp});
  }
}

std::vector<Compute> GpipeOrder(int m) {
  std::vector<Compute> out;
  for (int i = 0; i < m; ++i) out.push_back({true, i, 0});
  for (int i = 0; i < m; ++i) out.push_back({false, i, 0});
  return out;
}

std::vector<Compute> OneFOneBOrder(int pp, int rank, int m) {
  const int warmup = std::min(pp - rank - 1, m);
  std::vector<Compute> out;
  for (int i = 0; i < warmup; ++i) out.push_back({true, i, 0});
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back({true, warmup + i, 0});
    out.push_back({false, i, 0});
  }
  for (int i = m - warmup; i < m; ++i) out.push_back({false, i, 0});
  return out;
}

// Megatron-LM's forward_backward_pipelining_with_interleaving order.
std::vector<Compute> InterleavedOrder(int pp, int rank, int chunks, int m) {
  const int total = m * chunks;
  int warmup = 0;
  if (m == pp) {
    warmup = total;
  } else {
    warmup = std::min((pp - rank - 1) * 2 + (chunks - 1) * pp, total);
  }
  auto micro = [&](int k) { return (k / (pp * chunks)) * pp + k % pp; };
  auto fchunk = [&](int k) { return (k / pp) % chunks; };
  auto bchunk = [&](int k) { return chunks - 1 - (k / pp) % chunks; };
  std::vector<Compute> out;
  for (int k = 0; k < warmup; ++k) out.push_back({true, micro(k), fchunk(k)});
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back({true, micro(warmup + k), fchunk(warmup + k)});
    out.push_back({false, micro(k), bchunk(k)});
  }
  for (int k = total - warmup; k < total; ++k) out.push_back({false, micro(k), bchunk(k)});
  return out;
}

}  // namespace

StatusOr<PipelinePlan> PlanPipeline(PpSchedule schedule, int pp, int chunks, int m) {
  if (pp < 1 || chunks < 1 || m < 1) {
    return InvalidArgument("pipeline plan needs pp, chunks and micro-batches >= 1 (got " + std::to_string(pp) +
                           ", " + std::to_string(chunks) + ", " + std::to_string(m) + ")");
  }
  if (schedule == PpSchedule::kInterleaved) {
    if (chunks < 2) return InvalidArgument("interleaved 1F1B needs parallel.virtual_stages >= 2");
    if (pp < 2) return InvalidArgument("interleaved 1F1B needs parallel.pp >= 2");
    if (m % pp != 0) {
      return InvalidArgument("interleaved 1F1B needs the micro-batches per step (" + std::to_string(m) +
                             ") to be a multiple of pp=" + std::to_string(pp));
    }
  } else if (chunks != 1) {
    return InvalidArgument("parallel.virtual_stages > 1 needs pp_schedule: interleaved");
  }
  PipelinePlan plan;
  plan.pp = pp;
  plan.chunks = chunks;
  plan.microbatches = m;
  plan.ops.resize(pp);
  for (int rank = 0; rank < pp; ++rank) {
    std::vector<Compute> order = schedule == PpSchedule::kGpipe  ? GpipeOrder(m)
                                 : schedule == PpSchedule::k1F1B ? OneFOneBOrder(pp, rank, m)
                                                                 : InterleavedOrder(pp, rank, chunks, m);
    for (const Compute& c : order) Emit(plan, rank, c, plan.ops[rank]);
  }
  return plan;
}

uint32_t PipeTag(const PipelinePlan& plan, bool gradient, int microbatch, int virtual_stage) {
  return static_cast<uint32_t>((microbatch * plan.virtual_stages() + virtual_stage) * 2 + (gradient ? 1 : 0));
}

std::string ToString(const PipeOp& op) {
  const char* names[] = {"recv_act", "F", "send_act", "recv_grad", "B", "send_grad"};
  std::string s = std::string(names[static_cast<int>(op.kind)]) + "(mb " + std::to_string(op.microbatch) +
                  ", chunk " + std::to_string(op.chunk);
  if (op.peer >= 0) s += ", peer " + std::to_string(op.peer);
  return s + ")";
}

PipelineSimulation SimulatePipeline(const PipelinePlan& plan) {
  PipelineSimulation sim;
  const int pp = plan.pp;
  // Messages posted and not yet received: (gradient, microbatch, virtual stage of the sender, dst).
  std::multiset<std::tuple<bool, int, int, int>> posted;
  std::vector<size_t> pc(pp, 0);
  // Per rank: which (mb, chunk) were received, computed, etc.
  std::vector<std::set<std::pair<int, int>>> have_input(pp), forwarded(pp), have_grad(pp), backwarded(pp);
  std::vector<int> in_flight(pp, 0);
  const int last = plan.virtual_stages() - 1;
  auto fail = [&](int rank, const PipeOp& op, const std::string& why) {
    sim.error = "rank " + std::to_string(rank) + " op " + ToString(op) + ": " + why;
    return sim;
  };
  while (true) {
    bool progressed = false, all_done = true;
    for (int r = 0; r < pp; ++r) {
      // Run rank r until it blocks.
      while (pc[r] < plan.ops[r].size()) {
        const PipeOp& op = plan.ops[r][pc[r]];
        const int vs = VirtualStage(pp, r, op.chunk);
        const std::pair<int, int> key{op.microbatch, op.chunk};
        if (op.chunk < 0 || op.chunk >= plan.chunks || op.microbatch < 0 || op.microbatch >= plan.microbatches) {
          return fail(r, op, "micro-batch or chunk out of range");
        }
        bool blocked = false;
        switch (op.kind) {
          case PipeOpKind::kRecvActivation:
          case PipeOpKind::kRecvGrad: {
            const bool grad = op.kind == PipeOpKind::kRecvGrad;
            const int from_vs = grad ? vs + 1 : vs - 1;
            if (from_vs < 0 || from_vs > last || op.peer != from_vs % pp) return fail(r, op, "receives from the wrong peer");
            auto it = posted.find({grad, op.microbatch, from_vs, r});
            if (it == posted.end()) {
              blocked = true;
            } else {
              posted.erase(it);
              (grad ? have_grad : have_input)[r].insert(key);
            }
            break;
          }
          case PipeOpKind::kForward:
            if (vs > 0 && !have_input[r].count(key)) return fail(r, op, "forward before its input arrived");
            if (!forwarded[r].insert(key).second) return fail(r, op, "forward twice");
            sim.max_in_flight = std::max(sim.max_in_flight, ++in_flight[r]);
            break;
          case PipeOpKind::kBackward:
            if (!forwarded[r].count(key)) return fail(r, op, "backward before its forward");
            if (vs < last && !have_grad[r].count(key)) return fail(r, op, "backward before its output gradient arrived");
            if (!backwarded[r].insert(key).second) return fail(r, op, "backward twice");
            --in_flight[r];
            break;
          case PipeOpKind::kSendActivation:
          case PipeOpKind::kSendGrad: {
            const bool grad = op.kind == PipeOpKind::kSendGrad;
            const int to_vs = grad ? vs - 1 : vs + 1;
            if (to_vs < 0 || to_vs > last || op.peer != to_vs % pp) return fail(r, op, "sends to the wrong peer");
            if (!(grad ? backwarded : forwarded)[r].count(key)) return fail(r, op, "sends before computing");
            posted.insert({grad, op.microbatch, vs, op.peer});
            break;
          }
        }
        if (blocked) break;
        ++pc[r];
        progressed = true;
      }
      if (pc[r] < plan.ops[r].size()) all_done = false;
    }
    ++sim.steps;
    if (all_done) break;
    if (!progressed) {
      sim.error = "deadlock:";
      for (int r = 0; r < pp; ++r) {
        sim.error += " rank " + std::to_string(r) + " at " +
                     (pc[r] < plan.ops[r].size() ? ToString(plan.ops[r][pc[r]]) : std::string("end")) + ";";
      }
      return sim;
    }
  }
  for (int r = 0; r < pp; ++r) {
    const size_t expected = static_cast<size_t>(plan.microbatches) * plan.chunks;
    if (forwarded[r].size() != expected || backwarded[r].size() != expected) {
      sim.error = "rank " + std::to_string(r) + " computed " + std::to_string(forwarded[r].size()) + " forwards and " +
                  std::to_string(backwarded[r].size()) + " backwards, expected " + std::to_string(expected) + " each";
      return sim;
    }
  }
  if (!posted.empty()) {
    sim.error = std::to_string(posted.size()) + " message(s) sent and never received";
    return sim;
  }
  sim.completed = true;
  return sim;
}

}  // namespace ltrain
