// What ltrain-worker does for `ltrain export` and `ltrain generate`: one process loads a checkpoint
// (any layout it was saved in) into a one-rank model and
//   export    writes it in Hugging Face transformers' layout: model.safetensors (sharded above
//             --max-shard-gb, with model.safetensors.index.json), config.json, the tokenizer files;
//   generate  samples text after a prompt (temperature, top-k), or with --score prints the prompt's
//             per-token log-probabilities.
// The control-plane CLI runs it (cmd/model_commands.cc), so that LibTorch stays out of `ltrain`.
#pragma once

namespace ltrain::worker {

// argv[1] is "export" or "generate"; returns the process exit code (0 done, 1 failed, 2 bad usage).
int RunModelTool(int argc, char** argv);

}  // namespace ltrain::worker
