// Named model shapes for `k3 synth --preset`: the real K3 / K3.1 / Kimi-Linear configs and tiny
// versions with the same structure (layer mix, dense layer 0, latent MoE, AttnRes, DSA).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "model/config.h"

namespace k3 {

std::vector<std::string> synth_preset_names();
// Throws k3::Error listing the known presets.
ModelConfig synth_preset(const std::string& name);

// Size overrides that keep the model's structure: a new layer count re-derives the K3-style
// schedule (every 4th layer and the last are MLA), a new expert count keeps top-k <= experts.
struct PresetOverrides {
  std::optional<int> num_hidden_layers;
  std::optional<int> num_experts;
};
ModelConfig apply_overrides(ModelConfig cfg, const PresetOverrides& o);

// The K3 schedule for n layers (1-based lists): MLA at every 4th layer and at the last layer.
void set_k3_layer_schedule(ModelConfig& cfg, int num_layers);

}  // namespace k3
