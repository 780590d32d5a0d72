#include "worker/model/context_attention.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "worker/comm/communicator.h"

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

// The score of a key a query may not see: so low that exp() of it against any real score is 0, yet
// finite, so that a row that sees nothing in a block has a finite log-sum-exp (its weight in the
// merge then 0) and backward stays free of inf - inf.
constexpr double kHidden = -1e30;

Partial BlockAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& q_pos, const torch::Tensor& k_pos, double scale) {
  const torch::ScalarType wide = q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  torch::Tensor scores = at::matmul(q, k.transpose(-2, -1)).to(wide) * scale;
  const torch::Tensor visible = q_pos.unsqueeze(-1) >= k_pos.unsqueeze(0);  // [tq, tk]
  scores = scores.masked_fill(visible.logical_not(), kHidden);
  // exp(scores - max) is the one [tq, tk] tensor backward keeps (the max is a shift the result does
  // not depend on, so it takes no gradient); the sum, the log-sum-exp and the output follow from it.
  const torch::Tensor max = std::get<0>(scores.max(-1, /*keepdim=*/true)).detach();
  const torch::Tensor e = at::exp(scores - max);
  const torch::Tensor sum = e.sum(-1, /*keepdim=*/true);
  Partial p;
  p.lse = (max + at::log(sum)).squeeze(-1);
  p.out = at::matmul(e.to(v.scalar_type()), v) / sum.to(v.scalar_type());
  return p;
}

Partial Merge(const Partial& a, const Partial& b) {
  const torch::Tensor m = at::maximum(a.lse, b.lse);
  const torch::Tensor wa = at::exp(a.lse - m), wb = at::exp(b.lse - m);  // the larger 1, the other at most 1
  const torch::Tensor sum = wa + wb;
  Partial out;
  out.lse = m + at::log(sum);
  const torch::ScalarType wide = sum.scalar_type();
  out.out = ((a.out.to(wide) * wa.unsqueeze(-1) + b.out.to(wide) * wb.unsqueeze(-1)) / sum.unsqueeze(-1))
                .to(a.out.scalar_type());
  return out;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr uint32_t kRingTag = 0x6370;

// x to the ring's next rank, the previous rank's x back; backward the other way round.
struct RingShift : public torch::autograd::Function<RingShift> {
  static torch::Tensor Shift(Communicator* ring, const torch::Tensor& x, int forward) {
    const int n = ring->size(), r = ring->rank();
    const int to = (r + forward + n) % n, from = (r - forward + n) % n;
    torch::Tensor in = x.contiguous();
    torch::Tensor out = torch::empty_like(in);
    if (Status s = ring->SendRecv(in, to, out, from, kRingTag); !s.ok()) {
      throw std::runtime_error("context parallelism's ring: " + s.message());
    }
    return out;
  }
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t ring) {
    ctx->saved_data["ring"] = ring;
    return Shift(reinterpret_cast<Communicator*>(ring), x, 1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* ring = reinterpret_cast<Communicator*>(ctx->saved_data["ring"].toInt());
    return {Shift(ring, grads[0], -1), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor RingAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, Communicator* ring,
                            int64_t seq_len) {
  const int n = ring->size(), r = ring->rank();
  const int64_t groups = q.size(1) / k.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  auto expand = [groups](const torch::Tensor& t) { return groups == 1 ? t : t.repeat_interleave(groups, 1); };
  const torch::Tensor q_pos = PositionsOf(seq_len, n, r, q.device());
  Partial acc = BlockAttention(q, expand(k), expand(v), q_pos, q_pos, scale);
  torch::Tensor kv = torch::stack({k, v});
  for (int step = 1; step < n; ++step) {
    kv = RingShift::apply(kv, reinterpret_cast<int64_t>(ring));
    const torch::Tensor k_pos = PositionsOf(seq_len, n, (r - step + n) % n, q.device());
    acc = Merge(acc, BlockAttention(q, expand(kv[0]), expand(kv[1]), q_pos, k_pos, scale));
  }
  return acc.out.to(q.scalar_type());
}

}  // namespace ltrain::worker::cp
