// Collectives on DEVICE buffers, ordered on a CUDA stream: the GPU counterpart of
// parallel::Communicator (same rules: sizes in elements given by every rank, every rank calling
// the same collectives in the same order, a rank with no work still calls them with zero sizes).
// Implementations must not allocate or synchronize the host inside a collective, so a sequence
// of collectives can be captured in a CUDA graph and replayed. NcclCommunicator
// (cuda/nccl_communicator.h) is the implementation for one process per GPU;
// HostStagedCommunicator (cuda/host_staged_communicator.h) stages through the host over any
// parallel::Communicator (ranks as threads sharing a GPU, or processes without NCCL): it waits
// on the stream, so graph_safe() is false and steps using it run eagerly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace k3::cuda {

enum class DevType : uint8_t { F32, BF16, I32, I64 };

inline size_t dev_type_size(DevType t) {
  return t == DevType::BF16 ? 2 : t == DevType::I64 ? 8 : 4;
}

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[n] replaced (in place) by the sum over ranks. Every rank gets the same values, but the
  // summation order is the backend's (see NcclCommunicator), not rank order.
  virtual void all_reduce_sum(void* data, int64_t n, DevType t, cudaStream_t stream) = 0;
  // in[n] of every rank -> out[size * n], rank r's values at out + r * n.
  virtual void all_gather(const void* in, int64_t n, DevType t, void* out, cudaStream_t stream) = 0;
  // send: packed by destination, send_counts[size] elements each; recv: packed by source,
  // recv_counts[size] each (matching what the sources send). The counts are HOST arrays: a
  // captured graph bakes them in, so graph replays need fixed (e.g. padded) counts.
  virtual void all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                            const int64_t* recv_counts, DevType t, cudaStream_t stream) = 0;
  // data[n] of rank `root` copied to every rank (in place).
  virtual void broadcast(void* data, int64_t n, DevType t, int root, cudaStream_t stream) = 0;
  // in[size * n] of every rank -> out[n] = sum over ranks r of their in[rank() * n, +n): this
  // rank's block of the element-wise sum (same summation caveat as all_reduce_sum).
  virtual void reduce_scatter_sum(const void* in, void* out, int64_t n, DevType t,
                                  cudaStream_t stream) = 0;
  // Stream-ordered: work after it on `stream` starts once every rank's stream reached it. The
  // host does not wait (synchronize the stream for that).
  virtual void barrier(cudaStream_t stream) = 0;
  // True when the collectives neither allocate nor wait on the host, so they can be captured
  // in a CUDA graph.
  virtual bool graph_safe() const = 0;

  // Typed conveniences.
  void all_reduce_sum(float* d, int64_t n, cudaStream_t s) {
    all_reduce_sum(d, n, DevType::F32, s);
  }
  void all_reduce_sum(__nv_bfloat16* d, int64_t n, cudaStream_t s) {
    all_reduce_sum(d, n, DevType::BF16, s);
  }
  void all_gather(const float* in, int64_t n, float* out, cudaStream_t s) {
    all_gather(in, n, DevType::F32, out, s);
  }
  void all_gather(const int32_t* in, int64_t n, int32_t* out, cudaStream_t s) {
    all_gather(in, n, DevType::I32, out, s);
  }
};

}  // namespace k3::cuda
