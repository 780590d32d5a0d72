#include "common/recipe.h"

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

namespace ltrain {
namespace {

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string Suggest(const std::string& key, const std::vector<std::string>& known) {
  std::string best;
  size_t best_distance = 3;  // only suggest near misses
  for (const auto& k : known) {
    size_t d = EditDistance(key, k);
    if (d < best_distance) {
      best_distance = d;
      best = k;
    }
  }
  return best;
}

std::string Join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// Walks the YAML tree section by section, converting values and collecting every problem with its
// location. Values set by --set have no location in the file; they are reported by their override.
class RecipeReader {
 public:
  RecipeReader(std::string source, std::set<std::string> overridden)
      : source_(std::move(source)), overridden_(std::move(overridden)) {}

  void Error(const YAML::Node& node, const std::string& path, const std::string& message) {
    RecipeError error;
    error.message = message;
    if (overridden_.count(path)) {
      error.file = "--set " + path;
    } else {
      error.file = source_;
      if (node.IsDefined() && node.Mark().line >= 0) {
        error.line = node.Mark().line + 1;
        error.column = node.Mark().column + 1;
      }
    }
    errors_.push_back(std::move(error));
  }

  void ErrorAt(int line, int column, const std::string& message) {
    errors_.push_back(RecipeError{source_, line, column, message});
  }

  // Reports keys of `map` that are not in `known`.
  void CheckKeys(const YAML::Node& map, const std::string& prefix, const std::vector<std::string>& known) {
    for (auto it = map.begin(); it != map.end(); ++it) {
      std::string key = it->first.Scalar();
      if (std::find(known.begin(), known.end(), key) != known.end()) continue;
      std::string path = prefix.empty() ? key : prefix + "." + key;
      std::string message = "unknown key '" + path + "'";
      std::string suggestion = Suggest(key, known);
      if (!suggestion.empty()) {
        message += "; did you mean '" + (prefix.empty() ? suggestion : prefix + "." + suggestion) + "'?";
      } else {
        message += "; known keys" + std::string(prefix.empty() ? "" : " of " + prefix) + ": " + Join(known);
      }
      Error(it->first, path, message);
    }
  }

  // Returns the child map `key` of `root`, or an undefined node when absent or not a map.
  YAML::Node Section(const YAML::Node& root, const std::string& key) {
    YAML::Node node = root[key];
    if (!node.IsDefined() || node.IsNull()) return YAML::Node(YAML::NodeType::Undefined);
    if (!node.IsMap()) {
      Error(node, key, "'" + key + "' must be a mapping of keys to values");
      return YAML::Node(YAML::NodeType::Undefined);
    }
    return node;
  }

  template <typename Int>
  void ReadInt(const YAML::Node& section, const std::string& prefix, const std::string& key, Int& out,
               int64_t min, int64_t max) {
    if (!section.IsDefined()) return;
    YAML::Node node = section[key];
    if (!node.IsDefined()) return;
    std::string path = prefix + "." + key;
    if (!node.IsScalar()) {
      Error(node, path, path + " must be an integer");
      return;
    }
    const std::string& text = node.Scalar();
    int64_t value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size()) {
      Error(node, path, path + " must be an integer, got '" + text + "'");
      return;
    }
    if (value < min || value > max) {
      Error(node, path, path + "=" + text + " is out of range; it must be between " + std::to_string(min) +
                            " and " + std::to_string(max));
      return;
    }
    out = static_cast<Int>(value);
  }

  void ReadDouble(const YAML::Node& section, const std::string& prefix, const std::string& key, double& out,
                  double min, double max) {
    if (!section.IsDefined()) return;
    YAML::Node node = section[key];
    if (!node.IsDefined()) return;
    std::string path = prefix + "." + key;
    if (!node.IsScalar()) {
      Error(node, path, path + " must be a number");
      return;
    }
    const std::string& text = node.Scalar();
    char* end = nullptr;
    double value = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(value)) {
      Error(node, path, path + " must be a number, got '" + text + "'");
      return;
    }
    if (value < min || value > max) {
      std::ostringstream range;
      range << path << "=" << text << " is out of range; it must be between " << min << " and " << max;
      Error(node, path, range.str());
      return;
    }
    out = value;
  }

  void ReadString(const YAML::Node& section, const std::string& prefix, const std::string& key,
                  std::string& out, const std::vector<std::string>& allowed = {}) {
    if (!section.IsDefined()) return;
    YAML::Node node = section[key];
    if (!node.IsDefined()) return;
    std::string path = prefix.empty() ? key : prefix + "." + key;
    if (node.IsNull()) {
      out.clear();
      return;
    }
    if (!node.IsScalar()) {
      Error(node, path, path + " must be a string");
      return;
    }
    if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), node.Scalar()) == allowed.end()) {
      Error(node, path, path + "='" + node.Scalar() + "' is not one of: " + Join(allowed));
      return;
    }
    out = node.Scalar();
  }

  void ReadBool(const YAML::Node& section, const std::string& prefix, const std::string& key, bool& out) {
    if (!section.IsDefined()) return;
    YAML::Node node = section[key];
    if (!node.IsDefined()) return;
    std::string path = prefix + "." + key;
    const std::string text = node.IsScalar() ? node.Scalar() : "";
    if (text == "true" || text == "yes" || text == "on") {
      out = true;
    } else if (text == "false" || text == "no" || text == "off") {
      out = false;
    } else {
      Error(node, path, path + " must be true or false, got '" + text + "'");
    }
  }

  void ReadIntList(const YAML::Node& section, const std::string& prefix, const std::string& key,
                   std::vector<int>& out, int64_t min, int64_t max) {
    if (!section.IsDefined()) return;
    YAML::Node node = section[key];
    if (!node.IsDefined() || node.IsNull()) return;
    std::string path = prefix + "." + key;
    if (!node.IsSequence()) {
      Error(node, path, path + " must be a list of integers, e.g. [3, 3, 2]");
      return;
    }
    std::vector<int> values;
    for (size_t i = 0; i < node.size(); ++i) {
      int value = 0;
      YAML::Node holder(YAML::NodeType::Map);
      holder[key] = node[i];
      size_t before = errors_.size();
      ReadInt(holder, prefix, key, value, min, max);
      if (errors_.size() != before) {
        errors_.back().line = node[i].Mark().line + 1;
        errors_.back().column = node[i].Mark().column + 1;
        return;
      }
      values.push_back(value);
    }
    out = values;
  }

  // Location of `prefix.key` for cross-field errors (the key's value if present, else its section).
  void ErrorOn(const YAML::Node& root, const std::string& prefix, const std::string& key,
               const std::string& message) {
    YAML::Node section = root[prefix];
    YAML::Node node = section.IsDefined() && section.IsMap() ? section[key] : YAML::Node();
    if (node.IsDefined()) {
      Error(node, prefix + "." + key, message);
    } else if (section.IsDefined()) {
      Error(section, prefix, message);
    } else {
      Error(root, prefix, message);
    }
  }

  std::vector<RecipeError> TakeErrors() { return std::move(errors_); }

 private:
  std::string source_;
  std::set<std::string> overridden_;
  std::vector<RecipeError> errors_;
};

constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();

void ApplyOverride(YAML::Node node, const std::vector<std::string>& parts, size_t i, const YAML::Node& value) {
  if (i + 1 == parts.size()) {
    node[parts[i]] = value;
    return;
  }
  if (!node[parts[i]].IsDefined() || !node[parts[i]].IsMap()) node[parts[i]] = YAML::Node(YAML::NodeType::Map);
  ApplyOverride(node[parts[i]], parts, i + 1, value);
}

}  // namespace

std::string RecipeError::ToString() const {
  if (line <= 0) return file + ": " + message;
  return file + ":" + std::to_string(line) + ":" + std::to_string(column) + ": " + message;
}

std::string RecipeParseResult::ErrorText() const {
  std::string out;
  for (const auto& error : errors) out += error.ToString() + "\n";
  return out;
}

RecipeParseResult ParseRecipe(const std::string& yaml_text, const std::string& source_name,
                              const std::vector<std::string>& overrides) {
  RecipeParseResult result;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    result.errors.push_back(
        RecipeError{source_name, e.mark.line + 1, e.mark.column + 1, "YAML syntax error: " + e.msg});
    return result;
  }
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) {
    result.errors.push_back(RecipeError{source_name, root.Mark().line + 1, root.Mark().column + 1,
                                        "a recipe is a mapping with keys name, model, data, training, "
                                        "parallel, checkpoint, fault"});
    return result;
  }

  std::set<std::string> overridden;
  for (const auto& entry : overrides) {
    size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) {
      result.errors.push_back(RecipeError{"--set " + entry, 0, 0, "an override is KEY=VALUE, e.g. training.steps=200"});
      continue;
    }
    std::string key = entry.substr(0, eq);
    std::vector<std::string> parts;
    std::stringstream stream(key);
    for (std::string part; std::getline(stream, part, '.');) parts.push_back(part);
    YAML::Node value;
    try {
      value = YAML::Load(entry.substr(eq + 1));
    } catch (const YAML::ParserException& e) {
      result.errors.push_back(RecipeError{"--set " + key, 0, 0, "value is not valid YAML: " + e.msg});
      continue;
    }
    if (parts.empty() || std::any_of(parts.begin(), parts.end(), [](const auto& p) { return p.empty(); })) {
      result.errors.push_back(RecipeError{"--set " + key, 0, 0, "empty key segment in '" + key + "'"});
      continue;
    }
    ApplyOverride(root, parts, 0, value);
    overridden.insert(key);
  }

  RecipeReader reader(source_name, overridden);
  Recipe& r = result.recipe;
  reader.CheckKeys(root, "", {"name", "model", "data", "training", "parallel", "checkpoint", "fault"});

  r.name = std::filesystem::path(source_name).stem().string();
  reader.ReadString(root, "", "name", r.name);

  YAML::Node model = reader.Section(root, "model");
  if (model.IsDefined()) {
    reader.CheckKeys(model, "model", {"layers", "d_model", "heads", "seq_len", "vocab", "init"});
    reader.ReadInt(model, "model", "layers", r.model.layers, 1, 1024);
    reader.ReadInt(model, "model", "d_model", r.model.d_model, 1, 1 << 20);
    reader.ReadInt(model, "model", "heads", r.model.heads, 1, 4096);
    reader.ReadInt(model, "model", "seq_len", r.model.seq_len, 1, 1 << 24);
    reader.ReadInt(model, "model", "vocab", r.model.vocab, 2, 1 << 24);
    reader.ReadString(model, "model", "init", r.model.init, {"auto", "pytorch", "per_parameter"});
  }
  YAML::Node data = reader.Section(root, "data");
  if (data.IsDefined()) {
    reader.CheckKeys(data, "data", {"path", "tokenizer", "sampling", "seed"});
    reader.ReadString(data, "data", "path", r.data.path);
    reader.ReadString(data, "data", "tokenizer", r.data.tokenizer, {"byte"});
    reader.ReadString(data, "data", "sampling", r.data.sampling, {"hash", "torch"});
    // PyTorch's CPU generator keeps 32 bits of its seed.
    reader.ReadInt(data, "data", "seed", r.data.seed, 0, int64_t{0xffffffff});
  }
  YAML::Node training = reader.Section(root, "training");
  if (training.IsDefined()) {
    reader.CheckKeys(training, "training",
                     {"steps", "micro_batch", "global_batch", "lr", "min_lr", "warmup_steps", "lr_schedule",
                      "weight_decay", "beta1", "beta2", "grad_clip", "seed", "log_every"});
    reader.ReadInt(training, "training", "steps", r.training.steps, 1, kMaxInt64);
    reader.ReadInt(training, "training", "micro_batch", r.training.micro_batch, 1, kMaxInt);
    reader.ReadInt(training, "training", "global_batch", r.training.global_batch, 1, kMaxInt);
    reader.ReadDouble(training, "training", "lr", r.training.lr, 0.0, 10.0);
    reader.ReadDouble(training, "training", "min_lr", r.training.min_lr, 0.0, 10.0);
    reader.ReadInt(training, "training", "warmup_steps", r.training.warmup_steps, 0, kMaxInt64);
    reader.ReadString(training, "training", "lr_schedule", r.training.lr_schedule, {"cosine", "constant"});
    reader.ReadDouble(training, "training", "weight_decay", r.training.weight_decay, 0.0, 10.0);
    reader.ReadDouble(training, "training", "beta1", r.training.beta1, 0.0, 0.999999);
    reader.ReadDouble(training, "training", "beta2", r.training.beta2, 0.0, 0.999999);
    reader.ReadDouble(training, "training", "grad_clip", r.training.grad_clip, 0.0, 1e9);
    reader.ReadInt(training, "training", "seed", r.training.seed, 0, kMaxInt64);
    reader.ReadInt(training, "training", "log_every", r.training.log_every, 1, kMaxInt64);
  }
  YAML::Node parallel = reader.Section(root, "parallel");
  if (parallel.IsDefined()) {
    reader.CheckKeys(parallel, "parallel",
                     {"nodes", "nproc_per_node", "tp", "pp", "zero", "sequence_parallel", "pp_schedule",
                      "virtual_stages", "pp_split", "bucket_mb", "activation_checkpointing", "precision", "device"});
    YAML::Node nodes = parallel["nodes"];
    if (nodes.IsDefined() && nodes.IsMap()) {
      reader.CheckKeys(nodes, "parallel.nodes", {"min", "max"});
      r.parallel.nodes_min = 1;
      r.parallel.nodes_max = 1;
      reader.ReadInt(nodes, "parallel.nodes", "min", r.parallel.nodes_min, 1, 100000);
      reader.ReadInt(nodes, "parallel.nodes", "max", r.parallel.nodes_max, 1, 100000);
      if (!nodes["max"].IsDefined()) r.parallel.nodes_max = r.parallel.nodes_min;
      if (r.parallel.nodes_min > r.parallel.nodes_max) {
        reader.Error(nodes, "parallel.nodes", "parallel.nodes: min=" + std::to_string(r.parallel.nodes_min) +
                                                  " is larger than max=" + std::to_string(r.parallel.nodes_max));
      }
      r.parallel.nodes = r.parallel.nodes_max;
    } else {
      reader.ReadInt(parallel, "parallel", "nodes", r.parallel.nodes, 1, 100000);
      r.parallel.nodes_min = r.parallel.nodes_max = r.parallel.nodes;
    }
    reader.ReadInt(parallel, "parallel", "nproc_per_node", r.parallel.nproc_per_node, 1, 1024);
    reader.ReadInt(parallel, "parallel", "tp", r.parallel.tp, 1, 1024);
    reader.ReadInt(parallel, "parallel", "pp", r.parallel.pp, 1, 1024);
    reader.ReadInt(parallel, "parallel", "zero", r.parallel.zero, 0, 3);
    reader.ReadBool(parallel, "parallel", "sequence_parallel", r.parallel.sequence_parallel);
    reader.ReadString(parallel, "parallel", "pp_schedule", r.parallel.pp_schedule, {"gpipe", "1f1b", "interleaved"});
    reader.ReadInt(parallel, "parallel", "virtual_stages", r.parallel.virtual_stages, 1, 1024);
    reader.ReadIntList(parallel, "parallel", "pp_split", r.parallel.pp_split, 1, 1024);
    reader.ReadDouble(parallel, "parallel", "bucket_mb", r.parallel.bucket_mb, 0.001, 1e6);
    reader.ReadString(parallel, "parallel", "activation_checkpointing", r.parallel.activation_checkpointing,
                      {"none", "full", "selective"});
    reader.ReadString(parallel, "parallel", "precision", r.parallel.precision, {"auto", "fp32", "bf16", "bf16-autocast"});
    reader.ReadString(parallel, "parallel", "device", r.parallel.device, {"cpu", "cuda"});
  }
  YAML::Node checkpoint = reader.Section(root, "checkpoint");
  if (checkpoint.IsDefined()) {
    reader.CheckKeys(checkpoint, "checkpoint", {"dir", "every", "keep", "resume_from", "async", "enabled"});
    reader.ReadBool(checkpoint, "checkpoint", "async", r.checkpoint.async);
    reader.ReadBool(checkpoint, "checkpoint", "enabled", r.checkpoint.enabled);
    reader.ReadString(checkpoint, "checkpoint", "dir", r.checkpoint.dir);
    reader.ReadInt(checkpoint, "checkpoint", "every", r.checkpoint.every, 0, kMaxInt64);
    reader.ReadInt(checkpoint, "checkpoint", "keep", r.checkpoint.keep, 1, 1000000);
    reader.ReadString(checkpoint, "checkpoint", "resume_from", r.checkpoint.resume_from);
  }
  YAML::Node fault = reader.Section(root, "fault");
  if (fault.IsDefined()) {
    reader.CheckKeys(fault, "fault",
                     {"max_restarts", "restart_backoff_s", "restart_backoff_max_s", "heartbeat_interval_s",
                      "heartbeat_misses", "hang_timeout_s", "collective_timeout_s"});
    reader.ReadInt(fault, "fault", "max_restarts", r.fault.max_restarts, 0, 1000000);
    reader.ReadDouble(fault, "fault", "restart_backoff_s", r.fault.restart_backoff_s, 0, 3600);
    reader.ReadDouble(fault, "fault", "restart_backoff_max_s", r.fault.restart_backoff_max_s, 0, 86400);
    reader.ReadDouble(fault, "fault", "collective_timeout_s", r.fault.collective_timeout_s, 0.1, 86400);
    reader.ReadDouble(fault, "fault", "heartbeat_interval_s", r.fault.heartbeat_interval_s, 0.01, 3600);
    reader.ReadInt(fault, "fault", "heartbeat_misses", r.fault.heartbeat_misses, 1, 1000);
    reader.ReadDouble(fault, "fault", "hang_timeout_s", r.fault.hang_timeout_s, 0.1, 86400);
  }

  // Cross-field rules: only meaningful when the fields themselves parsed.
  if (r.name.empty()) reader.ErrorOn(root, "name", "", "name must not be empty");
  if (r.data.path.empty()) {
    reader.ErrorOn(root, "data", "path",
                   "data.path is required: the directory written by `ltrain data prepare --output DIR`");
  }
  if (r.model.d_model % r.model.heads != 0) {
    reader.ErrorOn(root, "model", "heads",
                   "model.heads=" + std::to_string(r.model.heads) + " does not divide model.d_model=" +
                       std::to_string(r.model.d_model) + "; choose heads so that d_model/heads is a whole number");
  }
  if (r.data.tokenizer == "byte" && r.model.vocab < 256) {
    reader.ErrorOn(root, "model", "vocab",
                   "model.vocab=" + std::to_string(r.model.vocab) +
                       " is smaller than the byte tokenizer's 256 symbols; set model.vocab: 256");
  }
  const ParallelSpec& p = r.parallel;
  if (p.world_size() % (p.tp * p.pp) != 0) {
    reader.ErrorOn(root, "parallel", "tp",
                   "world size " + std::to_string(p.world_size()) + " (nodes*nproc_per_node) is not a multiple of tp*pp=" +
                       std::to_string(p.tp * p.pp));
  } else {
    if (p.tp > 1 && r.model.heads % p.tp != 0) {
      reader.ErrorOn(root, "parallel", "tp",
                     "parallel.tp=" + std::to_string(p.tp) + " does not divide model.heads=" + std::to_string(r.model.heads));
    }
    if (p.tp > 1 && (4 * r.model.d_model) % p.tp != 0) {
      reader.ErrorOn(root, "parallel", "tp",
                     "parallel.tp=" + std::to_string(p.tp) + " does not divide the MLP width 4*d_model=" +
                         std::to_string(4 * r.model.d_model));
    }
    if (p.tp > 1 && r.model.vocab % p.tp != 0) {
      reader.ErrorOn(root, "parallel", "tp",
                     "parallel.tp=" + std::to_string(p.tp) + " does not divide model.vocab=" + std::to_string(r.model.vocab) +
                         " (the embedding is split by vocabulary); pad vocab to a multiple of tp");
    }
    if (p.tp > 1 && p.nproc_per_node % p.tp != 0) {
      reader.ErrorOn(root, "parallel", "tp",
                     "parallel.tp=" + std::to_string(p.tp) + " must divide nproc_per_node=" +
                         std::to_string(p.nproc_per_node) + ": a tensor-parallel group stays within one node");
    }
    if (p.sequence_parallel && p.tp == 1) {
      reader.ErrorOn(root, "parallel", "sequence_parallel", "parallel.sequence_parallel needs parallel.tp > 1");
    }
    if (p.sequence_parallel && r.model.seq_len % p.tp != 0) {
      reader.ErrorOn(root, "parallel", "sequence_parallel",
                     "parallel.sequence_parallel splits the sequence: model.seq_len=" + std::to_string(r.model.seq_len) +
                         " is not a multiple of tp=" + std::to_string(p.tp));
    }
    int stages = p.pp * p.virtual_stages;
    if (p.pp > r.model.layers) {
      reader.ErrorOn(root, "parallel", "pp",
                     "parallel.pp=" + std::to_string(p.pp) + " is larger than model.layers=" + std::to_string(r.model.layers));
    } else if (stages > r.model.layers) {
      reader.ErrorOn(root, "parallel", "virtual_stages",
                     "pp*virtual_stages=" + std::to_string(stages) + " stages is more than model.layers=" +
                         std::to_string(r.model.layers));
    }
    if (p.zero == 3 && p.pp > 1) {
      reader.ErrorOn(root, "parallel", "zero",
                     "parallel.zero=3 shards parameters across data-parallel ranks and does not combine with pp>1; "
                     "use zero: 1 with pipeline parallelism");
    }
    if (p.pp_schedule == "interleaved" && p.pp == 1) {
      reader.ErrorOn(root, "parallel", "pp_schedule", "parallel.pp_schedule=interleaved needs parallel.pp > 1");
    }
    if (p.pp_schedule == "interleaved" && p.virtual_stages < 2) {
      reader.ErrorOn(root, "parallel", "virtual_stages",
                     "parallel.pp_schedule=interleaved needs parallel.virtual_stages >= 2");
    }
    if (p.pp_schedule != "interleaved" && p.virtual_stages != 1) {
      reader.ErrorOn(root, "parallel", "virtual_stages",
                     "parallel.virtual_stages > 1 needs parallel.pp_schedule: interleaved");
    }
    if (!p.pp_split.empty()) {
      int sum = 0;
      for (int layers : p.pp_split) sum += layers;
      if (static_cast<int>(p.pp_split.size()) != stages || sum != r.model.layers) {
        reader.ErrorOn(root, "parallel", "pp_split",
                       "parallel.pp_split needs " + std::to_string(stages) + " entries (pp*virtual_stages) summing to model.layers=" +
                           std::to_string(r.model.layers) + "; it has " + std::to_string(p.pp_split.size()) +
                           " summing to " + std::to_string(sum));
      }
    }
    int64_t per_step = static_cast<int64_t>(r.training.micro_batch) * p.dp();
    if (r.training.global_batch % per_step == 0 && p.pp_schedule == "interleaved" && p.pp > 1 &&
        (r.training.global_batch / per_step) % p.pp != 0) {
      reader.ErrorOn(root, "training", "global_batch",
                     "interleaved 1F1B needs the micro-batches per step (global_batch/(micro_batch*dp)=" +
                         std::to_string(r.training.global_batch / per_step) + ") to be a multiple of pp=" +
                         std::to_string(p.pp));
    }
    if (r.training.global_batch % per_step != 0) {
      int64_t lower = std::max<int64_t>(per_step, r.training.global_batch / per_step * per_step);
      reader.ErrorOn(root, "training", "global_batch",
                     "training.global_batch=" + std::to_string(r.training.global_batch) +
                         " is not a multiple of micro_batch*dp=" + std::to_string(r.training.micro_batch) + "*" +
                         std::to_string(p.dp()) + "=" + std::to_string(per_step) + "; try " + std::to_string(lower));
    }
  }
  if (r.training.min_lr > r.training.lr) {
    reader.ErrorOn(root, "training", "min_lr", "training.min_lr must not exceed training.lr");
  }
  result.errors = reader.TakeErrors();
  return result;
}

RecipeParseResult LoadRecipeFile(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) {
    RecipeParseResult result;
    result.errors.push_back(RecipeError{path, 0, 0, "cannot read the recipe file: " + std::string(std::strerror(errno))});
    return result;
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseRecipe(buffer.str(), path, overrides);
}

namespace {

// A double written with the fewest significant digits (15 to 17) that read back as the same value:
// 0.0003 rather than 0.00029999999999999997.
struct Shortest {
  double value;
};

YAML::Emitter& operator<<(YAML::Emitter& out, Shortest n) {
  int digits = 15;
  for (; digits < 17; ++digits) {
    char text[40];
    std::snprintf(text, sizeof(text), "%.*g", digits, n.value);
    if (std::strtod(text, nullptr) == n.value) break;
  }
  return out << YAML::DoublePrecision(digits) << n.value;
}

}  // namespace

std::string RecipeToYaml(const Recipe& r) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << r.name;
  out << YAML::Key << "model" << YAML::Value << YAML::BeginMap
      << YAML::Key << "layers" << YAML::Value << r.model.layers
      << YAML::Key << "d_model" << YAML::Value << r.model.d_model
      << YAML::Key << "heads" << YAML::Value << r.model.heads
      << YAML::Key << "seq_len" << YAML::Value << r.model.seq_len
      << YAML::Key << "vocab" << YAML::Value << r.model.vocab;
  // Keys at their defaults are left out, so that a recipe written here still reads in a binary
  // that predates them (a node mid-upgrade, a stored job).
  if (r.model.init != "auto") out << YAML::Key << "init" << YAML::Value << r.model.init;
  out << YAML::EndMap;
  out << YAML::Key << "data" << YAML::Value << YAML::BeginMap
      << YAML::Key << "path" << YAML::Value << r.data.path
      << YAML::Key << "tokenizer" << YAML::Value << r.data.tokenizer;
  if (r.data.sampling != "hash") out << YAML::Key << "sampling" << YAML::Value << r.data.sampling;
  if (r.data.seed >= 0) out << YAML::Key << "seed" << YAML::Value << r.data.seed;
  out << YAML::EndMap;
  out << YAML::Key << "training" << YAML::Value << YAML::BeginMap
      << YAML::Key << "steps" << YAML::Value << r.training.steps
      << YAML::Key << "micro_batch" << YAML::Value << r.training.micro_batch
      << YAML::Key << "global_batch" << YAML::Value << r.training.global_batch
      << YAML::Key << "lr" << YAML::Value << Shortest{r.training.lr}
      << YAML::Key << "min_lr" << YAML::Value << Shortest{r.training.min_lr}
      << YAML::Key << "warmup_steps" << YAML::Value << r.training.warmup_steps
      << YAML::Key << "lr_schedule" << YAML::Value << r.training.lr_schedule
      << YAML::Key << "weight_decay" << YAML::Value << Shortest{r.training.weight_decay}
      << YAML::Key << "beta1" << YAML::Value << Shortest{r.training.beta1}
      << YAML::Key << "beta2" << YAML::Value << Shortest{r.training.beta2}
      << YAML::Key << "grad_clip" << YAML::Value << Shortest{r.training.grad_clip}
      << YAML::Key << "seed" << YAML::Value << r.training.seed
      << YAML::Key << "log_every" << YAML::Value << r.training.log_every << YAML::EndMap;
  out << YAML::Key << "parallel" << YAML::Value << YAML::BeginMap
      << YAML::Key << "nodes" << YAML::Value;
  if (r.parallel.nodes_min == r.parallel.nodes_max) {
    out << r.parallel.nodes;
  } else {
    out << YAML::Flow << YAML::BeginMap << YAML::Key << "min" << YAML::Value << r.parallel.nodes_min
        << YAML::Key << "max" << YAML::Value << r.parallel.nodes_max << YAML::EndMap;
  }
  out << YAML::Key << "nproc_per_node" << YAML::Value << r.parallel.nproc_per_node
      << YAML::Key << "tp" << YAML::Value << r.parallel.tp
      << YAML::Key << "pp" << YAML::Value << r.parallel.pp
      << YAML::Key << "zero" << YAML::Value << r.parallel.zero
      << YAML::Key << "sequence_parallel" << YAML::Value << r.parallel.sequence_parallel
      << YAML::Key << "pp_schedule" << YAML::Value << r.parallel.pp_schedule
      << YAML::Key << "virtual_stages" << YAML::Value << r.parallel.virtual_stages
      << YAML::Key << "pp_split" << YAML::Value << YAML::Flow << r.parallel.pp_split
      << YAML::Key << "bucket_mb" << YAML::Value << Shortest{r.parallel.bucket_mb}
      << YAML::Key << "activation_checkpointing" << YAML::Value << r.parallel.activation_checkpointing
      << YAML::Key << "precision" << YAML::Value << r.parallel.precision
      << YAML::Key << "device" << YAML::Value << r.parallel.device << YAML::EndMap;
  out << YAML::Key << "checkpoint" << YAML::Value << YAML::BeginMap
      << YAML::Key << "dir" << YAML::Value << r.checkpoint.dir
      << YAML::Key << "every" << YAML::Value << r.checkpoint.every
      << YAML::Key << "keep" << YAML::Value << r.checkpoint.keep
      << YAML::Key << "resume_from" << YAML::Value << r.checkpoint.resume_from
      << YAML::Key << "async" << YAML::Value << r.checkpoint.async
      << YAML::Key << "enabled" << YAML::Value << r.checkpoint.enabled << YAML::EndMap;
  out << YAML::Key << "fault" << YAML::Value << YAML::BeginMap
      << YAML::Key << "max_restarts" << YAML::Value << r.fault.max_restarts
      << YAML::Key << "restart_backoff_s" << YAML::Value << Shortest{r.fault.restart_backoff_s}
      << YAML::Key << "restart_backoff_max_s" << YAML::Value << Shortest{r.fault.restart_backoff_max_s}
      << YAML::Key << "heartbeat_interval_s" << YAML::Value << Shortest{r.fault.heartbeat_interval_s}
      << YAML::Key << "heartbeat_misses" << YAML::Value << r.fault.heartbeat_misses
      << YAML::Key << "hang_timeout_s" << YAML::Value << Shortest{r.fault.hang_timeout_s}
      << YAML::Key << "collective_timeout_s" << YAML::Value << Shortest{r.fault.collective_timeout_s} << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

int64_t DataSeed(const Recipe& recipe) { return recipe.data.seed >= 0 ? recipe.data.seed : recipe.training.seed; }

}  // namespace ltrain
