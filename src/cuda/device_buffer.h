// RAII device memory: a typed, move-only cudaMalloc'd array, and host<->device copy helpers.
// bf16 lives on the device as __nv_bfloat16 and on the host as uint16_t bits (core/numeric.h);
// the copy helpers accept any host type of the same size, so both sides keep their own type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/error.h"
#include "cuda/check.h"

namespace k3::cuda {

using bf16 = __nv_bfloat16;

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // count elements, uninitialized (callers poison or fill explicitly).
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ > 0) K3_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), count_ * sizeof(T)));
  }
  ~DeviceBuffer() { release(); }

  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), count_(o.count_) {
    o.ptr_ = nullptr;
    o.count_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }

  T* data() { return ptr_; }
  const T* data() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  bool empty() const { return count_ == 0; }

  // Every byte set to `byte` (0xff poisons fp32/bf16 with NaN), ordered on `stream`.
  void fill_bytes(int byte, cudaStream_t stream = nullptr) {
    if (count_ > 0) K3_CUDA_CHECK(cudaMemsetAsync(ptr_, byte, bytes(), stream));
  }

 private:
  void release() noexcept {
    // A destructor must not throw: a failing cudaFree (e.g. after a sticky kernel error) is
    // left for the next checked call to report.
    if (ptr_) (void)cudaFree(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }

  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// Synchronous copies (cudaMemcpy: waits for the copy, and for prior work on the legacy stream).
template <typename T, typename H>
void copy_to_device(DeviceBuffer<T>& dst, const H* src, size_t count, size_t dst_offset = 0) {
  static_assert(sizeof(T) == sizeof(H), "host and device element types differ in size");
  K3_CHECK(dst_offset + count <= dst.size(), "copy_to_device: ", count, " elements at ", dst_offset,
           " overflow a buffer of ", dst.size());
  if (count > 0)
    K3_CUDA_CHECK(
        cudaMemcpy(dst.data() + dst_offset, src, count * sizeof(T), cudaMemcpyHostToDevice));
}
template <typename T, typename H>
void copy_to_host(H* dst, const DeviceBuffer<T>& src, size_t count, size_t src_offset = 0) {
  static_assert(sizeof(T) == sizeof(H), "host and device element types differ in size");
  K3_CHECK(src_offset + count <= src.size(), "copy_to_host: ", count, " elements at ", src_offset,
           " overflow a buffer of ", src.size());
  if (count > 0)
    K3_CUDA_CHECK(
        cudaMemcpy(dst, src.data() + src_offset, count * sizeof(T), cudaMemcpyDeviceToHost));
}

// A new device buffer holding a copy of a host vector.
template <typename T, typename H>
DeviceBuffer<T> to_device(const std::vector<H>& host) {
  DeviceBuffer<T> d(host.size());
  copy_to_device(d, host.data(), host.size());
  return d;
}
// The whole buffer back on the host, as H (e.g. uint16_t for bf16).
template <typename H, typename T>
std::vector<H> to_host(const DeviceBuffer<T>& d) {
  std::vector<H> h(d.size());
  copy_to_host(h.data(), d, d.size());
  return h;
}

// Asynchronous variants, ordered on `stream`; the host memory must stay alive (and, to really
// overlap, be pinned) until the stream reaches the copy.
template <typename T, typename H>
void copy_to_device_async(T* dst, const H* src, size_t count, cudaStream_t stream) {
  static_assert(sizeof(T) == sizeof(H), "host and device element types differ in size");
  if (count > 0)
    K3_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(T), cudaMemcpyHostToDevice, stream));
}
template <typename H, typename T>
void copy_to_host_async(H* dst, const T* src, size_t count, cudaStream_t stream) {
  static_assert(sizeof(T) == sizeof(H), "host and device element types differ in size");
  if (count > 0)
    K3_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
}

}  // namespace k3::cuda
