// Synthetic training text for the worker tests: a deterministic stream of byte tokens, "words" of
// lowercase letters between spaces, written as a token file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/data/token_data.h"

namespace ltrain::testing {

// `count` tokens drawn from SplitMix64 starting at `seed`: a space where the draw is a multiple of
// `space_every`, else one of the first `letters` lowercase letters; written to `path` (vocab 256).
inline Status WriteSyntheticTokens(const std::string& path, size_t count, uint64_t seed, uint64_t space_every,
                                   uint64_t letters) {
  std::vector<uint16_t> tokens(count);
  uint64_t x = seed;
  for (auto& t : tokens) t = static_cast<uint16_t>(((x = SplitMix64(x)) % space_every == 0) ? 32 : 97 + x % letters);
  return WriteTokenFile(path, tokens, 256);
}

}  // namespace ltrain::testing
