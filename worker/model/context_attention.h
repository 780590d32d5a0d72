// Context parallelism's attention (parallel.cp), the arithmetic: each of cp ranks holds two chunks of
// every sequence (load-balanced for the causal mask: chunk r from the front and its mirror 2cp-1-r
// from the back), and its queries meet every rank's keys and values one block at a time, each block
// a softmax of its own (its output and log-sum-exp) merged into the running result as online softmax
// does; positions are the whole sequence's, so the causal mask and RoPE are those of one process.
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

// One step of the ring on rank `rank` of `cp`: its queries q [b, heads, t, hd] against the keys and
// values k, v [b, kv_heads, t, hd] of rank `src` (t = 2 chunks, ChunksOf's order). By the chunks'
// order only three blocks occur, and none needs a mask of positions:
//   - src == rank: its own tokens, causal (positions rise along the rank's order);
//   - src < rank: every query sees src's front chunk, none its back chunk;
//   - src > rank: the back chunk's queries see both of src's chunks, the front chunk's none.
// Flash attention's kernels compute the block on GPUs (bf16, fp16); elsewhere it is written out
// (products in q's type, the softmax in fp32, fp64 for fp64 inputs).
//
// The running result of a rank's queries: the output and the log-sum-exp of each query's scaled
// scores, in fp32 (fp64 for fp64 inputs). The first step (the rank's own block) sets it; each later
// step merges its block in, as online softmax does.
struct Partial {
  torch::Tensor out;  // [b, h, t, hd]
  torch::Tensor lse;  // [b, h, t]
};
void AttendStep(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int cp, int rank, int src,
                Partial* acc);

// The step's share of the gradients, given the whole row's result (out in q's type, lse as
// AttendStep left it) and dout, the output's gradient: added to dq (this rank's queries) and to dk and
// dv (src's keys and values), all three in fp32 (fp64 for fp64 inputs) and shaped as q, k and v.
void AttendStepBackward(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse, int cp, int rank,
                        int src, torch::Tensor& dq, torch::Tensor& dk, torch::Tensor& dv);

// Causal attention of this rank's queries over the whole sequence, its keys and values passed around
// the ring of `ring`'s ranks (to the next, from the previous): q [b, heads, t, hd], k and v
// [b, kv_heads, t, hd] of this rank's tokens (ChunksOf's order, t = seq_len / ring size). Each pass
// runs while the step before it computes (on GPUs on a stream of its own, on CPUs on a thread).
// Backward goes round the ring again, the keys' and values' gradients travelling with them, each
// block's gradients from the whole row's output and log-sum-exp; it keeps q, k, v, the output and
// the log-sum-exp, not the blocks. Every rank of the ring calls it, in the same order.
torch::Tensor RingAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, Communicator* ring);

}  // namespace ltrain::worker::cp
