// The model families ltrain builds, in one table: what each changes against the block it shares
// (biases, per-head norms), its Hugging Face architecture, and what follows from those: every
// parameter's name and shape in the worker's order and its transformers name. The worker's layouts
// and initialisation, `model.init_from` and `ltrain export` all read them here, so that a family is a
// row of the table and its numerics in the worker's block (worker/model/parallel_model.cc). No LibTorch.
//
//   gpt2     GPT2LMHeadModel: learned positions, LayerNorm, GELU MLP, biases everywhere, tied head.
//   llama    LlamaForCausalLM: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no
//            biases, tied or untied head. The families below are this block with one change each.
//   mistral  MistralForCausalLM: a Llama whose attention may slide; ltrain trains it where the
//            window covers the whole sequence (model.seq_len <= sliding_window), where it is a Llama.
//   qwen2    Qwen2ForCausalLM (Qwen2, Qwen2.5): biases on the q, k and v projections.
//   qwen3    Qwen3ForCausalLM: an RMSNorm over each head of q and of k before the rotation; heads may
//            be wider than d_model/heads (model.head_dim).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/recipe.h"

namespace ltrain {

struct ModelFamily {
  Arch arch = Arch::kLlama;
  std::string_view hf_architecture;  // config.json's architectures[0]
  std::string_view hf_model_type;    // config.json's model_type
  bool llama_block = true;           // every family but gpt2
  bool qkv_bias = false;             // q, k and v projections have biases
  bool qk_norm = false;              // RMSNorm over each head of q and k (weights of head_dim)
};

const ModelFamily& FamilyOf(Arch arch);

// transformers' mixtures of experts of the Llama block, and the family each is a mixture of:
// Qwen3MoeForCausalLM (qwen3_moe) of qwen3's block, MixtralForCausalLM (mixtral) of a windowless
// Mistral's (a Llama's). A model with model.moe is exported as its family's (a llama's and a mistral's
// as Mixtral); qwen2's has none (Qwen2-MoE gates its shared expert).
struct MoeArchitecture {
  std::string_view hf_architecture;
  std::string_view hf_model_type;
  Arch arch;
};
// Null where `architecture` is none of them.
const MoeArchitecture* MoeArchitectureOfHf(std::string_view architecture);
// The one `arch` is exported as; null for qwen2 and gpt2.
const MoeArchitecture* MoeArchitectureOf(Arch arch);
// The family transformers builds as `architecture` ("Qwen2ForCausalLM"); null where none is.
const ModelFamily* FamilyOfHfArchitecture(std::string_view architecture);
// "LlamaForCausalLM, MistralForCausalLM, ...": for errors.
std::string HfArchitectureList();

struct ModelParameter {
  std::string name;            // ours: "layers.3.wq.weight"
  std::vector<int64_t> shape;
  std::string hf_name;         // transformers': "model.layers.3.self_attn.q_proj.weight"
  bool hf_transposed = false;  // GPT-2's Conv1D stores [in, out]: ours transposed
  // Above 0: a mixture of experts' stacked tensor, ours [experts, ...], transformers' one tensor an
  // expert, hf_name's "{e}" standing for the expert's index.
  int64_t hf_experts = 0;
};

// Every parameter of the full model in the worker's order (the Python models' registration order
// for gpt2 and llama; a family's additions beside the projection or norm they belong to). A tied
// head has no entry of its own.
std::vector<ModelParameter> ModelParameters(const ModelSpec& model);
// The same as {name, shape} pairs.
std::vector<std::pair<std::string, std::vector<int64_t>>> ModelParameterShapes(const ModelSpec& model);
int64_t ModelParameterCount(const ModelSpec& model);
// The names of block `layer`'s parameters below "layers.N." (or "blocks.N."), in order: an MoE block
// (IsMoeLayer) has a router and experts where the others have an MLP.
std::vector<std::string> BlockParameterNames(const ModelSpec& model, int layer);
// transformers' name of expert `expert`'s tensor of a stacked parameter: its hf_name (hf_experts > 0)
// with "{e}" replaced by the index.
std::string HfExpertName(const std::string& hf_name, int64_t expert);
// The block of a parameter's name ("blocks.3.qkv.weight", "layers.3.wq.weight": 3); -1 for others.
int LayerOf(const std::string& name);

}  // namespace ltrain
