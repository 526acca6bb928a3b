// GPU sampling: (1) each logit becomes a 64-bit sort key, the row in the high bits and an
// order-reversed encoding of the fp32 logit in the low 32 (NaN -> -inf, -0 -> +0, so the key
// order is the CPU's double comparison), with the token id as value; (2) one stable CUB radix
// sort over all rows at once (a segmented sort would give each row a single CTA): equal logits
// keep ascending ids, the CPU's tie order, and each row stays in its own vocab-sized range;
// (3) one CTA per row replays the CPU arithmetic in double over the sorted prefix (block scans
// for the cumulative sums), stopping at the first chunk that settles top-p and the draw.
#include "cuda/sampling.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <climits>
#include <cmath>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

constexpr int kPrepThreads = 256;
constexpr int kSelThreads = 1024;  // one CTA per row, one sorted position per thread per chunk
constexpr size_t kAlign = 256;

size_t align_up(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

// Workspace layout: keys_in, keys_out [N] u64; vals_in, vals_out [N] int32; CUB temp storage.
// N = rows * vocab.
struct Layout {
  size_t keys_in, keys_out, vals_in, vals_out, temp, temp_bytes, total;
  int end_bit;  // 32 logit bits + enough bits for the row index
};

Layout layout(int64_t rows, int64_t vocab) {
  K3_CHECK(rows >= 0 && vocab >= 1 && rows * vocab < INT_MAX, "cuda::sample_rows: rows ", rows,
           ", vocab ", vocab, " (rows * vocab must be < 2^31)");
  const size_t n = static_cast<size_t>(rows * vocab);
  Layout l{};
  l.keys_in = 0;
  l.keys_out = l.keys_in + align_up(n * sizeof(uint64_t));
  l.vals_in = l.keys_out + align_up(n * sizeof(uint64_t));
  l.vals_out = l.vals_in + align_up(n * sizeof(int32_t));
  l.temp = l.vals_out + align_up(n * sizeof(int32_t));
  l.end_bit = 32;
  while ((int64_t{1} << (l.end_bit - 32)) < rows) ++l.end_bit;
  // Size query only (null temp storage): CUB launches nothing and reads no pointer.
  l.temp_bytes = 0;
  if (rows > 0)
    K3_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, l.temp_bytes, static_cast<const uint64_t*>(nullptr),
        static_cast<uint64_t*>(nullptr), static_cast<const int32_t*>(nullptr),
        static_cast<int32_t*>(nullptr), static_cast<int>(n), 0, l.end_bit));
  l.total = l.temp + align_up(l.temp_bytes);
  return l;
}

// fp32 -> 32 bits whose ascending unsigned order is descending float order, and back.
__device__ __forceinline__ uint32_t desc_key(float x) {
  if (isnan(x)) x = -INFINITY;
  if (x == 0.0f) x = 0.0f;  // -0 and +0 are one key (the CPU compares them equal)
  const uint32_t u = __float_as_uint(x);
  const uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending order
  return ~ord;
}
__device__ __forceinline__ float key_value(uint64_t key) {
  const uint32_t ord = ~static_cast<uint32_t>(key);
  return __uint_as_float((ord & 0x80000000u) ? (ord & 0x7fffffffu) : ~ord);
}

// Logits, the sorted keys / values and the per-row params and draws: no __restrict__ (PDL: their
// producer may still run when a kernel starts, so no ld.global.nc; see mma.cuh ld_act128).
__global__ void __launch_bounds__(kPrepThreads)
    sample_prep_kernel(const float* logits, int64_t stride, int vocab, uint64_t* __restrict__ keys,
                       int32_t* __restrict__ vals) {
  K3_PDL_ENTRY();
  // logits [rows][stride]; keys, vals [rows][vocab].
  const int r = blockIdx.y;
  const int i = blockIdx.x * kPrepThreads + threadIdx.x;
  if (i >= vocab) return;
  const float x = logits[static_cast<int64_t>(r) * stride + i];
  const int64_t o = static_cast<int64_t>(r) * vocab + i;
  keys[o] = (static_cast<uint64_t>(r) << 32) | desc_key(x);
  vals[o] = i;
}

using Scan = cub::BlockScan<double, kSelThreads>;
using Reduce = cub::BlockReduce<double, kSelThreads>;

__global__ void __launch_bounds__(kSelThreads)
    sample_select_kernel(const uint64_t* keys, const int32_t* vals, int vocab,
                         const SampleRowParams* params, const double* uniform,
                         int32_t* __restrict__ ids) {
  K3_PDL_ENTRY();
  // keys, vals [rows][vocab], each row sorted by descending logit (ties: ascending id).
  __shared__ union {
    Scan::TempStorage scan;
    Reduce::TempStorage reduce;
  } tmp;
  __shared__ double total_s, mass_s;
  __shared__ int found_s, last_nz_s;

  const int r = blockIdx.x, tid = threadIdx.x;
  const uint64_t* k = keys + static_cast<int64_t>(r) * vocab;  // [vocab]
  const int32_t* v = vals + static_cast<int64_t>(r) * vocab;   // [vocab]
  const SampleRowParams p = params[r];
  const double temp = static_cast<double>(p.temperature);
  // Greedy (and the CPU's error cases, which cannot raise here): the first sorted id.
  const double zmax = temp > 0.0 ? static_cast<double>(key_value(k[0])) / temp : 0.0;
  if (!(temp > 0.0) || !isfinite(zmax)) {
    if (tid == 0) ids[r] = v[0];
    return;
  }
  const int kept = p.top_k > 0 ? min(p.top_k, vocab) : vocab;
  auto weight = [&](int i) {  // exp(z_i - zmax), as the CPU computes it; 0 past kept
    return i < kept ? exp(static_cast<double>(key_value(k[i])) / temp - zmax) : 0.0;
  };

  // Softmax denominator over the kept tokens.
  double part = 0.0;
  for (int i = tid; i < kept; i += kSelThreads) part += weight(i);
  const double total = Reduce(tmp.reduce).Sum(part);
  if (tid == 0) total_s = total;
  __syncthreads();
  const double denom = total_s;
  auto prob = [&](int i) { return weight(i) / denom; };  // the CPU's prob[i] /= total

  // Nucleus: n = 1 + the first index whose cumulative probability reaches top_p.
  int n = kept;
  bool have_mass = false;
  if (p.top_p < 1.0f) {
    const double top_p = static_cast<double>(p.top_p);
    double carry = 0.0;
    for (int c0 = 0; c0 < kept; c0 += kSelThreads) {
      const int i = c0 + tid;
      double cum, agg;
      if (tid == 0) found_s = INT_MAX;
      __syncthreads();
      Scan(tmp.scan).InclusiveSum(prob(i), cum, agg);
      cum += carry;
      if (i < kept && cum >= top_p) atomicMin(&found_s, i);
      __syncthreads();
      const int f = found_s;
      if (f != INT_MAX) {
        if (i == f) mass_s = cum;  // the CPU's mass: the same prefix sum
        n = f + 1;
        have_mass = true;
        __syncthreads();
        break;
      }
      carry += agg;
      __syncthreads();  // tmp and found_s are reused by the next chunk
    }
  }
  if (!have_mass) {  // top-p off or never reached: mass = sum of every kept probability
    double s = 0.0;
    for (int i = tid; i < kept; i += kSelThreads) s += prob(i);
    const double m = Reduce(tmp.reduce).Sum(s);
    if (tid == 0) mass_s = m;
  }
  __syncthreads();
  const double u = uniform[r] * mass_s;

  // Inverse CDF: the first i < n with u < cum_i; never a zero-probability token.
  if (tid == 0) last_nz_s = 0;
  double carry = 0.0;
  for (int c0 = 0; c0 < n; c0 += kSelThreads) {
    const int i = c0 + tid;
    const double q = i < n ? prob(i) : 0.0;
    double cum, agg;
    if (tid == 0) found_s = INT_MAX;
    __syncthreads();  // also orders last_nz_s's reset before the first atomicMax
    Scan(tmp.scan).InclusiveSum(q, cum, agg);
    cum += carry;
    if (i < n && q > 0.0) atomicMax(&last_nz_s, i);
    if (i < n && u < cum) atomicMin(&found_s, i);
    __syncthreads();
    const int f = found_s;
    if (f != INT_MAX) {
      if (tid == 0) ids[r] = v[f];
      return;
    }
    carry += agg;
    __syncthreads();
  }
  if (tid == 0) ids[r] = v[last_nz_s];
}

}  // namespace

size_t sample_rows_workspace_bytes(int64_t rows, int64_t vocab) {
  return layout(rows, vocab).total;
}

void sample_rows(const float* logits, int64_t stride, int64_t rows, int64_t vocab,
                 const SampleRowParams* params, const double* uniform, void* workspace,
                 int32_t* ids, cudaStream_t stream) {
  const Layout l = layout(rows, vocab);
  K3_CHECK(stride >= vocab, "cuda::sample_rows: stride ", stride, " < vocab ", vocab);
  K3_CHECK(rows <= 65535, "cuda::sample_rows: rows ", rows, " > 65535");
  K3_CHECK(reinterpret_cast<uintptr_t>(workspace) % kAlign == 0,
           "cuda::sample_rows: workspace must be 256-byte aligned");
  if (rows == 0) return;
  char* ws = static_cast<char*>(workspace);
  uint64_t* keys_in = reinterpret_cast<uint64_t*>(ws + l.keys_in);    // [rows][vocab]
  uint64_t* keys_out = reinterpret_cast<uint64_t*>(ws + l.keys_out);  // [rows][vocab]
  int32_t* vals_in = reinterpret_cast<int32_t*>(ws + l.vals_in);      // [rows][vocab]
  int32_t* vals_out = reinterpret_cast<int32_t*>(ws + l.vals_out);    // [rows][vocab]
  const int v = static_cast<int>(vocab), nr = static_cast<int>(rows);

  const dim3 pgrid(static_cast<unsigned>((vocab + kPrepThreads - 1) / kPrepThreads),
                   static_cast<unsigned>(rows));
  sample_prep_kernel<<<pgrid, kPrepThreads, 0, stream>>>(logits, stride, v, keys_in, vals_in);
  K3_CUDA_CHECK_LAUNCH();
  size_t temp_bytes = l.temp_bytes;
  K3_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws + l.temp, temp_bytes, keys_in, keys_out, vals_in,
                                                vals_out, v * nr, 0, l.end_bit, stream));
  sample_select_kernel<<<nr, kSelThreads, 0, stream>>>(keys_out, vals_out, v, params, uniform, ids);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
