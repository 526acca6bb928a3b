// The serving engine's StepBackend over the stock CUDA decode step (cuda/backbone.h): request
// slots are slots of the GPU slot pool; a forward call runs its rows' tokens position by
// position (prefill chunks are fed token by token through the decode step, batched across
// rows), so every launch is one captured graph of the step for that many rows.
#pragma once

#include <memory>

#include "serve/step_backend.h"

namespace k3::cuda {

// Slots: deploy.max_num_seqs; context: deploy.max_model_len (or the model's limit).
std::unique_ptr<serve::StepBackend> make_cuda_step_backend(std::unique_ptr<LoadedModel> model,
                                                           const DeployConfig& deploy);

}  // namespace k3::cuda
