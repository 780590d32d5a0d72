#include "worker/model/context_attention.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "worker/comm/communicator.h"
#include "worker/torch_compat.h"

namespace ltrain::worker::cp {

Chunks ChunksOf(int64_t seq_len, int cp, int rank) {
  if (cp < 1 || rank < 0 || rank >= cp || seq_len % (2 * cp) != 0) {
    throw std::invalid_argument("context chunks: seq_len " + std::to_string(seq_len) + " over " + std::to_string(cp) +
                                " ranks (rank " + std::to_string(rank) + ") needs seq_len a multiple of 2*cp");
  }
  Chunks c;
  c.size = seq_len / (2 * cp);
  c.first = rank * c.size;
  c.second = (2 * cp - 1 - rank) * c.size;
  return c;
}

torch::Tensor PositionsOf(int64_t seq_len, int cp, int rank, const torch::Device& device) {
  const Chunks c = ChunksOf(seq_len, cp, rank);
  const torch::TensorOptions i64 = torch::TensorOptions().dtype(torch::kLong).device(device);
  return torch::cat({torch::arange(c.first, c.first + c.size, i64), torch::arange(c.second, c.second + c.size, i64)});
}

torch::Tensor Take(const torch::Tensor& x, int cp, int rank) {
  const Chunks c = ChunksOf(x.size(1), cp, rank);
  return torch::cat({x.narrow(1, c.first, c.size), x.narrow(1, c.second, c.size)}, 1);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr uint32_t kRingTag = 0x6370;

torch::ScalarType WideOf(const torch::Tensor& q) {
  return q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
}

// Key and value heads repeated for the query heads they serve; a gradient of the repeated heads
// summed back onto them.
torch::Tensor Expand(const torch::Tensor& t, int64_t groups) { return groups == 1 ? t : t.repeat_interleave(groups, 1); }
torch::Tensor Fold(const torch::Tensor& g, int64_t groups) {
  if (groups == 1) return g;
  return g.view({g.size(0), g.size(1) / groups, groups, g.size(2), g.size(3)}).sum(2);
}

// The part of a step's block that is computed (see AttendStep): the queries of the back chunk only,
// the keys of the front chunk only, or all of both, causal.
struct Block {
  bool causal = false;
  bool back_queries = false;
  bool front_keys = false;
};
Block BlockOf(int rank, int src) {
  Block b;
  b.causal = src == rank;
  b.front_keys = src < rank;
  b.back_queries = src > rank;
  return b;
}

// A causal block's scores [.., tq, tk] (tq == tk) with each query's later keys at -inf, in place:
// every query sees its own key, so no row is empty.
void HideFuture(torch::Tensor& scores) {
  const int64_t t = scores.size(-1);
  scores.masked_fill_(torch::ones({t, t}, scores.options().dtype(torch::kBool)).triu(1), -INFINITY);
}

// The written-out block: the output in q's type, the log-sum-exp in the wide type.
std::pair<torch::Tensor, torch::Tensor> WrittenForward(const torch::Tensor& q, const torch::Tensor& k,
                                                       const torch::Tensor& v, bool causal, double scale) {
  torch::Tensor scores = at::matmul(q, k.transpose(-2, -1)).to(WideOf(q)) * scale;
  if (causal) HideFuture(scores);
  torch::Tensor lse = at::logsumexp(scores, -1);
  const torch::Tensor& p = scores.sub_(lse.unsqueeze(-1)).exp_();  // the probabilities, in place
  return {at::matmul(p.to(v.scalar_type()), v), lse};
}

// Its gradients from the whole row's output and log-sum-exp, in the wide type.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> WrittenBackward(const torch::Tensor& dout, const torch::Tensor& q,
                                                                        const torch::Tensor& k, const torch::Tensor& v,
                                                                        const torch::Tensor& out, const torch::Tensor& lse,
                                                                        bool causal, double scale) {
  const torch::ScalarType wide = WideOf(q);
  const torch::Tensor qw = q.to(wide), kw = k.to(wide), vw = v.to(wide), dow = dout.to(wide);
  // Two [tq, tk] tensors at a time, each made in place: the probabilities, then the scores' gradient.
  torch::Tensor p = at::matmul(qw, kw.transpose(-2, -1)).mul_(scale);
  if (causal) HideFuture(p);
  p.sub_(lse.to(wide).unsqueeze(-1)).exp_();
  const torch::Tensor dv = at::matmul(p.transpose(-2, -1), dow);
  const torch::Tensor d = (dow * out.to(wide)).sum(-1, /*keepdim=*/true);
  torch::Tensor ds = at::matmul(dow, vw.transpose(-2, -1));
  ds.sub_(d).mul_(p);
  return {at::matmul(ds, kw).mul_(scale), at::matmul(ds.transpose(-2, -1), qw).mul_(scale), dv};
}

// Flash attention's kernels take tensors whose last dimension is contiguous.
torch::Tensor Dense(const torch::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// What a step of rank `rank` against src's keys and values computes, forward and backward alike: the
// block's shape, the chunk size c (half the rank's tokens), the scale, the key and value heads
// repeated for the query heads (groups of them each) and cut to the keys the block sees.
struct Step {
  Block block;
  int64_t groups = 1, c = 0;
  double scale = 1.0;
  torch::Tensor k, v;
  // q's rows (or any [b, h, t, ...] tensor's) that the block's queries are.
  torch::Tensor Rows(const torch::Tensor& t) const { return block.back_queries ? t.narrow(2, c, c) : t; }
  // A [b, kv_heads, t, hd] gradient's part that the block's keys are.
  torch::Tensor Keys(const torch::Tensor& t) const { return block.front_keys ? t.narrow(2, 0, c) : t; }
};
Step StepOf(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int cp, int rank, int src) {
  if (src < 0 || src >= cp || rank < 0 || rank >= cp) {
    throw std::invalid_argument("context parallelism's ring: rank " + std::to_string(rank) + " or source " +
                                std::to_string(src) + " is not of a ring of " + std::to_string(cp));
  }
  Step s;
  s.block = BlockOf(rank, src);
  s.groups = q.size(1) / k.size(1);
  s.c = q.size(2) / 2;
  s.scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  s.k = s.Keys(Expand(k, s.groups));
  s.v = s.Keys(Expand(v, s.groups));
  return s;
}

}  // namespace

void AttendStep(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int cp, int rank, int src,
                Partial* acc) {
  const Step step = StepOf(q, k, v, cp, rank, src);
  const torch::Tensor qb = step.Rows(q);
  auto [out, lse] = compat::FlashBlocksAvailable(q)
                        ? compat::FlashBlockForward(Dense(qb), Dense(step.k), Dense(step.v), step.block.causal, step.scale)
                        : WrittenForward(qb, step.k, step.v, step.block.causal, step.scale);
  const torch::ScalarType wide = WideOf(q);
  if (step.block.causal) {  // the first step: the rank's own block
    acc->out = out.to(wide);
    acc->lse = lse.to(wide);
    return;
  }
  torch::Tensor ao = step.Rows(acc->out), al = step.Rows(acc->lse);
  const torch::Tensor lw = lse.to(wide);
  const torch::Tensor m = at::maximum(al, lw);
  const torch::Tensor wa = at::exp(al - m), wb = at::exp(lw - m);  // the larger 1, the other at most 1
  const torch::Tensor sum = wa + wb;
  ao.mul_(wa.unsqueeze(-1)).add_(out.to(wide) * wb.unsqueeze(-1)).div_(sum.unsqueeze(-1));
  al.copy_(m + at::log(sum));
}

void AttendStepBackward(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse, int cp, int rank,
                        int src, torch::Tensor& dq, torch::Tensor& dk, torch::Tensor& dv) {
  const Step step = StepOf(q, k, v, cp, rank, src);
  torch::Tensor gq, gk, gv;
  if (compat::FlashBlocksAvailable(q)) {
    std::tie(gq, gk, gv) = compat::FlashBlockBackward(
        Dense(step.Rows(dout)), Dense(step.Rows(q)), Dense(step.k), Dense(step.v), Dense(step.Rows(out)),
        step.Rows(lse).to(torch::kFloat).contiguous(), step.block.causal, step.scale);
  } else {
    std::tie(gq, gk, gv) = WrittenBackward(step.Rows(dout), step.Rows(q), step.k, step.v, step.Rows(out),
                                           step.Rows(lse), step.block.causal, step.scale);
  }
  step.Rows(dq).add_(gq.to(dq.scalar_type()));
  step.Keys(dk).add_(Fold(gk.to(dk.scalar_type()), step.groups));
  step.Keys(dv).add_(Fold(gv.to(dv.scalar_type()), step.groups));
}

namespace {

// One pass of the ring: each tensor to the next rank, the previous rank's back. Start() takes the
// tensors (ready on the device's current stream); the pass itself runs until Finish(), beside what
// the caller computes meanwhile: on CPUs on a thread of its own, started at once; on GPUs on a stream
// of its own, waiting for the tensors only, issued in Finish() after the caller has queued its work.
class RingPass {
 public:
  RingPass(Communicator* ring, const torch::Device& device)
      : ring_(ring), device_(device), side_(device, /*high_priority=*/true) {}
  RingPass(const RingPass&) = delete;
  RingPass& operator=(const RingPass&) = delete;
  ~RingPass() {
    if (thread_.joinable()) thread_.join();
  }

  void Start(std::vector<torch::Tensor> send) {
    sends_.clear();
    recvs_.clear();
    for (torch::Tensor& t : send) {
      sends_.push_back(t.contiguous());
      recvs_.push_back(torch::empty_like(sends_.back()));
    }
    if (side_.active()) {
      side_.WaitForCurrent(device_);
      return;
    }
    thread_ = std::thread([this] { status_ = Run(); });
  }

  std::vector<torch::Tensor> Finish() {
    if (side_.active()) {
      {
        compat::SideStream::Scope on_side(side_);
        status_ = Run();
      }
      side_.CurrentWaitsForIt(device_);
    } else if (thread_.joinable()) {
      thread_.join();
    }
    if (!status_.ok()) throw std::runtime_error("context parallelism's ring: " + status_.message());
    sends_.clear();
    return std::move(recvs_);
  }

 private:
  Status Run() {
    const int n = ring_->size(), r = ring_->rank();
    for (size_t i = 0; i < sends_.size(); ++i) {
      LTRAIN_RETURN_IF_ERROR(ring_->SendRecv(sends_[i], (r + 1) % n, recvs_[i], (r + n - 1) % n,
                                             kRingTag + static_cast<uint32_t>(i)));
    }
    return Status::Ok();
  }

  Communicator* ring_;
  torch::Device device_;
  compat::SideStream side_;
  std::vector<torch::Tensor> sends_, recvs_;
  std::thread thread_;
  Status status_;
};

struct Ring : public torch::autograd::Function<Ring> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t ring_address) {
    auto* ring = reinterpret_cast<Communicator*>(ring_address);
    const int n = ring->size(), r = ring->rank();
    RingPass pass(ring, q.device());
    Partial acc;
    torch::Tensor kv = torch::stack({k, v});
    for (int step = 0; step < n; ++step) {
      const bool more = step + 1 < n;
      if (more) pass.Start({kv});
      AttendStep(q, kv[0], kv[1], n, r, (r - step + n) % n, &acc);
      if (more) kv = pass.Finish()[0];
    }
    // Laid out [b, t, heads, hd] as flash attention's output is: the caller's transpose back to the
    // tokens' rows is then a view, and the output is kept once, here and by the product after it.
    torch::Tensor out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    out.copy_(acc.out);
    ctx->save_for_backward({q, k, v, out, acc.lse});
    ctx->saved_data["ring"] = ring_address;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* ring = reinterpret_cast<Communicator*>(ctx->saved_data["ring"].toInt());
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const torch::Tensor dout = grads[0].to(q.scalar_type()).contiguous();
    const int n = ring->size(), r = ring->rank();
    const torch::ScalarType wide = WideOf(q);
    RingPass pass(ring, q.device());
    torch::Tensor dq = torch::zeros(q.sizes(), q.options().dtype(wide));
    torch::Tensor kv = torch::stack({k, v}), dkv;
    // Step s computes rank r - s's share; the keys and values go on to the next rank for its step s + 1,
    // the gradients gathered so far for its step s: both pass while this step computes.
    for (int step = 0; step < n; ++step) {
      std::vector<torch::Tensor> send;
      if (step + 1 < n) send.push_back(kv);
      if (step > 0) send.push_back(dkv);
      const bool passing = !send.empty();
      if (passing) pass.Start(std::move(send));
      torch::Tensor part = torch::zeros(kv.sizes(), kv.options().dtype(wide));
      torch::Tensor dk = part[0], dv = part[1];
      AttendStepBackward(dout, q, kv[0], kv[1], out, lse, n, r, (r - step + n) % n, dq, dk, dv);
      if (passing) {
        std::vector<torch::Tensor> got = pass.Finish();
        if (step > 0) part.add_(got.back());
        if (step + 1 < n) kv = got.front();
      }
      dkv = part;
    }
    // The last step's gradients are of rank r + 1's keys and values: to their owner.
    if (n > 1) {
      pass.Start({dkv});
      dkv = pass.Finish()[0];
    }
    return {dq.to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type()), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor RingAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, Communicator* ring) {
  if (q.size(2) % 2 != 0) throw std::invalid_argument("context parallelism's ring: a rank's tokens are two equal chunks");
  return Ring::apply(q, k, v, reinterpret_cast<int64_t>(ring));
}

}  // namespace ltrain::worker::cp
