// The read-bandwidth curve of the GPU in use, measured in the same run as the kernels it judges
// (shared/spec/h200-ceilings.md: ceilings "measured again in the same run where possible"): a
// plain streaming read of S bytes per launch (16-byte non-allocating loads, every SM busy), timed
// as every op is timed (graph_timing.h), for S = 1 MB .. 256 MB. The H200 table
// (cuda::h200_read_curve_tbps) stays the fixed mark the issues name; this one sets a kernel or a
// step against what this card reads at the same size, the fair mark on another card (an H100
// reads at most 3.35 TB/s by its datasheet, below the H200's measured 4.3).
#pragma once

#include <cuda_runtime.h>

#include <vector>

namespace k3::bench {

class ReadCurve {
 public:
  // Times the read at each size (about a second); allocates 512 MB while it runs.
  static ReadCurve measure(cudaStream_t stream);

  // TB/s at `bytes`, interpolated as the H200 table is (cuda::read_curve_tbps); 0 before measure.
  double tbps(double bytes) const;
  double peak_tbps() const { return tbps_.empty() ? 0.0 : tbps_.back(); }
  // A result of `gbps` over `bytes` as a percentage of this curve at its size (0 before measure).
  double percent(double gbps, double bytes) const {
    const double card_gbps = tbps(bytes) * 1e3;
    return card_gbps > 0 ? 100.0 * gbps / card_gbps : 0.0;
  }
  // One line: the measured curve, the H200 table's rate at each size beside it.
  void print() const;

 private:
  std::vector<double> mb_, tbps_;  // sizes (MiB) and their rates, ascending
};

}  // namespace k3::bench
