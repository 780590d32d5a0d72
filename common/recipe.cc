#include "common/recipe.h"

#include <algorithm>
#include <tuple>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "common/hf_config.h"
#include "common/layout.h"
#include "common/logging.h"
#include "common/model_family.h"
#include "common/python_command.h"
#include "common/recipe_schema.h"
#include "common/strings.h"

namespace ltrain {
namespace {

template <typename T>
struct IsNodesField : std::false_type {};
template <typename I>
struct IsNodesField<NodesField<I>> : std::true_type {};

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

// The keys of each section ("" for the top level: `name` and the sections), from the schema.
std::map<std::string, std::vector<std::string>> KnownKeys() {
  std::map<std::string, std::vector<std::string>> known;
  Recipe defaults;
  VisitRecipeKeys(defaults, [&](const RecipeKey& key, auto&) {
    const std::string section(key.section);
    std::vector<std::string>& keys = known[section];
    // A section within a section (model.moe) is a key of its parent.
    if (keys.empty() && section.find('.') != std::string::npos) {
      known[section.substr(0, section.rfind('.'))].push_back(section.substr(section.rfind('.') + 1));
    }
    known[section].push_back(std::string(key.name));
  });
  for (std::string_view section : kRecipeSections) known[""].push_back(std::string(section));
  known["parallel.nodes"] = {"min", "max"};
  return known;
}

// The sections within sections ("model.moe"), from the schema.
std::vector<std::string> NestedSections() {
  std::vector<std::string> nested;
  Recipe defaults;
  VisitRecipeKeys(defaults, [&](const RecipeKey& key, auto&) {
    const std::string section(key.section);
    if (section.find('.') != std::string::npos && (nested.empty() || nested.back() != section)) {
      nested.push_back(section);
    }
  });
  return nested;
}

// A YAML location: 1-based line and column.
struct Mark {
  int line = 0;
  int column = 0;
};

Mark MarkOf(const YAML::Node& node) {
  if (!node.IsDefined() || node.Mark().line < 0) return {};
  return {node.Mark().line + 1, node.Mark().column + 1};
}

// Walks the YAML tree key by key as the schema lists them, converting values and collecting every
// problem with its location. Values set by --set have no location in the file; they are reported
// by their override. Remembers where each key and section was, for the rules between keys.
class RecipeReader {
 public:
  RecipeReader(std::string source, std::set<std::string> overridden, YAML::Node root)
      : source_(std::move(source)), overridden_(std::move(overridden)), root_(std::move(root)) {}

  void Error(const std::string& path, Mark mark, const std::string& message) {
    // However many a recipe has (700,000 unknown keys), what is said of them stays readable.
    if (errors_.size() >= kMaxRecipeErrors) {
      ++dropped_;
      return;
    }
    RecipeError error;
    error.message = message;
    if (overridden_.count(path)) {
      error.file = "--set " + Shortened(path);
    } else {
      error.file = source_;
      error.line = mark.line;
      error.column = mark.column;
    }
    errors_.push_back(std::move(error));
  }

  void Error(const YAML::Node& node, const std::string& path, const std::string& message) {
    Error(path, MarkOf(node), message);
  }

  // An error about `path` ("training.global_batch") found after reading: located at the key's value
  // when the file gives it, else at its section, else at the top.
  void ErrorOnKey(const std::string& path, const std::string& message) {
    if (auto it = marks_.find(path); it != marks_.end()) return Error(path, it->second, message);
    // The innermost section the file gives ("model.moe", then "model").
    for (std::string section = path; section.find('.') != std::string::npos;) {
      section.resize(section.rfind('.'));
      if (auto it = marks_.find(section); it != marks_.end()) return Error(path, it->second, message);
    }
    Error(path, MarkOf(root_), message);
  }

  // Reports keys of `map` that are not in `known`.
  void CheckKeys(const YAML::Node& map, const std::string& prefix, const std::vector<std::string>& known) {
    std::map<std::string, int> first_line;
    for (auto it = map.begin(); it != map.end(); ++it) {
      std::string key = it->first.Scalar();
      std::string path = prefix.empty() ? key : prefix + "." + key;
      // YAML reads the first of two equal keys and drops the other without a word: a section written
      // again at the end of a recipe would change nothing. (A key that is a sequence or a mapping has no
      // name to meet twice; it is an unknown key below.)
      if (it->first.IsScalar()) {
        const auto [seen, inserted] = first_line.emplace(key, it->first.Mark().line + 1);
        if (!inserted) {
          const bool section = prefix.empty() && it->second.IsMap();
          Error(it->first, path,
                "'" + path + "' is given twice (first at line " + std::to_string(seen->second) +
                    "), and only the first would count; keep one" + (section ? " section and move its keys into it" : ""));
          continue;
        }
      }
      if (std::find(known.begin(), known.end(), key) != known.end()) continue;
      if (errors_.size() >= kMaxRecipeErrors) {  // counted, and no suggestion sought
        ++dropped_;
        continue;
      }
      std::string message = "unknown key '" + Shortened(path) + "'";
      std::string suggestion = Suggest(key, known);
      if (!suggestion.empty()) {
        message += "; did you mean '" + (prefix.empty() ? suggestion : prefix + "." + suggestion) + "'?";
      } else {
        message += "; known keys" + std::string(prefix.empty() ? "" : " of " + prefix) + ": " + Join(known);
      }
      Error(it->first, path, message);
    }
  }

  // Checks the sections and their keys against the schema, and remembers where each is.
  void CheckStructure() {
    std::map<std::string, std::vector<std::string>> known = KnownKeys();
    CheckKeys(root_, "", known[""]);
    for (std::string_view name : kRecipeSections) {
      const std::string section(name);
      YAML::Node node = root_[section];
      if (!node.IsDefined() || node.IsNull()) continue;
      marks_[section] = MarkOf(node);
      if (!node.IsMap()) {
        Error(node, section, "'" + section + "' must be a mapping of keys to values");
        continue;
      }
      CheckKeys(node, section, known[section]);
      for (auto it = node.begin(); it != node.end(); ++it) marks_[section + "." + it->first.Scalar()] = MarkOf(it->second);
    }
    YAML::Node nodes = Value("parallel", "nodes");
    if (nodes.IsDefined() && nodes.IsMap()) CheckKeys(nodes, "parallel.nodes", known["parallel.nodes"]);
    for (const std::string& section : NestedSections()) {
      const std::string parent = section.substr(0, section.rfind('.'));
      YAML::Node node = Value(parent, section.substr(section.rfind('.') + 1));
      if (!node.IsDefined() || node.IsNull()) continue;
      if (!node.IsMap()) {
        Error(node, section, "'" + section + "' must be a mapping of keys to values");
        continue;
      }
      CheckKeys(node, section, known[section]);
      for (auto it = node.begin(); it != node.end(); ++it) marks_[section + "." + it->first.Scalar()] = MarkOf(it->second);
    }
  }

  // The value of `section.name` (or of the top-level `name`; a section may be nested: "model.moe");
  // undefined when absent or when a section on the way is not a mapping.
  YAML::Node Value(std::string_view section, std::string_view name) const {
    if (section.empty()) return root_[std::string(name)];
    YAML::Node node = root_;
    for (size_t start = 0; start <= section.size();) {
      const size_t dot = std::min(section.find('.', start), section.size());
      YAML::Node inner = node[std::string(section.substr(start, dot - start))];
      if (!inner.IsDefined() || !inner.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
      node.reset(inner);  // rebinds (operator= would write inner's value into root_)
      start = dot + 1;
    }
    return node[std::string(name)];
  }

  // Reads one key into its field, by the field's type.
  template <typename Field>
  void Read(const RecipeKey& key, Field& field) {
    YAML::Node node = Value(key.section, key.name);
    if (!node.IsDefined()) return;
    const std::string path = key.path();
    const size_t errors_before = errors_.size() + dropped_;
    ReadValue(key, node, path, field);
    if (errors_.size() + dropped_ > errors_before) refused_.insert(path);
  }

  // Whether a key's own value was refused, among `paths` ("model.heads", or a section's "model.").
  // Such a key keeps its default, so a rule across keys that reads it would judge a value the user
  // never wrote; the rule waits until the key is mended.
  bool Refused(std::initializer_list<std::string_view> paths) const {
    for (const std::string& refused : refused_) {
      for (std::string_view path : paths) {
        if (path.ends_with('.') ? refused.starts_with(path) : refused == path) return true;
      }
    }
    return false;
  }

  std::vector<RecipeError> TakeErrors() { return std::move(errors_); }
  // The errors past kMaxRecipeErrors, counted only.
  size_t dropped() const { return dropped_; }

  // Whether the recipe (file or overrides) has `section` with something in it.
  bool HasSection(std::string_view section) const {
    YAML::Node node = root_[std::string(section)];
    return node.IsDefined() && !node.IsNull() && (!node.IsMap() || node.size() > 0);
  }

 private:
  template <typename Field>
  void ReadValue(const RecipeKey& key, const YAML::Node& node, const std::string& path, Field& field) {
    using T = std::remove_cvref_t<Field>;
    if constexpr (IsNodesField<T>::value) {
      ReadNodes(key, node, field);
    } else if constexpr (std::is_same_v<T, bool>) {
      const std::string text = node.IsScalar() ? node.Scalar() : "";
      if (text == "true" || text == "yes" || text == "on") {
        field = true;
      } else if (text == "false" || text == "no" || text == "off") {
        field = false;
      } else {
        Error(node, path, path + " must be true or false, got '" + Shortened(text) + "'");
      }
    } else if constexpr (std::is_integral_v<T>) {
      int64_t value = 0;
      if (ReadInt(node, path, key, &value)) field = static_cast<T>(value);
    } else if constexpr (std::is_floating_point_v<T>) {
      ReadDouble(node, path, key, field);
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (node.IsNull()) {
        field.clear();
      } else if (!node.IsScalar()) {
        Error(node, path, path + " must be a string");
      } else {
        field = node.Scalar();
      }
    } else if constexpr (std::is_enum_v<T>) {
      if (!node.IsScalar()) {
        Error(node, path, path + " must be one of: " + EnumNameList<T>());
      } else if (std::optional<T> value = EnumFromName<T>(node.Scalar())) {
        field = *value;
      } else {
        Error(node, path, path + "='" + node.Scalar() + "' is not one of: " + EnumNameList<T>());
      }
    } else if constexpr (std::is_same_v<T, std::vector<int>>) {
      ReadIntList(node, path, key, field);
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      ReadTextList(node, path, field);
    } else if constexpr (std::is_same_v<T, std::map<std::string, std::string>>) {
      ReadTextMap(node, path, field);
    } else if constexpr (std::is_same_v<T, std::vector<DataSource>>) {
      ReadSources(node, path, key, field);
    } else {
      static_assert(sizeof(T) == 0, "a recipe key of a type the reader does not know");
    }
  }

  bool ReadInt(const YAML::Node& node, const std::string& path, const RecipeKey& key, int64_t* out) {
    if (!node.IsScalar()) {
      Error(node, path, path + " must be an integer");
      return false;
    }
    const std::string& text = node.Scalar();
    int64_t value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size()) {
      Error(node, path, path + " must be an integer, got '" + Shortened(text) + "'");
      return false;
    }
    if (value < key.int_min || value > key.int_max) {
      Error(node, path, path + "=" + text + " is out of range; it must be between " + std::to_string(key.int_min) +
                            " and " + std::to_string(key.int_max));
      return false;
    }
    *out = value;
    return true;
  }

  void ReadDouble(const YAML::Node& node, const std::string& path, const RecipeKey& key, double& out) {
    if (!node.IsScalar()) {
      Error(node, path, path + " must be a number");
      return;
    }
    const std::string& text = node.Scalar();
    char* end = nullptr;
    double value = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(value)) {
      Error(node, path, path + " must be a number, got '" + Shortened(text) + "'");
      return;
    }
    if (value < key.real_min || value > key.real_max) {
      std::ostringstream range;
      range << path << "=" << text << " is out of range; it must be between " << key.real_min << " and " << key.real_max;
      Error(node, path, range.str());
      return;
    }
    out = value;
  }

  void ReadIntList(const YAML::Node& node, const std::string& path, const RecipeKey& key, std::vector<int>& out) {
    if (node.IsNull()) return;
    if (!node.IsSequence()) {
      Error(node, path, path + " must be a list of integers, e.g. [3, 3, 2]");
      return;
    }
    std::vector<int> values;
    for (size_t i = 0; i < node.size(); ++i) {
      int64_t value = 0;
      if (!ReadInt(node[i], path, key, &value)) return;
      values.push_back(static_cast<int>(value));
    }
    out = values;
  }

  void ReadTextList(const YAML::Node& node, const std::string& path, std::vector<std::string>& out) {
    if (node.IsNull()) return;
    if (!node.IsSequence()) {
      Error(node, path, path + " must be a list, e.g. [python3, train.py, --epochs, \"3\"]");
      return;
    }
    std::vector<std::string> values;
    for (size_t i = 0; i < node.size(); ++i) {
      if (!node[i].IsScalar()) {
        Error(node[i], path, path + "[" + std::to_string(i) + "] must be a string");
        return;
      }
      values.push_back(node[i].Scalar());
    }
    out = values;
  }

  void ReadTextMap(const YAML::Node& node, const std::string& path, std::map<std::string, std::string>& out) {
    if (node.IsNull()) return;
    if (!node.IsMap()) {
      Error(node, path, path + " must be a mapping of names to values, e.g. {NCCL_DEBUG: INFO}");
      return;
    }
    std::map<std::string, std::string> values;
    for (auto it = node.begin(); it != node.end(); ++it) {
      const std::string name = it->first.Scalar();
      if (!it->second.IsScalar()) {
        Error(it->second, path, path + "." + name + " must be a string");
        return;
      }
      if (name.empty() || name.find('=') != std::string::npos) {
        Error(it->first, path, path + ": '" + name + "' is not a variable name");
        return;
      }
      values[name] = it->second.Scalar();
    }
    out = values;
  }

  void ReadSources(const YAML::Node& node, const std::string& path, const RecipeKey& key,
                   std::vector<DataSource>& out) {
    if (node.IsNull()) return;
    const std::string example = "e.g. [{path: web, weight: 0.7}, {path: code, weight: 0.3}]";
    if (!node.IsSequence() || node.size() == 0) {
      Error(node, path, path + " must be a list of datasets, " + example);
      return;
    }
    std::vector<DataSource> values;
    for (size_t i = 0; i < node.size(); ++i) {
      const YAML::Node entry = node[i];
      const std::string at = path + "[" + std::to_string(i) + "]";
      if (!entry.IsMap()) {
        Error(entry, path, at + " must be a mapping with a path and a weight, " + example);
        return;
      }
      for (auto it = entry.begin(); it != entry.end(); ++it) {
        const std::string name = it->first.Scalar();
        if (name != "path" && name != "weight") {
          Error(it->first, path, at + "." + name + " is not a key of a data source; it has path and weight");
          return;
        }
      }
      DataSource source;
      const YAML::Node p = entry["path"];
      if (!p.IsDefined() || !p.IsScalar() || p.Scalar().empty()) {
        Error(entry, path, at + ".path is required: a directory written by `ltrain data prepare`");
        return;
      }
      source.path = p.Scalar();
      if (entry["weight"].IsDefined()) {
        const size_t errors = errors_.size() + dropped_;
        ReadDouble(entry["weight"], at + ".weight", key, source.weight);
        if (errors_.size() + dropped_ > errors) return;
      }
      values.push_back(std::move(source));
    }
    out = values;
  }

  template <typename I>
  void ReadNodes(const RecipeKey& key, const YAML::Node& node, NodesField<I>& nodes) {
    const std::string path = key.path();
    if (node.IsMap()) {
      int64_t min = 1, max = 1;
      bool ok = true;
      if (node["min"].IsDefined()) ok = ReadInt(node["min"], path, key, &min) && ok;
      if (node["max"].IsDefined()) {
        ok = ReadInt(node["max"], path, key, &max) && ok;
      } else {
        max = min;
      }
      if (!ok) return;
      if (min > max) {
        Error(node, path, "parallel.nodes: min=" + std::to_string(min) + " is larger than max=" + std::to_string(max));
      }
      nodes.min = static_cast<int>(min);
      nodes.max = static_cast<int>(max);
      nodes.nodes = nodes.max;
      return;
    }
    int64_t count = 0;
    if (!ReadInt(node, path, key, &count)) return;
    nodes.nodes = nodes.min = nodes.max = static_cast<int>(count);
  }

  std::string source_;
  std::set<std::string> overridden_;
  YAML::Node root_;
  std::map<std::string, Mark> marks_;  // "section" and "section.key" -> where the file has it
  std::vector<RecipeError> errors_;
  size_t dropped_ = 0;  // errors past kMaxRecipeErrors, counted, not kept
  std::set<std::string> refused_;  // keys whose own value was refused ("training.micro_batch")
};

void ApplyOverride(YAML::Node node, const std::vector<std::string>& parts, size_t i, const YAML::Node& value) {
  if (i + 1 == parts.size()) {
    node[parts[i]] = value;
    return;
  }
  if (!node[parts[i]].IsDefined() || !node[parts[i]].IsMap()) node[parts[i]] = YAML::Node(YAML::NodeType::Map);
  ApplyOverride(node[parts[i]], parts, i + 1, value);
}

bool IsJobNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
}

// The keys one architecture has and the other lacks.
void CheckArchKeys(const ModelSpec& m, RecipeReader& reader) {
  if (m.arch == Arch::kGpt2) {
    if (m.kv_heads != 0 && m.kv_heads != m.heads) {
      reader.ErrorOnKey("model.kv_heads", "model.kv_heads (grouped-query attention) is a Llama key; set model.arch: "
                                          "llama, or remove it (GPT-2 has as many key/value heads as heads)");
    }
    if (m.ffn != 0 && m.ffn != 4 * m.d_model) {
      reader.ErrorOnKey("model.ffn", "model.ffn is a Llama key: GPT-2's MLP is 4*d_model=" + std::to_string(4 * m.d_model) +
                                     " wide; set model.arch: llama, or remove it");
    }
    const ModelSpec defaults;
    if (m.rope_scaling != defaults.rope_scaling) {
      reader.ErrorOnKey("model.rope_scaling", "model.rope_scaling is a Llama key (GPT-2 has learned positions); set "
                                              "model.arch: llama, or remove it");
    }
    if (m.rope_theta != defaults.rope_theta || m.norm_eps != defaults.norm_eps) {
      reader.ErrorOnKey(m.rope_theta != defaults.rope_theta ? "model.rope_theta" : "model.norm_eps",
                        "model.rope_theta and model.norm_eps are Llama keys (GPT-2 has learned positions and "
                        "LayerNorms of epsilon 1e-5); set model.arch: llama, or remove them");
    }
    if (!m.tie_embeddings) {
      reader.ErrorOnKey("model.tie_embeddings", "GPT-2's head is always its token embedding; model.tie_embeddings: "
                                                "false needs model.arch: llama");
    }
    if (m.max_positions != 0) {
      reader.ErrorOnKey("model.max_positions", "GPT-2's context is model.seq_len (its learned positions); "
                                               "model.max_positions is a key of the Llama-block families: remove it");
    }
    if (m.head_dim != 0 && m.head_dim * m.heads != m.d_model) {
      reader.ErrorOnKey("model.head_dim", "GPT-2's heads are d_model/heads wide; model.head_dim is a key of the "
                                          "Llama-block families (llama, mistral, qwen2, qwen3): remove it");
    }
    return;
  }
  const int kv = KvHeads(m);
  if (kv > m.heads || m.heads % kv != 0) {
    reader.ErrorOnKey("model.kv_heads", "model.kv_heads=" + std::to_string(kv) + " must divide model.heads=" +
                                        std::to_string(m.heads) + " (each key/value head serves heads/kv_heads query heads)");
  }
  if (m.max_positions != 0 && m.seq_len > m.max_positions) {
    reader.ErrorOnKey("model.seq_len", "model.seq_len=" + std::to_string(m.seq_len) + " is longer than model.max_positions=" +
                                           std::to_string(m.max_positions) +
                                           ", the longest context the model is made for; lower model.seq_len");
  }
  if (HeadDim(m) % 2 != 0) {
    reader.ErrorOnKey(m.head_dim > 0 ? "model.head_dim" : "model.heads",
                      "rotary embeddings rotate pairs: the head width " +
                          std::string(m.head_dim > 0 ? "model.head_dim=" : "d_model/heads=") +
                          std::to_string(HeadDim(m)) + " must be even");
  }
  if (m.rope_scaling == RopeScaling::kLlama3 && m.rope_high_freq_factor <= m.rope_low_freq_factor) {
    std::ostringstream text;
    text << "model.rope_high_freq_factor=" << m.rope_high_freq_factor << " must be larger than "
         << "model.rope_low_freq_factor=" << m.rope_low_freq_factor << " (llama3 scaling blends between them)";
    reader.ErrorOnKey("model.rope_high_freq_factor", text.str());
  }
  if (m.init == ModelInit::kPytorch) {
    reader.ErrorOnKey("model.init", "model.init: pytorch builds gpt_model.GPT's parameters; a Llama draws each "
                                    "parameter on its own (per_parameter, or auto)");
  }
}

// model.moe's rules: a Llama block, experts enough for top_k, at least one MoE block, each
// balance's coefficient only under that balance.
void CheckMoeKeys(const ModelSpec& m, RecipeReader& reader) {
  const MoeSpec& moe = m.moe;
  if (reader.Refused({"model.moe.", "model.arch", "model.layers"})) return;
  if (moe.experts == 0) {
    Recipe defaults;
    VisitRecipeKeys(defaults, [&](const RecipeKey& key, auto&) {
      if (key.section == "model.moe" && key.name != "experts" && reader.Value(key.section, key.name).IsDefined()) {
        reader.ErrorOnKey(key.path(), key.path() + " is a key of a mixture of experts: set model.moe.experts "
                                      "(the routed experts of each MoE block), or remove it");
      }
    });
    return;
  }
  if (!FamilyOf(m.arch).llama_block) {
    reader.ErrorOnKey("model.moe.experts", "model.moe needs a Llama-block family (llama, mistral, qwen2, qwen3); "
                                           "GPT-2's blocks are dense: set model.arch, or remove model.moe");
    return;
  }
  if (moe.experts == 1) {
    reader.ErrorOnKey("model.moe.experts", "model.moe.experts=1 sends every token to one expert, a dense MLP: use "
                                           "model.ffn, or at least 2 experts");
    return;
  }
  if (moe.top_k > moe.experts) {
    reader.ErrorOnKey("model.moe.top_k", "model.moe.top_k=" + std::to_string(moe.top_k) + " is more than "
                                         "model.moe.experts=" + std::to_string(moe.experts) +
                                         ": each token goes to top_k different experts");
  }
  for (int layer : moe.dense_layers) {
    if (layer >= m.layers) {
      reader.ErrorOnKey("model.moe.dense_layers", "model.moe.dense_layers names block " + std::to_string(layer) +
                                                  " of a model of " + std::to_string(m.layers) +
                                                  " (model.layers); blocks count from 0");
      return;
    }
  }
  bool any = false;
  for (int layer = 0; layer < m.layers && !any; ++layer) any = IsMoeLayer(m, layer);
  if (!any) {
    reader.ErrorOnKey("model.moe.experts", "model.moe makes no block an MoE block (model.layers=" +
                                           std::to_string(m.layers) + ", first_dense=" +
                                           std::to_string(moe.first_dense) + ", every=" + std::to_string(moe.every) +
                                           ", dense_layers): lower first_dense or every, or list fewer dense layers");
  }
  const auto given = [&](const char* name) { return reader.Value("model.moe", name).IsDefined(); };
  if (moe.balance != MoeBalance::kAuxLoss && given("aux_loss_coef")) {
    reader.ErrorOnKey("model.moe.aux_loss_coef", "model.moe.aux_loss_coef weighs the loss of balance: aux_loss, and "
                                                 "this recipe's balance is " + NameOf(moe.balance) +
                                                 ": remove it, or set model.moe.balance: aux_loss");
  }
  if (moe.balance != MoeBalance::kBias && given("bias_update")) {
    reader.ErrorOnKey("model.moe.bias_update", "model.moe.bias_update moves the bias of balance: bias, and this "
                                               "recipe's balance is " + NameOf(moe.balance) +
                                               ": remove it, or set model.moe.balance: bias");
  }
}

bool IsTrainerSection(std::string_view section) {
  section = section.substr(0, section.find('.'));
  return std::find(std::begin(kTrainerSections), std::end(kTrainerSections), section) != std::end(kTrainerSections);
}

// A recipe that runs the user's program: ltrain's trainer's sections and layout keys do not apply.
void CheckProgramRecipe(const Recipe& r, RecipeReader& reader) {
  for (std::string_view section : kTrainerSections) {
    if (!reader.HasSection(section)) continue;
    reader.ErrorOnKey(std::string(section), std::string(section) + " describes ltrain's own trainer, and this recipe runs "
                                            "entrypoint.command instead: remove " + std::string(section) +
                                            " (or entrypoint, to train with ltrain)");
  }
  if (r.entrypoint.command.front().empty()) {
    reader.ErrorOnKey("entrypoint.command", "entrypoint.command starts with an empty program name");
  }
  if (std::string why;
      r.entrypoint.warm_standby == WarmStandby::kGpu && !ParsePythonCommand(r.entrypoint.command, why)) {
    reader.ErrorOnKey("entrypoint.warm_standby", "entrypoint.warm_standby: gpu runs a Python script in an interpreter "
                                                 "started ahead, and " + why + ": run python3 SCRIPT.py ARGS or "
                                                 "python3 -m MODULE ARGS, or remove warm_standby");
  }
  const ParallelSpec defaults;
  if (r.parallel.tp != defaults.tp || r.parallel.pp != defaults.pp || r.parallel.zero != defaults.zero) {
    const char* key = r.parallel.tp != defaults.tp ? "parallel.tp" : r.parallel.pp != defaults.pp ? "parallel.pp" : "parallel.zero";
    reader.ErrorOnKey(key, std::string(key) + " lays out ltrain's own trainer; your program (entrypoint.command) "
                                             "decides its own parallelism from WORLD_SIZE: remove it");
  }
}

// The rules between keys that are not layout rules (those are CheckLayout's).
// A rule that reads a key whose own value was refused waits until that key is mended (it would
// judge the default in its place).
void CheckAcrossKeys(const Recipe& r, RecipeReader& reader) {
  if (std::string problem = JobNameProblem(r.name); !problem.empty() && !reader.Refused({"name"})) {
    reader.ErrorOnKey("name", problem + "; for example name: " + SuggestJobName(r.name));
  }
  // Whether the recipe runs a program or ltrain's trainer is not known.
  if (reader.Refused({"entrypoint.command"})) return;
  if (r.runs_program()) return CheckProgramRecipe(r, reader);
  if (r.entrypoint.output_timeout_s > 0) {
    reader.ErrorOnKey("entrypoint.output_timeout_s", "entrypoint.output_timeout_s watches your program "
                                                     "(entrypoint.command); ltrain's trainer reports its progress: "
                                                     "use fault.hang_timeout_s");
  }
  if (r.entrypoint.warm_standby != WarmStandby::kAuto) {
    reader.ErrorOnKey("entrypoint.warm_standby", "entrypoint.warm_standby keeps interpreters ready for your program "
                                                 "(entrypoint.command); ltrain's trainer restarts without one: remove it");
  }
  if (r.data.path.empty() && r.data.sources.empty() && !reader.Refused({"data.path", "data.sources"})) {
    reader.ErrorOnKey("data.path", "data.path is required: the directory written by `ltrain data prepare --output DIR` "
                                   "(or data.sources, a mixture of several)");
  }
  if (!r.data.path.empty() && !r.data.sources.empty()) {
    reader.ErrorOnKey("data.sources", "data.sources and data.path both name the data: keep data.sources (a mixture) "
                                      "or data.path (one dataset)");
  }
  if (r.data.sources.size() > 1 && r.data.sampling == Sampling::kTorch && !reader.Refused({"data.sampling"})) {
    reader.ErrorOnKey("data.sampling", "data.sampling: torch replays one PyTorch loop over one dataset; a mixture "
                                       "(data.sources) draws by epochs or hash: set data.sampling: epochs");
  }
  if (r.parallel.precision == Precision::kFp8 && r.parallel.device != Device::kCuda &&
      !reader.Refused({"parallel.precision", "parallel.device"})) {
    reader.ErrorOnKey("parallel.precision", "parallel.precision: fp8 needs parallel.device: cuda, on a GPU of compute "
                                            "capability 8.9 or newer (Hopper, Ada); on CPU use auto or fp32");
  }
  if (!r.parallel.fp8_bf16_layers.empty() && r.parallel.precision != Precision::kFp8 &&
      !reader.Refused({"parallel.precision", "parallel.fp8_bf16_layers"})) {
    reader.ErrorOnKey("parallel.fp8_bf16_layers", "parallel.fp8_bf16_layers names blocks kept in bf16 under "
                                                  "parallel.precision: fp8; this recipe's precision is " +
                                                      NameOf(r.parallel.precision) + ": remove the key or set fp8");
  }
  if (r.parallel.fp8_scaling != Fp8ScalingKind::kTensorwise && r.parallel.precision != Precision::kFp8 &&
      !reader.Refused({"parallel.precision", "parallel.fp8_scaling"})) {
    reader.ErrorOnKey("parallel.fp8_scaling", "parallel.fp8_scaling chooses the scaling of parallel.precision: fp8; "
                                              "this recipe's precision is " + NameOf(r.parallel.precision) +
                                                  ": remove the key or set fp8");
  }
  if (r.training.min_lr > r.training.lr && !reader.Refused({"training.lr", "training.min_lr"})) {
    reader.ErrorOnKey("training.min_lr", "training.min_lr must not exceed training.lr");
  }
  if (reader.Refused({"model."})) return;  // every rule below reads the model
  if (r.model.d_model % r.model.heads != 0 && (r.model.arch == Arch::kGpt2 || r.model.head_dim == 0)) {
    reader.ErrorOnKey("model.heads", "model.heads=" + std::to_string(r.model.heads) + " does not divide model.d_model=" +
                                         std::to_string(r.model.d_model) +
                                         "; choose heads so that d_model/heads is a whole number");
  }
  CheckArchKeys(r.model, reader);
  CheckMoeKeys(r.model, reader);
  for (const int layer : r.parallel.fp8_bf16_layers) {
    if (layer >= r.model.layers && !reader.Refused({"parallel.fp8_bf16_layers"})) {
      reader.ErrorOnKey("parallel.fp8_bf16_layers", "parallel.fp8_bf16_layers names block " + std::to_string(layer) +
                                                        " of a model of " + std::to_string(r.model.layers) +
                                                        " (model.layers); blocks count from 0");
      break;
    }
  }
  if (r.data.tokenizer == Tokenizer::kByte && r.model.vocab < 256 && !reader.Refused({"data.tokenizer"})) {
    reader.ErrorOnKey("model.vocab", "model.vocab=" + std::to_string(r.model.vocab) +
                                         " is smaller than the byte tokenizer's 256 symbols; set model.vocab: 256");
  }
  if (reader.Refused({"parallel.", "training.micro_batch", "training.global_batch"})) return;
  for (const LayoutProblem& problem : CheckLayout(r, r.parallel.world_size())) reader.ErrorOnKey(problem.key, problem.message);
}

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

// Writes one field as a YAML value, by its type.
template <typename Field>
void EmitValue(YAML::Emitter& out, const Field& field) {
  using T = std::remove_cvref_t<Field>;
  if constexpr (IsNodesField<T>::value) {
    if (field.min == field.max) {
      out << field.nodes;
    } else {
      out << YAML::Flow << YAML::BeginMap << YAML::Key << "min" << YAML::Value << field.min << YAML::Key << "max"
          << YAML::Value << field.max << YAML::EndMap;
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    out << Shortest{field};
  } else if constexpr (std::is_enum_v<T>) {
    out << NameOf(field);
  } else if constexpr (std::is_same_v<T, std::vector<int>> || std::is_same_v<T, std::vector<std::string>> ||
                       std::is_same_v<T, std::map<std::string, std::string>>) {
    out << YAML::Flow << field;
  } else if constexpr (std::is_same_v<T, std::vector<DataSource>>) {
    out << YAML::Flow << YAML::BeginSeq;
    for (const DataSource& source : field) {
      out << YAML::BeginMap << YAML::Key << "path" << YAML::Value << source.path << YAML::Key << "weight"
          << YAML::Value << Shortest{source.weight} << YAML::EndMap;
    }
    out << YAML::EndSeq;
  } else {
    out << field;
  }
}

template <typename Field>
std::string ValueText(const Field& field) {
  YAML::Emitter out;
  EmitValue(out, field);
  return out.c_str();
}

// The text of every key's default, by path.
const std::map<std::string, std::string>& DefaultTexts() {
  static const auto* texts = new std::map<std::string, std::string>(RecipeKeyValues(Recipe{}));
  return *texts;
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

// Data-parallel defaults that depend on where the job runs, for the keys the recipe leaves out. On
// GPUs: ZeRO-1 whenever there is data parallelism (its sharded update halves the optimizer's
// memory traffic, for the same bytes on the wire as an all-reduce), and on one node 400 MB buckets
// (about 13 collectives a step for gpt-1.3b instead of 120; across nodes PyTorch DDP's 25 MB, so
// that a slow network does not expose one large last bucket). docs/performance.md has the runs.
void ApplyTopologyDefaults(const YAML::Node& root, Recipe& r) {
  if (r.parallel.device != Device::kCuda) return;
  const YAML::Node parallel = root["parallel"];
  const bool has_zero = parallel.IsMap() && parallel["zero"].IsDefined();
  const bool has_bucket = parallel.IsMap() && parallel["bucket_mb"].IsDefined();
  if (!has_zero && r.parallel.dp() > 1) r.parallel.zero = 1;
  if (!has_bucket && r.parallel.nodes_max == 1) r.parallel.bucket_mb = 400;
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
    std::string sections = "name";
    for (std::string_view section : kRecipeSections) sections += ", " + std::string(section);
    result.errors.push_back(RecipeError{source_name, root.Mark().line + 1, root.Mark().column + 1,
                                        "a recipe is a mapping with keys " + sections});
    return result;
  }

  std::set<std::string> overridden;
  std::vector<RecipeError> override_errors;
  for (const auto& entry : overrides) {
    size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) {
      override_errors.push_back(RecipeError{"--set " + entry, 0, 0, "an override is KEY=VALUE, e.g. training.steps=200"});
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
      override_errors.push_back(RecipeError{"--set " + key, 0, 0, "value is not valid YAML: " + e.msg});
      continue;
    }
    if (parts.empty() || std::any_of(parts.begin(), parts.end(), [](const auto& p) { return p.empty(); })) {
      override_errors.push_back(RecipeError{"--set " + key, 0, 0, "empty key segment in '" + key + "'"});
      continue;
    }
    ApplyOverride(root, parts, 0, value);
    overridden.insert(key);
  }

  // Unknown keys and sections that are not mappings first, then each key's own problems, then the
  // rules between keys.
  RecipeReader reader(source_name, overridden, root);
  Recipe& r = result.recipe;
  r.name = SuggestJobName(std::filesystem::path(source_name).stem().string());
  reader.CheckStructure();
  VisitRecipeKeys(r, [&](const RecipeKey& key, auto&& field) {
    reader.Read(key, field);
    if (reader.Value(key.section, key.name).IsDefined()) result.given.insert(key.path());
  });
  ApplyTopologyDefaults(root, r);
  CheckAcrossKeys(r, reader);
  result.errors = reader.TakeErrors();
  result.errors.insert(result.errors.begin(), override_errors.begin(), override_errors.end());
  // In the order of the file (--set overrides, at line 0, first), as compilers list them.
  std::stable_sort(result.errors.begin(), result.errors.end(), [](const RecipeError& a, const RecipeError& b) {
    return a.file == b.file ? std::tie(a.line, a.column) < std::tie(b.line, b.column) : a.file < b.file;
  });
  if (reader.dropped() > 0) {
    result.errors.push_back(RecipeError{source_name, 0, 0,
                                        "... and " + std::to_string(reader.dropped()) + " more error(s) not shown (the " +
                                            "first " + std::to_string(kMaxRecipeErrors) + " are)"});
  }
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
  RecipeParseResult result = ParseRecipe(buffer.str(), path, overrides);
  if (!result.ok() || result.recipe.model.init_from.empty()) return result;
  return WithHfModelConfig(std::move(result), path);
}

std::string RecipeToYaml(const Recipe& r) {
  const std::map<std::string, std::string>& defaults = DefaultTexts();
  YAML::Emitter out;
  out << YAML::BeginMap;
  // The sections open now, outermost first ("model", "moe"); a nested section's keys follow its
  // parent's in the schema.
  std::vector<std::string> open;
  VisitRecipeKeys(r, [&](const RecipeKey& key, const auto& field) {
    if (key.omit_at_default && ValueText(field) == defaults.at(key.path())) return;
    if (r.runs_program() && IsTrainerSection(key.section)) return;
    if (key.path() == "data.path" && r.data.path.empty() && !r.data.sources.empty()) return;  // a mixture
    std::vector<std::string> want;
    for (size_t start = 0; start < key.section.size();) {
      const size_t dot = std::min(key.section.find('.', start), key.section.size());
      want.emplace_back(key.section.substr(start, dot - start));
      start = dot + 1;
    }
    size_t same = 0;
    while (same < open.size() && same < want.size() && open[same] == want[same]) ++same;
    for (; open.size() > same; open.pop_back()) out << YAML::EndMap;
    for (; open.size() < want.size(); open.push_back(want[open.size()])) {
      out << YAML::Key << want[open.size()] << YAML::Value << YAML::BeginMap;
    }
    out << YAML::Key << std::string(key.name) << YAML::Value;
    EmitValue(out, field);
  });
  for (; !open.empty(); open.pop_back()) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::map<std::string, std::string> RecipeKeyValues(const Recipe& recipe) {
  std::map<std::string, std::string> values;
  VisitRecipeKeys(recipe, [&](const RecipeKey& key, const auto& field) { values[key.path()] = ValueText(field); });
  return values;
}

namespace {

// `base` seconds plus one per 50 MB of checkpoint state: a disk a tenth as fast as a local NVMe
// still moves the state in that time.
PhaseTimeout AutoTimeout(const Recipe& recipe, const char* key, double set, double base) {
  char text[160];
  if (set > 0) {
    std::snprintf(text, sizeof(text), "%s=%g", key, set);
    return PhaseTimeout{set, text};
  }
  const double bytes = static_cast<double>(ApproxCheckpointBytes(recipe.model));
  const double seconds = std::max(recipe.fault.hang_timeout_s, base + bytes / 50e6);
  std::snprintf(text, sizeof(text), "%s auto: %.0f s + 1 s per 50 MB of %.1f GB of state", key, base, bytes / 1e9);
  return PhaseTimeout{seconds, text};
}

}  // namespace

PhaseTimeout CheckpointTimeout(const Recipe& recipe) {
  return AutoTimeout(recipe, "checkpoint.timeout_s", recipe.checkpoint.timeout_s, 60);
}

PhaseTimeout StartupTimeout(const Recipe& recipe) {
  return AutoTimeout(recipe, "fault.startup_timeout_s", recipe.fault.startup_timeout_s, 120);
}

PhaseTimeout StepTimeout(const Recipe& recipe, int64_t steps_seen, double slowest_step_ms) {
  char text[224];
  if (recipe.fault.hang_timeout_s > 0) {
    std::snprintf(text, sizeof(text), "fault.hang_timeout_s=%g", recipe.fault.hang_timeout_s);
    return PhaseTimeout{recipe.fault.hang_timeout_s, text};
  }
  if (steps_seen < kStartupSteps) {
    const PhaseTimeout startup = StartupTimeout(recipe);
    std::snprintf(text, sizeof(text), "fault.hang_timeout_s auto: %.0f s, the start-up limit until %d steps are done",
                  startup.seconds, kStartupSteps);
    return PhaseTimeout{startup.seconds, text};
  }
  const double seconds = std::clamp(kStepLimitMultiple * slowest_step_ms / 1000.0, kStepLimitFloorS, kStepLimitCeilingS);
  std::snprintf(text, sizeof(text),
                "fault.hang_timeout_s auto: %.1f s, %g x the slowest of the last %lld steps (%.2f s) within %g-%g s",
                seconds, kStepLimitMultiple,
                static_cast<long long>(std::min<int64_t>(steps_seen, kDerivedWindowSteps)),
                slowest_step_ms / 1000.0, kStepLimitFloorS, kStepLimitCeilingS);
  return PhaseTimeout{seconds, text};
}

PhaseTimeout CollectiveTimeout(const Recipe& recipe, int64_t steps_seen, double slowest_step_ms) {
  char text[160];
  if (recipe.fault.collective_timeout_s > 0) {
    std::snprintf(text, sizeof(text), "fault.collective_timeout_s=%g", recipe.fault.collective_timeout_s);
    return PhaseTimeout{recipe.fault.collective_timeout_s, text};
  }
  const double step = StepTimeout(recipe, steps_seen, slowest_step_ms).seconds;
  const double startup = StartupTimeout(recipe).seconds, checkpoint = CheckpointTimeout(recipe).seconds;
  const double longest = std::max({step, startup, checkpoint});
  std::snprintf(text, sizeof(text), "fault.collective_timeout_s auto: %.0f s, twice the %s's limit", 2 * longest,
                longest == step ? "training step" : longest == startup ? "start-up" : "checkpoint");
  return PhaseTimeout{2 * longest, text};
}

int64_t DataSeed(const Recipe& recipe) { return recipe.data.seed >= 0 ? recipe.data.seed : recipe.training.seed; }

std::vector<DataSource> DataSources(const Recipe& recipe) {
  if (!recipe.data.sources.empty()) return recipe.data.sources;
  return {DataSource{.path = recipe.data.path, .weight = 1}};
}

std::vector<RecipeKeyDoc> DescribeRecipeKeys() {
  std::vector<RecipeKeyDoc> docs;
  const Recipe defaults;
  VisitRecipeKeys(defaults, [&](const RecipeKey& key, const auto& field) {
    using T = std::remove_cvref_t<decltype(field)>;
    RecipeKeyDoc doc;
    doc.path = key.path();
    doc.help = std::string(key.help);
    doc.default_text = key.default_text.empty() ? ValueText(field) : std::string(key.default_text);
    auto int_range = [&] {
      if (key.int_max == std::numeric_limits<int32_t>::max() || key.int_max == std::numeric_limits<int64_t>::max()) {
        return "integer >= " + std::to_string(key.int_min);
      }
      return "integer " + std::to_string(key.int_min) + " to " + std::to_string(key.int_max);
    };
    if constexpr (IsNodesField<T>::value) {
      doc.type = int_range() + ", or {min, max}";
    } else if constexpr (std::is_same_v<T, bool>) {
      doc.type = "true or false";
    } else if constexpr (std::is_integral_v<T>) {
      doc.type = int_range();
    } else if constexpr (std::is_floating_point_v<T>) {
      std::ostringstream range;
      range << "number " << key.real_min << " to " << key.real_max;
      doc.type = range.str();
    } else if constexpr (std::is_same_v<T, std::string>) {
      doc.type = "text";
    } else if constexpr (std::is_enum_v<T>) {
      doc.type = "one of " + EnumNameList<T>();
    } else if constexpr (std::is_same_v<T, std::vector<int>>) {
      doc.type = "list of integers >= " + std::to_string(key.int_min);
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      doc.type = "list of text";
    } else if constexpr (std::is_same_v<T, std::map<std::string, std::string>>) {
      doc.type = "mapping of names to text";
    } else if constexpr (std::is_same_v<T, std::vector<DataSource>>) {
      doc.type = "list of {path, weight}";
    }
    if (!key.type_text.empty()) doc.type = std::string(key.type_text);
    docs.push_back(std::move(doc));
  });
  return docs;
}

std::string RecipeKeysMarkdown() {
  std::string out = "| key | type | default | meaning |\n| --- | --- | --- | --- |\n";
  for (const RecipeKeyDoc& doc : DescribeRecipeKeys()) {
    out += "| `" + doc.path + "` | " + doc.type + " | `" + doc.default_text + "` | " + doc.help + " |\n";
  }
  return out;
}

std::string RecipeKeysText() {
  std::vector<RecipeKeyDoc> docs = DescribeRecipeKeys();
  size_t path_width = 0, type_width = 0, default_width = 0;
  for (const RecipeKeyDoc& doc : docs) {
    path_width = std::max(path_width, doc.path.size());
    type_width = std::max(type_width, doc.type.size());
    default_width = std::max(default_width, doc.default_text.size());
  }
  auto pad = [](std::string text, size_t width) { return text + std::string(width - text.size() + 2, ' '); };
  std::string out = pad("KEY", path_width) + pad("TYPE", type_width) + pad("DEFAULT", default_width) + "MEANING\n";
  for (const RecipeKeyDoc& doc : docs) {
    out += pad(doc.path, path_width) + pad(doc.type, type_width) + pad(doc.default_text, default_width) + doc.help + "\n";
  }
  return out;
}

std::string JobNameProblem(std::string_view name) {
  constexpr size_t kMaxLength = 64;
  const std::string shown = "\"" + TerminalSafe(Shortened(name)) + "\"";
  if (name.empty()) return "name must not be empty";
  if (name.size() > kMaxLength) {
    return "name " + shown + " has " + std::to_string(name.size()) + " characters, more than " +
           std::to_string(kMaxLength) + " (it becomes the job id and a directory name)";
  }
  if (name == "." || name == "..") return "name " + shown + " is not a usable directory name";
  if (!std::all_of(name.begin(), name.end(), IsJobNameChar)) {
    return "name " + shown + " may hold only A-Z a-z 0-9 . _ - (it becomes the job id and a directory name)";
  }
  // A job id that begins with '-' reads as a flag to every command (`ltrain status -rf-1`).
  if (name.front() == '-' || name.front() == '.') {
    return "name " + shown + " must begin with a letter, digit or '_' (a job id that begins with '" +
           std::string(1, name.front()) + "' reads as a flag or a hidden folder)";
  }
  return "";
}

std::string SuggestJobName(std::string_view name) {
  std::string out;
  for (char c : name) {
    const char kept = IsJobNameChar(c) ? c : '-';
    if (kept == '-' && !out.empty() && out.back() == '-') continue;
    out += kept;
  }
  while (!out.empty() && (out.front() == '-' || out.front() == '.')) out.erase(out.begin());
  while (!out.empty() && out.back() == '-') out.pop_back();
  if (out.size() > 64) out.resize(64);
  if (out.empty() || out == "." || out == "..") return "job";
  return out;
}

}  // namespace ltrain
