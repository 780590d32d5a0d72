#include "common/hf_format.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "common/files.h"
#include "common/safetensors.h"

namespace ltrain {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

}  // namespace

std::vector<HfName> HfNames(const ModelSpec& m) {
  std::vector<HfName> out;
  auto add = [&](const std::string& ours, const std::string& hf, bool transposed = false) {
    out.push_back(HfName{ours, hf, transposed});
  };
  if (m.arch == Arch::kLlama) {
    add("tok_embeddings.weight", "model.embed_tokens.weight");
    for (int l = 0; l < m.layers; ++l) {
      const std::string o = "layers." + std::to_string(l) + ".", h = "model.layers." + std::to_string(l) + ".";
      add(o + "attn_norm.weight", h + "input_layernorm.weight");
      add(o + "wq.weight", h + "self_attn.q_proj.weight");
      add(o + "wk.weight", h + "self_attn.k_proj.weight");
      add(o + "wv.weight", h + "self_attn.v_proj.weight");
      add(o + "wo.weight", h + "self_attn.o_proj.weight");
      add(o + "ffn_norm.weight", h + "post_attention_layernorm.weight");
      add(o + "w1.weight", h + "mlp.gate_proj.weight");
      add(o + "w3.weight", h + "mlp.up_proj.weight");
      add(o + "w2.weight", h + "mlp.down_proj.weight");
    }
    add("norm.weight", "model.norm.weight");
    if (!m.tie_embeddings) add("output.weight", "lm_head.weight");
    return out;
  }
  add("wte.weight", "transformer.wte.weight");
  add("wpe.weight", "transformer.wpe.weight");
  for (int l = 0; l < m.layers; ++l) {
    const std::string o = "blocks." + std::to_string(l) + ".", h = "transformer.h." + std::to_string(l) + ".";
    add(o + "ln1.weight", h + "ln_1.weight");
    add(o + "ln1.bias", h + "ln_1.bias");
    add(o + "qkv.weight", h + "attn.c_attn.weight", true);
    add(o + "qkv.bias", h + "attn.c_attn.bias");
    add(o + "proj.weight", h + "attn.c_proj.weight", true);
    add(o + "proj.bias", h + "attn.c_proj.bias");
    add(o + "ln2.weight", h + "ln_2.weight");
    add(o + "ln2.bias", h + "ln_2.bias");
    add(o + "fc.weight", h + "mlp.c_fc.weight", true);
    add(o + "fc.bias", h + "mlp.c_fc.bias");
    add(o + "fc2.weight", h + "mlp.c_proj.weight", true);
    add(o + "fc2.bias", h + "mlp.c_proj.bias");
  }
  add("lnf.weight", "transformer.ln_f.weight");
  add("lnf.bias", "transformer.ln_f.bias");
  return out;
}

std::string HfConfigJson(const ModelSpec& m, int64_t bos, int64_t eos) {
  Json j;
  auto id = [](int64_t v) { return v >= 0 ? Json(v) : Json(nullptr); };
  if (m.arch == Arch::kLlama) {
    j["architectures"] = Json::array({"LlamaForCausalLM"});
    j["model_type"] = "llama";
    j["hidden_size"] = m.d_model;
    j["intermediate_size"] = FfnWidth(m);
    j["num_hidden_layers"] = m.layers;
    j["num_attention_heads"] = m.heads;
    j["num_key_value_heads"] = KvHeads(m);
    j["head_dim"] = m.d_model / m.heads;
    j["vocab_size"] = m.vocab;
    j["max_position_embeddings"] = m.seq_len;
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
    j["attention_bias"] = false;
    j["attention_dropout"] = 0.0;
    j["mlp_bias"] = false;
    j["initializer_range"] = 0.02;
    j["tie_word_embeddings"] = m.tie_embeddings;
    j["bos_token_id"] = id(bos);
    j["eos_token_id"] = id(eos);
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

}  // namespace ltrain
