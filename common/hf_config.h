// A Hugging Face model directory's config.json, read into the recipe's model section: what
// `model.init_from: DIR` derives, so that a recipe needs no model keys beyond it. Every key of the
// configuration is either read (and what it says is supported), refused (it changes the numerics in
// a way ltrain does not implement: exit 2, naming it), noted (it changes training only: dropout,
// which ltrain does not apply), or known to change nothing here (token ids, dtype, cache); keys
// ltrain does not know are listed in a note. No LibTorch.
#pragma once

#include <string>
#include <vector>

#include "common/recipe.h"
#include "common/status.h"

namespace ltrain {

struct HfModelConfig {
  std::string path;                 // DIR/config.json
  std::string architecture;         // "LlamaForCausalLM"
  ModelSpec model;                  // the keys below, the others at their defaults
  std::vector<std::string> keys;    // the recipe keys it gives ("model.layers", ...)
  std::vector<std::string> notes;   // what the user should know (dropout not applied, keys not known)
};

// DIR/config.json; NotFound where DIR has none (a .safetensors file, or a directory without one).
// `seq_len`: the recipe's, checked against max_position_embeddings and sliding_window.
// InvalidArgument names the configuration key ltrain cannot honour and why.
StatusOr<HfModelConfig> ReadHfModelConfig(const std::string& dir, int seq_len);

// `parsed` (a valid recipe with model.init_from) with its model section derived from init_from's
// config.json: each key the recipe leaves out takes the configuration's value, a key the recipe sets
// to another value is refused naming both, and the result is checked again as a whole. `source`: the
// recipe's file, for the errors. A directory without config.json leaves the recipe as it is.
RecipeParseResult WithHfModelConfig(RecipeParseResult parsed, const std::string& source);

}  // namespace ltrain
