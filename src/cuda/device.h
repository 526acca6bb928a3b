// GPU discovery for the CLI's device choice (`--device auto` picks the GPU when one exists).
#pragma once

#include <string>
#include <vector>

namespace k3::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int multiprocessors = 0;
  size_t global_memory = 0;
  size_t l2_bytes = 0;
};

// Devices the runtime sees; empty (never an error) when there is no driver or no GPU.
std::vector<DeviceInfo> list_devices();

}  // namespace k3::cuda
