// Hugging Face transformers' layout of our models: parameter names, GPT-2's transposed Conv1D
// weights, config.json. `ltrain export --format hf` writes it, `model.init_from` reads it (and our
// own names: llama_model.Llama's and gpt_model.GPT's state_dict saved as safetensors). No LibTorch.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain {

struct HfName {
  std::string ours;        // "layers.3.wq.weight"
  std::string hf;          // "model.layers.3.self_attn.q_proj.weight"
  bool transposed = false; // GPT-2's Conv1D stores [in, out]: ours transposed
  // Above 0: ours stacks this many experts' tensors along a first dimension, transformers keeps one
  // tensor an expert, `hf` with "{e}" for the expert's index (HfExpertName).
  int64_t experts = 0;
};

// Every parameter of the model, in our order, with its transformers name (ModelParameters': the
// family's own architecture). A tied head has no entry of its own.
std::vector<HfName> HfNames(const ModelSpec& model);

// Why transformers cannot build the model as ltrain trains it (a mixture of experts with a shared
// expert, a router bias, sigmoid scores, ...); empty when it can.
std::string HfExportProblem(const ModelSpec& model);

// config.json for the model (a mixture of experts as its family's: Qwen3-MoE, Mixtral); `bos`/`eos`
// are the tokenizer's ids, -1 for none.
std::string HfConfigJson(const ModelSpec& model, int64_t bos, int64_t eos);

// Safetensors files of a directory written by `ltrain export` or transformers' save_pretrained
// (model.safetensors, or the shards model.safetensors.index.json lists), or one .safetensors file:
// tensor name -> file.
StatusOr<std::map<std::string, std::string>> SafetensorsTensorFiles(const std::string& path);

// Whether the safetensors of `path` (as SafetensorsTensorFiles) hold exactly the model's parameters,
// by transformers' names or ours: every parameter there, of its shape, in F32, BF16 or F16, and no
// tensor the model would ignore (transformers' rotary buffers and a tied head's copy aside). Reads the
// headers only. InvalidArgument names each mismatch.
Status CheckHfTensors(const std::string& path, const ModelSpec& model);

}  // namespace ltrain
