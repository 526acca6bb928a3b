// k3: the engine's command line.
#include "cli/commands/commands.h"

#ifdef K3_HAVE_CUDA
#include "cli/commands/diff_hook.h"
#include "cuda/cuda_step_backend.h"
#include "cuda/device.h"
#include "cuda/rank_group.h"
#include "cuda/step_diff.h"
#ifdef K3_HAVE_NCCL
#include "cuda/nccl_communicator.h"
#endif
#include "serve/step_backend.h"

static std::vector<std::string> list_gpus() {
  std::vector<std::string> out;
  for (const auto& d : k3::cuda::list_devices())
    out.push_back(d.name + " (sm_" + std::to_string(d.sm_major) + std::to_string(d.sm_minor) +
                  ", " + std::to_string(d.multiprocessors) + " SMs, " +
                  std::to_string(d.global_memory >> 30) + " GiB)");
  return out;
}
#endif

int main(int argc, char** argv) {
#ifdef K3_HAVE_CUDA
  k3::cli::set_gpu_probe(list_gpus);
  k3::serve::set_cuda_backend_factory(k3::cuda::make_cuda_step_backend);
  k3::serve::set_cuda_follower(k3::cuda::run_cuda_follower);
#ifdef K3_HAVE_NCCL
  k3::cuda::set_nccl_rank_comms_factory(k3::cuda::make_nccl_rank_comms);
#endif
  k3::cli::set_step_diff_runner(k3::cuda::run_step_diff);
#endif
  return k3::cli::run_cli(argc, argv);
}
