#include "cuda/host_staged_communicator.h"

#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "cuda/check.h"

namespace k3::cuda {
namespace {

using parallel::CommType;

// The host type a device type travels as: bf16 as fp32 (exact), the others as themselves.
CommType transport(DevType t) {
  switch (t) {
    case DevType::F32:
    case DevType::BF16:
      return CommType::F32;
    case DevType::I32:
      return CommType::I32;
    case DevType::I64:
      return CommType::I64;
  }
  fail("host-staged collective: unknown element type");
}

size_t count_of(int64_t n, const char* op) {
  K3_CHECK(n >= 0, op, ": negative element count ", n);
  return static_cast<size_t>(n);
}

// Waits for the stream, then returns n device elements in their transport type (host bytes).
std::vector<uint8_t> stage_in(const void* dev, size_t n, DevType t, cudaStream_t stream) {
  K3_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> raw(n * dev_type_size(t));
  if (n > 0) K3_CUDA_CHECK(cudaMemcpy(raw.data(), dev, raw.size(), cudaMemcpyDeviceToHost));
  if (t != DevType::BF16) return raw;
  std::vector<uint8_t> out(n * sizeof(float));
  for (size_t i = 0; i < n; ++i) {
    uint16_t h = 0;
    std::memcpy(&h, raw.data() + 2 * i, 2);
    const float f = bf16_to_float(h);
    std::memcpy(out.data() + 4 * i, &f, 4);
  }
  return out;
}

// Writes n transport-type host elements to the device as type t (bf16: rounded), synchronously.
void stage_out(const std::vector<uint8_t>& host, size_t n, DevType t, void* dev) {
  if (n == 0) return;
  if (t != DevType::BF16) {
    K3_CUDA_CHECK(cudaMemcpy(dev, host.data(), n * dev_type_size(t), cudaMemcpyHostToDevice));
    return;
  }
  std::vector<uint16_t> bits(n);
  for (size_t i = 0; i < n; ++i) {
    float f = 0;
    std::memcpy(&f, host.data() + 4 * i, 4);
    bits[i] = float_to_bf16(f);
  }
  K3_CUDA_CHECK(cudaMemcpy(dev, bits.data(), n * 2, cudaMemcpyHostToDevice));
}

}  // namespace

void HostStagedCommunicator::all_reduce_sum(void* data, int64_t n, DevType t, cudaStream_t stream) {
  K3_CHECK(t == DevType::F32 || t == DevType::BF16,
           "host-staged all_reduce_sum: fp32 or bf16 operands only");
  const size_t count = count_of(n, "all_reduce_sum");
  std::vector<uint8_t> h = stage_in(data, count, t, stream);
  host_.all_reduce_sum(reinterpret_cast<float*>(h.data()), n);
  stage_out(h, count, t, data);
}

void HostStagedCommunicator::all_gather(const void* in, int64_t n, DevType t, void* out,
                                        cudaStream_t stream) {
  const size_t count = count_of(n, "all_gather");
  const std::vector<uint8_t> h = stage_in(in, count, t, stream);
  std::vector<uint8_t> all(h.size() * static_cast<size_t>(size()));
  host_.all_gather(h.data(), n, transport(t), all.data());
  stage_out(all, count * static_cast<size_t>(size()), t, out);
}

void HostStagedCommunicator::all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                                          const int64_t* recv_counts, DevType t,
                                          cudaStream_t stream) {
  size_t sent = 0, received = 0;
  for (int p = 0; p < size(); ++p) {
    sent += count_of(send_counts[p], "all_to_all_v");
    received += count_of(recv_counts[p], "all_to_all_v");
  }
  const std::vector<uint8_t> h = stage_in(send, sent, t, stream);
  std::vector<uint8_t> r(received * parallel::comm_type_size(transport(t)));
  host_.all_to_all_v(h.data(), send_counts, r.data(), recv_counts, transport(t));
  stage_out(r, received, t, recv);
}

void HostStagedCommunicator::broadcast(void* data, int64_t n, DevType t, int root,
                                       cudaStream_t stream) {
  const size_t count = count_of(n, "broadcast");
  std::vector<uint8_t> h = stage_in(data, count, t, stream);
  host_.broadcast(h.data(), n, transport(t), root);
  stage_out(h, count, t, data);
}

void HostStagedCommunicator::reduce_scatter_sum(const void* in, void* out, int64_t n, DevType t,
                                                cudaStream_t stream) {
  K3_CHECK(t == DevType::F32 || t == DevType::BF16,
           "host-staged reduce_scatter_sum: fp32 or bf16 operands only");
  const size_t count = count_of(n, "reduce_scatter_sum");
  std::vector<uint8_t> h = stage_in(in, count * static_cast<size_t>(size()), t, stream);
  host_.all_reduce_sum(reinterpret_cast<float*>(h.data()), n * size());
  const size_t off = count * static_cast<size_t>(rank()) * sizeof(float);
  const std::vector<uint8_t> mine(h.begin() + static_cast<std::ptrdiff_t>(off),
                                  h.begin() + static_cast<std::ptrdiff_t>(off + count * 4));
  stage_out(mine, count, t, out);
}

void HostStagedCommunicator::barrier(cudaStream_t stream) {
  K3_CUDA_CHECK(cudaStreamSynchronize(stream));
  host_.barrier();
}

}  // namespace k3::cuda
