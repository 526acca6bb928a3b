// Kernel timeline of a stretch of GPU work through CUPTI's activity API (k3_bench_step --trace):
// every kernel's start and end on the GPU's clock, graph-launched ones included, so the decode
// step's graph replay can be read kernel by kernel: where the GPU idles between kernels and how
// far each kernel pushes the step's end. The per-stage profile (CudaBackbone::profile_step) puts
// events between stages, which cuts the programmatic (PDL) edges; this does not.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k3::bench {

struct KernelRecord {
  std::string name;  // demangled, shortened (short_kernel_name)
  uint64_t start_ns = 0, end_ns = 0;
  uint32_t stream = 0;
  int grid = 0, block = 0;  // x * y * z
};

// Kernel name without namespaces, template arguments and parameters; the skinny GEMM keeps its
// weight format (bf16 / mxfp4), since its two instances are different ops.
std::string short_kernel_name(const std::string& demangled);

class KernelTrace {
 public:
  // Starts recording kernel activity for the whole process. Call before graphs are captured:
  // graph kernels are traced only where activity was on when the graph was built.
  KernelTrace();
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  // Drops what was recorded so far (flushes the buffers CUPTI holds first).
  void clear();
  // Kernels recorded since the last clear(), in start order. The caller synchronizes first.
  std::vector<KernelRecord> take();
};

// Prints the timeline's summary: span, idle time (no kernel running), and per kernel name the
// launches, summed durations and the "frontier" time (how much the latest end among the
// kernels so far moves at each kernel's end, summed by name: the step's span split among the
// kernels that set its pace); then the kernels of the stretch from the `from`-th to the `to`-th
// launch of `marker` (0-based), one line each.
void print_trace(const std::vector<KernelRecord>& ks, const std::string& title,
                 const std::string& marker, int from, int to);

}  // namespace k3::bench
