// Programmatic dependent launch (PDL) inside a kernel. Every kernel of the decode step starts
// with K3_PDL_ENTRY: it lets the next kernel of the stream be scheduled as soon as all of this
// kernel's blocks are resident (launch_dependents), then waits until the previous kernel has
// completed and its writes are visible (wait). Both are no-ops for a kernel launched without a
// programmatic dependency, so plain launches behave exactly as before; graphs whose kernel edges
// are made programmatic (graph_pdl.h) overlap one kernel's launch and prologue with the previous
// kernel's tail. A kernel may do independent work (weight loads) between the two; nothing that
// reads a previous kernel's output may come before pdl_wait().
#pragma once

namespace k3::cuda::detail {

__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

}  // namespace k3::cuda::detail

#define K3_PDL_ENTRY()                           \
  do {                                           \
    ::k3::cuda::detail::pdl_launch_dependents(); \
    ::k3::cuda::detail::pdl_wait();              \
  } while (0)
