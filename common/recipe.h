// Recipe: the YAML description of a training job, parsed into plain structs and validated before
// anything starts. The same parser reads the user's file, the resolved copy stored with the job,
// and the copy a worker receives.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace ltrain {

struct ModelSpec {
  int layers = 2;
  int d_model = 128;
  int heads = 4;
  int seq_len = 64;
  int vocab = 256;
  // auto | pytorch | per_parameter (README). PyTorch's initialisation reproduces gpt_model.GPT's
  // parameters but makes every rank build the whole model on the CPU from one serial generator, too
  // slow and too large for billions of parameters; per_parameter lets each rank draw only what it
  // keeps, on its own device.
  std::string init = "auto";
};

struct DataSpec {
  std::string path;              // a directory written by `ltrain data prepare`
  std::string tokenizer = "byte";
  // hash | torch (README). "hash" lets a resumed run start at any data position for free; "torch"
  // replays a PyTorch loop's torch.randint draws, so that a run can be compared with one batch for
  // batch, at the cost of replaying the draws up to the data position on resume.
  std::string sampling = "hash";
  int64_t seed = -1;             // the sampler's seed; unset (-1): training.seed
};

struct TrainingSpec {
  int64_t steps = 100;
  int micro_batch = 8;
  int global_batch = 16;         // sequences per optimizer step, across all data-parallel ranks
  double lr = 1e-3;              // peak learning rate
  double min_lr = 1e-4;          // floor of the cosine decay
  int64_t warmup_steps = 10;
  std::string lr_schedule = "cosine";  // cosine | constant
  double weight_decay = 0.1;
  double beta1 = 0.9;            // AdamW moment decay rates
  double beta2 = 0.95;
  double grad_clip = 1.0;        // max global gradient norm; 0 turns clipping off
  uint64_t seed = 1337;
  int64_t log_every = 10;
};

struct ParallelSpec {
  int nodes = 1;                 // nodes the job runs on now (`nodes: N`, or the max of `nodes: {min, max}`)
  int nodes_min = 1;             // elastic floor: the job goes on while at least this many remain
  int nodes_max = 1;
  int nproc_per_node = 1;
  int tp = 1;                    // tensor parallel degree (innermost, within a node)
  int pp = 1;                    // pipeline stages (outermost)
  int zero = 0;                  // 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded over dp
  bool sequence_parallel = false;
  std::string pp_schedule = "1f1b";     // gpipe | 1f1b | interleaved
  int virtual_stages = 1;               // model chunks per pipeline rank (interleaved 1F1B)
  std::vector<int> pp_split;            // layers per (virtual) stage; empty = balanced
  double bucket_mb = 25.0;              // data-parallel gradient bucket size
  std::string activation_checkpointing = "none";  // none | full | selective
  std::string precision = "auto";       // auto (bf16 on cuda, fp32 on cpu) | fp32 | bf16 | bf16-autocast
  std::string device = "cpu";    // cpu (Gloo) | cuda (NCCL)

  int world_size() const { return nodes * nproc_per_node; }
  int dp() const { return world_size() / (tp * pp); }
};

struct CheckpointSpec {
  std::string dir;               // empty: $LTRAIN_HOME/checkpoints/<job>
  int64_t every = 0;             // steps between checkpoints; 0 writes only the final one
  int keep = 2;
  std::string resume_from;       // a checkpoint directory to start from; empty starts fresh
  bool async = true;             // snapshot to host memory, write in the background
  bool enabled = true;           // false: no checkpoint at all (benchmarks, throw-away runs)
};

struct FaultSpec {
  int max_restarts = 0;
  double restart_backoff_s = 1.0;       // first delay; doubles per restart up to restart_backoff_max_s
  double restart_backoff_max_s = 30.0;
  double heartbeat_interval_s = 1.0;
  int heartbeat_misses = 3;
  double hang_timeout_s = 60.0;         // no progress this long: the rank is hung
  double collective_timeout_s = 300.0;  // a collective that takes longer is aborted
};

struct Recipe {
  std::string name;
  ModelSpec model;
  DataSpec data;
  TrainingSpec training;
  ParallelSpec parallel;
  CheckpointSpec checkpoint;
  FaultSpec fault;

  // Micro-batches each data-parallel rank accumulates per optimizer step.
  int accumulation_steps() const {
    return training.global_batch / (training.micro_batch * parallel.dp());
  }
};

// The data sampler's seed: data.seed when set, training.seed otherwise.
int64_t DataSeed(const Recipe& recipe);

// One problem found in a recipe, located in its source. line/column are 1-based; 0 when the value
// came from a --set override rather than the file.
struct RecipeError {
  std::string file;
  int line = 0;
  int column = 0;
  std::string message;

  std::string ToString() const;  // "file:line:col: message"
};

struct RecipeParseResult {
  Recipe recipe;
  std::vector<RecipeError> errors;
  bool ok() const { return errors.empty(); }
  std::string ErrorText() const;  // every error, one per line
};

// Parses YAML text. `source_name` names the file in errors. `overrides` are "dotted.key=value"
// strings applied on top of the file before validation, as `--set` gives them.
RecipeParseResult ParseRecipe(const std::string& yaml_text, const std::string& source_name,
                              const std::vector<std::string>& overrides = {});

// Reads and parses a file; a missing file is one error naming it.
RecipeParseResult LoadRecipeFile(const std::string& path,
                                 const std::vector<std::string>& overrides = {});

// The resolved recipe as YAML, every field present; ParseRecipe of it gives the same Recipe.
std::string RecipeToYaml(const Recipe& recipe);

}  // namespace ltrain
