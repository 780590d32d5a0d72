// Context parallelism's attention (parallel.cp), the arithmetic: each of cp ranks holds two chunks of
// every sequence (load-balanced for the causal mask: chunk r from the front and its mirror 2cp-1-r
// from the back), and its queries meet every rank's keys and values one block at a time, each block
// a softmax of its own (its output and log-sum-exp) merged into the running result as online softmax
// does. Written from LibTorch operations, so autograd gives the backward; positions are the whole
// sequence's, so the causal mask and RoPE are those of one process.
#pragma once

#include <cstdint>

#include <torch/types.h>

namespace ltrain::worker {
class Communicator;
}  // namespace ltrain::worker

namespace ltrain::worker::cp {

// Rank `rank`'s chunks of a sequence of `seq_len` split into 2*cp chunks of seq_len / (2*cp) each:
// chunk `rank` and chunk 2*cp - 1 - rank. seq_len must be a multiple of 2*cp.
struct Chunks {
  int64_t size = 0;    // tokens a chunk
  int64_t first = 0;   // where the front chunk starts in the sequence
  int64_t second = 0;  // where the back chunk starts
};
Chunks ChunksOf(int64_t seq_len, int cp, int rank);

// The sequence positions rank `rank` holds, in its order (front chunk, then back chunk): int64 [2 * size].
torch::Tensor PositionsOf(int64_t seq_len, int cp, int rank, const torch::Device& device = torch::kCPU);

// The tokens of x [b, seq_len, ...] that rank `rank` holds, in its order: [b, seq_len / cp, ...].
torch::Tensor Take(const torch::Tensor& x, int cp, int rank);

// Attention of queries at positions q_pos against one block of keys and values at positions k_pos,
// causal by position (a query sees the keys at its position and before): q [b, h, tq, hd], k and v
// [b, h, tk, hd] (key/value heads already repeated for the query heads). The output normalized
// within the block, and the block's log-sum-exp of the scaled scores per query: about -1e30 where it
// has no key a query may see (its weight in a merge is then 0). Products in q's dtype; the softmax in
// fp32 (fp64 for fp64 inputs). A query's result is whole once the block holding its own position is
// merged in: start each query's merges from that block.
struct Partial {
  torch::Tensor out;  // [b, h, tq, hd]
  torch::Tensor lse;  // [b, h, tq]
};
Partial BlockAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& q_pos, const torch::Tensor& k_pos, double scale);

// Two partial results of the same queries over disjoint keys, as one softmax over both.
Partial Merge(const Partial& a, const Partial& b);

// Causal attention of this rank's queries over the whole sequence of `seq_len`, its keys and values
// passed around the ring of `ring`'s ranks (to the next, from the previous: each step one block, its
// own first), each block merged in: q [b, heads, t, hd], k and v [b, kv_heads, t, hd] of this rank's
// tokens (ChunksOf's order, t = seq_len / ring size). Backward passes the keys' and values'
// gradients back around the ring. Every rank of the ring calls it, in the same order.
torch::Tensor RingAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, Communicator* ring,
                            int64_t seq_len);

}  // namespace ltrain::worker::cp
