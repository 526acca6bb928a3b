// The serving engine's StepBackend over the CUDA decode step (a StepExecutor: cuda/backbone.h,
// or the ranks of a multi-rank layout, cuda/rank_group.h): request slots are the executor's
// slots; a forward call packs its rows' tokens into steps of runs (prefill chunks, verify q
// positions), each step one launch (a captured graph where the executor has one).
#pragma once

#include <memory>

#include "serve/step_backend.h"

namespace k3::cuda {

// Slots: deploy.max_num_seqs; context: deploy.max_model_len (or the model's limit). A
// multi-rank layout (tensor_parallel_size, data_parallel_size, enable_expert_parallel,
// decode_context_parallel_size) runs on a RankedBackbone: its ranks as threads of this process,
// or, when K3_WORLD_SIZE > 1 (tools/launch_ranks.sh), this process as rank 0 leading the others.
std::unique_ptr<serve::StepBackend> make_cuda_step_backend(std::unique_ptr<LoadedModel> model,
                                                           const DeployConfig& deploy);

// A follower rank (K3_RANK != 0) of a multi-process run: builds its rank of the deployment's
// layout and runs rank 0's commands until rank 0 stops.
void run_cuda_follower(std::unique_ptr<LoadedModel> model, const DeployConfig& deploy);

}  // namespace k3::cuda
