#include "common/model_family.h"

#include <algorithm>
#include <array>
#include <cmath>
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
  int64_t hf_experts = 0;  // ModelParameter's
};

// Block `layer`'s (its MLP or its experts).
std::vector<BlockParam> LlamaBlockParams(const ModelSpec& m, int layer) {
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
  if (!IsMoeLayer(m, layer)) {
    out.push_back({"w1.weight", "mlp.gate_proj.weight", {ffn, d}});
    out.push_back({"w3.weight", "mlp.up_proj.weight", {ffn, d}});
    out.push_back({"w2.weight", "mlp.down_proj.weight", {d, ffn}});
    return out;
  }
  // A mixture of experts: the router, each routed expert's SwiGLU stacked along a first dimension of
  // `experts` (transformers keeps one tensor an expert: {e} in its name), the shared experts' SwiGLU.
  // Qwen3-MoE's names for the Qwen families, Mixtral's for the Llama and Mistral ones; the shared
  // experts' as DeepSeek-V3 names them (neither has any).
  const int64_t experts = m.moe.experts, fe = MoeFfnWidth(m), fs = int64_t{m.moe.shared_experts} * fe;
  const bool qwen = m.arch == Arch::kQwen2 || m.arch == Arch::kQwen3;
  if (qwen) {
    out.push_back({"router.weight", "mlp.gate.weight", {experts, d}});
    out.push_back({"experts.w1.weight", "mlp.experts.{e}.gate_proj.weight", {experts, fe, d}, experts});
    out.push_back({"experts.w3.weight", "mlp.experts.{e}.up_proj.weight", {experts, fe, d}, experts});
    out.push_back({"experts.w2.weight", "mlp.experts.{e}.down_proj.weight", {experts, d, fe}, experts});
  } else {
    out.push_back({"router.weight", "block_sparse_moe.gate.weight", {experts, d}});
    out.push_back({"experts.w1.weight", "block_sparse_moe.experts.{e}.w1.weight", {experts, fe, d}, experts});
    out.push_back({"experts.w3.weight", "block_sparse_moe.experts.{e}.w3.weight", {experts, fe, d}, experts});
    out.push_back({"experts.w2.weight", "block_sparse_moe.experts.{e}.w2.weight", {experts, d, fe}, experts});
  }
  if (fs > 0) {
    out.push_back({"shared.w1.weight", "mlp.shared_experts.gate_proj.weight", {fs, d}});
    out.push_back({"shared.w3.weight", "mlp.shared_experts.up_proj.weight", {fs, d}});
    out.push_back({"shared.w2.weight", "mlp.shared_experts.down_proj.weight", {d, fs}});
  }
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

constexpr std::array<MoeArchitecture, 2> kMoeArchitectures = {{
    {"Qwen3MoeForCausalLM", "qwen3_moe", Arch::kQwen3},
    {"MixtralForCausalLM", "mixtral", Arch::kMistral},
}};

const MoeArchitecture* MoeArchitectureOfHf(std::string_view architecture) {
  for (const MoeArchitecture& a : kMoeArchitectures) {
    if (a.hf_architecture == architecture) return &a;
  }
  return nullptr;
}

const MoeArchitecture* MoeArchitectureOf(Arch arch) {
  if (arch == Arch::kQwen3) return &kMoeArchitectures[0];
  if (arch == Arch::kLlama || arch == Arch::kMistral) return &kMoeArchitectures[1];
  return nullptr;
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
  for (const MoeArchitecture& a : kMoeArchitectures) out += ", " + std::string(a.hf_architecture);
  return out;
}

std::vector<ModelParameter> ModelParameters(const ModelSpec& m) {
  std::vector<ModelParameter> out;
  const int64_t d = m.d_model;
  if (FamilyOf(m.arch).llama_block) {
    out.push_back({"tok_embeddings.weight", {m.vocab, d}, "model.embed_tokens.weight"});
    for (int l = 0; l < m.layers; ++l) {
      const std::string ours = "layers." + std::to_string(l) + ".", hf = "model.layers." + std::to_string(l) + ".";
      for (const BlockParam& p : LlamaBlockParams(m, l)) {
        out.push_back({ours + p.ours, p.shape, hf + p.hf, false, p.hf_experts});
      }
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

std::vector<std::string> BlockParameterNames(const ModelSpec& m, int layer) {
  std::vector<std::string> out;
  for (const BlockParam& p : FamilyOf(m.arch).llama_block ? LlamaBlockParams(m, layer) : GptBlockParams(m)) {
    out.emplace_back(p.ours);
  }
  return out;
}

std::string HfExpertName(const std::string& hf_name, int64_t expert) {
  const size_t at = hf_name.find("{e}");
  if (at == std::string::npos) throw std::logic_error("HfExpertName: " + hf_name + " is not a stack of experts");
  return hf_name.substr(0, at) + std::to_string(expert) + hf_name.substr(at + 3);
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

// The model arithmetic recipe.h declares (the recipe reader and the plan use it).

int KvHeads(const ModelSpec& m) { return m.kv_heads > 0 ? m.kv_heads : m.heads; }

int HeadDim(const ModelSpec& m) { return m.head_dim > 0 ? m.head_dim : m.d_model / m.heads; }

int FfnWidth(const ModelSpec& m) {
  if (m.arch == Arch::kGpt2) return 4 * m.d_model;
  if (m.ffn > 0) return m.ffn;
  const int64_t width = (8 * int64_t{m.d_model} + 2) / 3;
  return static_cast<int>((width + 63) / 64 * 64);
}

bool IsMoeLayer(const ModelSpec& m, int layer) {
  const MoeSpec& moe = m.moe;
  if (moe.experts == 0 || layer < moe.first_dense || layer >= m.layers) return false;
  if (std::find(moe.dense_layers.begin(), moe.dense_layers.end(), layer) != moe.dense_layers.end()) return false;
  return (layer - moe.first_dense + 1) % moe.every == 0;
}

int MoeFfnWidth(const ModelSpec& m) { return m.moe.ffn > 0 ? m.moe.ffn : FfnWidth(m); }

std::string ModelShapeDifferences(const ModelSpec& saved, const ModelSpec& current) {
  std::string differences;
  auto compare = [&](const char* key, const std::string& a, const std::string& b) {
    if (a == b) return;
    differences += (differences.empty() ? "" : ", ") + std::string("model.") + key + " " + a + " (this recipe: " + b + ")";
  };
  auto number = [](int64_t v) { return std::to_string(v); };
  compare("arch", std::string(NameOf(saved.arch)), std::string(NameOf(current.arch)));
  compare("layers", number(saved.layers), number(current.layers));
  compare("d_model", number(saved.d_model), number(current.d_model));
  compare("heads", number(saved.heads), number(current.heads));
  // Unset, these two follow heads and d_model, whose difference is then said once.
  if (saved.kv_heads > 0 || current.kv_heads > 0) compare("kv_heads", number(KvHeads(saved)), number(KvHeads(current)));
  if (saved.head_dim > 0 || current.head_dim > 0) compare("head_dim", number(HeadDim(saved)), number(HeadDim(current)));
  if (saved.d_model == current.d_model || saved.ffn > 0 || current.ffn > 0) {
    compare("ffn", number(FfnWidth(saved)), number(FfnWidth(current)));
  }
  compare("vocab", number(saved.vocab), number(current.vocab));
  compare("tie_embeddings", saved.tie_embeddings ? "true" : "false", current.tie_embeddings ? "true" : "false");
  if (saved.arch == Arch::kGpt2 && current.arch == Arch::kGpt2) {
    compare("seq_len", number(saved.seq_len), number(current.seq_len));
  }
  compare("moe.experts", number(saved.moe.experts), number(current.moe.experts));
  if (saved.moe.experts > 0 && current.moe.experts > 0) {
    compare("moe.ffn", number(MoeFfnWidth(saved)), number(MoeFfnWidth(current)));
    compare("moe.shared_experts", number(saved.moe.shared_experts), number(current.moe.shared_experts));
    // Which blocks are MoE blocks: the pattern's keys, said as the blocks it gives.
    auto pattern = [](const ModelSpec& m) {
      std::string blocks;
      for (int l = 0; l < m.layers; ++l) {
        if (IsMoeLayer(m, l)) blocks += (blocks.empty() ? "" : ",") + std::to_string(l);
      }
      return "[" + blocks + "]";
    };
    if (saved.layers == current.layers) compare("moe blocks", pattern(saved), pattern(current));
  }
  return differences;
}

int64_t MlpParameters(const ModelSpec& m, int layer, bool active) {
  const int64_t d = m.d_model;
  if (!IsMoeLayer(m, layer)) return 3 * int64_t{FfnWidth(m)} * d;
  // The router, the routed experts (all, or the top_k a token runs through), the shared experts.
  const int64_t routed = active ? m.moe.top_k : m.moe.experts;
  return m.moe.experts * d + 3 * (routed + m.moe.shared_experts) * int64_t{MoeFfnWidth(m)} * d;
}

int64_t ActiveParameterCount(const ModelSpec& m) {
  int64_t inactive = 0;
  for (int l = 0; l < m.layers; ++l) inactive += MlpParameters(m, l, false) - MlpParameters(m, l, true);
  return ApproxParameterCount(m) - inactive;
}

int64_t ApproxParameterCount(const ModelSpec& m) {
  const int64_t d = m.d_model;
  const int64_t f = FfnWidth(m);
  if (m.arch != Arch::kGpt2) {
    const int64_t hd = HeadDim(m), q = hd * m.heads, kv = hd * KvHeads(m);
    // Per block: two RMSNorms, wq and wo (q x d), wk and wv (kv x d), w1, w3 and w2 (f x d); qwen2's
    // q, k and v biases, qwen3's per-head norms of q and k.
    int64_t block = 2 * d + 2 * q * d + 2 * kv * d;
    if (m.arch == Arch::kQwen2) block += q + 2 * kv;
    if (m.arch == Arch::kQwen3) block += 2 * hd;
    int64_t mlps = 0;
    for (int l = 0; l < m.layers; ++l) mlps += MlpParameters(m, l, /*active=*/false);
    return m.vocab * d * (m.tie_embeddings ? 1 : 2) + m.layers * block + mlps + d;
  }
  // Per block: two layer norms (4d), attention (qkv 3d^2+3d, projection d^2+d), MLP (2fd+f+d).
  const int64_t block = 4 * d + 4 * d * d + 4 * d + 2 * f * d + f + d;
  return (m.vocab + m.seq_len) * d + m.layers * block + 2 * d;
}

int64_t ApproxCheckpointBytes(const ModelSpec& model) { return 12 * ApproxParameterCount(model); }

std::vector<float> RopeInverseFrequencies(const ModelSpec& m) {
  const int hd = HeadDim(m);
  std::vector<float> out;
  for (int i = 0; i < hd; i += 2) {
    // transformers: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), all in fp32.
    const float exponent = static_cast<float>(i) / static_cast<float>(hd);
    const float inv = 1.0f / std::pow(static_cast<float>(m.rope_theta), exponent);
    if (m.rope_scaling == RopeScaling::kLinear) {
      out.push_back(inv / static_cast<float>(m.rope_factor));
      continue;
    }
    if (m.rope_scaling != RopeScaling::kLlama3) {
      out.push_back(inv);
      continue;
    }
    // transformers' _compute_llama3_parameters, in fp32 as it computes them.
    const float factor = static_cast<float>(m.rope_factor);
    const float low = static_cast<float>(m.rope_low_freq_factor), high = static_cast<float>(m.rope_high_freq_factor);
    const float old_context = static_cast<float>(m.rope_original_positions);
    const float low_freq_wavelen = old_context / low, high_freq_wavelen = old_context / high;
    const float wavelen = 2.0f * static_cast<float>(M_PI) / inv;
    float scaled = wavelen > low_freq_wavelen ? inv / factor : inv;
    if (!(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen)) {
      const float smooth = (old_context / wavelen - low) / (high - low);
      scaled = (1 - smooth) * scaled / factor + smooth * scaled;
    }
    out.push_back(scaled);
  }
  return out;
}

}  // namespace ltrain
