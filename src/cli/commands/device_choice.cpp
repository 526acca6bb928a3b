#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "parallel/tcp_bootstrap.h"
#include "serve/step_backend.h"

namespace k3::cli {

// The device the run uses: auto takes the GPU when this build has the CUDA backend and a GPU
// is visible, else the CPU reference; asking for cuda without either is an error.
std::string choose_device(const std::string& want) {
  const std::vector<std::string> gpus = probe_gpus();
  K3_CHECK(want == "auto" || want == "cpu" || want == "cuda",
           "--device must be auto, cpu or cuda, got \"", want, "\"");
  for (const auto& g : gpus) std::fprintf(stderr, "k3: found GPU %s\n", g.c_str());
  if (want == "cpu") return "cpu";
  if (want == "cuda") {
    K3_CHECK(serve::have_cuda_backend(),
             "--device cuda: this build has no CUDA backend (nvcc was not found at configure "
             "time); use --device cpu");
    K3_CHECK(!gpus.empty(), "--device cuda: no GPU is visible");
    return "cuda";
  }
  return serve::have_cuda_backend() && !gpus.empty() ? "cuda" : "cpu";
}

bool follower_process() {
  const parallel::BootstrapConfig c = parallel::BootstrapConfig::from_env();
  return c.world > 1 && c.rank != 0;
}

}  // namespace k3::cli
