#include "worker/train/model_tools.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "common/checkpoint_manifest.h"
#include "common/data/prepare.h"
#include "common/files.h"
#include "common/hf_format.h"
#include "common/model_family.h"
#include "common/recipe.h"
#include "common/safetensors.h"
#include "common/data/tokenizer.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/comm/communicator.h"
#include "worker/train/trainer.h"
#include "worker/torch_compat.h"

namespace ltrain::worker {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// "--key value" pairs after the command and its one positional argument.
struct ToolArgs {
  std::string command, checkpoint;
  std::map<std::string, std::string> options;
  std::string Get(const std::string& key, const std::string& fallback = "") const {
    auto it = options.find(key);
    return it == options.end() ? fallback : it->second;
  }
};

StatusOr<ToolArgs> ParseToolArgs(int argc, char** argv) {
  ToolArgs args;
  args.command = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      if (i + 1 >= argc) return InvalidArgument(a + " needs a value");
      args.options[a.substr(2)] = argv[++i];
    } else if (args.checkpoint.empty()) {
      args.checkpoint = a;
    } else {
      return InvalidArgument("unexpected argument " + a);
    }
  }
  if (args.checkpoint.empty()) return InvalidArgument(args.command + " needs a CHECKPOINT (a step-N directory or a checkpoint directory)");
  return args;
}

// The step directory `path` names: itself, or its newest commit.
StatusOr<std::string> StepDir(const std::string& path) {
  std::error_code ec;
  if (fs::exists(fs::path(path) / kCheckpointMetaFile, ec)) return path;
  if (!fs::is_directory(path, ec)) {
    return InvalidArgument(path + " is not a checkpoint: name a job's checkpoint directory ($LTRAIN_HOME/checkpoints/JOB, "
                           "`ltrain status JOB` shows it) or one of its step directories (step-N)");
  }
  StatusOr<ResumeChoice> choice = ChooseResumeCheckpoint(path);
  if (!choice.ok()) return choice.status();
  return choice->step_dir;
}

// A one-rank, CPU or one-GPU copy of the checkpoint's model, its parameters loaded.
struct Loaded {
  Recipe recipe;
  std::string step_dir;
  SelfCommunicator comm;
  std::unique_ptr<Trainer> trainer;
};

StatusOr<std::unique_ptr<Loaded>> Load(const std::string& checkpoint, const std::string& device,
                                       const std::string& dtype = "fp32") {
  if (dtype != "fp32" && (dtype != "bf16" || device != "cuda")) {
    return InvalidArgument("--dtype " + dtype + ": fp32, or bf16 with --device cuda");
  }
  auto loaded = std::make_unique<Loaded>();
  LTRAIN_ASSIGN_OR_RETURN(loaded->step_dir, StepDir(checkpoint));
  LTRAIN_ASSIGN_OR_RETURN(std::string yaml, ReadCheckpointRecipeYaml(loaded->step_dir));
  RecipeParseResult parsed = ParseRecipe(yaml, loaded->step_dir + "/meta.yaml");
  if (!parsed.ok()) return InvalidArgument("the recipe saved in the checkpoint does not read: " + parsed.ErrorText());
  Recipe r = parsed.recipe;
  ParallelSpec& p = r.parallel;
  p.nodes = p.nodes_min = p.nodes_max = 1;
  p.nproc_per_node = 1;
  p.tp = p.pp = 1;
  p.zero = 0;
  p.sequence_parallel = false;
  p.virtual_stages = 1;
  p.pp_split.clear();
  p.activation_checkpointing = ActivationCheckpointing::kNone;
  if (device == "cuda") {
    p.device = Device::kCuda;
    // bf16: the products in bf16 under autocast, the weights, norms and residual stream in fp32 (as
    // mixed-precision inference does), not bf16 weights and activations throughout.
    p.precision = dtype == "bf16" ? Precision::kBf16Autocast : Precision::kFp32;
  } else if (device == "cpu") {
    p.device = Device::kCpu;
    p.precision = Precision::kAuto;
  } else {
    return InvalidArgument("--device " + device + ": cpu or cuda");
  }
  r.training.micro_batch = 1;
  r.training.global_batch = 1;
  r.training.eval_every = 0;
  r.model.init_from.clear();
  r.checkpoint.resume_from = loaded->step_dir;
  TrainerOptions options;
  options.print_progress = false;
  options.model_only = true;
  LTRAIN_ASSIGN_OR_RETURN(loaded->trainer, Trainer::Create(r, options, &loaded->comm));
  loaded->recipe = r;
  return loaded;
}

// The tokenizer the checkpoint's data was made with (its data.yaml), or `file`.
StatusOr<std::unique_ptr<TextTokenizer>> TokenizerOf(const Recipe& recipe, const std::string& file) {
  if (!file.empty()) return TextTokenizer::Load(file);
  // Every source of a mixture has the same tokenizer (the trainer refuses others): the first's.
  const std::string dir = DataSources(recipe).front().path;
  StatusOr<DataInfo> info = ReadDataInfo(dir);
  if (!info.ok()) {
    if (info.status().code() == StatusCode::kNotFound && fs::exists(dir + "/train.bin")) {
      return TextTokenizer::Load("byte");  // data prepared before data.yaml existed: bytes
    }
    return FailedPrecondition("the checkpoint's data (" + dir + ") does not say its tokenizer: " +
                              info.status().message() + "; give --tokenizer FILE");
  }
  if (info->tokenizer == "byte") return TextTokenizer::Load("byte");
  return TextTokenizer::Load((fs::path(dir) / info->tokenizer_file).string());
}

Status WriteShards(const std::string& dir, const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                   double max_shard_bytes) {
  // Shards in order, each up to max_shard_bytes (one larger tensor alone).
  std::vector<std::vector<size_t>> shards(1);
  double in_shard = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const double bytes = static_cast<double>(tensors[i].second.numel() * tensors[i].second.element_size());
    if (!shards.back().empty() && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
  }
  Json weight_map = Json::object();
  uint64_t total = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    const std::string file = shards.size() == 1 ? "model.safetensors" : name;
    std::vector<SafetensorsEntry> entries;
    for (size_t i : shards[s]) {
      const torch::Tensor& t = tensors[i].second;
      SafetensorsEntry e;
      e.name = tensors[i].first;
      e.dtype = t.scalar_type() == torch::kBFloat16 ? "BF16" : "F32";
      e.shape = t.sizes().vec();
      e.bytes = static_cast<uint64_t>(t.numel() * t.element_size());
      entries.push_back(e);
      weight_map[e.name] = file;
      total += e.bytes;
    }
    LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> w,
                            SafetensorsWriter::Create((fs::path(dir) / file).string(), entries, {{"format", "pt"}}));
    for (size_t i : shards[s]) {
      const torch::Tensor& t = tensors[i].second;
      LTRAIN_RETURN_IF_ERROR(w->Write(t.data_ptr(), static_cast<size_t>(t.numel() * t.element_size())));
    }
    LTRAIN_RETURN_IF_ERROR(w->Finish().status());
  }
  if (shards.size() > 1) {
    Json index{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    LTRAIN_RETURN_IF_ERROR(WriteFileAtomically((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n"));
  }
  return Status::Ok();
}

int Export(const ToolArgs& args) {
  const std::string output = args.Get("output");
  if (output.empty()) {
    std::fprintf(stderr, "ltrain export: --output DIR is required\n");
    return 2;
  }
  if (args.Get("format", "hf") != "hf") {
    std::fprintf(stderr, "ltrain export: --format %s is not known; hf writes Hugging Face transformers' layout\n",
                 args.Get("format").c_str());
    return 2;
  }
  const std::string dtype = args.Get("dtype", "fp32");
  if (dtype != "fp32" && dtype != "bf16") {
    std::fprintf(stderr, "ltrain export: --dtype %s: fp32 or bf16\n", dtype.c_str());
    return 2;
  }
  std::error_code ec;
  if (fs::exists(output, ec) && !fs::is_empty(output, ec)) {
    std::fprintf(stderr, "ltrain export: %s exists and is not empty; name a new directory\n", output.c_str());
    return 2;
  }
  // Written beside, then renamed into place: a failed export leaves no half directory. A place that
  // cannot be written (read-only, another user's) is refused before the checkpoint is read.
  const std::string partial = output + ".partial-" + std::to_string(::getpid());
  fs::create_directories(partial, ec);
  if (ec) {
    std::fprintf(stderr, "ltrain export: cannot create %s: %s; give --output a folder you can write\n",
                 partial.c_str(), ec.message().c_str());
    return 2;
  }
  struct RemoveUnlessDone {
    std::string dir;
    bool done = false;
    ~RemoveUnlessDone() {
      if (!done) RemoveTree(dir);  // not std::filesystem::remove_all: see common/files.h
    }
  } cleanup{partial};
  StatusOr<std::unique_ptr<Loaded>> loaded = Load(args.checkpoint, "cpu");
  if (!loaded.ok()) {
    std::fprintf(stderr, "ltrain export: %s\n", loaded.status().message().c_str());
    return loaded.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  const Recipe& r = (*loaded)->recipe;
  if (const std::string problem = HfExportProblem(r.model); !problem.empty()) {
    std::fprintf(stderr, "ltrain export: %s cannot be written for transformers: %s\n", args.checkpoint.c_str(),
                 problem.c_str());
    return 2;
  }
  std::map<std::string, torch::Tensor> ours;
  for (auto& [name, t] : (*loaded)->trainer->FullParameters()) ours[name] = t;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const HfName& n : HfNames(r.model)) {
    auto it = ours.find(n.ours);
    if (it == ours.end()) {
      std::fprintf(stderr, "ltrain export: the checkpoint has no parameter %s\n", n.ours.c_str());
      return 1;
    }
    torch::Tensor t = n.transposed ? it->second.t().contiguous() : it->second.contiguous();
    if (dtype == "bf16") t = t.to(torch::kBFloat16);
    if (n.experts > 0) {
      // One tensor an expert, as transformers keeps them.
      for (int64_t e = 0; e < n.experts; ++e) tensors.emplace_back(HfExpertName(n.hf, e), t[e].contiguous());
      continue;
    }
    tensors.emplace_back(n.hf, t);
  }
  StatusOr<std::unique_ptr<TextTokenizer>> tokenizer = TokenizerOf(r, args.Get("tokenizer"));
  const double max_shard = std::stod(args.Get("max-shard-gb", "5")) * 1e9;
  Status s = WriteShards(partial, tensors, max_shard);
  int64_t eos = -1, bos = -1;
  std::string tokenizer_note = "no tokenizer files (" + (tokenizer.ok() ? std::string() : tokenizer.status().message()) + ")";
  if (s.ok() && tokenizer.ok()) {
    eos = (*tokenizer)->end_of_text();
    bos = (*tokenizer)->begin_of_text();
    Json config{{"model_max_length", r.model.seq_len}, {"clean_up_tokenization_spaces", false}};
    if ((*tokenizer)->kind() == "huggingface") {
      StatusOr<std::string> json = ReadFileText((*tokenizer)->file());
      s = json.ok() ? WriteFileAtomically(partial + "/tokenizer.json", *json) : json.status();
      config["tokenizer_class"] = "PreTrainedTokenizerFast";
      tokenizer_note = "tokenizer.json";
    } else if ((*tokenizer)->kind() == "sentencepiece") {
      StatusOr<std::string> model = ReadFileText((*tokenizer)->file());
      s = model.ok() ? WriteFileAtomically(partial + "/tokenizer.model", *model) : model.status();
      config["tokenizer_class"] = "LlamaTokenizer";
      tokenizer_note = "tokenizer.model";
    } else {
      tokenizer_note = "no tokenizer files (the data is bytes: token id = byte value)";
    }
    if (eos >= 0) {
      const std::string text = (*tokenizer)->Decode({static_cast<uint32_t>(eos)});
      config["eos_token"] = text;
      config["bos_token"] = text;
    }
    if (const std::string text = bos >= 0 ? (*tokenizer)->Decode({static_cast<uint32_t>(bos)}) : ""; !text.empty()) {
      config["bos_token"] = text;
    }
    if (s.ok() && (*tokenizer)->kind() != "byte") {
      s = WriteFileAtomically(partial + "/tokenizer_config.json", config.dump(2) + "\n");
    }
  }
  // Without a begin-of-text token of the tokenizer's own (a model's, put before each document by data
  // prepare), the end-of-text token that ends the document before stands for both, as
  // tokenizer_config.json's bos_token says.
  if (s.ok()) s = WriteFileAtomically(partial + "/config.json", HfConfigJson(r.model, bos >= 0 ? bos : eos, eos));
  if (s.ok()) {
    fs::remove(output, ec);  // an empty directory
    fs::rename(partial, output, ec);
    if (ec) s = Internal("renaming " + partial + " to " + output + ": " + ec.message());
  }
  if (!s.ok()) {
    std::fprintf(stderr, "ltrain export: %s\n", WithFreeSpace(s.message(), partial).c_str());
    return 1;
  }
  cleanup.done = true;
  int64_t params = 0;
  for (const auto& [name, t] : tensors) params += t.numel();
  std::printf("exported %s (step %s, %s, %lld parameters) to %s: %s weights, config.json (%s), %s\n",
              (*loaded)->step_dir.c_str(), (*loaded)->step_dir.substr((*loaded)->step_dir.rfind('-') + 1).c_str(),
              NameOf(r.model.arch).c_str(), static_cast<long long>(params), output.c_str(), dtype.c_str(),
              std::string(FamilyOf(r.model.arch).hf_architecture).c_str(), tokenizer_note.c_str());
  std::printf("load it with: AutoModelForCausalLM.from_pretrained(\"%s\")\n", output.c_str());
  return 0;
}

int Generate(const ToolArgs& args) {
  StatusOr<std::unique_ptr<Loaded>> loaded = Load(args.checkpoint, args.Get("device", "cpu"), args.Get("dtype", "fp32"));
  if (!loaded.ok()) {
    std::fprintf(stderr, "ltrain generate: %s\n", loaded.status().message().c_str());
    return loaded.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  const Recipe& r = (*loaded)->recipe;
  StatusOr<std::unique_ptr<TextTokenizer>> tokenizer = TokenizerOf(r, args.Get("tokenizer"));
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "ltrain generate: %s\n", tokenizer.status().message().c_str());
    return 2;
  }
  Trainer& trainer = *(*loaded)->trainer;
  const std::string prompt = args.Get("prompt");
  std::vector<uint32_t> ids = (*tokenizer)->Encode(prompt);
  // A model's tokenizer that begins each text with its own token (Llama 3's <|begin_of_text|>): the
  // prompt begins with it as the data's documents did (data prepare put it there). Not printed.
  const int64_t bos = (*tokenizer)->begin_of_text();
  size_t lead = 0;
  if (bos >= 0 && (ids.empty() || ids[0] != static_cast<uint32_t>(bos))) {
    ids.insert(ids.begin(), static_cast<uint32_t>(bos));
    lead = 1;
  }
  auto shown = [&](const std::vector<uint32_t>& all) {
    return (*tokenizer)->Decode(std::vector<uint32_t>(all.begin() + static_cast<int64_t>(lead), all.end()));
  };
  const bool json = args.Get("output-format", "text") == "json";
  torch::NoGradGuard no_grad;
  if (args.Get("score", "0") == "1") {
    // Each token's log-probability given the tokens before it.
    if (ids.size() < 2 || static_cast<int>(ids.size()) > r.model.seq_len + 1) {
      std::fprintf(stderr, "ltrain generate --score: the prompt must be 2 to %d tokens, it is %zu\n", r.model.seq_len + 1,
                   ids.size());
      return 2;
    }
    std::vector<int64_t> in(ids.begin(), ids.end() - 1);
    torch::Tensor logits = trainer.Logits(torch::tensor(in, torch::kLong).unsqueeze(0))[0];
    torch::Tensor logp = torch::log_softmax(logits.to(torch::kDouble), -1).cpu();
    Json tokens = Json::array(), logprobs = Json::array();
    double sum = 0;
    for (size_t t = 1; t < ids.size(); ++t) {
      const double lp = logp[static_cast<int64_t>(t - 1)][ids[t]].item<double>();
      tokens.push_back(ids[t]);
      logprobs.push_back(lp);
      sum += lp;
    }
    const double mean_loss = -sum / static_cast<double>(ids.size() - 1);
    if (json) {
      Json out{{"first_token", ids[0]}, {"tokens", tokens}, {"logprobs", logprobs}, {"mean_loss", mean_loss}};
      std::printf("%s\n", out.dump().c_str());
    } else {
      std::printf("%zu tokens scored: mean loss %.6f (perplexity %.3f)\n", ids.size() - 1, mean_loss, std::exp(mean_loss));
    }
    return 0;
  }
  if (ids.empty()) {
    const int64_t eot = (*tokenizer)->end_of_text();
    if (eot < 0) {
      std::fprintf(stderr, "ltrain generate: give a --prompt (this tokenizer has no end-of-text token to start from)\n");
      return 2;
    }
    ids.push_back(static_cast<uint32_t>(eot));
  }
  const int max_tokens = std::stoi(args.Get("max-tokens", "200"));
  const double temperature = std::stod(args.Get("temperature", "0.8"));
  const int top_k = std::stoi(args.Get("top-k", "50"));
  at::Generator generator = at::globalContext().defaultGenerator(torch::kCPU).clone();
  generator.set_current_seed(std::stoull(args.Get("seed", "1")));
  const size_t prompt_tokens = ids.size();
  std::string printed = shown(ids);
  if (!json) {
    std::printf("%s", printed.c_str());
    std::fflush(stdout);
  }
  for (int n = 0; n < max_tokens; ++n) {
    const size_t from = ids.size() > static_cast<size_t>(r.model.seq_len) ? ids.size() - r.model.seq_len : 0;
    std::vector<int64_t> window(ids.begin() + static_cast<int64_t>(from), ids.end());
    torch::Tensor logits = trainer.Logits(torch::tensor(window, torch::kLong).unsqueeze(0))[0][-1].to(torch::kFloat).cpu();
    int64_t next = 0;
    if (temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / temperature;
      if (top_k > 0 && top_k < logits.size(0)) {
        const double kth = std::get<0>(logits.topk(top_k))[-1].item<double>();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      next = torch::multinomial(torch::softmax(logits, -1), 1, false, generator).item<int64_t>();
    }
    if (next == (*tokenizer)->end_of_text()) break;
    ids.push_back(static_cast<uint32_t>(next));
    const std::string text = shown(ids);
    // Printed as it grows; a multi-byte character waits until it is whole.
    if (!json && text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
      std::printf("%s", text.substr(printed.size()).c_str());
      std::fflush(stdout);
      printed = text;
    }
  }
  const std::string completion =
      (*tokenizer)->Decode(std::vector<uint32_t>(ids.begin() + static_cast<int64_t>(prompt_tokens), ids.end()));
  if (json) {
    Json out{{"prompt", prompt}, {"completion", completion}, {"tokens", ids.size() - prompt_tokens}};
    std::printf("%s\n", out.dump().c_str());
  } else {
    const std::string all = (*tokenizer)->Decode(ids);
    if (all.size() > printed.size()) std::printf("%s", all.substr(printed.size()).c_str());
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int RunModelTool(int argc, char** argv) {
  StatusOr<ToolArgs> args = ParseToolArgs(argc, argv);
  if (!args.ok()) {
    std::fprintf(stderr, "ltrain-worker %s: %s\n", argv[1], args.status().message().c_str());
    return 2;
  }
  try {
    if (args->command == "export") return Export(*args);
    return Generate(*args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ltrain %s: %s\n", args->command.c_str(), e.what());
    return 1;
  }
}

}  // namespace ltrain::worker
