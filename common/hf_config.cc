#include "common/hf_config.h"

#include <cmath>
#include <filesystem>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "common/files.h"
#include "common/model_family.h"
#include "common/recipe_schema.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// Every key ReadLlama and ReadGpt2 read, and those that change nothing ltrain computes: ids of
// special tokens, the dtype the weights were saved in, inference switches, bookkeeping.
const std::set<std::string> kKnownKeys = {
    "architectures",      "model_type",   "torch_dtype",       "dtype",           "transformers_version",
    "bos_token_id",       "eos_token_id", "pad_token_id",      "use_cache",       "initializer_range",
    "_name_or_path",      "tie_word_embeddings", "output_attentions", "output_hidden_states", "return_dict",
    "max_position_embeddings", "n_ctx",   "num_key_value_heads", "head_dim",       "rope_theta",
    "rope_scaling",       "rms_norm_eps", "hidden_size",       "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "vocab_size",  "hidden_act",        "attention_bias",  "mlp_bias",
    "pretraining_tp",     "attention_dropout", "sliding_window", "use_sliding_window", "max_window_layers",
    "n_layer",            "n_embd",       "n_head",            "n_positions",     "n_inner",
    "activation_function", "layer_norm_epsilon", "resid_pdrop", "embd_pdrop",     "attn_pdrop",
    "scale_attn_weights", "summary_type", "summary_use_proj",  "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx", "task_specific_params",
    "layer_types",        "id2label",     "label2id",          "rope_parameters",
    // Qwen3-MoE's and Mixtral's (ReadMoe)
    "num_experts",        "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
    "mlp_only_layers",    "norm_topk_prob", "router_aux_loss_coef", "output_router_logits", "router_jitter_noise"};

// A number of the configuration: InvalidArgument naming the key where it is missing (and required)
// or not a number.
class ConfigReader {
 public:
  ConfigReader(const Json& j, std::string path) : j_(j), path_(std::move(path)) {}

  bool Has(const std::string& key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  StatusOr<int64_t> Int(const std::string& key) const {
    if (!Has(key)) return InvalidArgument(path_ + ": " + key + " is missing; a model's configuration needs it");
    const Json& v = j_.at(key);
    if (!v.is_number_integer()) return InvalidArgument(path_ + ": " + key + " is " + v.dump() + ", not an integer");
    return v.get<int64_t>();
  }
  StatusOr<double> Number(const std::string& key, double fallback) const {
    if (!Has(key)) return fallback;
    const Json& v = j_.at(key);
    if (!v.is_number()) return InvalidArgument(path_ + ": " + key + " is " + v.dump() + ", not a number");
    return v.get<double>();
  }
  StatusOr<bool> Bool(const std::string& key, bool fallback) const {
    if (!Has(key)) return fallback;
    const Json& v = j_.at(key);
    if (!v.is_boolean()) return InvalidArgument(path_ + ": " + key + " is " + v.dump() + ", not true or false");
    return v.get<bool>();
  }
  std::string Text(const std::string& key) const {
    return Has(key) && j_.at(key).is_string() ? j_.at(key).get<std::string>() : "";
  }
  Status Refuse(const std::string& key, const std::string& why) const {
    return InvalidArgument(path_ + ": " + key + (why.starts_with('=') ? "" : " ") + why);
  }

 private:
  const Json& j_;
  std::string path_;
};

// The fewest significant digits (up to 17) that read back as `v`: 0.1, not 0.10000000000000001.
std::string Shortest(double v) {
  for (int digits = 1;; ++digits) {
    std::ostringstream out;
    out.precision(digits);
    out << v;
    if (digits == 17 || std::stod(out.str()) == v) return out.str();
  }
}

// transformers' rotary settings: rope_theta and rope_scaling (up to transformers 4), or both inside
// rope_parameters (transformers 5 saves them so).
Status ReadRope(const Json& j, const ConfigReader& config, ModelSpec* m) {
  LTRAIN_ASSIGN_OR_RETURN(m->rope_theta, config.Number("rope_theta", 10000.0));
  const bool v5 = j.contains("rope_parameters") && !j.at("rope_parameters").is_null();
  const std::string where = v5 ? "rope_parameters" : "rope_scaling";
  if (v5 && j.contains("rope_scaling") && !j.at("rope_scaling").is_null()) {
    return config.Refuse("rope_scaling", "is given beside rope_parameters: keep one of them");
  }
  if (!j.contains(where) || j.at(where).is_null()) return Status::Ok();
  const Json& s = j.at(where);
  if (!s.is_object()) return config.Refuse(where, "is " + s.dump() + ", not an object or null");
  const std::string type = s.contains("rope_type") ? s.value("rope_type", "") : s.value("type", "default");
  std::set<std::string> known = {"rope_type", "type"};
  auto number = [&](const std::string& key, double* out, bool required) -> Status {
    known.insert(key);
    if (!s.contains(key) || s.at(key).is_null()) {
      if (required) return config.Refuse(where + "." + key, "is missing; rope_type " + type + " needs it");
      return Status::Ok();
    }
    if (!s.at(key).is_number()) return config.Refuse(where + "." + key, "is " + s.at(key).dump() + ", not a number");
    *out = s.at(key).get<double>();
    return Status::Ok();
  };
  if (v5) {
    LTRAIN_RETURN_IF_ERROR(number("rope_theta", &m->rope_theta, false));
    double partial = 1;
    LTRAIN_RETURN_IF_ERROR(number("partial_rotary_factor", &partial, false));
    if (partial != 1) {
      return config.Refuse(where + ".partial_rotary_factor", "=" + Shortest(partial) +
                                                                 " is not supported: ltrain rotates every pair of a head");
    }
  }
  if (type == "default") {
    // transformers' plain RoPE.
  } else if (type == "linear") {
    m->rope_scaling = RopeScaling::kLinear;
    LTRAIN_RETURN_IF_ERROR(number("factor", &m->rope_factor, true));
  } else if (type == "llama3") {
    m->rope_scaling = RopeScaling::kLlama3;
    double original = 0;
    LTRAIN_RETURN_IF_ERROR(number("factor", &m->rope_factor, true));
    LTRAIN_RETURN_IF_ERROR(number("low_freq_factor", &m->rope_low_freq_factor, true));
    LTRAIN_RETURN_IF_ERROR(number("high_freq_factor", &m->rope_high_freq_factor, true));
    LTRAIN_RETURN_IF_ERROR(number("original_max_position_embeddings", &original, true));
    m->rope_original_positions = static_cast<int>(original);
  } else {
    return config.Refuse(where + ".rope_type",
                         "'" + type + "' is not supported: ltrain applies linear and llama3 scaling (a run with " +
                             "another would rotate every position otherwise than the model was trained with)");
  }
  for (const auto& [key, value] : s.items()) {
    if (known.count(key) == 0) {
      return config.Refuse(where + "." + key, "is not a key ltrain knows of rope_type " + type +
                                                  ": it would change the rotary angles, so it is refused");
    }
  }
  return Status::Ok();
}

// Llama and the families of its block (Mistral, Qwen2, Qwen3).
StatusOr<HfModelConfig> ReadLlamaBlock(const Json& j, const ConfigReader& c, const ModelFamily& family,
                                       HfModelConfig out, int seq_len) {
  ModelSpec& m = out.model;
  m.arch = family.arch;
  LTRAIN_ASSIGN_OR_RETURN(int64_t layers, c.Int("num_hidden_layers"));
  LTRAIN_ASSIGN_OR_RETURN(int64_t hidden, c.Int("hidden_size"));
  LTRAIN_ASSIGN_OR_RETURN(int64_t heads, c.Int("num_attention_heads"));
  LTRAIN_ASSIGN_OR_RETURN(int64_t ffn, c.Int("intermediate_size"));
  LTRAIN_ASSIGN_OR_RETURN(int64_t vocab, c.Int("vocab_size"));
  int64_t kv = heads;
  if (c.Has("num_key_value_heads")) {
    LTRAIN_ASSIGN_OR_RETURN(kv, c.Int("num_key_value_heads"));
  }
  int64_t head_dim = 0;
  if (c.Has("head_dim")) {
    LTRAIN_ASSIGN_OR_RETURN(head_dim, c.Int("head_dim"));
    if (head_dim <= 0 || head_dim % 2 != 0) {
      return c.Refuse("head_dim", "=" + std::to_string(head_dim) + " must be even: rotary embeddings rotate pairs");
    }
  } else if (heads <= 0 || hidden % heads != 0) {
    return c.Refuse("num_attention_heads", "=" + std::to_string(heads) + " does not divide hidden_size=" +
                                               std::to_string(hidden) + " and head_dim is not given");
  }
  m.layers = static_cast<int>(layers);
  m.d_model = static_cast<int>(hidden);
  m.heads = static_cast<int>(heads);
  m.kv_heads = static_cast<int>(kv);
  m.ffn = static_cast<int>(ffn);
  m.vocab = static_cast<int>(vocab);
  // Heads of d_model/heads are the default (a recipe need not say so).
  m.head_dim = heads > 0 && hidden % heads == 0 && head_dim == hidden / heads ? 0 : static_cast<int>(head_dim);
  // transformers' defaults (LlamaConfig's, MistralConfig's, Qwen2Config's, Qwen3Config's agree), where
  // the file leaves a key out.
  LTRAIN_ASSIGN_OR_RETURN(m.norm_eps, c.Number("rms_norm_eps", 1e-6));
  LTRAIN_ASSIGN_OR_RETURN(m.tie_embeddings, c.Bool("tie_word_embeddings", false));
  LTRAIN_RETURN_IF_ERROR(ReadRope(j, c, &m));
  out.keys = {"model.arch", "model.layers", "model.d_model", "model.heads", "model.kv_heads", "model.head_dim",
              "model.max_positions", "model.ffn",
              "model.vocab", "model.rope_theta", "model.norm_eps", "model.tie_embeddings", "model.rope_scaling",
              "model.rope_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
              "model.rope_original_positions"};

  if (const std::string act = c.Text("hidden_act"); c.Has("hidden_act") && act != "silu") {
    return c.Refuse("hidden_act", "'" + act + "' is not supported: ltrain's Llama MLP is SwiGLU (silu)");
  }
  // Qwen2's q, k and v biases are its family's own; a Llama's or Qwen3's attention_bias adds them to
  // the output projection too, which no family here has.
  LTRAIN_ASSIGN_OR_RETURN(bool attention_bias, c.Bool("attention_bias", false));
  if (attention_bias) {
    return c.Refuse("attention_bias", "true is not supported: ltrain's " + std::string(family.hf_architecture) +
                                          " has no attention biases");
  }
  LTRAIN_ASSIGN_OR_RETURN(bool mlp_bias, c.Bool("mlp_bias", false));
  if (mlp_bias) return c.Refuse("mlp_bias", "true is not supported: ltrain's MLPs of this family have no biases");
  LTRAIN_ASSIGN_OR_RETURN(double tp, c.Number("pretraining_tp", 1));
  if (tp != 1) {
    return c.Refuse("pretraining_tp", "=" + Shortest(tp) + " is not supported (it splits the products into slices "
                                      "that sum otherwise); save the model again with pretraining_tp 1");
  }
  if (c.Has("max_position_embeddings")) {
    LTRAIN_ASSIGN_OR_RETURN(int64_t max_positions, c.Int("max_position_embeddings"));
    m.max_positions = static_cast<int>(max_positions);
    if (seq_len > max_positions) {
      return c.Refuse("max_position_embeddings",
                      "=" + std::to_string(max_positions) + " is smaller than model.seq_len=" + std::to_string(seq_len) +
                          ": the model was not made for positions that far; lower model.seq_len");
    }
  }
  // Sliding-window attention: Mistral's (and, to be safe, a Llama's) whenever sliding_window is set;
  // Qwen's where use_sliding_window is on (for the layers from max_window_layers), or where
  // layer_types names sliding_attention.
  bool sliding = family.arch == Arch::kMistral || family.arch == Arch::kLlama;
  if (!sliding) {
    LTRAIN_ASSIGN_OR_RETURN(sliding, c.Bool("use_sliding_window", false));
  }
  if (j.contains("layer_types") && j.at("layer_types").is_array()) {
    for (const Json& type : j.at("layer_types")) {
      const std::string t = type.is_string() ? type.get<std::string>() : type.dump();
      if (t == "sliding_attention") {
        sliding = true;
      } else if (t != "full_attention") {
        return c.Refuse("layer_types", "names '" + t + "': ltrain's layers are full_attention (or sliding_attention "
                                                       "whose window covers model.seq_len)");
      }
    }
  }
  if (c.Has("sliding_window") && sliding) {
    LTRAIN_ASSIGN_OR_RETURN(int64_t window, c.Int("sliding_window"));
    if (window < seq_len) {
      return c.Refuse("sliding_window", "=" + std::to_string(window) + " is smaller than model.seq_len=" +
                                            std::to_string(seq_len) +
                                            ": sliding-window attention is not implemented; train with model.seq_len "
                                            "at most " + std::to_string(window) +
                                            " (where the window covers every position, attention is the same)");
    }
  }
  LTRAIN_ASSIGN_OR_RETURN(double dropout, c.Number("attention_dropout", 0));
  if (dropout != 0) {
    out.notes.push_back(out.path + ": attention_dropout=" + Shortest(dropout) +
                        " is not applied: ltrain trains without dropout");
  }
  return out;
}

// A mixture of experts of the Llama block (Qwen3-MoE, Mixtral): model.moe from its keys, after
// ReadLlamaBlock has read the rest (Mixtral's intermediate_size is its experts' width; Qwen3-MoE's is
// its dense blocks').
StatusOr<HfModelConfig> ReadMoe(const Json& j, const ConfigReader& c, const MoeArchitecture& a, HfModelConfig out) {
  ModelSpec& m = out.model;
  MoeSpec& moe = m.moe;
  const bool qwen = a.arch == Arch::kQwen3;
  // transformers 5 writes Qwen3-MoE's count as num_local_experts too (4.x: num_experts).
  const char* count_key = qwen && c.Has("num_experts") ? "num_experts" : "num_local_experts";
  LTRAIN_ASSIGN_OR_RETURN(int64_t experts, c.Int(count_key));
  LTRAIN_ASSIGN_OR_RETURN(int64_t top_k, c.Int("num_experts_per_tok"));
  if (experts < 2 || top_k < 1 || top_k > experts) {
    return c.Refuse("num_experts_per_tok", "=" + std::to_string(top_k) + " of " + std::to_string(experts) +
                                               " experts: ltrain routes each token to 1 to all of at least 2 experts");
  }
  moe.experts = static_cast<int>(experts);
  moe.top_k = static_cast<int>(top_k);
  // transformers' defaults where the file leaves a key out.
  LTRAIN_ASSIGN_OR_RETURN(moe.aux_loss_coef, c.Number("router_aux_loss_coef", 0.001));
  if (qwen) {
    LTRAIN_ASSIGN_OR_RETURN(int64_t width, c.Int("moe_intermediate_size"));
    moe.ffn = static_cast<int>(width);
    int64_t step = 1;
    if (c.Has("decoder_sparse_step")) {
      LTRAIN_ASSIGN_OR_RETURN(step, c.Int("decoder_sparse_step"));
    }
    if (step < 1) return c.Refuse("decoder_sparse_step", "=" + std::to_string(step) + " must be at least 1");
    moe.every = static_cast<int>(step);
    if (c.Has("mlp_only_layers")) {
      const Json& dense = j.at("mlp_only_layers");
      if (!dense.is_array()) return c.Refuse("mlp_only_layers", "is " + dense.dump() + ", not a list of layers");
      for (const Json& layer : dense) {
        if (!layer.is_number_integer() || layer.get<int64_t>() < 0 || layer.get<int64_t>() >= m.layers) {
          return c.Refuse("mlp_only_layers", "names " + layer.dump() + ", not a layer of the " +
                                                 std::to_string(m.layers));
        }
        moe.dense_layers.push_back(layer.get<int>());
      }
    }
    LTRAIN_ASSIGN_OR_RETURN(moe.norm_topk, c.Bool("norm_topk_prob", false));
  } else {
    // Every block a mixture; the gates always divided by their sum.
    moe.ffn = m.ffn;
    moe.norm_topk = true;
    LTRAIN_ASSIGN_OR_RETURN(double jitter, c.Number("router_jitter_noise", 0));
    if (jitter != 0) {
      return c.Refuse("router_jitter_noise", "=" + Shortest(jitter) + " is not supported: ltrain routes without "
                                             "noise (transformers adds it in training only); set it to 0");
    }
  }
  out.notes.push_back(out.path + ": router_aux_loss_coef=" + Shortest(moe.aux_loss_coef) +
                      " weighs ltrain's sequence-wise balance loss (DeepSeek-V3's, 1 at an even load), where "
                      "transformers' load_balancing_loss_func pools the batch: the same aim, other values");
  for (const char* key : {"model.moe.experts", "model.moe.top_k", "model.moe.ffn", "model.moe.every",
                          "model.moe.dense_layers", "model.moe.norm_topk", "model.moe.aux_loss_coef"}) {
    out.keys.push_back(key);
  }
  return out;
}

StatusOr<HfModelConfig> ReadGpt2(const ConfigReader& c, HfModelConfig out) {
  ModelSpec& m = out.model;
  m.arch = Arch::kGpt2;
  LTRAIN_ASSIGN_OR_RETURN(int64_t layers, c.Int("n_layer"));
  LTRAIN_ASSIGN_OR_RETURN(int64_t hidden, c.Int("n_embd"));
  LTRAIN_ASSIGN_OR_RETURN(int64_t heads, c.Int("n_head"));
  LTRAIN_ASSIGN_OR_RETURN(int64_t vocab, c.Int("vocab_size"));
  LTRAIN_ASSIGN_OR_RETURN(int64_t positions, c.Int("n_positions"));
  m.layers = static_cast<int>(layers);
  m.d_model = static_cast<int>(hidden);
  m.heads = static_cast<int>(heads);
  m.vocab = static_cast<int>(vocab);
  // GPT-2's learned positions: the table is n_positions long, and ltrain's is model.seq_len long.
  m.seq_len = static_cast<int>(positions);
  out.keys = {"model.arch", "model.layers", "model.d_model", "model.heads", "model.vocab", "model.seq_len"};
  if (c.Has("n_inner")) {
    LTRAIN_ASSIGN_OR_RETURN(int64_t inner, c.Int("n_inner"));
    if (inner != 4 * hidden) {
      return c.Refuse("n_inner", "=" + std::to_string(inner) + " is not supported: ltrain's GPT-2 MLP is 4*n_embd=" +
                                     std::to_string(4 * hidden) + " wide");
    }
  }
  if (const std::string act = c.Text("activation_function"); c.Has("activation_function") && act != "gelu_new") {
    return c.Refuse("activation_function", "'" + act + "' is not supported: ltrain's GPT-2 uses gelu_new (GELU's tanh "
                                                       "approximation)");
  }
  LTRAIN_ASSIGN_OR_RETURN(double eps, c.Number("layer_norm_epsilon", 1e-5));
  if (eps != 1e-5) return c.Refuse("layer_norm_epsilon", "=" + Shortest(eps) + " is not supported: ltrain's is 1e-5");
  LTRAIN_ASSIGN_OR_RETURN(bool tied, c.Bool("tie_word_embeddings", true));
  if (!tied) return c.Refuse("tie_word_embeddings", "false is not supported: GPT-2's head is its token embedding");
  LTRAIN_ASSIGN_OR_RETURN(bool scaled, c.Bool("scale_attn_weights", true));
  if (!scaled) return c.Refuse("scale_attn_weights", "false is not supported: ltrain scales attention by 1/sqrt(d)");
  for (const char* key : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"}) {
    LTRAIN_ASSIGN_OR_RETURN(bool on, c.Bool(key, false));
    if (on) return c.Refuse(key, "true is not supported");
  }
  std::vector<std::string> dropouts;
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) {
    LTRAIN_ASSIGN_OR_RETURN(double p, c.Number(key, 0));
    if (p != 0) dropouts.push_back(std::string(key) + "=" + Shortest(p));
  }
  if (!dropouts.empty()) {
    std::string list;
    for (const std::string& d : dropouts) list += (list.empty() ? "" : ", ") + d;
    out.notes.push_back(out.path + ": " + list + " not applied: ltrain trains without dropout");
  }
  return out;
}

}  // namespace

StatusOr<HfModelConfig> ReadHfModelConfig(const std::string& dir, int seq_len) {
  std::error_code ec;
  const fs::path path = fs::path(dir) / "config.json";
  if (!fs::is_directory(dir, ec) || !fs::exists(path, ec)) return NotFound(path.string() + " does not exist");
  LTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileText(path.string()));
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    return InvalidArgument(path.string() + " is not JSON: " + e.what());
  }
  if (!j.is_object()) return InvalidArgument(path.string() + " is not a JSON object");
  HfModelConfig out;
  out.path = path.string();
  const ConfigReader c(j, out.path);
  if (!j.contains("architectures") || !j.at("architectures").is_array() || j.at("architectures").size() != 1 ||
      !j.at("architectures")[0].is_string()) {
    return c.Refuse("architectures", "must name one architecture, e.g. [\"LlamaForCausalLM\"]");
  }
  out.architecture = j.at("architectures")[0].get<std::string>();
  const MoeArchitecture* moe = MoeArchitectureOfHf(out.architecture);
  const ModelFamily* family = moe != nullptr ? &FamilyOf(moe->arch) : FamilyOfHfArchitecture(out.architecture);
  if (family == nullptr) {
    return c.Refuse("architectures", "names " + out.architecture + ", which ltrain does not build; it builds " +
                                         HfArchitectureList());
  }
  StatusOr<HfModelConfig> read = family->llama_block ? ReadLlamaBlock(j, c, *family, out, seq_len) : ReadGpt2(c, out);
  if (read.ok() && moe != nullptr) read = ReadMoe(j, c, *moe, std::move(*read));
  if (!read.ok()) return read.status();
  std::string unknown;
  for (const auto& [key, value] : j.items()) {
    if (kKnownKeys.count(key) == 0) unknown += (unknown.empty() ? "" : ", ") + key;
  }
  if (!unknown.empty()) {
    read->notes.push_back(out.path + ": keys ltrain does not know, not read: " + unknown);
  }
  return read;
}

RecipeParseResult WithHfModelConfig(RecipeParseResult parsed, const std::string& source) {
  const std::string& dir = parsed.recipe.model.init_from;
  StatusOr<HfModelConfig> config = ReadHfModelConfig(dir, parsed.recipe.model.seq_len);
  if (!config.ok()) {
    if (config.status().code() == StatusCode::kNotFound) return parsed;
    parsed.errors.push_back(RecipeError{source, 0, 0, "model.init_from: " + config.status().message()});
    return parsed;
  }
  Recipe derived = parsed.recipe;
  derived.model = config->model;
  derived.model.init_from = parsed.recipe.model.init_from;
  if (config->model.arch != Arch::kGpt2) derived.model.seq_len = parsed.recipe.model.seq_len;
  const std::map<std::string, std::string> want = RecipeKeyValues(derived), have = RecipeKeyValues(parsed.recipe);
  YAML::Node root = YAML::Load(RecipeToYaml(parsed.recipe));
  std::vector<RecipeError> contradictions;
  for (const std::string& key : config->keys) {
    if (parsed.given.count(key)) {
      if (have.at(key) != want.at(key)) {
        contradictions.push_back(RecipeError{
            source, 0, 0,
            key + "=" + have.at(key) + " but " + config->path + " gives " + want.at(key) + " (model.init_from): " +
                "remove " + key + " from the recipe, the configuration sets it"});
      }
      continue;
    }
    // model.KEY, or model.SECTION.KEY (model.moe's).
    const std::string rest = key.substr(key.find('.') + 1);
    const size_t dot = rest.find('.');
    if (dot == std::string::npos) {
      root["model"][rest] = YAML::Load(want.at(key));
    } else {
      root["model"][rest.substr(0, dot)][rest.substr(dot + 1)] = YAML::Load(want.at(key));
    }
  }
  if (!contradictions.empty()) {
    parsed.errors = contradictions;
    return parsed;
  }
  YAML::Emitter out;
  out << root;
  RecipeParseResult result = ParseRecipe(out.c_str(), source + " (its model from " + config->path + ")");
  result.given = parsed.given;
  result.notes = parsed.notes;
  result.notes.insert(result.notes.end(), config->notes.begin(), config->notes.end());
  return result;
}

}  // namespace ltrain
