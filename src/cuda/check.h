// Every CUDA runtime call goes through K3_CUDA_CHECK; a failure raises k3::Error with the
// call, the file and the CUDA error string.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define K3_CUDA_CHECK(call)                                                                   \
  do {                                                                                        \
    const cudaError_t k3_err_ = (call);                                                       \
    if (k3_err_ != cudaSuccess)                                                               \
      ::k3::fail("CUDA error ", cudaGetErrorName(k3_err_), " (", cudaGetErrorString(k3_err_), \
                 ") in ", #call, " at ", __FILE__, ":", __LINE__);                            \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define K3_CUDA_CHECK_LAUNCH() K3_CUDA_CHECK(cudaGetLastError())
