// Recipe: the YAML description of a training job, parsed into plain structs and validated before
// anything starts. The same parser reads the user's file, the resolved copy stored with the job,
// and the copy a worker receives. Every key is declared once, in common/recipe_schema.h; the
// reader, the writer, `ltrain validate --explain` and the README's table all walk that list.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace ltrain {

// The closed sets of recipe values. EnumNames<E>::kNames gives the names recipes use, in the order
// `ltrain validate --explain` lists them.
enum class Arch { kGpt2, kLlama, kMistral, kQwen2, kQwen3 };
enum class ModelInit { kAuto, kPytorch, kPerParameter };
enum class Tokenizer { kAuto, kByte, kHuggingFace };
enum class Sampling { kEpochs, kHash, kTorch };
enum class RopeScaling { kNone, kLinear, kLlama3 };
enum class LrScheduleKind { kCosine, kConstant };
enum class PpSchedule { kGpipe, k1F1B, kInterleaved };
enum class ActivationCheckpointing { kNone, kFull, kSelective };
enum class Precision { kAuto, kFp32, kBf16, kBf16Autocast, kBf16Fp32Residual, kFp8 };
enum class Device { kCpu, kCuda };
enum class Fp8ScalingKind { kTensorwise, kRowwise };
enum class WarmStandby { kAuto, kOff, kGpu };
enum class Recovery { kRestart, kInPlace };
enum class MoeScore { kSoftmax, kSigmoid };
enum class MoeBalance { kAuxLoss, kBias, kNone };

template <typename E>
struct EnumNames;
template <>
struct EnumNames<Arch> {
  static constexpr std::array<std::pair<Arch, std::string_view>, 5> kNames = {{{Arch::kGpt2, "gpt2"},
                                                                              {Arch::kLlama, "llama"},
                                                                              {Arch::kMistral, "mistral"},
                                                                              {Arch::kQwen2, "qwen2"},
                                                                              {Arch::kQwen3, "qwen3"}}};
};
template <>
struct EnumNames<Recovery> {
  static constexpr std::array<std::pair<Recovery, std::string_view>, 2> kNames = {
      {{Recovery::kRestart, "restart"}, {Recovery::kInPlace, "in_place"}}};
};
template <>
struct EnumNames<WarmStandby> {
  static constexpr std::array<std::pair<WarmStandby, std::string_view>, 3> kNames = {
      {{WarmStandby::kAuto, "auto"}, {WarmStandby::kOff, "off"}, {WarmStandby::kGpu, "gpu"}}};
};
template <>
struct EnumNames<ModelInit> {
  static constexpr std::array<std::pair<ModelInit, std::string_view>, 3> kNames = {
      {{ModelInit::kAuto, "auto"}, {ModelInit::kPytorch, "pytorch"}, {ModelInit::kPerParameter, "per_parameter"}}};
};
template <>
struct EnumNames<Tokenizer> {
  static constexpr std::array<std::pair<Tokenizer, std::string_view>, 3> kNames = {
      {{Tokenizer::kAuto, "auto"}, {Tokenizer::kByte, "byte"}, {Tokenizer::kHuggingFace, "huggingface"}}};
};
template <>
struct EnumNames<Sampling> {
  static constexpr std::array<std::pair<Sampling, std::string_view>, 3> kNames = {
      {{Sampling::kEpochs, "epochs"}, {Sampling::kHash, "hash"}, {Sampling::kTorch, "torch"}}};
};
template <>
struct EnumNames<RopeScaling> {
  static constexpr std::array<std::pair<RopeScaling, std::string_view>, 3> kNames = {
      {{RopeScaling::kNone, "none"}, {RopeScaling::kLinear, "linear"}, {RopeScaling::kLlama3, "llama3"}}};
};
template <>
struct EnumNames<LrScheduleKind> {
  static constexpr std::array<std::pair<LrScheduleKind, std::string_view>, 2> kNames = {
      {{LrScheduleKind::kCosine, "cosine"}, {LrScheduleKind::kConstant, "constant"}}};
};
template <>
struct EnumNames<PpSchedule> {
  static constexpr std::array<std::pair<PpSchedule, std::string_view>, 3> kNames = {
      {{PpSchedule::kGpipe, "gpipe"}, {PpSchedule::k1F1B, "1f1b"}, {PpSchedule::kInterleaved, "interleaved"}}};
};
template <>
struct EnumNames<ActivationCheckpointing> {
  static constexpr std::array<std::pair<ActivationCheckpointing, std::string_view>, 3> kNames = {
      {{ActivationCheckpointing::kNone, "none"},
       {ActivationCheckpointing::kFull, "full"},
       {ActivationCheckpointing::kSelective, "selective"}}};
};
template <>
struct EnumNames<Fp8ScalingKind> {
  static constexpr std::array<std::pair<Fp8ScalingKind, std::string_view>, 2> kNames = {
      {{Fp8ScalingKind::kTensorwise, "tensorwise"}, {Fp8ScalingKind::kRowwise, "rowwise"}}};
};
template <>
struct EnumNames<Precision> {
  static constexpr std::array<std::pair<Precision, std::string_view>, 6> kNames = {
      {{Precision::kAuto, "auto"}, {Precision::kFp32, "fp32"}, {Precision::kBf16, "bf16"},
       {Precision::kBf16Autocast, "bf16-autocast"}, {Precision::kBf16Fp32Residual, "bf16-fp32-residual"},
       {Precision::kFp8, "fp8"}}};
};
template <>
struct EnumNames<MoeScore> {
  static constexpr std::array<std::pair<MoeScore, std::string_view>, 2> kNames = {
      {{MoeScore::kSoftmax, "softmax"}, {MoeScore::kSigmoid, "sigmoid"}}};
};
template <>
struct EnumNames<MoeBalance> {
  static constexpr std::array<std::pair<MoeBalance, std::string_view>, 3> kNames = {
      {{MoeBalance::kAuxLoss, "aux_loss"}, {MoeBalance::kBias, "bias"}, {MoeBalance::kNone, "none"}}};
};
template <>
struct EnumNames<Device> {
  static constexpr std::array<std::pair<Device, std::string_view>, 2> kNames = {
      {{Device::kCpu, "cpu"}, {Device::kCuda, "cuda"}}};
};

// The recipe name of `value` ("1f1b", "bf16-autocast", ...).
template <typename E>
std::string NameOf(E value) {
  for (const auto& [e, name] : EnumNames<E>::kNames) {
    if (e == value) return std::string(name);
  }
  return "?";
}

// The value a recipe names, or nullopt.
template <typename E>
std::optional<E> EnumFromName(std::string_view name) {
  for (const auto& [e, n] : EnumNames<E>::kNames) {
    if (n == name) return e;
  }
  return std::nullopt;
}

// Every name of E, comma-separated: "gpipe, 1f1b, interleaved".
template <typename E>
std::string EnumNameList() {
  std::string out;
  for (const auto& [e, name] : EnumNames<E>::kNames) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

// A mixture of experts in place of the MLP of some Llama-block layers (model.moe): a router sends each
// token to top_k of `experts` SwiGLU experts and weighs their outputs by its gates; shared experts
// see every token. Every routed row is computed (no capacity, nothing dropped).
struct MoeSpec {
  int experts = 0;          // routed experts per MoE block; 0: no MoE blocks
  int top_k = 2;            // experts per token
  int shared_experts = 0;   // an ungated SwiGLU of width shared_experts * ffn beside them
  int ffn = 0;              // each expert's SwiGLU width; 0: model.ffn's
  int every = 1;            // block l is MoE iff l >= first_dense and (l - first_dense + 1) % every == 0
  int first_dense = 0;      // the first blocks stay dense
  std::vector<int> dense_layers;  // and these
  MoeScore score = MoeScore::kSoftmax;
  bool norm_topk = true;    // a token's gates divided by their sum
  double route_scale = 1;   // then multiplied by this
  MoeBalance balance = MoeBalance::kAuxLoss;
  double aux_loss_coef = 0.001;
  double bias_update = 0.001;
  double z_loss_coef = 0;
  // 0: dropless. Otherwise each expert takes at most ceil(capacity_factor * tokens * top_k / experts)
  // of a micro-batch's assignments on each rank, the first in token order; the others are dropped
  // (the token keeps its other experts' outputs and the residual stream).
  double capacity_factor = 0;
};

struct ModelSpec {
  int layers = 2;
  int d_model = 128;
  int heads = 4;
  int seq_len = 64;
  int vocab = 256;
  // gpt2: learned positions, LayerNorm, GELU MLP of 4*d_model, biases, tied head (gpt_model.GPT).
  // llama: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases
  // (llama_model.Llama, Hugging Face's LlamaForCausalLM). mistral, qwen2, qwen3: the Llama block with
  // their changes (common/model_family.h says which).
  Arch arch = Arch::kGpt2;
  int kv_heads = 0;              // key/value heads (grouped-query attention; llama); 0: model.heads
  int ffn = 0;                   // SwiGLU hidden width (llama); 0: 8*d_model/3 rounded up to a multiple of 64
  int head_dim = 0;              // width of an attention head (llama block); 0: d_model/heads
  // The longest context the model is made for (config.json's max_position_embeddings), kept through
  // training for the export; 0: seq_len.
  int max_positions = 0;
  double rope_theta = 500000;    // rotary base (llama)
  // Rotary scaling for contexts past the one a model was trained on, as transformers' rope_scaling:
  // linear divides every frequency by rope_factor; llama3 (Llama 3.1 and 3.2) divides those of
  // wavelengths past rope_original_positions / rope_low_freq_factor by it, keeps those below
  // rope_original_positions / rope_high_freq_factor, and blends between.
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_factor = 1;
  double rope_low_freq_factor = 1;
  double rope_high_freq_factor = 4;
  int rope_original_positions = 8192;
  double norm_eps = 1e-5;        // RMSNorm epsilon (llama)
  bool tie_embeddings = true;    // the output head is the token embedding (always for gpt2)
  // PyTorch's initialisation reproduces gpt_model.GPT's parameters but makes every rank build the
  // whole model on the CPU from one serial generator, too slow and too large for billions of
  // parameters; per_parameter lets each rank draw only what it keeps, on its own device.
  ModelInit init = ModelInit::kAuto;
  // Start from these parameters instead of drawing them: a directory transformers' save_pretrained
  // or `ltrain export` wrote, or a .safetensors file (transformers' names or ours). A resume wins.
  std::string init_from;
  MoeSpec moe;
};

// One dataset of a mixture: its directory and its share of the samples (weights need not sum to 1).
struct DataSource {
  std::string path;
  double weight = 1;
  bool operator==(const DataSource&) const = default;
};

struct DataSpec {
  std::string path;              // a directory written by `ltrain data prepare`
  // A mixture instead of path: several prepared datasets, each sample drawn from one by weight.
  std::vector<DataSource> sources;
  // What the data's data.yaml must say made it; auto: whatever did.
  Tokenizer tokenizer = Tokenizer::kAuto;
  // "epochs": a seeded permutation of each source's windows per epoch, none drawn twice in one;
  // "hash": windows drawn with replacement from a hash of the sample's index. Both start a resumed
  // run at any data position for free. "torch" replays a PyTorch loop's torch.randint draws, so that
  // a run can be compared with one batch for batch, at the cost of replaying the draws up to the
  // data position on resume.
  Sampling sampling = Sampling::kEpochs;
  int64_t seed = -1;             // the sampler's seed; unset (-1): training.seed
};

struct TrainingSpec {
  int64_t steps = 100;
  int micro_batch = 8;
  int global_batch = 16;         // sequences per optimizer step, across all data-parallel ranks
  double lr = 1e-3;              // peak learning rate
  double min_lr = 1e-4;          // floor of the cosine decay
  int64_t warmup_steps = 10;
  LrScheduleKind lr_schedule = LrScheduleKind::kCosine;
  double weight_decay = 0.1;
  double beta1 = 0.9;            // AdamW moment decay rates
  double beta2 = 0.95;
  double grad_clip = 1.0;        // max global gradient norm; 0 turns clipping off
  uint64_t seed = 1337;
  int64_t log_every = 10;
  // Validation: the mean loss over eval_batches global batches of the validation split (fixed windows, each
  // data-parallel rank its share) every eval_every steps and after the last; 0 turns it off.
  int64_t eval_every = 0;
  int eval_batches = 10;
  // Deterministic kernels (attention backward, cuBLAS, cuDNN), so that a run and its restart from a
  // checkpoint compute the same losses bit for bit; slower. The CPU is deterministic anyway.
  bool deterministic = false;
};

// What the user asks for; common/layout.h resolves it, for a world size, into a Layout.
struct ParallelSpec {
  int nodes = 1;                 // nodes the job runs on now (`nodes: N`, or the max of `nodes: {min, max}`)
  int nodes_min = 1;             // elastic floor: the job goes on while at least this many remain
  int nodes_max = 1;
  int nproc_per_node = 1;
  int tp = 1;                    // tensor parallel degree (innermost, within a node)
  int pp = 1;                    // pipeline stages (outermost)
  int ep = 1;                    // expert parallelism: each MoE block's experts split over ep data-parallel ranks
  int cp = 1;                    // context parallelism: each sequence split over cp data-parallel ranks
  int zero = 0;                  // 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded over dp
  bool sequence_parallel = false;
  PpSchedule pp_schedule = PpSchedule::k1F1B;
  int virtual_stages = 1;        // model chunks per pipeline rank (interleaved 1F1B)
  std::vector<int> pp_split;     // layers per (virtual) stage; empty = balanced
  double bucket_mb = 25.0;       // data-parallel gradient bucket size
  ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::kNone;
  Precision precision = Precision::kAuto;  // auto: bf16-fp32-residual on cuda, fp32 on cpu
  std::vector<int> fp8_bf16_layers;  // under fp8: the blocks (0-based) whose products stay bf16
  Fp8ScalingKind fp8_scaling = Fp8ScalingKind::kTensorwise;  // under fp8: one scale a tensor, or a row
  Device device = Device::kCpu;  // cpu (Gloo) | cuda (NCCL)

  int world_size() const { return nodes * nproc_per_node; }
  // Whether the model keeps bf16 copies with its residual stream in fp32: bf16-fp32-residual, fp8
  // (its products in FP8 on top), and auto on cuda.
  bool fp32_residual_stream() const {
    return device == Device::kCuda && (precision == Precision::kBf16Fp32Residual || precision == Precision::kAuto ||
                                       precision == Precision::kFp8);
  }
  int dp() const { return world_size() / (tp * pp); }
};

struct CheckpointSpec {
  std::string dir;               // empty: $LTRAIN_HOME/checkpoints/<job>
  int64_t every = 0;             // steps between checkpoints; 0 writes only the final one
  int keep = 2;
  std::string resume_from;       // a checkpoint directory to start from; empty starts fresh
  bool async = true;             // snapshot to host memory, write in the background
  bool enabled = true;           // false: no checkpoint at all (benchmarks, throw-away runs)
  double timeout_s = 0;          // a save or load without progress this long is stuck; 0: auto
  bool share_with_group = false;  // folders 0750 and files 0640 instead of 0700 and 0600
};

struct FaultSpec {
  int max_restarts = 0;
  double restart_backoff_s = 1.0;       // first delay; doubles per restart up to restart_backoff_max_s
  double restart_backoff_max_s = 30.0;
  double heartbeat_interval_s = 1.0;
  int heartbeat_misses = 3;
  double hang_timeout_s = 0;            // no progress this long in a step: the rank is hung; 0: derived from the run
  double startup_timeout_s = 0;         // a start-up without progress this long is stuck; 0: auto
  double collective_timeout_s = 0;      // a collective that takes longer is aborted; 0: derived from the run
  Recovery recovery = Recovery::kRestart;  // a failed rank: restart the job, or replace it in place
  int memory_checkpoint_every = 0;  // in place under ZeRO: steps between peers' copies of the shards; 0: auto
};

// What a job records of its run beside metrics.jsonl.
struct MetricsSpec {
  bool tensorboard = false;  // rank 0 writes TensorBoard event files in the job's tensorboard/ directory
};

// A program of the user's own that ltrain runs once per rank with torchrun's environment (`ltrain
// run`), instead of its own trainer: the recipe then has no model, data or training.
struct EntrypointSpec {
  std::vector<std::string> command;           // empty: ltrain's own trainer
  std::map<std::string, std::string> env;     // added to every rank's environment
  std::string workdir;                        // where the program starts; empty: where ltrain ran
  double output_timeout_s = 0;                // a rank that prints and reports nothing this long is
                                              // stopped as hung; 0: never
  // Whether a Python program's next generation starts in interpreters that have imported torch
  // already: auto (when the job may restart), off, gpu (with the GPU's CUDA context made too).
  WarmStandby warm_standby = WarmStandby::kAuto;
};

struct Recipe {
  std::string name;
  ModelSpec model;
  DataSpec data;
  TrainingSpec training;
  ParallelSpec parallel;
  CheckpointSpec checkpoint;
  FaultSpec fault;
  MetricsSpec metrics;
  EntrypointSpec entrypoint;

  // The recipe runs the user's program (entrypoint.command), not ltrain's trainer.
  bool runs_program() const { return !entrypoint.command.empty(); }

  // Micro-batches each data-parallel rank accumulates per optimizer step.
  int accumulation_steps() const {
    return training.global_batch / (training.micro_batch * parallel.dp());
  }
};

// The model's arithmetic, from here to ModelShapeDifferences (defined in common/model_family.cc, with
// the families). How many parameters the model has, each counted once (a tied head is the token
// embedding), in closed form: what ModelParameterCount counts from the list of parameters.
int64_t ApproxParameterCount(const ModelSpec& model);
// model.kv_heads resolved (model.heads when unset).
int KvHeads(const ModelSpec& model);
// model.head_dim resolved (d_model/heads when unset).
int HeadDim(const ModelSpec& model);
// The MLP's hidden width: 4*d_model for gpt2, model.ffn (or its default) for llama.
int FfnWidth(const ModelSpec& model);
// Whether block `layer` (0-based) is a mixture of experts: model.moe.experts above 0, the layer not
// among the first_dense nor in dense_layers, and (layer - first_dense + 1) a multiple of every.
bool IsMoeLayer(const ModelSpec& model, int layer);
// Each routed expert's SwiGLU width: model.moe.ffn, or the MLP's.
int MoeFfnWidth(const ModelSpec& model);
// The parameters of block `layer`'s MLP, or of its router and experts: all of them, or (`active`) those
// one token runs through (top_k routed experts and the shared ones).
int64_t MlpParameters(const ModelSpec& model, int layer, bool active);
// ApproxParameterCount less the routed experts a token does not run through: what a token's FLOPs
// follow. ApproxParameterCount itself for a dense model.
int64_t ActiveParameterCount(const ModelSpec& model);

// The rotary inverse frequencies of a Llama's heads (head_dim / 2 of them, pair i first): theta^(-2i/hd)
// in fp32 as transformers computes it, then model.rope_scaling's rescaling.
std::vector<float> RopeInverseFrequencies(const ModelSpec& model);
// Where `saved` and `current` differ in a key that gives the parameters their shapes, each as
// "model.d_model 128 (this recipe: 32)", joined by ", "; empty when one's parameters fit the other.
// seq_len counts only for gpt2 (its learned positions); rope_theta and norm_eps change no shape.
std::string ModelShapeDifferences(const ModelSpec& saved, const ModelSpec& current);

// The bytes of training state a checkpoint holds: fp32 weights and AdamW's two moments.
int64_t ApproxCheckpointBytes(const ModelSpec& model);

// How long a rank may make no progress in a long phase before it counts as stuck, and how that
// figure came about ("checkpoint.timeout_s=30", or "checkpoint.timeout_s auto: 60 s + 1 s per 50 MB
// of 15.6 GB of state"). An auto limit is never below fault.hang_timeout_s.
struct PhaseTimeout {
  double seconds = 0;
  std::string how;
};
PhaseTimeout CheckpointTimeout(const Recipe& recipe);  // checkpoint saves, loads and commits
PhaseTimeout StartupTimeout(const Recipe& recipe);     // model build, connection, resume load

// A training step's limit, fault.hang_timeout_s when the recipe sets it; else derived from the run:
// kStepLimitMultiple times the slowest of the last steps (`slowest_step_ms`, of `steps_seen` steps),
// within the floor and the ceiling, and the start-up limit until kStartupSteps steps are done (their
// compilation, communicators made on first use, autotuning). Progress changes many times a step
// (phases, collectives), so the multiple is wide.
constexpr int kStartupSteps = 3;
constexpr int kDerivedWindowSteps = 50;  // the last steps whose slowest counts
constexpr double kStepLimitMultiple = 20;
constexpr double kStepLimitFloorS = 20;
constexpr double kStepLimitCeilingS = 600;
PhaseTimeout StepTimeout(const Recipe& recipe, int64_t steps_seen, double slowest_step_ms);
// A collective's limit, fault.collective_timeout_s when set; else twice the longest of the training
// step's (StepTimeout), the start-up's and the checkpoint's limits: the coordinator names the hang,
// with every rank's view, before a collective gives up.
PhaseTimeout CollectiveTimeout(const Recipe& recipe, int64_t steps_seen, double slowest_step_ms);

// The data sampler's seed: data.seed when set, training.seed otherwise.
int64_t DataSeed(const Recipe& recipe);

// The datasets the job trains on: data.sources, or data.path with weight 1.
std::vector<DataSource> DataSources(const Recipe& recipe);

// One problem found in a recipe, located in its source. line/column are 1-based; 0 when the value
// came from a --set override rather than the file.
struct RecipeError {
  std::string file;
  int line = 0;
  int column = 0;
  std::string message;

  std::string ToString() const;  // "file:line:col: message"
};

// At most this many errors of one recipe are kept and said; one more line counts the rest. A value
// an error quotes is shortened (Shortened in strings.h).
inline constexpr size_t kMaxRecipeErrors = 100;

struct RecipeParseResult {
  Recipe recipe;
  std::vector<RecipeError> errors;
  std::set<std::string> given;     // the keys the file or the overrides set ("model.heads")
  std::vector<std::string> notes;  // what the user should know and nothing refuses (one line each)
  bool ok() const { return errors.empty(); }
  std::string ErrorText() const;  // every error, one per line
};

// A job's name becomes its id (NAME-N), a directory name and part of log lines: 1 to 64 of
// A-Z a-z 0-9 . _ -, beginning with neither '-' nor '.'. Returns what is wrong with `name`, empty
// when nothing is.
std::string JobNameProblem(std::string_view name);
// A valid name close to `name` (the characters outside the rule become '-'; "job" when nothing is left).
std::string SuggestJobName(std::string_view name);

// Parses YAML text and checks it: every key's type and range (common/recipe_schema.h), then the
// rules between keys, the layout rules of common/layout.h among them (for the recipe's own world
// size). `source_name` names the file in errors. `overrides` are "dotted.key=value" strings applied
// on top of the file before validation, as `--set` gives them.
RecipeParseResult ParseRecipe(const std::string& yaml_text, const std::string& source_name,
                              const std::vector<std::string>& overrides = {});

// Reads and parses a file; a missing file is one error naming it.
RecipeParseResult LoadRecipeFile(const std::string& path,
                                 const std::vector<std::string>& overrides = {});

// The resolved recipe as YAML, every key present except the few that older binaries do not know
// while they hold their defaults (RecipeKey::omit_at_default); ParseRecipe of it gives the same Recipe.
std::string RecipeToYaml(const Recipe& recipe);

}  // namespace ltrain
