// The weight table: every tensor a K3 / K3.1 / Kimi-Linear checkpoint must carry, with its
// dtype and shape derived from the config. Used to validate a checkpoint (one error listing
// every problem), to bind weights, and to synthesize checkpoints.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor_view.h"
#include "model/config.h"

namespace k3 {

class Checkpoint;

// What a tensor is for; `k3 inspect` reports bytes by kind.
enum class WeightKind : uint8_t {
  Embedding,
  LmHead,
  Norm,      // RMSNorm / LayerNorm weights and biases
  AttnRes,   // AttnRes norm / proj vectors
  KdaProj,   // KDA q/k/v/g/o and gate projections
  KdaParam,  // conv weights, A_log, dt_bias
  MlaProj,
  DsaIndexer,
  Router,
  LatentProj,  // latent MoE down / up
  SharedExpert,
  DenseFfn,
  RoutedExpert,
};
std::string_view weight_kind_name(WeightKind k);

struct WeightEntry {
  // Accepted names; the first is canonical (what synth writes). Alternatives cover layouts
  // seen in the wild (e.g. transformers' block_sparse_moe.* names for the dense layer 0).
  std::vector<std::string> names;
  std::vector<DType> dtypes;  // accepted dtypes; the first is what synth writes
  std::vector<Shape> shapes;  // accepted shapes; the first is what synth writes
  WeightKind kind;
  int layer = -1;  // -1: model level
  // Routed expert id (experts only), so synth and binding can iterate experts cheaply.
  int expert = -1;
};

std::vector<WeightEntry> weight_table(const ModelConfig& cfg);

// Result of matching a checkpoint against the table.
struct WeightCheck {
  std::vector<std::string> missing;     // "name (expected BF16 [a, b])"
  std::vector<std::string> mismatched;  // "name: got F32 [x], expected BF16 [a, b]"
  std::vector<std::string> unknown;     // checkpoint tensors the table does not name
  std::map<WeightKind, uint64_t> bytes_by_kind;
  uint64_t total_bytes = 0;
  bool ok() const { return missing.empty() && mismatched.empty(); }
};

WeightCheck check_weights(const Checkpoint& ckpt, const std::vector<WeightEntry>& table);
// Throws one k3::Error listing every missing and mismatched tensor (unknown ones are allowed:
// vision tower, projector).
void require_weights(const Checkpoint& ckpt, const std::vector<WeightEntry>& table);

// The name of `e` present in the checkpoint (nullptr if none).
const TensorView* find_weight(const Checkpoint& ckpt, const WeightEntry& e);

}  // namespace k3
