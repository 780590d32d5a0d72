#include "common/model_family.h"

#include <array>
#include <cstring>
#include <stdexcept>

namespace ltrain {
namespace {

constexpr std::array<ModelFamily, 5> kFamilies = {{
    {.arch = Arch::kGpt2, .hf_architecture = "GPT2LMHeadModel", .hf_model_type = "gpt2", .llama_block = false},
    {.arch = Arch::kLlama, .hf_architecture = "LlamaForCausalLM", .hf_model_type = "llama"},
    {.arch = Arch::kMistral, .hf_architecture = "MistralForCausalLM", .hf_model_type = "mistral"},
    {.arch = Arch::kQwen2, .hf_architecture = "Qwen2ForCausalLM", .hf_model_type = "qwen2", .qkv_bias = true},
    {.arch = Arch::kQwen3, .hf_architecture = "Qwen3ForCausalLM", .hf_model_type = "qwen3", .qk_norm = true},
}};

// One block parameter of a Llama-block family: ours, transformers', and its shape.
struct BlockParam {
  const char* ours;
  const char* hf;
  std::vector<int64_t> shape;
};

std::vector<BlockParam> LlamaBlockParams(const ModelSpec& m) {
  const ModelFamily& f = FamilyOf(m.arch);
  const int64_t d = m.d_model, ffn = FfnWidth(m), hd = HeadDim(m);
  const int64_t q = hd * m.heads, kv = hd * KvHeads(m);
  std::vector<BlockParam> out = {{"attn_norm.weight", "input_layernorm.weight", {d}},
                                 {"wq.weight", "self_attn.q_proj.weight", {q, d}}};
  if (f.qkv_bias) out.push_back({"wq.bias", "self_attn.q_proj.bias", {q}});
  out.push_back({"wk.weight", "self_attn.k_proj.weight", {kv, d}});
  if (f.qkv_bias) out.push_back({"wk.bias", "self_attn.k_proj.bias", {kv}});
  out.push_back({"wv.weight", "self_attn.v_proj.weight", {kv, d}});
  if (f.qkv_bias) out.push_back({"wv.bias", "self_attn.v_proj.bias", {kv}});
  if (f.qk_norm) {
    out.push_back({"q_norm.weight", "self_attn.q_norm.weight", {hd}});
    out.push_back({"k_norm.weight", "self_attn.k_norm.weight", {hd}});
  }
  out.push_back({"wo.weight", "self_attn.o_proj.weight", {d, q}});
  out.push_back({"ffn_norm.weight", "post_attention_layernorm.weight", {d}});
  out.push_back({"w1.weight", "mlp.gate_proj.weight", {ffn, d}});
  out.push_back({"w3.weight", "mlp.up_proj.weight", {ffn, d}});
  out.push_back({"w2.weight", "mlp.down_proj.weight", {d, ffn}});
  return out;
}

std::vector<BlockParam> GptBlockParams(const ModelSpec& m) {
  const int64_t d = m.d_model, f = FfnWidth(m);
  return {{"ln1.weight", "ln_1.weight", {d}},      {"ln1.bias", "ln_1.bias", {d}},
          {"qkv.weight", "attn.c_attn.weight", {3 * d, d}}, {"qkv.bias", "attn.c_attn.bias", {3 * d}},
          {"proj.weight", "attn.c_proj.weight", {d, d}},    {"proj.bias", "attn.c_proj.bias", {d}},
          {"ln2.weight", "ln_2.weight", {d}},      {"ln2.bias", "ln_2.bias", {d}},
          {"fc.weight", "mlp.c_fc.weight", {f, d}},        {"fc.bias", "mlp.c_fc.bias", {f}},
          {"fc2.weight", "mlp.c_proj.weight", {d, f}},     {"fc2.bias", "mlp.c_proj.bias", {d}}};
}

}  // namespace

const ModelFamily& FamilyOf(Arch arch) {
  for (const ModelFamily& f : kFamilies) {
    if (f.arch == arch) return f;
  }
  throw std::logic_error("FamilyOf: an architecture without a family");
}

const ModelFamily* FamilyOfHfArchitecture(std::string_view architecture) {
  for (const ModelFamily& f : kFamilies) {
    if (f.hf_architecture == architecture) return &f;
  }
  return nullptr;
}

std::string HfArchitectureList() {
  std::string out;
  for (const ModelFamily& f : kFamilies) out += (out.empty() ? "" : ", ") + std::string(f.hf_architecture);
  return out;
}

std::vector<ModelParameter> ModelParameters(const ModelSpec& m) {
  std::vector<ModelParameter> out;
  const int64_t d = m.d_model;
  if (FamilyOf(m.arch).llama_block) {
    out.push_back({"tok_embeddings.weight", {m.vocab, d}, "model.embed_tokens.weight"});
    const std::vector<BlockParam> block = LlamaBlockParams(m);
    for (int l = 0; l < m.layers; ++l) {
      const std::string ours = "layers." + std::to_string(l) + ".", hf = "model.layers." + std::to_string(l) + ".";
      for (const BlockParam& p : block) out.push_back({ours + p.ours, p.shape, hf + p.hf});
    }
    out.push_back({"norm.weight", {d}, "model.norm.weight"});
    if (!m.tie_embeddings) out.push_back({"output.weight", {m.vocab, d}, "lm_head.weight"});
    return out;
  }
  out.push_back({"wte.weight", {m.vocab, d}, "transformer.wte.weight"});
  out.push_back({"wpe.weight", {m.seq_len, d}, "transformer.wpe.weight"});
  const std::vector<BlockParam> block = GptBlockParams(m);
  for (int l = 0; l < m.layers; ++l) {
    const std::string ours = "blocks." + std::to_string(l) + ".", hf = "transformer.h." + std::to_string(l) + ".";
    for (const BlockParam& p : block) {
      // Conv1D's matrices are stored [in, out].
      out.push_back({ours + p.ours, p.shape, hf + p.hf, p.shape.size() == 2});
    }
  }
  out.push_back({"lnf.weight", {d}, "transformer.ln_f.weight"});
  out.push_back({"lnf.bias", {d}, "transformer.ln_f.bias"});
  return out;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ModelParameterShapes(const ModelSpec& m) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (ModelParameter& p : ModelParameters(m)) out.emplace_back(std::move(p.name), std::move(p.shape));
  return out;
}

int64_t ModelParameterCount(const ModelSpec& m) {
  int64_t n = 0;
  for (const ModelParameter& p : ModelParameters(m)) {
    int64_t size = 1;
    for (int64_t s : p.shape) size *= s;
    n += size;
  }
  return n;
}

std::vector<std::string> BlockParameterNames(const ModelSpec& m) {
  std::vector<std::string> out;
  for (const BlockParam& p : FamilyOf(m.arch).llama_block ? LlamaBlockParams(m) : GptBlockParams(m)) {
    out.emplace_back(p.ours);
  }
  return out;
}

int LayerOf(const std::string& name) {
  for (const char* prefix : {"blocks.", "layers."}) {
    if (name.rfind(prefix, 0) != 0) continue;
    const size_t start = std::strlen(prefix), dot = name.find('.', start);
    if (dot == std::string::npos || dot == start) return -1;
    int layer = 0;
    for (size_t k = start; k < dot; ++k) {
      if (name[k] < '0' || name[k] > '9') return -1;
      layer = layer * 10 + (name[k] - '0');
    }
    return layer;
  }
  return -1;
}

}  // namespace ltrain
