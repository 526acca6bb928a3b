// Synthetic checkpoints with the real names, dtypes and layouts: config.json,
// model-0000k-of-0000n.safetensors shards and model.safetensors.index.json, written the way a
// Hugging Face K3 release is, with values scaled so activations stay in a realistic range.
#pragma once

#include <cstdint>
#include <string>

#include "model/config.h"

namespace k3 {

struct SynthOptions {
  uint64_t seed = 0;
  uint64_t max_shard_bytes = 5ull << 30;  // HF's default shard size is 5 GB
  bool progress = false;                  // progress bar on stderr
  int threads = 0;                        // 0: hardware concurrency
};

// Writes the checkpoint for `cfg` into dir (created if needed). Deterministic in seed. Configs
// with the tiny tokenizer layout (uses_synthetic_tokenizer) also get tiktoken.model and
// tokenizer_config.json.
void synthesize_checkpoint(const ModelConfig& cfg, const std::string& dir, const SynthOptions& o);

// Bytes the checkpoint of cfg will occupy (tensor data only).
uint64_t checkpoint_bytes(const ModelConfig& cfg);

}  // namespace k3
