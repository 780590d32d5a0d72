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

// The written-out block: the output in q's type, the log-sum-exp in the wide type.
std::pair<torch::Tensor, torch::Tensor> WrittenForward(const torch::Tensor& q, const torch::Tensor& k,
                                                       const torch::Tensor& v, bool causal, double scale) {
  torch::Tensor scores = at::matmul(q, k.transpose(-2, -1)).to(WideOf(q)) * scale;
  if (causal) {
    const torch::Tensor future =
        torch::ones({q.size(2), k.size(2)}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
    scores.masked_fill_(future, -INFINITY);  // every query sees its own key: no row is empty
  }
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
  if (causal) {
    const torch::Tensor future =
        torch::ones({q.size(2), k.size(2)}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
    p.masked_fill_(future, -INFINITY);
  }
  p.sub_(lse.to(wide).unsqueeze(-1)).exp_();
  const torch::Tensor dv = at::matmul(p.transpose(-2, -1), dow);
  const torch::Tensor d = (dow * out.to(wide)).sum(-1, /*keepdim=*/true);
  torch::Tensor ds = at::matmul(dow, vw.transpose(-2, -1));
  ds.sub_(d).mul_(p);
  return {at::matmul(ds, kw).mul_(scale), at::matmul(ds.transpose(-2, -1), qw).mul_(scale), dv};
}

// Flash attention's kernels take tensors whose last dimension is contiguous.
torch::Tensor Dense(const torch::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace

void AttendStep(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int cp, int rank, int src,
                Partial* acc) {
  if (src < 0 || src >= cp || rank < 0 || rank >= cp) throw std::invalid_argument("AttendStep: rank or src out of the ring");
  const int64_t groups = q.size(1) / k.size(1), c = q.size(2) / 2;
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const Block block = BlockOf(rank, src);
  torch::Tensor qb = block.back_queries ? q.narrow(2, c, c) : q;
  torch::Tensor kb = Expand(k, groups), vb = Expand(v, groups);
  if (block.front_keys) kb = kb.narrow(2, 0, c), vb = vb.narrow(2, 0, c);
  auto [out, lse] = compat::FlashBlocksAvailable(q)
                        ? compat::FlashBlockForward(Dense(qb), Dense(kb), Dense(vb), block.causal, scale)
                        : WrittenForward(qb, kb, vb, block.causal, scale);
  const torch::ScalarType wide = WideOf(q);
  if (block.causal) {  // the first step: the rank's own block
    acc->out = out.to(wide);
    acc->lse = lse.to(wide);
    return;
  }
  torch::Tensor ao = block.back_queries ? acc->out.narrow(2, c, c) : acc->out;
  torch::Tensor al = block.back_queries ? acc->lse.narrow(2, c, c) : acc->lse;
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
  if (src < 0 || src >= cp || rank < 0 || rank >= cp) {
    throw std::invalid_argument("AttendStepBackward: rank or src out of the ring");
  }
  const int64_t groups = q.size(1) / k.size(1), c = q.size(2) / 2;
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const Block block = BlockOf(rank, src);
  auto rows = [&](const torch::Tensor& t) { return block.back_queries ? t.narrow(2, c, c) : t; };
  torch::Tensor kb = Expand(k, groups), vb = Expand(v, groups);
  if (block.front_keys) kb = kb.narrow(2, 0, c), vb = vb.narrow(2, 0, c);
  torch::Tensor gq, gk, gv;
  if (compat::FlashBlocksAvailable(q)) {
    std::tie(gq, gk, gv) = compat::FlashBlockBackward(Dense(rows(dout)), Dense(rows(q)), Dense(kb), Dense(vb),
                                                      Dense(rows(out)), rows(lse).to(torch::kFloat).contiguous(),
                                                      block.causal, scale);
  } else {
    std::tie(gq, gk, gv) = WrittenBackward(rows(dout), rows(q), kb, vb, rows(out), rows(lse), block.causal, scale);
  }
  rows(dq).add_(gq.to(dq.scalar_type()));
  torch::Tensor dk_at = block.front_keys ? dk.narrow(2, 0, c) : dk;
  torch::Tensor dv_at = block.front_keys ? dv.narrow(2, 0, c) : dv;
  dk_at.add_(Fold(gk.to(dk.scalar_type()), groups));
  dv_at.add_(Fold(gv.to(dv.scalar_type()), groups));
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
      if (!send.empty()) pass.Start(std::move(send));
      torch::Tensor part = torch::zeros(kv.sizes(), kv.options().dtype(wide));
      torch::Tensor dk = part[0], dv = part[1];
      AttendStepBackward(dout, q, kv[0], kv[1], out, lse, n, r, (r - step + n) % n, dq, dk, dv);
      if (step + 1 < n || step > 0) {
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
