// The recipe schema: every key declared once, with its type (the field's), range, default (the
// field's initial value in common/recipe.h) and one line of help. The reader, the writer,
// `ltrain validate --explain` and the README's table all walk VisitRecipeKeys; nothing else lists
// the keys.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/recipe.h"

namespace ltrain {

struct RecipeKey {
  std::string_view section;  // "" for the top-level `name`
  std::string_view name;
  std::string_view help;     // one line
  // Integers (and the entries of integer lists): the allowed range.
  int64_t int_min = std::numeric_limits<int64_t>::min();
  int64_t int_max = std::numeric_limits<int64_t>::max();
  // Numbers: the allowed range.
  double real_min = 0;
  double real_max = 0;
  // How the default reads when the field's initial value does not say it ("training.seed").
  std::string_view default_text = {};
  // How the type reads when the field's type does not say it ("path" for a string).
  std::string_view type_text = {};
  // Written only when it differs from its default, so that binaries older than the key still read
  // the resolved recipes of newer ones (a node mid-upgrade, a stored job).
  bool omit_at_default = false;

  std::string path() const { return section.empty() ? std::string(name) : std::string(section) + "." + std::string(name); }
};

// parallel.nodes: a count, or {min, max} for an elastic job (the job runs on max while it can).
template <typename Int>
struct NodesField {
  Int& nodes;
  Int& min;
  Int& max;
};

// The sections of a recipe, in the order the writer emits them.
inline constexpr std::string_view kRecipeSections[] = {"model", "data",  "training",  "parallel",
                                                       "checkpoint", "fault", "metrics", "entrypoint"};

// The sections that describe ltrain's own trainer, which a recipe with entrypoint.command lacks.
inline constexpr std::string_view kTrainerSections[] = {"model", "data", "training"};

// Calls visit(key, field) for every key, in the order the writer emits them. `field` refers into
// `r` (const when `r` is) and is one of: int, int64_t, uint64_t, double, bool, std::string, an enum
// with EnumNames, std::vector<int>, std::vector<std::string>, std::map<std::string, std::string>,
// std::vector<DataSource>, NodesField.
template <typename R, typename Visitor>
void VisitRecipeKeys(R& r, Visitor&& visit) {
  static_assert(std::is_same_v<std::remove_const_t<R>, Recipe>);
  using Int = std::conditional_t<std::is_const_v<R>, const int, int>;
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

  visit(RecipeKey{.section = "", .name = "name", .help = "the job's name; job ids are NAME-N",
                  .default_text = "the recipe file's stem"},
        r.name);

  visit(RecipeKey{.section = "model", .name = "arch",
                  .help = "gpt2 (learned positions, LayerNorm, GELU, biases); llama (rotary positions, RMSNorm, "
                          "SwiGLU, grouped-query attention, no biases); mistral (a llama, its window covering "
                          "seq_len); qwen2 (a llama with q, k and v biases); qwen3 (a llama with an RMSNorm on each "
                          "head of q and k)",
                  .omit_at_default = true},
        r.model.arch);
  visit(RecipeKey{.section = "model", .name = "layers", .help = "transformer blocks", .int_min = 1, .int_max = 1024},
        r.model.layers);
  visit(RecipeKey{.section = "model", .name = "d_model", .help = "width of the residual stream",
                  .int_min = 1, .int_max = 1 << 20},
        r.model.d_model);
  visit(RecipeKey{.section = "model", .name = "heads", .help = "attention heads; must divide d_model",
                  .int_min = 1, .int_max = 4096},
        r.model.heads);
  visit(RecipeKey{.section = "model", .name = "seq_len", .help = "tokens per training sequence (the context)",
                  .int_min = 1, .int_max = 1 << 24},
        r.model.seq_len);
  visit(RecipeKey{.section = "model", .name = "vocab", .help = "vocabulary size; at least the tokenizer's symbols",
                  .int_min = 2, .int_max = 1 << 24},
        r.model.vocab);
  visit(RecipeKey{.section = "model", .name = "kv_heads",
                  .help = "key/value heads (llama: grouped-query attention); must divide heads",
                  .int_min = 0, .int_max = 4096, .default_text = "model.heads", .omit_at_default = true},
        r.model.kv_heads);
  visit(RecipeKey{.section = "model", .name = "ffn", .help = "SwiGLU hidden width (llama)", .int_min = 0,
                  .int_max = 1 << 22, .default_text = "8*d_model/3 rounded up to a multiple of 64",
                  .omit_at_default = true},
        r.model.ffn);
  visit(RecipeKey{.section = "model", .name = "head_dim",
                  .help = "width of an attention head (llama, mistral, qwen2, qwen3; Qwen3 heads are wider than "
                          "d_model/heads)",
                  .int_min = 0, .int_max = 4096, .default_text = "d_model/heads", .omit_at_default = true},
        r.model.head_dim);
  visit(RecipeKey{.section = "model", .name = "max_positions",
                  .help = "the longest context the model is made for (config.json's max_position_embeddings; "
                          "llama block): at least seq_len, written back on export",
                  .int_min = 0, .int_max = 1 << 24, .default_text = "model.seq_len", .omit_at_default = true},
        r.model.max_positions);
  visit(RecipeKey{.section = "model", .name = "rope_theta", .help = "base of the rotary position angles (llama)",
                  .real_min = 1, .real_max = 1e12, .omit_at_default = true},
        r.model.rope_theta);
  visit(RecipeKey{.section = "model", .name = "rope_scaling",
                  .help = "rotary scaling for a longer context (llama; transformers' rope_scaling): none; linear "
                          "divides every frequency by rope_factor; llama3 divides the low ones, keeps the high ones "
                          "and blends between (Llama 3.1, 3.2)",
                  .omit_at_default = true},
        r.model.rope_scaling);
  visit(RecipeKey{.section = "model", .name = "rope_factor", .help = "model.rope_scaling's factor",
                  .real_min = 1, .real_max = 1e6, .omit_at_default = true},
        r.model.rope_factor);
  visit(RecipeKey{.section = "model", .name = "rope_low_freq_factor",
                  .help = "llama3 scaling: wavelengths past rope_original_positions / this are divided by rope_factor",
                  .real_min = 1e-6, .real_max = 1e6, .omit_at_default = true},
        r.model.rope_low_freq_factor);
  visit(RecipeKey{.section = "model", .name = "rope_high_freq_factor",
                  .help = "llama3 scaling: wavelengths below rope_original_positions / this are kept",
                  .real_min = 1e-6, .real_max = 1e6, .omit_at_default = true},
        r.model.rope_high_freq_factor);
  visit(RecipeKey{.section = "model", .name = "rope_original_positions",
                  .help = "llama3 scaling: the context the model was first trained on "
                          "(original_max_position_embeddings)",
                  .int_min = 1, .int_max = 1 << 24, .omit_at_default = true},
        r.model.rope_original_positions);
  visit(RecipeKey{.section = "model", .name = "norm_eps", .help = "RMSNorm epsilon (llama)", .real_min = 0,
                  .real_max = 1, .omit_at_default = true},
        r.model.norm_eps);
  visit(RecipeKey{.section = "model", .name = "tie_embeddings",
                  .help = "the output head is the token embedding (gpt2 always; llama-1b and -3b tie, 8b does not)",
                  .omit_at_default = true},
        r.model.tie_embeddings);
  visit(RecipeKey{.section = "model", .name = "init",
                  .help = "initial parameters: pytorch (gpt_model.GPT's, every rank builds the whole model on the "
                          "CPU), per_parameter (each rank draws what it keeps on its device), auto (per_parameter "
                          "from 2 billion parameters, and always for llama)",
                  .omit_at_default = true},
        r.model.init);
  visit(RecipeKey{.section = "model", .name = "init_from",
                  .help = "start from a Hugging Face model directory (save_pretrained, `ltrain export`), whose "
                          "config.json gives the model's keys, or a .safetensors file, in any layout",
                  .default_text = "none: drawn as model.init says", .type_text = "path", .omit_at_default = true},
        r.model.init_from);
  // model.moe: a mixture of experts in some blocks' place of the MLP (Llama-block families).
  visit(RecipeKey{.section = "model.moe", .name = "experts",
                  .help = "routed experts in each MoE block; 0: none (a dense model)", .int_min = 0, .int_max = 65536,
                  .omit_at_default = true},
        r.model.moe.experts);
  visit(RecipeKey{.section = "model.moe", .name = "top_k", .help = "experts each token is sent to", .int_min = 1,
                  .int_max = 256, .omit_at_default = true},
        r.model.moe.top_k);
  visit(RecipeKey{.section = "model.moe", .name = "shared_experts",
                  .help = "experts every token goes through besides its routed ones (one SwiGLU of that many "
                          "times model.moe.ffn)",
                  .int_min = 0, .int_max = 64, .omit_at_default = true},
        r.model.moe.shared_experts);
  visit(RecipeKey{.section = "model.moe", .name = "ffn", .help = "each expert's SwiGLU width (moe_intermediate_size)",
                  .int_min = 0, .int_max = 1 << 22, .default_text = "model.ffn's", .omit_at_default = true},
        r.model.moe.ffn);
  visit(RecipeKey{.section = "model.moe", .name = "every",
                  .help = "every that many blocks (after model.moe.first_dense) is an MoE block; 1: all of them",
                  .int_min = 1, .int_max = 1024, .omit_at_default = true},
        r.model.moe.every);
  visit(RecipeKey{.section = "model.moe", .name = "first_dense",
                  .help = "the first that many blocks stay dense", .int_min = 0, .int_max = 1024,
                  .omit_at_default = true},
        r.model.moe.first_dense);
  visit(RecipeKey{.section = "model.moe", .name = "dense_layers",
                  .help = "more blocks (0-based) that stay dense, e.g. [0, 1]", .int_min = 0, .int_max = 1023,
                  .default_text = "none", .omit_at_default = true},
        r.model.moe.dense_layers);
  visit(RecipeKey{.section = "model.moe", .name = "score",
                  .help = "the router's scores: softmax over the experts, or a sigmoid each", .omit_at_default = true},
        r.model.moe.score);
  visit(RecipeKey{.section = "model.moe", .name = "norm_topk",
                  .help = "a token's gates divided by their sum", .omit_at_default = true},
        r.model.moe.norm_topk);
  visit(RecipeKey{.section = "model.moe", .name = "route_scale",
                  .help = "the gates multiplied by this (after norm_topk)", .real_min = 1e-6, .real_max = 100,
                  .omit_at_default = true},
        r.model.moe.route_scale);
  visit(RecipeKey{.section = "model.moe", .name = "balance",
                  .help = "how the load is kept even: aux_loss (a sequence-wise loss), bias (a bias on the choice, "
                          "moved after each step toward the even load, no loss), none",
                  .omit_at_default = true},
        r.model.moe.balance);
  visit(RecipeKey{.section = "model.moe", .name = "aux_loss_coef",
                  .help = "balance aux_loss: the loss's weight (it equals this at an even load)", .real_min = 0,
                  .real_max = 10, .omit_at_default = true},
        r.model.moe.aux_loss_coef);
  visit(RecipeKey{.section = "model.moe", .name = "bias_update",
                  .help = "balance bias: how far each step moves an expert's bias", .real_min = 0, .real_max = 1,
                  .omit_at_default = true},
        r.model.moe.bias_update);
  visit(RecipeKey{.section = "model.moe", .name = "z_loss_coef",
                  .help = "the router's z-loss weight (keeps its logits small); 0: none", .real_min = 0,
                  .real_max = 10, .omit_at_default = true},
        r.model.moe.z_loss_coef);
  visit(RecipeKey{.section = "model.moe", .name = "capacity_factor",
                  .help = "0: dropless (every assignment computed); otherwise each expert computes at most "
                          "capacity_factor * tokens * top_k / experts of a micro-batch's assignments on a rank, "
                          "the first in token order, and drops the rest (GShard's and Switch's capacity)",
                  .real_min = 0, .real_max = 1024, .omit_at_default = true},
        r.model.moe.capacity_factor);

  visit(RecipeKey{.section = "data", .name = "path",
                  .help = "directory written by `ltrain data prepare` (this or data.sources is required; relative "
                          "to where ltrain runs)",
                  .default_text = "none: required", .type_text = "path"},
        r.data.path);
  visit(RecipeKey{.section = "data", .name = "sources",
                  .help = "a mixture instead of data.path: prepared datasets, each sample drawn from one in "
                          "proportion to its weight, e.g. [{path: web, weight: 0.7}, {path: code, weight: 0.3}]",
                  .real_min = 1e-9, .real_max = 1e9, .default_text = "none: data.path alone",
                  .omit_at_default = true},
        r.data.sources);
  visit(RecipeKey{.section = "data", .name = "tokenizer",
                  .help = "the tokenizer the data must have been made with (its data.yaml says); auto: any",
                  .omit_at_default = true},
        r.data.tokenizer);
  visit(RecipeKey{.section = "data", .name = "sampling",
                  .help = "epochs: each source's windows in a seeded order per epoch, none twice in one; hash: each "
                          "sample's window from a hash of the seed and its index (with replacement); torch: windows "
                          "as torch.randint with a seeded generator draws them, a PyTorch loop's batches (one source)",
                  .omit_at_default = true},
        r.data.sampling);
  visit(RecipeKey{.section = "data", .name = "seed", .help = "the sampler's seed (PyTorch keeps 32 bits)",
                  .int_min = 0, .int_max = int64_t{0xffffffff}, .default_text = "training.seed",
                  .omit_at_default = true},
        r.data.seed);

  visit(RecipeKey{.section = "training", .name = "steps", .help = "optimizer steps of the whole run",
                  .int_min = 1, .int_max = kInt64Max},
        r.training.steps);
  visit(RecipeKey{.section = "training", .name = "micro_batch", .help = "sequences per forward and backward on a rank",
                  .int_min = 1, .int_max = kInt32Max},
        r.training.micro_batch);
  visit(RecipeKey{.section = "training", .name = "global_batch",
                  .help = "sequences per optimizer step over all data-parallel ranks; a multiple of micro_batch x dp",
                  .int_min = 1, .int_max = kInt32Max},
        r.training.global_batch);
  visit(RecipeKey{.section = "training", .name = "lr", .help = "peak learning rate", .real_min = 0, .real_max = 10},
        r.training.lr);
  visit(RecipeKey{.section = "training", .name = "min_lr", .help = "floor of the cosine decay; at most lr",
                  .real_min = 0, .real_max = 10},
        r.training.min_lr);
  visit(RecipeKey{.section = "training", .name = "warmup_steps", .help = "steps of linear warmup to lr",
                  .int_min = 0, .int_max = kInt64Max},
        r.training.warmup_steps);
  visit(RecipeKey{.section = "training", .name = "lr_schedule", .help = "after warmup: cosine decay to min_lr, or constant"},
        r.training.lr_schedule);
  visit(RecipeKey{.section = "training", .name = "weight_decay", .help = "AdamW weight decay (matrices and embeddings only)",
                  .real_min = 0, .real_max = 10},
        r.training.weight_decay);
  visit(RecipeKey{.section = "training", .name = "beta1", .help = "AdamW first-moment decay", .real_min = 0, .real_max = 0.999999},
        r.training.beta1);
  visit(RecipeKey{.section = "training", .name = "beta2", .help = "AdamW second-moment decay", .real_min = 0, .real_max = 0.999999},
        r.training.beta2);
  visit(RecipeKey{.section = "training", .name = "grad_clip", .help = "largest global gradient norm; 0 turns clipping off",
                  .real_min = 0, .real_max = 1e9},
        r.training.grad_clip);
  visit(RecipeKey{.section = "training", .name = "seed", .help = "seed of the initial parameters and the data",
                  .int_min = 0, .int_max = kInt64Max},
        r.training.seed);
  visit(RecipeKey{.section = "training", .name = "log_every", .help = "rank 0 prints a step line every this many steps",
                  .int_min = 1, .int_max = kInt64Max},
        r.training.log_every);
  visit(RecipeKey{.section = "training", .name = "eval_every",
                  .help = "validation loss on the data's validation split every this many steps and after the last; "
                          "0: never",
                  .int_min = 0, .int_max = kInt64Max, .omit_at_default = true},
        r.training.eval_every);
  visit(RecipeKey{.section = "training", .name = "eval_batches",
                  .help = "global batches of the validation split each validation reads (the same windows every time)",
                  .int_min = 1, .int_max = kInt32Max, .omit_at_default = true},
        r.training.eval_batches);
  visit(RecipeKey{.section = "training", .name = "deterministic",
                  .help = "deterministic GPU kernels: a run and its resume from a checkpoint compute the same losses bit "
                          "for bit (slower)"},
        r.training.deterministic);

  NodesField<Int> nodes{r.parallel.nodes, r.parallel.nodes_min, r.parallel.nodes_max};
  visit(RecipeKey{.section = "parallel", .name = "nodes",
                  .help = "nodes the job runs on, or {min, max} for an elastic job", .int_min = 1, .int_max = 100000},
        nodes);
  visit(RecipeKey{.section = "parallel", .name = "nproc_per_node", .help = "ranks (worker processes) per node",
                  .int_min = 1, .int_max = 1024},
        r.parallel.nproc_per_node);
  visit(RecipeKey{.section = "parallel", .name = "tp", .help = "tensor-parallel degree, within a node",
                  .int_min = 1, .int_max = 1024},
        r.parallel.tp);
  visit(RecipeKey{.section = "parallel", .name = "pp", .help = "pipeline stages", .int_min = 1, .int_max = 1024},
        r.parallel.pp);
  visit(RecipeKey{.section = "parallel", .name = "ep",
                  .help = "expert-parallel degree: each MoE block's experts split over this many data-parallel "
                          "ranks, its tokens sent to their experts' ranks and back by all-to-all (divides the "
                          "data-parallel degree and model.moe.experts)",
                  .int_min = 1, .int_max = 1024},
        r.parallel.ep);
  visit(RecipeKey{.section = "parallel", .name = "cp",
                  .help = "context-parallel degree: each sequence split over this many data-parallel ranks (two "
                          "chunks each, one from the front and its mirror from the back), attention passing the "
                          "keys and values around them as a ring; divides the data-parallel degree, and "
                          "model.seq_len is a multiple of 2*cp",
                  .int_min = 1, .int_max = 1024},
        r.parallel.cp);
  visit(RecipeKey{.section = "parallel", .name = "zero",
                  .help = "ZeRO stage over data parallel: 1 shards optimizer state, 2 also gradients, 3 also parameters",
                  .int_min = 0, .int_max = 3, .default_text = "1 on cuda with data parallelism, else 0"},
        r.parallel.zero);
  visit(RecipeKey{.section = "parallel", .name = "sequence_parallel",
                  .help = "split norms and dropout along the sequence over the tensor-parallel ranks"},
        r.parallel.sequence_parallel);
  visit(RecipeKey{.section = "parallel", .name = "pp_schedule", .help = "pipeline schedule"}, r.parallel.pp_schedule);
  visit(RecipeKey{.section = "parallel", .name = "virtual_stages",
                  .help = "model chunks per pipeline rank (interleaved 1F1B)", .int_min = 1, .int_max = 1024},
        r.parallel.virtual_stages);
  visit(RecipeKey{.section = "parallel", .name = "pp_split",
                  .help = "layers per (virtual) stage, e.g. [3, 3, 2]", .int_min = 1, .int_max = 1024,
                  .default_text = "balanced"},
        r.parallel.pp_split);
  visit(RecipeKey{.section = "parallel", .name = "bucket_mb",
                  .help = "data-parallel gradients are reduced in buckets of this many MB during backward",
                  .real_min = 0.001, .real_max = 1e6, .default_text = "400 on cuda on one node, else 25"},
        r.parallel.bucket_mb);
  visit(RecipeKey{.section = "parallel", .name = "activation_checkpointing",
                  .help = "recompute activations in backward: full blocks, or only attention and the MLP's activation (selective)"},
        r.parallel.activation_checkpointing);
  visit(RecipeKey{.section = "parallel", .name = "precision",
                  .help = "auto: bf16-fp32-residual on cuda, fp32 on cpu; bf16-fp32-residual: bf16 compute "
                          "copies of fp32 masters, the residual stream and the norms' inputs in fp32; bf16: the same "
                          "with the residual stream in bf16 too (faster, learns worse); bf16-autocast: fp32 weights "
                          "cast per operation, as PyTorch AMP; fp8: bf16-fp32-residual with the blocks' linear "
                          "products in FP8 (e4m3 weights and activations, e5m2 gradients; a GPU of compute "
                          "capability 8.9 or newer), the embedding and the output head in bf16"},
        r.parallel.precision);
  visit(RecipeKey{.section = "parallel", .name = "fp8_bf16_layers",
                  .help = "under precision fp8: the blocks (0-based) whose linear products stay bf16 besides the "
                          "embedding and the output head, e.g. [0, 23] for a 24-layer model's first and last",
                  .int_min = 0, .int_max = 1 << 20, .default_text = "none"},
        r.parallel.fp8_bf16_layers);
  visit(RecipeKey{.section = "parallel", .name = "fp8_scaling",
                  .help = "under precision fp8: tensorwise (one scale an operand, from its largest magnitude; the "
                          "faster) or rowwise (a scale for each row along the products' inner dimension, each "
                          "operand quantized once for each direction it is read in, the gradients in e4m3; finer where "
                          "magnitudes differ between tokens or features)"},
        r.parallel.fp8_scaling);
  visit(RecipeKey{.section = "parallel", .name = "device", .help = "cpu (Gloo) or cuda (NCCL)"}, r.parallel.device);

  visit(RecipeKey{.section = "checkpoint", .name = "dir", .help = "where the job's checkpoints go",
                  .default_text = "$LTRAIN_HOME/checkpoints/JOB", .type_text = "path"},
        r.checkpoint.dir);
  visit(RecipeKey{.section = "checkpoint", .name = "every", .help = "steps between checkpoints; 0 writes only the final one",
                  .int_min = 0, .int_max = kInt64Max},
        r.checkpoint.every);
  visit(RecipeKey{.section = "checkpoint", .name = "keep", .help = "committed checkpoints kept", .int_min = 1, .int_max = 1000000},
        r.checkpoint.keep);
  visit(RecipeKey{.section = "checkpoint", .name = "resume_from",
                  .help = "start from this step-N directory, or the newest commit of this checkpoint directory",
                  .default_text = "none: start fresh", .type_text = "path"},
        r.checkpoint.resume_from);
  visit(RecipeKey{.section = "checkpoint", .name = "async", .help = "snapshot to host memory and write in the background"},
        r.checkpoint.async);
  visit(RecipeKey{.section = "checkpoint", .name = "enabled", .help = "false saves nothing (benchmarks, throw-away runs)"},
        r.checkpoint.enabled);
  visit(RecipeKey{.section = "checkpoint", .name = "timeout_s",
                  .help = "a save, load or commit without progress this long is stuck (auto: 60 s + 1 s per 50 MB of "
                          "state, 12 bytes a parameter, and 3 x the slowest save so far; at least fault.hang_timeout_s)",
                  .real_min = 0, .real_max = 604800, .default_text = "0 (auto)", .omit_at_default = true},
        r.checkpoint.timeout_s);
  visit(RecipeKey{.section = "checkpoint", .name = "share_with_group",
                  .help = "let the group of the checkpoint folder read the checkpoints: folders 0750 and files 0640 "
                          "(by default they are the user's alone, 0700 and 0600, whatever the umask)",
                  .omit_at_default = true},
        r.checkpoint.share_with_group);

  visit(RecipeKey{.section = "fault", .name = "max_restarts", .help = "restarts from the last commit before the job fails",
                  .int_min = 0, .int_max = 1000000},
        r.fault.max_restarts);
  visit(RecipeKey{.section = "fault", .name = "recovery",
                  .help = "when a rank fails: restart, every rank starts again from the last commit; in_place, the "
                          "other ranks keep their processes, only the failed rank is started again, it takes its "
                          "state from a data-parallel peer's memory and the step in flight is redone ("
                          "parallel.dp 2 or more, parallel.zero 0 to 2, no pp; other jobs restart); where the failed "
                          "ranks' node is lost and none takes them, a plain data-parallel job goes on with the ranks "
                          "left, each taking more of the global batch's micro-batches; each replacement counts "
                          "against fault.max_restarts",
                  .omit_at_default = true},
        r.fault.recovery);
  visit(RecipeKey{.section = "fault", .name = "memory_checkpoint_every",
                  .help = "in-place recovery under parallel.zero 1 or 2: every this many steps each rank copies its "
                          "shard of the parameters and moments into its own host memory and the next data-parallel "
                          "rank's; a failed rank's replacement takes the newest copy, and every rank goes back to its "
                          "step (the steps after it are trained again); 0: as often as keeps the copies under 2% of "
                          "the step time, measured in the first steps",
                  .int_min = 0, .int_max = 1000000, .default_text = "0 (auto)", .omit_at_default = true},
        r.fault.memory_checkpoint_every);
  visit(RecipeKey{.section = "fault", .name = "restart_backoff_s", .help = "delay before the first restart; doubles per restart",
                  .real_min = 0, .real_max = 3600},
        r.fault.restart_backoff_s);
  visit(RecipeKey{.section = "fault", .name = "restart_backoff_max_s", .help = "longest delay between restarts",
                  .real_min = 0, .real_max = 86400},
        r.fault.restart_backoff_max_s);
  visit(RecipeKey{.section = "fault", .name = "heartbeat_interval_s", .help = "agents beat at least this often",
                  .real_min = 0.01, .real_max = 3600},
        r.fault.heartbeat_interval_s);
  visit(RecipeKey{.section = "fault", .name = "heartbeat_misses", .help = "missed heartbeats before a node is lost",
                  .int_min = 1, .int_max = 1000},
        r.fault.heartbeat_misses);
  visit(RecipeKey{.section = "fault", .name = "hang_timeout_s",
                  .help = "a rank without progress this long in a training step is hung (auto: 20 x the slowest of "
                          "the last 50 steps, 20-600 s; the start-up limit for a generation's first 3 steps)",
                  .real_min = 0, .real_max = 86400, .default_text = "0 (auto)", .omit_at_default = true},
        r.fault.hang_timeout_s);
  visit(RecipeKey{.section = "fault", .name = "startup_timeout_s",
                  .help = "a start-up (model build, connection, resume load) without progress this long is stuck "
                          "(auto: 120 s + 1 s per 50 MB of state; at least fault.hang_timeout_s)",
                  .real_min = 0, .real_max = 604800, .default_text = "0 (auto)", .omit_at_default = true},
        r.fault.startup_timeout_s);
  visit(RecipeKey{.section = "fault", .name = "collective_timeout_s",
                  .help = "a collective that takes longer is aborted (auto: twice the training step's limit, and "
                          "longer than a start-up's or a checkpoint's, so that the hang is diagnosed first)",
                  .real_min = 0, .real_max = 86400, .default_text = "0 (auto)", .omit_at_default = true},
        r.fault.collective_timeout_s);

  visit(RecipeKey{.section = "metrics", .name = "tensorboard",
                  .help = "true: rank 0 also writes the steps' loss, learning rate, tokens/s and step time, and the "
                          "validation loss, as TensorBoard event files in the job's tensorboard/ directory beside "
                          "metrics.jsonl (tensorboard --logdir DIR)",
                  .omit_at_default = true},
        r.metrics.tensorboard);
  visit(RecipeKey{.section = "entrypoint", .name = "command",
                  .help = "your program and its arguments, run once per rank with torchrun's environment instead of "
                          "ltrain's trainer (`ltrain run`); the recipe then has no model, data or training",
                  .default_text = "none: ltrain's trainer", .omit_at_default = true},
        r.entrypoint.command);
  visit(RecipeKey{.section = "entrypoint", .name = "env", .help = "variables added to every rank's environment",
                  .default_text = "none", .omit_at_default = true},
        r.entrypoint.env);
  visit(RecipeKey{.section = "entrypoint", .name = "workdir",
                  .help = "directory the program starts in (relative to where ltrain runs)",
                  .default_text = "where ltrain runs", .type_text = "path", .omit_at_default = true},
        r.entrypoint.workdir);
  visit(RecipeKey{.section = "entrypoint", .name = "output_timeout_s",
                  .help = "a rank of your program that prints nothing (and reports no progress) this long is stopped "
                          "as hung, and the restart policy applies; 0: never",
                  .real_min = 0, .real_max = 604800, .omit_at_default = true},
        r.entrypoint.output_timeout_s);
  visit(RecipeKey{.section = "entrypoint", .name = "warm_standby",
                  .help = "auto: while the job may restart, each rank of a Python program (python3 SCRIPT or -m "
                          "MODULE) has an interpreter beside it that has imported torch and what an optimizer loads, "
                          "and a restart runs the script in it (seconds sooner, for a second process per rank); gpu: "
                          "the same, and that interpreter also makes its GPU's CUDA context (a few tenths of a second "
                          "sooner, for some hundreds of MiB of GPU memory; a script that sets CUDA_VISIBLE_DEVICES "
                          "itself must not use it); off: every start is a new process",
                  .omit_at_default = true},
        r.entrypoint.warm_standby);
}

// Every key's value as the writer writes it, by path ("training.lr" -> "0.0003").
std::map<std::string, std::string> RecipeKeyValues(const Recipe& recipe);

// What `ltrain validate --explain` and the README's table show of one key.
struct RecipeKeyDoc {
  std::string path;          // "training.steps"
  std::string type;          // "integer 1..1024", "one of: cosine, constant"
  std::string default_text;  // as a recipe writes it
  std::string help;
};

std::vector<RecipeKeyDoc> DescribeRecipeKeys();

// Every key as a Markdown table (the README's "Recipe keys"), and as aligned text.
std::string RecipeKeysMarkdown();
std::string RecipeKeysText();

}  // namespace ltrain
