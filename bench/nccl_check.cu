// k3_nccl_check: every NcclCommunicator collective on random data against a host reference
// computed through the TcpCommunicator, on every rank; rank 0 prints a pass/fail table. Run one
// process per GPU under tools/launch_ranks.sh, e.g. `tools/launch_ranks.sh 8 build/k3_nccl_check`
// (K3_TEST_SEED picks the seed; rank 0's seed is used everywhere). Exit status 0 iff all pass.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/rng.h"
#include "cuda/check.h"
#include "cuda/device_buffer.h"
#include "cuda/nccl_communicator.h"
#include "parallel/tcp_bootstrap.h"
#include "parallel/tcp_communicator.h"

namespace {

using k3::Rng;
using k3::cuda::bf16;
using k3::cuda::DeviceBuffer;
using k3::cuda::DevType;

// All-reduce error metric: |gpu - ref| / sum_r |x_r| per element. A different summation order
// of `world` fp32 terms moves the sum by at most ~(world - 1) roundings of partial sums, each
// <= 2^-24 of sum |x|; bf16 rounds every partial sum to 8 bits (2^-9 each).
double f32_tol(int world) {
  return 2.0 * world * 0x1p-24;
}
double bf16_tol(int world) {
  return 2.0 * world * 0x1p-9;
}

struct Row {
  std::string name;
  int64_t elements = 0;
  double err = 0;  // max over this rank's elements (0 for exact checks)
  double tol = 0;
  bool pass = false;
};

std::vector<float> normals(Rng& rng, size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = rng.normal();
  return v;
}

class Checker {
 public:
  Checker(k3::parallel::TcpCommunicator& host, k3::cuda::NcclCommunicator& dev, uint64_t seed,
          cudaStream_t stream)
      : host_(host), dev_(dev), stream_(stream), rng_(seed * 1000003 + host.rank()) {}

  std::vector<Row> rows;

  void all_reduce_f32(int64_t n, bool graph) {
    std::vector<float> x = normals(rng_, n), abs_sum(n), ref = x;
    for (int64_t i = 0; i < n; ++i) abs_sum[i] = std::fabs(x[i]);
    host_.all_reduce_sum(ref.data(), n);
    host_.all_reduce_sum(abs_sum.data(), n);
    DeviceBuffer<float> d = k3::cuda::to_device<float>(x);  // [n] fp32
    if (graph) {
      // Warm up eagerly (NCCL may set up connections lazily), then capture and replay once on
      // fresh inputs.
      dev_.all_reduce_sum(d.data(), n, stream_);
      K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      K3_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
      dev_.all_reduce_sum(d.data(), n, stream_);
      K3_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
      K3_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      k3::cuda::copy_to_device(d, x.data(), x.size());
      K3_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
      K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
      K3_CUDA_CHECK(cudaGraphExecDestroy(exec));
      K3_CUDA_CHECK(cudaGraphDestroy(g));
    } else {
      dev_.all_reduce_sum(d.data(), n, stream_);
      K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    const std::vector<float> got = k3::cuda::to_host<float>(d);
    add(graph ? "all_reduce f32 (graph)" : "all_reduce f32", n, rel_err(got, ref, abs_sum),
        f32_tol(host_.size()));
  }

  void all_reduce_bf16(int64_t n) {
    std::vector<uint16_t> x(n);
    std::vector<float> xf(n), abs_sum(n);
    for (int64_t i = 0; i < n; ++i) {
      x[i] = k3::float_to_bf16(rng_.normal());
      xf[i] = k3::bf16_to_float(x[i]);
      abs_sum[i] = std::fabs(xf[i]);
    }
    host_.all_reduce_sum(xf.data(), n);  // the fp32 sum of the bf16 inputs
    host_.all_reduce_sum(abs_sum.data(), n);
    DeviceBuffer<bf16> d = k3::cuda::to_device<bf16>(x);  // [n] bf16
    dev_.all_reduce_sum(d.data(), n, stream_);
    K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const std::vector<uint16_t> bits = k3::cuda::to_host<uint16_t>(d);
    std::vector<float> got(n);
    for (int64_t i = 0; i < n; ++i) got[i] = k3::bf16_to_float(bits[i]);
    add("all_reduce bf16", n, rel_err(got, xf, abs_sum), bf16_tol(host_.size()));
  }

  void all_gather(int64_t n) {
    const int world = host_.size();
    std::vector<float> x = normals(rng_, n), ref(n * world);
    host_.all_gather(x.data(), n, ref.data());
    DeviceBuffer<float> in = k3::cuda::to_device<float>(x);  // [n] fp32
    DeviceBuffer<float> out(n * world);                      // [world, n] fp32
    out.fill_bytes(0xff, stream_);
    dev_.all_gather(in.data(), n, out.data(), stream_);
    K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
    add_exact("all_gather f32", n, k3::cuda::to_host<float>(out), ref);
  }

  void all_to_all_v(int64_t max_count) {
    const int world = host_.size();
    std::vector<int64_t> sc(world);
    for (auto& c : sc) c = static_cast<int64_t>(rng_.next_u64() % (max_count + 1));
    const std::vector<int64_t> rc = k3::parallel::exchange_counts(host_, sc);
    int64_t ts = 0, tr = 0;
    for (int r = 0; r < world; ++r) ts += sc[r], tr += rc[r];
    std::vector<int32_t> send(ts), ref(tr);
    for (auto& v : send) v = static_cast<int32_t>(rng_.next_u64());
    host_.all_to_all_v(send.data(), sc.data(), ref.data(), rc.data());
    DeviceBuffer<int32_t> ds = k3::cuda::to_device<int32_t>(send);  // [sum sc] int32
    DeviceBuffer<int32_t> dr(tr);                                   // [sum rc] int32
    dr.fill_bytes(0xff, stream_);
    dev_.all_to_all_v(ds.data(), sc.data(), dr.data(), rc.data(), DevType::I32, stream_);
    K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
    add_exact("all_to_all_v i32", tr, k3::cuda::to_host<int32_t>(dr), ref);
  }

  void broadcast(int64_t n, int root) {
    std::vector<float> x = normals(rng_, n), ref = x;
    host_.broadcast(ref.data(), n, root);
    DeviceBuffer<float> d = k3::cuda::to_device<float>(x);  // [n] fp32
    dev_.broadcast(d.data(), n, DevType::F32, root, stream_);
    K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
    add_exact("broadcast f32 root " + std::to_string(root), n, k3::cuda::to_host<float>(d), ref);
  }

  void barrier() {
    dev_.barrier(stream_);
    K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
    add("barrier", 0, 0, 0);
  }

 private:
  static double rel_err(const std::vector<float>& got, const std::vector<float>& ref,
                        const std::vector<float>& abs_sum) {
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const double e = std::fabs(static_cast<double>(got[i]) - ref[i]) /
                       std::max(static_cast<double>(abs_sum[i]), 1e-30);
      worst = std::isfinite(got[i]) ? std::max(worst, e) : INFINITY;
    }
    return worst;
  }
  template <typename T>
  void add_exact(const std::string& name, int64_t n, const std::vector<T>& got,
                 const std::vector<T>& ref) {
    const bool same =
        got.size() == ref.size() &&
        (got.empty() || std::memcmp(got.data(), ref.data(), got.size() * sizeof(T)) == 0);
    rows.push_back({name, n, same ? 0.0 : INFINITY, 0.0, same});
  }
  void add(const std::string& name, int64_t n, double err, double tol) {
    rows.push_back({name, n, err, tol, err <= tol});
  }

  k3::parallel::TcpCommunicator& host_;
  k3::cuda::NcclCommunicator& dev_;
  cudaStream_t stream_;
  Rng rng_;
};

int run() {
  k3::parallel::TcpBootstrap boot(k3::parallel::BootstrapConfig::from_env());
  k3::parallel::TcpCommunicator host(boot);
  k3::cuda::NcclCommunicator dev(boot);
  const int world = host.size(), rank = host.rank();
  uint64_t seed = 0;
  if (rank == 0) {
    const char* s = std::getenv("K3_TEST_SEED");
    seed = s ? std::strtoull(s, nullptr, 10) : std::random_device{}();
  }
  boot.broadcast_bytes(&seed, sizeof seed, 0);
  if (rank == 0)
    std::printf("k3_nccl_check: %d ranks, NCCL_NVLS_ENABLE=%s, seed %llu\n", world,
                std::getenv("NCCL_NVLS_ENABLE"), static_cast<unsigned long long>(seed));

  cudaStream_t stream = nullptr;
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Checker c(host, dev, seed, stream);
  for (int64_t n : {int64_t{1}, int64_t{1001}, int64_t{1} << 20}) {
    c.all_reduce_f32(n, false);
    c.all_reduce_bf16(n);
    c.all_gather(n);
    c.broadcast(n, world - 1);
  }
  c.all_reduce_f32(1 << 16, true);
  c.all_to_all_v(0);  // every pair empty
  c.all_to_all_v(5000);
  c.barrier();
  K3_CUDA_CHECK(cudaStreamDestroy(stream));

  // Rank 0 prints the worst error over ranks and which ranks failed.
  const size_t nrows = c.rows.size();
  std::vector<double> err(nrows), all_err(nrows * world);
  std::vector<int32_t> ok(nrows), all_ok(nrows * world);
  for (size_t i = 0; i < nrows; ++i) {
    err[i] = c.rows[i].err;
    ok[i] = c.rows[i].pass;
  }
  std::vector<float> err_f(err.begin(), err.end()), all_err_f(nrows * world);
  host.all_gather(err_f.data(), static_cast<int64_t>(nrows), all_err_f.data());
  host.all_gather(ok.data(), static_cast<int64_t>(nrows), all_ok.data());
  bool all_pass = true;
  if (rank == 0)
    std::printf("%-26s %9s %11s %11s  %s\n", "collective", "elements", "max err", "tol", "result");
  for (size_t i = 0; i < nrows; ++i) {
    double worst = 0;
    std::string failed;
    for (int r = 0; r < world; ++r) {
      worst = std::max(worst, static_cast<double>(all_err_f[r * nrows + i]));
      if (all_ok[r * nrows + i]) continue;
      if (!failed.empty()) failed += ',';
      failed += std::to_string(r);
    }
    all_pass = all_pass && failed.empty();
    const std::string result =
        failed.empty() ? std::string("pass") : std::string("FAIL on ranks ").append(failed);
    if (rank == 0)
      std::printf("%-26s %9lld %11.3g %11.3g  %s\n", c.rows[i].name.c_str(),
                  static_cast<long long>(c.rows[i].elements), worst, c.rows[i].tol, result.c_str());
  }
  if (rank == 0) std::printf("%s\n", all_pass ? "ALL PASS" : "SOME FAILED");
  host.barrier();
  return all_pass ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3_nccl_check: %s\n", e.what());
    return 2;
  }
}
