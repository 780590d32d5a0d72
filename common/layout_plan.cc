#include "common/layout_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <thread>
#include <tuple>

#include "common/pipeline_schedule.h"

namespace ltrain {
namespace {

// ---- Parameters ------------------------------------------------------------------------------------

// How tensor parallelism splits a parameter (Megatron's scheme, as the worker's model shards it).
enum class Split { kWhole, kRows, kCols };

struct ParamShape {
  int64_t numel = 0;
  Split split = Split::kWhole;
  int layer = -1;     // -1: not in a block
  bool embedding = false;
  bool head = false;  // the final norm, llama's untied output
  bool expert = false;  // an MoE block's stack of routed experts: split over parallel.ep
};

// The full model's parameters in the worker's order (ModelParameterShapes).
std::vector<ParamShape> ModelShapes(const ModelSpec& m, int tp) {
  const int64_t d = m.d_model, f = FfnWidth(m), V = m.vocab, T = m.seq_len;
  const int64_t kv_dim = int64_t{HeadDim(m)} * KvHeads(m), q_dim = int64_t{HeadDim(m)} * m.heads;
  const Split kv_split = KvHeads(m) % tp == 0 ? Split::kRows : Split::kWhole;
  std::vector<ParamShape> out;
  out.push_back({V * d, Split::kRows, -1, true, false});
  if (m.arch == Arch::kGpt2) out.push_back({T * d, Split::kWhole, -1, true, false});
  for (int l = 0; l < m.layers; ++l) {
    if (m.arch == Arch::kGpt2) {
      // ln1.w ln1.b qkv.w qkv.b proj.w proj.b ln2.w ln2.b fc.w fc.b fc2.w fc2.b
      for (const auto& [n, s] : std::vector<std::pair<int64_t, Split>>{
               {d, Split::kWhole}, {d, Split::kWhole}, {3 * d * d, Split::kRows}, {3 * d, Split::kRows},
               {d * d, Split::kCols}, {d, Split::kWhole}, {d, Split::kWhole}, {d, Split::kWhole},
               {f * d, Split::kRows}, {f, Split::kRows}, {d * f, Split::kCols}, {d, Split::kWhole}}) {
        out.push_back({n, s, l, false, false});
      }
    } else {
      // attn_norm wq wk wv wo ffn_norm w1 w3 w2 (the order of their sizes is what counts here), then
      // qwen2's biases and qwen3's per-head norms
      for (const auto& [n, s] : std::vector<std::pair<int64_t, Split>>{
               {d, Split::kWhole}, {q_dim * d, Split::kRows}, {kv_dim * d, kv_split}, {kv_dim * d, kv_split},
               {d * q_dim, Split::kCols}, {d, Split::kWhole}}) {
        out.push_back({n, s, l, false, false});
      }
      if (IsMoeLayer(m, l)) {
        // The router, the stacked experts' w1, w3 and w2, the shared experts' (common/model_family.h).
        const int64_t experts = m.moe.experts, fe = MoeFfnWidth(m), fs = int64_t{m.moe.shared_experts} * fe;
        out.push_back({experts * d, Split::kWhole, l, false, false});
        for (Split s : {Split::kRows, Split::kRows, Split::kCols}) {
          out.push_back({experts * fe * d, s, l, false, false, /*expert=*/true});
        }
        if (fs > 0) {
          for (Split s : {Split::kRows, Split::kRows, Split::kCols}) out.push_back({fs * d, s, l, false, false});
        }
      } else {
        for (Split s : {Split::kRows, Split::kRows, Split::kCols}) out.push_back({f * d, s, l, false, false});
      }
      if (m.arch == Arch::kQwen2) {
        out.push_back({q_dim, Split::kRows, l, false, false});
        out.push_back({kv_dim, kv_split, l, false, false});
        out.push_back({kv_dim, kv_split, l, false, false});
      }
      if (m.arch == Arch::kQwen3) {
        out.push_back({HeadDim(m), Split::kWhole, l, false, false});
        out.push_back({HeadDim(m), Split::kWhole, l, false, false});
      }
    }
  }
  if (m.arch == Arch::kGpt2) {
    out.push_back({d, Split::kWhole, -1, false, true});
    out.push_back({d, Split::kWhole, -1, false, true});
  } else {
    out.push_back({d, Split::kWhole, -1, false, true});
    if (!m.tie_embeddings) out.push_back({V * d, Split::kRows, -1, false, true});
  }
  return out;
}

struct RankParam {
  int64_t numel = 0;
  int unit = 0;  // ZeRO-3's structural unit: 0 embedding, 1 + layer, layers + 1 the head
  bool expert = false;  // this rank's experts/ep of a stack of experts, reduced over dp/ep ranks
};

// The parameters pipeline rank `pp_rank` holds, each tensor-parallel slice, in the store's order (the
// tied head's copy on a last stage that is not the first comes last).
std::vector<RankParam> RankParams(const ModelSpec& m, const Layout& layout, int pp_rank) {
  const int tp = layout.tp;
  std::vector<int> stage_of;
  for (size_t s = 0; s < layout.stage_layers.size(); ++s) {
    for (int i = 0; i < layout.stage_layers[s]; ++i) stage_of.push_back(static_cast<int>(s));
  }
  const bool first = pp_rank == 0, last = pp_rank == layout.pp - 1;
  std::vector<RankParam> out;
  for (const ParamShape& p : ModelShapes(m, tp)) {
    int64_t local = tp > 1 && p.split != Split::kWhole ? p.numel / tp : p.numel;
    const bool expert = p.expert && layout.ep > 1;
    if (expert) local /= layout.ep;
    if (p.embedding) {
      if (first) out.push_back({local, 0});
    } else if (p.layer >= 0) {
      if (stage_of[p.layer] % layout.pp == pp_rank) out.push_back({local, 1 + p.layer, expert});
    } else if (last) {
      out.push_back({local, m.layers + 1});
    }
  }
  const bool tied = m.arch == Arch::kGpt2 || m.tie_embeddings;
  if (tied && last && !first) out.push_back({int64_t{m.vocab} * m.d_model / tp, m.layers + 1});
  return out;
}

// A flat unit of the worker: its element count, and whether it holds experts split over ep (reduced
// and sharded over dp/ep ranks; the worker's SeparateExpertUnits puts them in units of their own).
struct FlatUnit {
  int64_t numel = 0;
  bool expert = false;
};

// The worker's flat units: buckets of at most bucket_mb MiB of fp32 elements, walked from the last
// parameter (zero 0-2), or one unit per embedding, block and head (zero 3); each unit's experts split
// over ep next to it, in a unit of their own.
std::vector<FlatUnit> Units(const std::vector<RankParam>& params, int zero, double bucket_mb) {
  std::vector<FlatUnit> units;
  auto push = [&units](int64_t dense, int64_t experts) {
    if (dense > 0) units.push_back({dense, false});
    if (experts > 0) units.push_back({experts, true});
  };
  if (zero == 3) {
    std::map<int, std::pair<int64_t, int64_t>, std::greater<>> by_unit;
    for (const RankParam& p : params) (p.expert ? by_unit[p.unit].second : by_unit[p.unit].first) += p.numel;
    for (const auto& [unit, n] : by_unit) push(n.first, n.second);
    return units;
  }
  const double cap = bucket_mb * 1024 * 1024;
  double bytes = 0;
  int64_t dense = 0, experts = 0;
  bool open = false;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const double size = static_cast<double>(it->numel) * 4;
    if (open && bytes + size > cap) {
      push(dense, experts);
      dense = experts = 0;
      bytes = 0;
    }
    (it->expert ? experts : dense) += it->numel;
    bytes += size;
    open = true;
  }
  if (open) push(dense, experts);
  return units;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- Activations -----------------------------------------------------------------------------------

struct Shape {
  int64_t b, T, Ts, d, f, h, hd, V, kv_local;
  int tp;
  // Context parallelism: T is a rank's tokens of a sequence (seq_len / cp).
  int cp = 1;
};

Shape ShapeOf(const ModelSpec& m, const Layout& layout) {
  Shape s;
  s.b = layout.micro_batch;
  s.cp = std::max(1, layout.cp);
  s.T = m.seq_len / s.cp;
  s.tp = layout.tp;
  s.Ts = layout.sequence_parallel ? s.T / layout.tp : s.T;
  s.d = m.d_model;
  s.f = FfnWidth(m);
  s.h = m.heads;
  s.hd = HeadDim(m);
  s.V = m.vocab;
  const int kv = KvHeads(m);
  s.kv_local = m.arch != Arch::kGpt2 && kv < layout.tp ? 1 : kv / layout.tp;
  return s;
}

// What one layer keeps for backward per micro-batch, in bytes.
// CPU (LibTorch 1.13, fp32): attention written out (the softmax's probabilities and a bool mask of
// T*T), layer and RMS norms written out.
int64_t CpuLayerBytes(const ModelSpec& m, const Shape& s, ActivationCheckpointing ac) {
  const int64_t b = s.b, T = s.T, Ts = s.Ts, d = s.d, t = s.tp, dl = s.d / t, fl = s.f / t, hl = s.h / t;
  if (ac == ActivationCheckpointing::kFull) return b * Ts * d * 4;
  // Whole-sequence attention keeps its probabilities and the causal mask; context parallelism's ring
  // (worker/model/context_attention.cc) keeps its queries' log-sum-exp instead (q, k, v and the
  // output, which it keeps too, are kept for the products beside it either way).
  const int64_t probs = s.cp > 1 ? 0 : b * hl * T * T, probs_mask = s.cp > 1 ? 0 : T * T;
  const int64_t ring = s.cp > 1 ? b * hl * T : 0;
  int64_t floats = 0, mask = 0;
  if (m.arch == Arch::kGpt2) {
    floats = 2 * b * Ts * d + 4 * b * Ts + 2 * b * T * d + 3 * b * T * dl + b * T * dl + 2 * b * T * fl + ring;
    if (ac == ActivationCheckpointing::kNone) {
      floats += probs;
      mask = probs_mask;
    }
  } else {
    // Attention's tensors are heads * head_dim wide (Qwen3's wider than d_model).
    const int64_t ql = hl * s.hd, kvl = s.kv_local * s.hd;
    floats = 2 * b * Ts * d + 2 * (2 * b * Ts * d + b * Ts) + 2 * b * T * d + b * T * ql + 4 * b * T * fl + ring;
    if (ac == ActivationCheckpointing::kNone) {
      floats += 3 * b * T * ql + probs;
      mask = probs_mask;
    } else {
      floats += b * T * ql + 2 * b * T * kvl;
    }
    // Qwen3's per-head norms of q and k: each keeps its input, its output and a statistic per head, and
    // the rotation of q its own copy (fitted to the layouts suite's Qwen3).
    if (m.arch == Arch::kQwen3) floats += 2 * b * T * (ql + kvl) + b * T * (hl + s.kv_local) + 2 * b * T * ql;
  }
  return floats * 4 + mask;
}

// CUDA (bf16 activations, the fused kernels, flash attention: no T*T term, so selective recompute
// of attention keeps what none keeps; of the MLP it keeps the activation's inputs only). `a` is the
// activations' element size, `sb` the residual stream's. The norms keep the block's input and its
// mid-block residual in `a` (an fp32 stream's as bf16 x − mean); full recompute keeps the block's
// input in `sb`. Selective recompute without sequence parallelism keeps no norm output: the products
// that read one make it again in backward from what the norm keeps (a Llama's attention norm's still,
// where wk and wv are kept whole on every tp rank and LibTorch's product reads it).
//
// With `fp8` (FP8 products) each product keeps its input's FP8 transposed copy instead of the bf16
// input, a byte an element: the norms' outputs, attention's output, and the MLP's activation (the
// GELU's output, SwiGLU's product), made again in backward by no recompute mode.
// Context parallelism's ring in backward on GPUs, beside what the layers keep (the ring itself keeps
// what flash attention keeps: q, k, v, the output and its log-sum-exp): the keys and values in flight
// and received, their gradients gathered so far (fp32, sent, received and this step's), the queries'
// gradient (fp32), the key and value heads repeated for grouped heads, and a block's gradients from
// the kernel. (On CPUs the layouts suite's peaks come before the ring's backward: none is counted.)
int64_t CudaRingTransientBytes(const ModelSpec& m, const Shape& s, int a) {
  if (s.cp <= 1) return 0;
  const int64_t hl = s.h / s.tp, kvl = m.arch == Arch::kGpt2 ? hl : s.kv_local;
  const int64_t q = s.b * hl * s.T * s.hd, kv = 2 * s.b * kvl * s.T * s.hd;
  return q * 4 + 3 * kv * 4 + 2 * kv * a + (kvl < hl ? 2 * q * a : 0) + 3 * q * a;
}

int64_t CudaLayerBytes(const ModelSpec& m, const Shape& s, ActivationCheckpointing ac, int a, int sb, bool fp8) {
  const int64_t b = s.b, T = s.T, Ts = s.Ts, d = s.d, t = s.tp;
  if (ac == ActivationCheckpointing::kFull) return b * Ts * d * sb;
  const bool selective = ac == ActivationCheckpointing::kSelective;
  const bool rebuilt = selective && Ts == T;
  const int64_t stream = 2 * b * Ts * d;
  if (fp8) {
    int64_t bf16_elems = 0, fp8_elems = 0;
    if (m.arch == Arch::kGpt2) {
      // q k v and the MLP's pre-GELU in bf16; the norms' outputs, attention's output and the GELU's in FP8
      bf16_elems = 3 * b * T * d / t + b * T * s.f / t;
      fp8_elems = 2 * b * T * d + b * T * d / t + b * T * s.f / t;
    } else {
      const int64_t ql = s.h / t * s.hd, kvl = s.kv_local * s.hd;
      bf16_elems = b * T * ql + 2 * b * T * kvl + 2 * b * T * s.f / t;
      fp8_elems = 2 * b * T * d + b * T * ql + b * T * s.f / t;
      if (m.arch == Arch::kQwen2) bf16_elems += b * T * (ql + 2 * kvl);
      if (m.arch == Arch::kQwen3) bf16_elems += b * T * (ql + kvl);
    }
    return stream * a + bf16_elems * a + fp8_elems + 4 * (4 * b * Ts + b * (s.h / t) * T);
  }
  int64_t elems = 0;
  if (m.arch == Arch::kGpt2) {
    // norm 1's output (the qkv product's input), q k v, attention's output, norm 2's output, the
    // MLP's pre- and post-GELU (selective recompute: pre only, backward recomputes the GELU)
    elems = (rebuilt ? 0 : 2) * b * T * d + 4 * b * T * d / t + (selective ? 1 : 2) * b * T * s.f / t;
  } else {
    // norm output, q (after RoPE), k and v, attention's output, norm output, w1's and w3's outputs
    // and their SwiGLU product (selective recompute: not the product, backward makes it again)
    const bool kv_whole = KvHeads(m) < t;
    const int64_t norm_outputs = rebuilt ? (kv_whole ? 1 : 0) : 2;
    const int64_t ql = s.h / t * s.hd, kvl = s.kv_local * s.hd;
    elems = norm_outputs * b * T * d + 2 * b * T * ql + 2 * b * T * kvl + (selective ? 2 : 3) * b * T * s.f / t;
    // Qwen2's biases add a sum of q, k and v each; Qwen3's per-head norms keep their inputs.
    if (m.arch == Arch::kQwen2) elems += b * T * (ql + 2 * kvl);
    if (m.arch == Arch::kQwen3) elems += b * T * (ql + kvl);
  }
  // norm statistics and attention's log-sum-exp, fp32
  return stream * a + elems * a + 4 * (4 * b * Ts + b * (s.h / t) * T);
}

// An MoE block's router and experts (worker/model/moe_block.cc) against the dense MLP they replace,
// per micro-batch at even routing (a dropless block's peak moves with the imbalance): bytes to add
// to CpuLayerBytes' or CudaLayerBytes' (negative where the experts keep less than the MLP). Kept:
// the router's scores (and its logits under the z-loss), the gates, the tokens' rows in expert order
// (T*k of them), each expert's w1 and w3 outputs, its activation (not on GPUs in bf16, whose fused
// SwiGLU makes it again in backward) and their product, the experts' output rows, the orders'
// indices; the shared experts as an MLP of their width.
int64_t MoeLayerExtraBytes(const ModelSpec& m, const Shape& s, ActivationCheckpointing ac, int a, bool cpu) {
  if (ac == ActivationCheckpointing::kFull) return 0;
  const int64_t N = s.b * s.T, k = m.moe.top_k, R = N * k, E = m.moe.experts, fe = MoeFfnWidth(m) / s.tp;
  const int64_t fs = int64_t{m.moe.shared_experts} * fe;
  const int64_t swiglu = !cpu && a == 2 ? 3 : 4;
  const int64_t fp32 = N * E * (m.moe.z_loss_coef > 0 ? 2 : 1) + 2 * N * k;
  const int64_t in_a = 2 * R * s.d + swiglu * R * fe + swiglu * N * fs;
  const int64_t ids = 3 * R + N * k;
  const int64_t dense = cpu ? 4 * N * s.f / s.tp * 4 : (ac == ActivationCheckpointing::kSelective ? 2 : 3) * N * s.f / s.tp * a;
  return fp32 * 4 + in_a * (cpu ? 4 : a) + ids * 8 - dense;
}

// The first stage's embedding output and, on the CPU under tensor parallelism, the ids and mask the
// vocabulary-parallel lookup keeps.
int64_t EmbedBytes(const Shape& s, int a, bool cpu) {
  return s.b * s.Ts * s.d * a + (cpu && s.tp > 1 ? 9 * s.b * s.T : 0);
}

// The last stage's final norm and loss: on the CPU the log-probabilities (t = 1) or the
// vocabulary-parallel cross entropy's two [b, T, V/t] tensors; on CUDA the bf16 logits (and the
// final norm's input in `a`, as the blocks' norms keep it).
int64_t HeadBytes(const ModelSpec& m, const Shape& s, int a, bool cpu) {
  const int64_t b = s.b, T = s.T, Ts = s.Ts, d = s.d, V = s.V, t = s.tp;
  if (cpu) {
    int64_t floats = m.arch == Arch::kGpt2 ? 2 * b * Ts + b * T * d : 2 * b * Ts * d + b * Ts + b * T * d;
    floats += t == 1 ? b * T * V : 2 * b * T * V / t + b * T;
    return floats * 4 + (t == 1 ? 0 : 9 * b * T);
  }
  return b * Ts * d * a + b * T * d * a + b * T * V / t * 2 + 8 * b * T;
}

// The step's peak of activations and pipeline buffers on pipeline rank `rank`: the (micro-batch,
// chunk) pairs in flight after each forward, plus every send posted so far (the runtime holds them
// until the step ends), measured where the worker samples: after each forward.
int64_t PipelinePeak(const Layout& layout, const std::vector<int64_t>& stage_bytes, int64_t send_bytes, int rank,
                     int64_t after_backward) {
  if (layout.pp == 1) return stage_bytes[0];
  StatusOr<PipelinePlan> plan = PlanPipeline(layout.pp_schedule, layout.pp, layout.chunks, layout.accumulation);
  if (!plan.ok()) return 0;
  std::map<std::pair<int, int>, int64_t> in_flight;
  int64_t held = 0, peak = 0, live = 0;
  bool backward_seen = false;
  for (const PipeOp& op : plan->ops[rank]) {
    const int vs = VirtualStage(layout.pp, rank, op.chunk);
    if (op.kind == PipeOpKind::kForward) {
      in_flight[{op.microbatch, op.chunk}] = stage_bytes[vs];
      live += stage_bytes[vs];
      peak = std::max(peak, live + held + (backward_seen ? after_backward : 0));
    } else if (op.kind == PipeOpKind::kBackward) {
      live -= in_flight[{op.microbatch, op.chunk}];
      in_flight.erase({op.microbatch, op.chunk});
      backward_seen = true;
    } else if (op.kind == PipeOpKind::kSendActivation || op.kind == PipeOpKind::kSendGrad) {
      held += send_bytes;
    }
  }
  return peak;
}

// The CPU heap grows by more than the saved tensors: autograd's nodes and their bookkeeping, per layer
// and micro-batch in flight whatever the tensors' sizes, and a little per rank. Fitted to the worker's
// `memory rank` lines of the layouts suite's models (ltrain's integration tests).
constexpr int64_t kCpuOverheadPerRank = 40 * 1024;
int64_t CpuLayerOverhead(const ModelSpec& m, ActivationCheckpointing ac) {
  if (ac == ActivationCheckpointing::kFull) return 8 * 1024;
  return m.arch == Arch::kGpt2 ? 40 * 1024 : 76 * 1024;
}
// An MoE block's routing and its experts' products add nodes of their own: per expert.
constexpr int64_t kCpuOverheadPerExpert = 16 * 1024;
// ---- The estimate ----------------------------------------------------------------------------------

// Cost model constants, from `ltrain launch` runs of gpt-1.3b and gpt-7b layouts on a host of four
// NVLink-connected GPUs (docs/performance.md, "Choosing a layout"): the single-GPU efficiency of the
// matrix products (higher for wider models), and the rate at which each kind of traffic delays the
// step where it is not hidden.
double ComputeEfficiency(int d_model) {
  return std::clamp(0.60 + 0.04 * std::log2(static_cast<double>(d_model) / 2048.0), 0.45, 0.66);
}
constexpr double kTensorParallelRate = 80e9;     // per-layer all-reduces on the critical path (forward's)
constexpr double kSequenceParallelRate = 85e9;   // the same bytes as all-gathers and reduce-scatters
constexpr double kDataParallelRate = 300e9;      // bucketed, overlapped in part with backward
constexpr double kZero3Rate = 450e9;             // ZeRO-3's prefetched gathers overlap compute
constexpr double kAutocastOverhead = 0.10;       // bf16-autocast casts the weights every micro-batch
constexpr double kPipelineRate = 25e9;           // stage-to-stage sends and receives wait for each other
// parallel.precision fp8: how much faster the blocks' matrix products run, their operands'
// quantization included (the rest of the step, attention and the head, stays bf16). Measured through
// `ltrain launch` on one H100 (docs/performance.md, FP8 products): 1.25 for gpt-1.3b, 1.16 for Llama
// 3.2 1B's shape.
constexpr double kFp8ProductSpeedup = 1.2;

// The blocks' matrices' parameters (every layer's): the products FP8 runs.
int64_t BlockMatrixParameters(const ModelSpec& m) {
  const int64_t d = m.d_model, f = FfnWidth(m);
  if (m.arch == Arch::kGpt2) return m.layers * (4 * d * d + 2 * f * d);
  const int64_t hd = HeadDim(m), q = hd * m.heads, kv = hd * KvHeads(m);
  // An MoE block's experts run LibTorch's bf16 products: only its attention's count.
  int64_t dense = 0;
  for (int l = 0; l < m.layers; ++l) dense += IsMoeLayer(m, l) ? 0 : 1;
  return m.layers * (2 * q * d + 2 * kv * d) + dense * 3 * f * d;
}

// CPU ranks (Gloo over TCP): a rank's arithmetic rate on a core of its own (higher for wider
// matrices), and what each collective or send costs on the step's path: its latency, in which the
// peer's lag is counted, and its bytes. Fitted to `ltrain launch` runs of the quickstart's model and
// a wider one in each layout on a 2-core virtual machine (docs/performance.md, "Layouts on CPUs").
double CpuCoreFlops(int d_model) {
  return std::clamp(49e9 * (1.0 + 0.45 * std::log2(static_cast<double>(d_model) / 128.0)), 25e9, 150e9);
}
constexpr double kGlooMessageSeconds = 3.5e-3;
constexpr double kGlooRate = 180e6;

int64_t Ring(int64_t bytes, int n, bool all_reduce) {
  if (n <= 1) return 0;
  const double share = static_cast<double>(n - 1) / n;
  return static_cast<int64_t>(std::llround((all_reduce ? 2 : 1) * share * static_cast<double>(bytes)));
}

}  // namespace

int CpuThreadsPerRank(int ranks_on_node) {
  if (const char* omp = std::getenv("OMP_NUM_THREADS"); omp && std::atoi(omp) > 0) return std::atoi(omp);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_on_node));
}

double ModelFlopsPerToken(const ModelSpec& model) {
  // A mixture of experts: the parameters a token runs through.
  return 6.0 * static_cast<double>(ActiveParameterCount(model)) +
         12.0 * model.layers * model.d_model * model.seq_len;
}

LayoutEstimate EstimateLayout(const Recipe& recipe, const Layout& layout, double cpu_cores_per_rank) {
  const ModelSpec& m = recipe.model;
  const ParallelSpec& ps = recipe.parallel;
  LayoutEstimate e;
  e.layout = layout;
  e.device = ps.device;
  const bool cuda = ps.device == Device::kCuda;
  const bool cpu = !cuda;
  const bool autocast = cuda && ps.precision == Precision::kBf16Autocast;
  const bool fp8 = cuda && ps.precision == Precision::kFp8;
  e.bf16 = cuda && ps.precision != Precision::kFp32 && !autocast;
  const int a = cuda && ps.precision != Precision::kFp32 ? 2 : 4;  // activation bytes
  const int sb = ps.fp32_residual_stream() ? 4 : a;                 // the residual stream's
  const int g = e.bf16 && layout.zero < 2 ? 2 : 4;                  // gradient bytes in the dp collectives
  const int dp = layout.dp, zero = layout.zero, mb = layout.accumulation;
  const Shape s = ShapeOf(m, layout);
  const bool tp_partial = (layout.sequence_parallel && layout.tp > 1) ||
                          (m.arch != Arch::kGpt2 && (KvHeads(m) < layout.tp || (m.arch == Arch::kQwen3 && layout.tp > 1)));
  const bool overlap = layout.pp == 1 && !tp_partial;
  const int stages = layout.pp * layout.chunks;
  const int64_t send = s.b * s.Ts * s.d * sb;

  int64_t dp_bytes = 0, tp_bytes = 0, pp_bytes = 0, embedding_bytes = 0, z3_bytes = 0;
  int64_t tp_exposed_bytes = 0;  // the part of tp_bytes on the critical path
  int64_t ep_bytes = 0, ep_messages = 0;  // expert parallelism's all-to-alls (the busiest stage's)
  // On CPUs the busiest pipeline rank's data-parallel collectives and bytes a step, and the tensor-
  // and pipeline-parallel messages of a step: each costs its latency there.
  int64_t cpu_dp_messages = 0, cpu_dp_bytes = 0, tp_messages = 0, pp_messages = 0;
  for (int r = 0; r < layout.pp; ++r) {
    const std::vector<RankParam> params = RankParams(m, layout, r);
    const std::vector<FlatUnit> units = Units(params, zero, ps.bucket_mb);
    StageMemory st;
    st.pp_rank = r;
    int64_t numel = 0, biggest_unit = 0, second_unit = 0, gathered = 0;
    for (const RankParam& p : params) numel += p.numel;
    st.parameters = numel;
    MemoryParts& parts = st.parts;
    int64_t rank_dp_messages = 0;
    const int64_t rank_dp_bytes_before = zero == 3 ? z3_bytes : dp_bytes;
    for (size_t i = 0; i < units.size(); ++i) {
      // A unit of experts split over ep is reduced and sharded over the dp/ep ranks holding them.
      const int group = units[i].expert ? dp / layout.ep : dp;
      const int64_t n = units[i].numel, shard = CeilDiv(n, group), padded = shard * group;
      // bf16 copies: of every parameter below ZeRO-3; under it only of the units gathered (below).
      parts.params += (zero == 3 ? shard : padded) * 4 + (e.bf16 && zero < 3 ? padded * 2 : 0);
      parts.grads += (zero >= 2 ? shard : padded) * (e.bf16 && zero < 2 ? 2 : 4);
      parts.optimizer += 2 * (zero == 0 ? padded : shard) * 4;
      // ZeRO-3 keeps the embedding and head units gathered from their forward to their gradients
      // (the first and last unit), the blocks' one at a time with the next prefetched.
      if (zero == 3) {
        if (i == 0 || i + 1 == units.size()) {
          gathered += padded * (e.bf16 ? 2 : 4);
        } else if (padded > biggest_unit) {
          second_unit = biggest_unit;
          biggest_unit = padded;
        } else {
          second_unit = std::max(second_unit, padded);
        }
      }
      // Data-parallel traffic of this unit per step.
      if (group > 1) {
        const bool sharded = e.bf16 && (zero == 1 || zero == 2);
        if (zero == 3) {
          // bf16: the copies gathered, the gradients reduce-scattered in bf16.
          const int64_t one = Ring(padded * (e.bf16 ? 2 : 4), group, false);
          z3_bytes += mb * 2 * one + (overlap ? mb : 1) * (cpu ? Ring(padded * 4, group, true) : one);
          rank_dp_messages += mb * 2 + (overlap ? mb : 1);
        } else if (zero == 0) {
          dp_bytes += Ring(padded * g, group, true);
          rank_dp_messages += 1;
        } else if (zero == 1) {
          rank_dp_messages += 2;
          dp_bytes += sharded ? Ring(padded * 2, group, false) + Ring(padded * 2, group, false)
                              : Ring(padded * g, group, true) + Ring(padded * 4, group, false);
        } else {
          // Gloo has no reduce-scatter: it all-reduces and keeps its slice.
          const int64_t rs = cpu ? Ring(padded * 4, group, true) : Ring(padded * 4, group, false);
          dp_bytes += (overlap ? mb : 1) * rs + Ring(padded * (sharded ? 2 : 4), group, false);
          rank_dp_messages += (overlap ? mb : 1) + 1;
        }
      }
    }
    if (rank_dp_messages > cpu_dp_messages) {
      cpu_dp_messages = rank_dp_messages;
      cpu_dp_bytes = (zero == 3 ? z3_bytes : dp_bytes) - rank_dp_bytes_before;
    }

    // Activations: each virtual stage of this rank per micro-batch, under every recompute mode.
    int layers_here = 0;
    for (int c = 0; c < layout.chunks; ++c) layers_here += layout.stage_layers[VirtualStage(layout.pp, r, c)];
    const int64_t unsharded_grads =
        zero >= 2 && (!overlap && mb > 1) ? numel * (cpu ? 4 : (e.bf16 ? 2 : 4)) : 0;
    // Under ZeRO-3 with bf16 copies also the gradient buffer of the block in backward.
    const int64_t z3_buffers =
        zero == 3 ? gathered + (cuda ? (biggest_unit + second_unit) * (e.bf16 ? 2 : 4) + (e.bf16 ? biggest_unit * 2 : 0) : 0)
                  : 0;
    for (int mode = 0; mode < 3; ++mode) {
      const auto ac = static_cast<ActivationCheckpointing>(mode);
      std::vector<int64_t> stage_bytes(stages, 0);
      int64_t layer_none = 0;
      for (int c = 0; c < layout.chunks; ++c) {
        const int vs = VirtualStage(layout.pp, r, c);
        const int64_t per_layer =
            cpu ? CpuLayerBytes(m, s, ac) + CpuLayerOverhead(m, ac) : CudaLayerBytes(m, s, ac, a, sb, fp8);
        const int64_t dense_none = cpu ? CpuLayerBytes(m, s, ActivationCheckpointing::kNone)
                                       : CudaLayerBytes(m, s, ActivationCheckpointing::kNone, a, sb, fp8);
        layer_none = std::max(layer_none, dense_none);
        int64_t bytes = per_layer * layout.stage_layers[vs];
        // The stage's MoE blocks keep their routing and experts' tensors instead of an MLP's.
        int first_layer = 0;
        for (int v = 0; v < vs; ++v) first_layer += layout.stage_layers[v];
        for (int l = first_layer; l < first_layer + layout.stage_layers[vs]; ++l) {
          if (!IsMoeLayer(m, l)) continue;
          bytes += MoeLayerExtraBytes(m, s, ac, a, cpu) +
                   (cpu && ac != ActivationCheckpointing::kFull ? kCpuOverheadPerExpert * (m.moe.experts / layout.ep) : 0);
          layer_none = std::max(layer_none, dense_none + MoeLayerExtraBytes(m, s, ActivationCheckpointing::kNone, a, cpu));
        }
        if (autocast) bytes += int64_t{4} * s.b * s.T * s.d * layout.stage_layers[vs];
        bytes += vs == 0 ? EmbedBytes(s, sb, cpu) + (cpu && s.tp == 1 ? 8 * s.b * s.T : 0) : send;
        if (vs == stages - 1) bytes += HeadBytes(m, s, a, cpu) + (cpu && s.tp == 1 ? 8 * s.b * s.T : 0);
        stage_bytes[vs] = bytes;
      }
      // Saved tensors (with the pipeline's held sends) at the sampled peak, and the buffers beside them.
      int64_t saved = PipelinePeak(layout, stage_bytes, send, r, layout.pp > 1 ? unsharded_grads : 0);
      int64_t buffers = z3_buffers + (layout.pp == 1 && mb > 1 ? unsharded_grads : 0);
      if (cpu) {
        saved += kCpuOverheadPerRank;
        // Under full recompute the little kept leaves the peak to the recomputed layer's ring in
        // backward: its own block's probabilities and their gradient, written out, and the mask.
        if (ac == ActivationCheckpointing::kFull && s.cp > 1) {
          buffers += 2 * s.b * (s.h / s.tp) * s.T * s.T * 4 + s.T * s.T;
        }
      } else {
        // Backward's transients: vocabulary-parallel cross entropy's gradient over the vocabulary
        // and the fp32 pieces of the logits it keeps until backward (without tp our cross entropy
        // writes its gradient over the logits), a recomputed layer, ZeRO-2's unsharded gradients
        // before they are reduced; and autocast's cached bf16 weights.
        int64_t transient = r == layout.pp - 1 && s.tp > 1 ? s.b * s.T * s.V / s.tp * 6 : 0;
        if (ac == ActivationCheckpointing::kFull) transient = std::max(transient, layer_none);
        if (zero == 2 && overlap) transient += numel * (e.bf16 ? 2 : 4);
        // FP8 products quantize at the product: at the widest one in backward, its output gradient
        // and its input in e4m3/e5m2 with their transposed copies, and its weight's.
        if (fp8) transient += 2 * s.b * s.T * (s.f / s.tp + s.d) + 2 * s.f / s.tp * s.d;
        transient += CudaRingTransientBytes(m, s, a);
        // Forward keeps each block weight's FP8 transposed copy for backward (not under ZeRO-3, whose
        // gathered weights backward quantizes again): a byte a parameter, from forward to backward.
        if (fp8 && zero < 3) buffers += BlockMatrixParameters(m) / m.layers * layers_here / s.tp;
        buffers += transient + (autocast ? numel * 2 : 0);
      }
      st.activations_by_mode[mode] = saved + buffers;
      if (ac == layout.activation_checkpointing) {
        parts.activations = saved;
        parts.buffers = buffers;
      }
    }

    // Tensor-parallel traffic: two all-reduces forward and two backward per layer and micro-batch (as
    // all-gathers and reduce-scatters under sequence parallelism: the same bytes), two more per layer
    // when full recompute repeats the forward, and the embedding's and the loss's. Without sequence
    // parallelism the two of backward (the block inputs' gradients) run beside the products' weight
    // gradients on GPUs: only the others delay the step.
    if (layout.tp > 1 && r == 0) {
      const int64_t act = s.b * s.T * s.d * a;
      const int per_layer = layout.activation_checkpointing == ActivationCheckpointing::kFull ? 6 : 4;
      const int64_t collectives = static_cast<int64_t>(per_layer) * layers_here + 2;
      tp_bytes = mb * collectives * Ring(act, layout.tp, true);
      const int64_t hidden = cuda && !layout.sequence_parallel ? 2 * int64_t{layers_here} : 0;
      tp_exposed_bytes = mb * (collectives - hidden) * Ring(act, layout.tp, true);
      tp_messages = mb * collectives;
    }
    // Expert-parallel traffic: each MoE block sends its routed rows (tokens * top_k, even routing) to
    // their experts' ranks and back, forward and backward (again where full recompute repeats the
    // forward), and the counts before them: each rank keeps 1/ep of its rows.
    if (layout.ep > 1) {
      int moe_here = 0;
      for (int c = 0; c < layout.chunks; ++c) {
        const int vs = VirtualStage(layout.pp, r, c);
        int first_layer = 0;
        for (int v = 0; v < vs; ++v) first_layer += layout.stage_layers[v];
        for (int l = first_layer; l < first_layer + layout.stage_layers[vs]; ++l) moe_here += IsMoeLayer(m, l) ? 1 : 0;
      }
      const int per_layer = layout.activation_checkpointing == ActivationCheckpointing::kFull ? 6 : 4;
      const int64_t rows = s.b * s.T * m.moe.top_k;
      const int64_t one = static_cast<int64_t>(std::llround(static_cast<double>(rows * s.d * a) * (layout.ep - 1) / layout.ep));
      const int64_t bytes = int64_t{mb} * moe_here * per_layer * one;
      if (bytes > ep_bytes) {
        ep_bytes = bytes;
        ep_messages = int64_t{mb} * moe_here * (per_layer + per_layer / 2);
      }
    }
    if (layout.pp > 1 && r == 0) {
      int sends = 0;
      for (int c = 0; c < layout.chunks; ++c) {
        const int vs = VirtualStage(layout.pp, r, c);
        sends += (vs < stages - 1) + (vs > 0);
      }
      pp_bytes = static_cast<int64_t>(mb) * sends * send;
      pp_messages = static_cast<int64_t>(mb) * sends;
      const bool tied = m.arch == Arch::kGpt2 || m.tie_embeddings;
      if (tied) embedding_bytes = int64_t{m.vocab} * m.d_model / layout.tp * g;
    }
    // On CUDA the gradient shards of ZeRO-2/3 are made by the step's first reduction, in backward, as
    // activations are freed: without accumulation none is held at the forward's peak.
    if (cuda && zero >= 2 && mb == 1 && layout.pp == 1) parts.grads = 0;
    // On one data-parallel rank below ZeRO-3 each block's gradients are made when backward reaches
    // it and released after its update (the worker's transient gradients): at forward's peak none,
    // in backward the block's beside the activations freed so far. One block's is counted.
    if (cuda && zero < 3 && dp == 1 && mb == 1 && layout.pp == 1) {
      int64_t biggest = 0;
      for (const FlatUnit& block : Units(params, /*zero=*/3, ps.bucket_mb)) biggest = std::max(biggest, block.numel);
      parts.grads = biggest * (e.bf16 ? 2 : 4);
    }
    e.stages.push_back(st);
    e.peak_bytes = std::max(e.peak_bytes, parts.total());
  }

  if (dp > 1) {
    e.traffic.push_back({"dp", dp, zero == 3 ? z3_bytes : dp_bytes,
                         zero == 0   ? "all-reduce of the gradients"
                         : zero == 1 ? "gradients reduced, parameters all-gathered after the update"
                         : zero == 2 ? "gradients reduce-scattered, parameters all-gathered after the update"
                                     : "parameters all-gathered for forward and backward, gradients reduce-scattered"});
  }
  if (layout.tp > 1) {
    e.traffic.push_back({"tp", layout.tp, tp_bytes,
                         layout.sequence_parallel ? "activations all-gathered and reduce-scattered in every layer"
                                                  : "activations all-reduced in every layer"});
  }
  if (layout.ep > 1) {
    e.traffic.push_back({"ep", layout.ep, ep_bytes, "each MoE block's routed rows to their experts' ranks and back, by all-to-all"});
  }
  if (layout.pp > 1) {
    e.traffic.push_back({"pp", layout.pp, pp_bytes, "activations and their gradients between stages"});
    if (embedding_bytes > 0) {
      e.traffic.push_back({"embedding", 2, embedding_bytes, "the tied embedding's gradient, first and last stage"});
    }
  }
  if (layout.pp > 1) {
    e.bubble = static_cast<double>(layout.pp - 1) /
               (static_cast<double>(layout.chunks) * layout.accumulation + layout.pp - 1);
  }

  const double tokens = static_cast<double>(layout.global_batch) * m.seq_len;
  const double flops = ModelFlopsPerToken(m) * tokens / layout.world_size;
  const double recompute = layout.activation_checkpointing == ActivationCheckpointing::kFull        ? 4.0 / 3.0
                           : layout.activation_checkpointing == ActivationCheckpointing::kSelective ? 1.03
                                                                                                    : 1.0;
  if (cpu) {
    // Every message waits for its peers (Gloo's collectives run on the step's path, ZeRO-3's gathers
    // too), and a rank computes at its cores' rate.
    const double compute = flops * recompute / (CpuCoreFlops(m.d_model) * std::max(1.0, cpu_cores_per_rank));
    const double embedding_messages = embedding_bytes > 0 ? 1 : 0;
    const double messages =
        static_cast<double>(cpu_dp_messages + tp_messages + pp_messages + ep_messages) + embedding_messages;
    const double bytes = static_cast<double>(cpu_dp_bytes + tp_bytes + pp_bytes + embedding_bytes + ep_bytes);
    e.step_seconds = compute / (1.0 - e.bubble) + messages * kGlooMessageSeconds + bytes / kGlooRate;
  }
  if (cuda) {
    double compute = flops / (kGpuPeakFlops * ComputeEfficiency(m.d_model));
    if (ps.precision == Precision::kFp8) {
      // The blocks parallel.fp8_bf16_layers keeps in bf16 run at bf16's rate.
      const double fp8_blocks = static_cast<double>(m.layers - static_cast<int>(ps.fp8_bf16_layers.size())) /
                                static_cast<double>(std::max(1, m.layers));
      const double share =
          fp8_blocks * 6.0 * static_cast<double>(BlockMatrixParameters(m)) / ModelFlopsPerToken(m);
      compute *= 1.0 - share + share / kFp8ProductSpeedup;
    }
    compute *= recompute;
    if (autocast) compute *= 1.0 + kAutocastOverhead;
    const double tp_rate = layout.sequence_parallel ? kSequenceParallelRate : kTensorParallelRate;
    const double pipelined = compute + static_cast<double>(tp_exposed_bytes + ep_bytes) / tp_rate +
                             static_cast<double>(pp_bytes) / kPipelineRate;
    e.step_seconds = pipelined / (1.0 - e.bubble) + static_cast<double>(dp_bytes) / kDataParallelRate +
                     static_cast<double>(z3_bytes) / kZero3Rate +
                     static_cast<double>(embedding_bytes) / kDataParallelRate;
    e.mfu = flops / e.step_seconds / kGpuPeakFlops;
  }
  return e;
}

std::string FitProblem(const Recipe& recipe) {
  if (recipe.runs_program()) return "";
  const int ranks = std::max(1, recipe.parallel.world_size());
  const bool cuda = recipe.parallel.device == Device::kCuda;
  const double limit = cuda ? kLargestGpuBytes : kLargestCpuRankBytes;
  const double parameters = static_cast<double>(ApproxParameterCount(recipe.model));
  const double floor = parameters * 16 / ranks;
  if (!(floor > limit)) return "";
  std::string own;
  if (CheckLayout(recipe, ranks).empty()) {
    if (StatusOr<Layout> layout = PlanLayout(recipe, ranks); layout.ok()) {
      char text[96];
      std::snprintf(text, sizeof(text), "%.2f GiB a rank in its own layout (`ltrain plan` shows it), and ",
                    static_cast<double>(EstimateLayout(recipe, *layout).peak_bytes) / (1 << 30));
      own = text;
    }
  }
  char text[512];
  std::snprintf(text, sizeof(text),
                "the model (%.4g parameters) cannot train on %d rank(s) in any layout: it needs %sat least %.2f GiB a "
                "rank with all of its training state (16 bytes a parameter) spread over every rank, more than any %s "
                "has (%.0f GiB); make the model smaller, or give it more ranks (parallel.nodes, parallel.nproc_per_node)",
                parameters, ranks, own.c_str(), floor / (1 << 30), cuda ? "GPU" : "machine", limit / (1 << 30));
  return text;
}

std::vector<PlanCandidate> RankLayouts(const Recipe& recipe, const PlanOptions& options) {
  const int ranks = options.ranks > 0 ? options.ranks : recipe.parallel.world_size();
  int per_node = options.ranks_per_node;
  if (per_node <= 0) {
    per_node = ranks % recipe.parallel.nproc_per_node == 0 ? recipe.parallel.nproc_per_node : std::min(ranks, 8);
    if (ranks % per_node != 0) per_node = ranks;
  }
  std::vector<PlanCandidate> out;
  auto consider = [&](int tp, int pp, int zero, bool sp, PpSchedule schedule, int chunks,
                      ActivationCheckpointing ac, int ep) {
    Recipe r = recipe;
    ParallelSpec& p = r.parallel;
    p.nodes = ranks / per_node;
    p.nodes_min = p.nodes_max = p.nodes;
    p.nproc_per_node = per_node;
    p.device = options.device;
    p.tp = tp;
    p.pp = pp;
    p.zero = zero;
    p.ep = ep;
    p.sequence_parallel = sp;
    p.pp_schedule = schedule;
    p.virtual_stages = chunks;
    p.activation_checkpointing = ac;
    if (!(tp == recipe.parallel.tp && pp == recipe.parallel.pp && chunks == recipe.parallel.virtual_stages)) {
      p.pp_split.clear();
    }
    PlanCandidate c;
    c.sets = {"parallel.tp=" + std::to_string(tp), "parallel.pp=" + std::to_string(pp),
              "parallel.zero=" + std::to_string(zero)};
    // Every key whose value here is not the recipe's, so that the keys applied to the same command line
    // give this layout (a pp schedule or split of the recipe's own left behind would not validate).
    if (ep != recipe.parallel.ep) c.sets.push_back("parallel.ep=" + std::to_string(ep));
    if (sp != recipe.parallel.sequence_parallel) {
      c.sets.push_back(std::string("parallel.sequence_parallel=") + (sp ? "true" : "false"));
    }
    if (pp > 1 || schedule != recipe.parallel.pp_schedule) c.sets.push_back("parallel.pp_schedule=" + NameOf(schedule));
    if (chunks > 1 || chunks != recipe.parallel.virtual_stages) {
      c.sets.push_back("parallel.virtual_stages=" + std::to_string(chunks));
    }
    if (p.pp_split.empty() && !recipe.parallel.pp_split.empty()) c.sets.push_back("parallel.pp_split=[]");
    c.sets.push_back("parallel.activation_checkpointing=" + NameOf(ac));
    const std::vector<LayoutProblem> problems = CheckLayout(r, ranks);
    if (!problems.empty()) {
      c.problem = problems.front().key + ": " + problems.front().message;
      out.push_back(std::move(c));
      return;
    }
    StatusOr<Layout> layout = PlanLayout(r, ranks);
    c.estimate = EstimateLayout(r, *layout, options.cpu_cores_per_rank);
    const double limit = options.device == Device::kCuda ? options.memory_bytes * kGpuMemoryUsable
                                                         : options.memory_bytes;
    if (options.memory_bytes > 0 && static_cast<double>(c.estimate.peak_bytes) > limit) {
      char text[160];
      std::snprintf(text, sizeof(text), "needs %.1f GiB a rank, more than %.1f GiB%s",
                    static_cast<double>(c.estimate.peak_bytes) / (1 << 30), limit / (1 << 30),
                    options.device == Device::kCuda ? " (90% of the GPU's memory)" : "");
      c.problem = text;
    } else {
      c.feasible = true;
    }
    out.push_back(std::move(c));
  };
  for (int tp = 1; tp <= ranks; ++tp) {
    if (ranks % tp != 0) continue;
    for (int pp = 1; pp * tp <= ranks; ++pp) {
      if ((ranks / tp) % pp != 0) continue;
      const int dp = ranks / (tp * pp);
      for (int zero = 0; zero <= 3; ++zero) {
        if (zero > 0 && dp == 1) continue;  // nothing to shard over
        if (zero == 3 && pp > 1) continue;  // not combined (CheckLayout's rule)
        for (int sp = 0; sp <= (tp > 1 ? 1 : 0); ++sp) {
          std::vector<std::pair<PpSchedule, int>> schedules = {{PpSchedule::k1F1B, 1}};
          if (pp > 1) {
            schedules.push_back({PpSchedule::kGpipe, 1});
            schedules.push_back({PpSchedule::kInterleaved, 2});
          }
          for (const auto& [schedule, chunks] : schedules) {
            for (ActivationCheckpointing ac : {ActivationCheckpointing::kNone, ActivationCheckpointing::kSelective,
                                               ActivationCheckpointing::kFull}) {
              // A mixture of experts: every expert-parallel degree that divides dp and the experts.
              for (int ep = 1; ep <= dp; ++ep) {
                if (ep > 1 && (recipe.model.moe.experts == 0 || dp % ep != 0 || recipe.model.moe.experts % ep != 0)) continue;
                consider(tp, pp, zero, sp == 1, schedule, chunks, ac, ep);
              }
            }
          }
        }
      }
    }
  }
  std::stable_sort(out.begin(), out.end(), [&](const PlanCandidate& x, const PlanCandidate& y) {
    if (x.feasible != y.feasible) return x.feasible;
    if (!x.feasible) return false;
    if (x.estimate.step_seconds != y.estimate.step_seconds) {
      return x.estimate.step_seconds < y.estimate.step_seconds;
    }
    return x.estimate.peak_bytes < y.estimate.peak_bytes;
  });
  return out;
}

}  // namespace ltrain
