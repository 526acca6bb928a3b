#include "cuda/device.h"

#include "cuda/check.h"

namespace k3::cuda {

std::vector<DeviceInfo> list_devices() {
  int count = 0;
  // No driver / no device is a normal CPU-only machine, not an error.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  std::vector<DeviceInfo> out;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    K3_CUDA_CHECK(cudaGetDeviceProperties(&p, i));
    out.push_back({i, p.name, p.major, p.minor, p.multiProcessorCount, p.totalGlobalMem,
                   static_cast<size_t>(p.l2CacheSize)});
  }
  return out;
}

}  // namespace k3::cuda
