#include "common/hf_format.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "common/files.h"
#include "common/model_family.h"
#include "common/safetensors.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

}  // namespace

std::vector<HfName> HfNames(const ModelSpec& m) {
  std::vector<HfName> out;
  for (const ModelParameter& p : ModelParameters(m)) {
    out.push_back(HfName{p.name, p.hf_name, p.hf_transposed, p.hf_experts});
  }
  return out;
}

std::string HfConfigJson(const ModelSpec& m, int64_t bos, int64_t eos) {
  Json j;
  auto id = [](int64_t v) { return v >= 0 ? Json(v) : Json(nullptr); };
  const ModelFamily& family = FamilyOf(m.arch);
  if (family.llama_block) {
    j["architectures"] = Json::array({std::string(family.hf_architecture)});
    j["model_type"] = std::string(family.hf_model_type);
    j["hidden_size"] = m.d_model;
    j["intermediate_size"] = FfnWidth(m);
    j["num_hidden_layers"] = m.layers;
    j["num_attention_heads"] = m.heads;
    j["num_key_value_heads"] = KvHeads(m);
    j["head_dim"] = HeadDim(m);
    j["vocab_size"] = m.vocab;
    j["max_position_embeddings"] = std::max(m.max_positions, m.seq_len);
    j["rms_norm_eps"] = m.norm_eps;
    j["rope_theta"] = m.rope_theta;
    if (m.rope_scaling == RopeScaling::kLinear) {
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", m.rope_factor}};
    } else if (m.rope_scaling == RopeScaling::kLlama3) {
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", m.rope_factor},
                           {"low_freq_factor", m.rope_low_freq_factor},
                           {"high_freq_factor", m.rope_high_freq_factor},
                           {"original_max_position_embeddings", m.rope_original_positions}};
    } else {
      j["rope_scaling"] = nullptr;
    }
    j["hidden_act"] = "silu";
    j["attention_dropout"] = 0.0;
    if (m.arch == Arch::kLlama || m.arch == Arch::kQwen3) j["attention_bias"] = false;
    if (m.arch == Arch::kLlama) j["mlp_bias"] = false;
    // Attention over the whole sequence: Mistral's window is the context, Qwen's is off.
    if (m.arch == Arch::kMistral) j["sliding_window"] = m.seq_len;
    if (m.arch == Arch::kQwen2 || m.arch == Arch::kQwen3) {
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
      j["max_window_layers"] = m.layers;
    }
    j["initializer_range"] = 0.02;
    j["tie_word_embeddings"] = m.tie_embeddings;
    j["bos_token_id"] = id(bos);
    j["eos_token_id"] = id(eos);
    if (const MoeArchitecture* moe = m.moe.experts > 0 ? MoeArchitectureOf(m.arch) : nullptr) {
      // A mixture of experts (HfExportProblem says which ones transformers builds).
      j["architectures"] = Json::array({std::string(moe->hf_architecture)});
      j["model_type"] = std::string(moe->hf_model_type);
      j["num_experts_per_tok"] = m.moe.top_k;
      j["router_aux_loss_coef"] = m.moe.aux_loss_coef;
      j["output_router_logits"] = false;
      if (moe->arch == Arch::kQwen3) {
        j["num_experts"] = m.moe.experts;
        j["moe_intermediate_size"] = MoeFfnWidth(m);
        j["norm_topk_prob"] = m.moe.norm_topk;
        j["decoder_sparse_step"] = m.moe.every;
        // The first dense blocks among the dense ones (first_dense a multiple of every: the same pattern).
        std::vector<int> dense;
        for (int l = 0; l < m.layers; ++l) {
          if (!IsMoeLayer(m, l) && (l + 1) % m.moe.every == 0) dense.push_back(l);
        }
        j["mlp_only_layers"] = dense;
      } else {
        j["num_local_experts"] = m.moe.experts;
        j["intermediate_size"] = MoeFfnWidth(m);
        j["router_jitter_noise"] = 0.0;
        j["sliding_window"] = nullptr;
        j.erase("mlp_bias");
        j.erase("attention_bias");
      }
    }
  } else {
    j["architectures"] = Json::array({"GPT2LMHeadModel"});
    j["model_type"] = "gpt2";
    j["n_embd"] = m.d_model;
    j["n_layer"] = m.layers;
    j["n_head"] = m.heads;
    j["n_positions"] = m.seq_len;
    j["n_ctx"] = m.seq_len;
    j["n_inner"] = nullptr;
    j["vocab_size"] = m.vocab;
    j["activation_function"] = "gelu_new";  // GELU's tanh approximation, as gpt_model.GPT
    j["layer_norm_epsilon"] = 1e-5;
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
    j["attn_pdrop"] = 0.0;
    j["scale_attn_weights"] = true;
    j["initializer_range"] = 0.02;
    j["tie_word_embeddings"] = true;
    j["bos_token_id"] = id(bos >= 0 ? bos : eos);
    j["eos_token_id"] = id(eos);
  }
  j["torch_dtype"] = "float32";
  j["use_cache"] = true;
  return j.dump(2) + "\n";
}

StatusOr<std::map<std::string, std::string>> SafetensorsTensorFiles(const std::string& path) {
  std::error_code ec;
  std::vector<std::string> files;
  if (fs::is_directory(path, ec)) {
    const fs::path index = fs::path(path) / "model.safetensors.index.json";
    const fs::path single = fs::path(path) / "model.safetensors";
    if (fs::exists(index, ec)) {
      LTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileText(index.string()));
      Json j;
      try {
        j = Json::parse(text);
        std::map<std::string, std::string> out;
        for (const auto& [name, file] : j.at("weight_map").items()) out[name] = (fs::path(path) / file.get<std::string>()).string();
        return out;
      } catch (const std::exception& e) {
        return InvalidArgument(index.string() + " cannot be read: " + e.what());
      }
    }
    if (!fs::exists(single, ec)) {
      return NotFound(path + " holds neither model.safetensors nor model.safetensors.index.json (a directory written "
                      "by `ltrain export` or transformers' save_pretrained)");
    }
    files.push_back(single.string());
  } else if (fs::exists(path, ec)) {
    files.push_back(path);
  } else {
    return NotFound(path + " does not exist");
  }
  std::map<std::string, std::string> out;
  for (const std::string& file : files) {
    LTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(file));
    for (const SafetensorsEntry& e : f->tensors()) out[e.name] = file;
  }
  return out;
}

std::string HfExportProblem(const ModelSpec& m) {
  const MoeSpec& moe = m.moe;
  if (moe.experts == 0) return "";
  const MoeArchitecture* target = MoeArchitectureOf(m.arch);
  if (target == nullptr) {
    return "transformers has no mixture of experts of " + std::string(NameOf(m.arch)) +
           "'s block (Qwen2-MoE gates its shared expert): train it as qwen3 (Qwen3-MoE) or llama (Mixtral)";
  }
  const std::string name(target->hf_architecture);
  if (moe.shared_experts > 0) return name + " has no shared experts (model.moe.shared_experts)";
  if (moe.score != MoeScore::kSoftmax) return name + " scores its router by softmax (model.moe.score is sigmoid)";
  if (moe.route_scale != 1) return name + " does not scale its gates (model.moe.route_scale)";
  if (moe.balance == MoeBalance::kBias) {
    return name + " has no router bias: the exported model would route otherwise; train with model.moe.balance: "
                  "aux_loss or none";
  }
  if (target->arch == Arch::kQwen3) {
    if (moe.first_dense % moe.every != 0) {
      return name + " makes block l sparse where (l + 1) is a multiple of decoder_sparse_step: model.moe.first_dense=" +
             std::to_string(moe.first_dense) + " must be a multiple of model.moe.every=" + std::to_string(moe.every);
    }
    return "";
  }
  for (int l = 0; l < m.layers; ++l) {
    if (!IsMoeLayer(m, l)) return name + " makes every block a mixture: block " + std::to_string(l) + " is dense";
  }
  if (!moe.norm_topk) return name + " always divides the gates by their sum (model.moe.norm_topk is false)";
  return "";
}

Status CheckHfTensors(const std::string& path, const ModelSpec& model) {
  LTRAIN_ASSIGN_OR_RETURN(auto tensor_files, SafetensorsTensorFiles(path));
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open;
  auto entry = [&](const std::string& name) -> StatusOr<const SafetensorsEntry*> {
    const std::string& file = tensor_files.at(name);
    if (!open.count(file)) {
      LTRAIN_ASSIGN_OR_RETURN(open[file], SafetensorsFile::Open(file));
    }
    return open[file]->Find(name);
  };
  // Each kind of mismatch apart, so that the first few of each are shown.
  std::vector<std::string> missing, shapes, dtypes, extra;
  std::set<std::string> used;
  for (const ModelParameter& p : ModelParameters(model)) {
    if (p.hf_experts > 0 && !tensor_files.count(p.name)) {
      // A stack of experts, one tensor an expert in transformers' names.
      const std::vector<int64_t> expert_shape(p.shape.begin() + 1, p.shape.end());
      for (int64_t e = 0; e < p.hf_experts; ++e) {
        const std::string name = HfExpertName(p.hf_name, e);
        if (!tensor_files.count(name)) {
          missing.push_back(name + " is missing");
          continue;
        }
        used.insert(name);
        LTRAIN_ASSIGN_OR_RETURN(const SafetensorsEntry* x, entry(name));
        if (x->shape != expert_shape) {
          shapes.push_back(name + " is " + ShapeText(x->shape) + ", the model needs " + ShapeText(expert_shape));
        }
        if (x->dtype != "F32" && x->dtype != "BF16" && x->dtype != "F16") {
          dtypes.push_back(name + " is " + x->dtype + " (F32, BF16 and F16 are read)");
        }
      }
      continue;
    }
    const bool hf = tensor_files.count(p.hf_name) > 0;
    if (!hf && !tensor_files.count(p.name)) {
      missing.push_back(p.hf_name + " is missing");
      continue;
    }
    const std::string& name = hf ? p.hf_name : p.name;
    used.insert(name);
    LTRAIN_ASSIGN_OR_RETURN(const SafetensorsEntry* e, entry(name));
    std::vector<int64_t> shape = e->shape;
    if (hf && p.hf_transposed && shape.size() == 2) std::swap(shape[0], shape[1]);
    if (shape != p.shape) {
      shapes.push_back(name + " is " + ShapeText(e->shape) + (hf && p.hf_transposed ? " (transposed)" : "") +
                         ", the model needs " + ShapeText(p.shape));
    }
    if (e->dtype != "F32" && e->dtype != "BF16" && e->dtype != "F16") {
      dtypes.push_back(name + " is " + e->dtype + " (F32, BF16 and F16 are read)");
    }
  }
  for (const auto& [name, file] : tensor_files) {
    // Buffers transformers derives (rotary frequencies, GPT-2's causal masks), and a tied head saved
    // beside its embedding.
    const bool derived = name.ends_with("rotary_emb.inv_freq") || name.ends_with(".attn.bias") ||
                         name.ends_with(".attn.masked_bias") || (model.tie_embeddings && name == "lm_head.weight");
    if (!used.count(name) && !derived) extra.push_back(name + " is not a parameter of the model (it would be ignored)");
  }
  const size_t problems = missing.size() + shapes.size() + dtypes.size() + extra.size();
  if (problems == 0) return Status::Ok();
  std::string text;
  for (const std::vector<std::string>* kind : {&missing, &shapes, &dtypes, &extra}) {
    const size_t shown = std::min<size_t>(kind->size(), 4);
    for (size_t i = 0; i < shown; ++i) text += "\n  " + (*kind)[i];
    if (kind->size() > shown) text += "\n  and " + std::to_string(kind->size() - shown) + " more like it";
  }
  return InvalidArgument("model.init_from: " + path + " does not hold the recipe's " + NameOf(model.arch) + " (" +
                         std::to_string(problems) + " mismatch" + (problems == 1 ? "" : "es") + "):" +
                         text + "\nset model.init_from to a directory with its config.json, or the model keys to the "
                         "saved model's");
}

}  // namespace ltrain
