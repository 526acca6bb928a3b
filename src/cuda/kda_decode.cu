// Fused KDA decode step, one CTA per (run of rows of one slot, head): a run is one request's
// next tokens in order (a verify's q positions, a prefill chunk), carried through in registers.
//
// Design: the head's D x D state (rows i = key channel, columns j = value channel) is held in
// registers for the whole run, so it is read once and written once (the byte floor). Thread t
// owns column j = t % D and the RPT consecutive rows of row group t / D (RPT = 32, or 16 for
// D = 32, so D = 128 runs 512 threads with 32 state registers each). At a fixed row a warp
// touches 32 consecutive columns: every access is one coalesced 128-byte (fp32) line.
// The run's tokens go in blocks of up to 4:
//   1. conv + SiLU of the head's 3D channels for every token of the block (one thread per
//      channel carries its window in registers), decay gates, betas;
//   2. L2 norms of q and k (one warp per token and stream);
//   3. per token: decay the rows, partial S^T k per row group -> shared -> u_j = beta (v_j - .);
//      S += k u^T in registers, partial S^T q from the UPDATED state (the CPU order): the only
//      serial part, two barriers per token;
//   4. for every token of the block: o_j = scale * sum, sum of o^2, out = o * inv * w *
//      sigmoid(z) -> bf16.
// Each token's arithmetic is the same whatever the run length, so a run equals one-token steps
// bit for bit. Bytes per (run, head): 2 * D * D * sizeof(state) for the state, plus
// 3D * (kernel-1) * 2 * 2 for the conv window and ~(6D + 1) * 2 per token for u, f, z, beta, out.
// Columns are independent in the recurrence; only the gated norm couples them. Splitting the
// columns across a thread-block cluster (DSMEM reduction of sum o^2) would give more CTAs at
// small batch (K3 TP16: 6 heads); not done here.
#include "cuda/kda_decode.h"

#include <cmath>
#include <type_traits>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

constexpr int kMaxKernel = 8;
// Tokens of a run whose state-independent parts (conv, norms, gates, gated norm) run at once.
constexpr int kTokenBlock = 4;

// Same branch structure as cpu::sigmoid (never exponentiates a positive number).
__device__ __forceinline__ float sigmoid_f(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}
__device__ __forceinline__ float softplus_f(float x) {
  return x > 20.0f ? x : log1pf(expf(x));
}

__device__ __forceinline__ float load_state(const float* p) {
  return *p;
}
__device__ __forceinline__ float load_state(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}
__device__ __forceinline__ void store_state(float* p, float v) {
  *p = v;
}
__device__ __forceinline__ void store_state(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);  // nearest even, as the CPU StateBuffer::store
}
// The value a store then a load of the state gives.
template <typename StateT>
__device__ __forceinline__ float round_state(float v) {
  if constexpr (std::is_same_v<StateT, float>)
    return v;
  else
    return __bfloat162float(__float2bfloat16_rn(v));
}

template <int D>
struct Cfg {
  static constexpr int kRpt = D >= 64 ? 32 : 16;  // state rows per thread (registers)
  static constexpr int kGroups = D / kRpt;        // row groups
  static constexpr int kThreads = D * kGroups;    // 64 (D 32), 128 (D 64), 512 (D 128)
  // Registers per thread: D 128 at 512 threads would take the whole register file at 128, so a
  // CTA could only start on an SM nothing else runs on (PDL overlaps kernels); 104 leaves room.
  static constexpr int kMaxRegs = D >= 128 ? 104 : 128;
};

// Lane 0 of a warp butterfly (warp_sum) over [w0 .. w(N-1), 0, ..., 0]: what block_sum gives
// when only the first N warps hold values, computed by one thread in the same order.
template <int N>
__device__ __forceinline__ float butterfly_lane0(const float* w) {
  float v[32];
#pragma unroll
  for (int l = 0; l < 32; ++l) v[l] = l < N ? w[l] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float nv[32];
#pragma unroll
    for (int l = 0; l < 32; ++l) nv[l] = v[l] + v[l ^ o];
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = nv[l];
  }
  return v[0];
}

// u, f, beta_logit, z and slot_of_row: no __restrict__ (PDL: their producer may still run when
// this kernel starts, so no ld.global.nc; see mma.cuh ld_act128).
template <int D, typename StateT>
__global__ void __launch_bounds__(Cfg<D>::kThreads) __maxnreg__(Cfg<D>::kMaxRegs)
    kda_decode_kernel(const __nv_bfloat16* u, const __nv_bfloat16* f,
                      const __nv_bfloat16* beta_logit, const __nv_bfloat16* z, KdaDecodeWeights w,
                      const int32_t* slot_of_row, __nv_bfloat16* conv_state, StateT* state,
                      __nv_bfloat16* __restrict__ out, int heads, int kernel,
                      KdaDecodeStrides ld,  // strides resolved (all non-zero)
                      KdaSnapshots snap) {
  // The recurrent state is written by no earlier kernel of the step (only by this layer's
  // kernel of the previous step, and by slot resets and snapshot restores: copies ordered before
  // the step's graph), and slot_of_row and snap.enabled are the step's input copies: the state
  // is read before the wait, so its bytes stream while the projection before it drains.
  detail::pdl_launch_dependents();
  using C = Cfg<D>;
  constexpr int B = kTokenBlock, kColWarps = D / 32;
  const int h = blockIdx.x, first = blockIdx.y, tid = threadIdx.x;
  const int rows = static_cast<int>(gridDim.y);
  const int64_t P = static_cast<int64_t>(heads) * D;
  const int hist = kernel - 1;
  const int32_t slot32 = slot_of_row[first];
  // A run of rows of one slot is that request's next tokens in order: the CTA of its first row
  // carries the state through all of them; the CTAs of the others have nothing to do.
  if (first > 0 && slot_of_row[first - 1] == slot32) return;
  int run = 1;
  while (first + run < rows && slot_of_row[first + run] == slot32) ++run;
  const int64_t slot = slot32;
  const bool keep = snap.enabled != nullptr && *snap.enabled != 0;

  __shared__ float qkv[B][3][D];             // post-conv q, k, v per token (q, k then L2-normed)
  __shared__ float alpha[B][D];              // exp(g) per token and key channel
  __shared__ float beta[B];                  // sigmoid(b) per token
  __shared__ float inv[B][2];                // 1/|q|, 1/|k| per token
  __shared__ float part[C::kGroups][D];      // per-row-group partial S^T k (one token at a time)
  __shared__ float opart[B][C::kGroups][D];  // per-row-group partial S^T q per token
  __shared__ float osq[B][kColWarps];        // warp sums of o^2 per token
  __shared__ float ud[D];                    // the delta-rule update u_j

  // The owned rows of column j stay in registers for the whole run.
  const int j = tid % D, grp = tid / D, i0 = grp * C::kRpt;
  const int warp = tid / 32, lane = tid % 32;
  StateT* S = state + (slot * heads + h) * static_cast<int64_t>(D) * D;  // [D][D]
  float s[C::kRpt];
#pragma unroll
  for (int r = 0; r < C::kRpt; ++r) s[r] = load_state(S + (i0 + r) * D + j);
  detail::pdl_wait();  // u, f, beta_logit, z: the projection's outputs

  // Tokens in blocks of B: what does not depend on the state (conv, norms, gates, the gated norm)
  // runs for the whole block at once; only the recurrence itself goes token by token.
  for (int t0 = 0; t0 < run; t0 += B) {
    const int nb = min(B, run - t0);
    // Snapshot t (the state after token t) when asked for and not the run's last token.
    const auto save = [&](int t) { return keep && t + 1 < run && t < snap.count; };
    // 1. Short conv + SiLU per channel c of stream sq (q, k, v), token by token in one thread
    // (its window carries in registers), then the window and any snapshots are stored.
    for (int e = tid; e < 3 * D; e += C::kThreads) {
      const int sq = e / D, d = e % D;
      const int64_t ch = sq * P + static_cast<int64_t>(h) * D + d;   // index into [3][P]
      const float* wc = w.conv + ch * kernel;                        // [kernel] fp32
      __nv_bfloat16* win = conv_state + (slot * 3 * P + ch) * hist;  // [kernel-1] bf16
      float x[kMaxKernel];
      for (int q = 0; q < hist; ++q) x[q] = __bfloat162float(win[q]);
      for (int tb = 0; tb < nb; ++tb) {
        const int64_t row = first + t0 + tb;
        const __nv_bfloat16 cur_b = u[row * ld.u + ch];
        const float cur = __bfloat162float(cur_b);
        float acc = 0.0f;
        for (int q = 0; q < hist; ++q) acc += wc[q] * x[q];
        acc += wc[hist] * cur;
        // The window holds bf16 pre-conv inputs, which u already is: the shift is exact.
        for (int q = 0; q + 1 < hist; ++q) x[q] = x[q + 1];
        if (hist > 0) x[hist - 1] = cur;
        if (save(t0 + tb)) {
          __nv_bfloat16* sw = snap.conv + (((t0 + tb) * snap.slots + slot) * 3 * P + ch) * hist;
          for (int q = 0; q < hist; ++q) sw[q] = __float2bfloat16_rn(x[q]);
        }
        qkv[tb][sq][d] = acc * sigmoid_f(acc);  // silu
      }
      for (int q = 0; q < hist; ++q) win[q] = __float2bfloat16_rn(x[q]);
    }
    // Decay gate per key channel and beta, per token.
    for (int e = tid; e < nb * D; e += C::kThreads) {
      const int tb = e / D, d = e % D;
      const int64_t row = first + t0 + tb, i = static_cast<int64_t>(h) * D + d;
      const float a = __bfloat162float(f[row * ld.f + i]) + w.dt_bias[i];
      const float a_scale = expf(w.a_log[h]);
      const float g = isnan(w.gate_lower_bound) ? -a_scale * softplus_f(a)
                                                : w.gate_lower_bound * sigmoid_f(a_scale * a);
      alpha[tb][d] = expf(g);
    }
    if (tid < nb)
      beta[tid] = sigmoid_f(__bfloat162float(beta_logit[(first + t0 + tid) * ld.beta + h]));
    __syncthreads();

    // 2. L2 norms (FLA: eps inside the root): one warp per (token, q or k).
    for (int task = warp; task < 2 * nb; task += C::kThreads / 32) {
      const int tb = task / 2, sq = task % 2;
      float ss = 0.0f;
      for (int d = lane; d < D; d += 32) ss += qkv[tb][sq][d] * qkv[tb][sq][d];
      ss = detail::warp_sum(ss);
      if (lane == 0) inv[tb][sq] = 1.0f / sqrtf(ss + 1e-6f);
    }
    __syncthreads();
    for (int e = tid; e < nb * 2 * D; e += C::kThreads) {
      const int tb = e / (2 * D), sq = (e / D) % 2, d = e % D;
      qkv[tb][sq][d] *= inv[tb][sq];
    }
    __syncthreads();

    // 3. The recurrence, token by token: decay the owned rows, partial S^T k -> u_j =
    // beta (v_j - k.S_j); rank-one write, partial S^T q from the UPDATED state (the CPU order).
    // The state carried to the next token is what a store and a load would give (rounded for a
    // bf16 state), so a run computes exactly what one-token steps would.
    for (int tb = 0; tb < nb; ++tb) {
      float acc = 0.0f;
#pragma unroll
      for (int r = 0; r < C::kRpt; ++r) {
        s[r] *= alpha[tb][i0 + r];
        acc += s[r] * qkv[tb][1][i0 + r];
      }
      part[grp][j] = acc;
      __syncthreads();
      if (grp == 0) {
        float kS = 0.0f;
#pragma unroll
        for (int g2 = 0; g2 < C::kGroups; ++g2) kS += part[g2][j];
        ud[j] = beta[tb] * (qkv[tb][2][j] - kS);
      }
      __syncthreads();
      const float uj = ud[j];
      const bool keep_t = save(t0 + tb);
      StateT* snap_S =
          keep_t ? static_cast<StateT*>(snap.state) +
                       (((t0 + tb) * snap.slots + slot) * heads + h) * static_cast<int64_t>(D) * D
                 : nullptr;
      acc = 0.0f;
#pragma unroll
      for (int r = 0; r < C::kRpt; ++r) {
        s[r] += qkv[tb][1][i0 + r] * uj;
        acc += s[r] * qkv[tb][0][i0 + r];
        s[r] = round_state<StateT>(s[r]);
        if (keep_t) store_state(snap_S + (i0 + r) * D + j, s[r]);
      }
      opart[tb][grp][j] = acc;
    }
    __syncthreads();

    // 4. o_j = scale * sum over row groups, the gated RMSNorm over the head (sum of o^2 as the
    // block-wide sum of the column warps would give it), out = o * inv * w * sigmoid(z).
    for (int e = tid; e < nb * D; e += C::kThreads) {
      const int tb = e / D, d = e % D;
      float o = 0.0f;
#pragma unroll
      for (int g2 = 0; g2 < C::kGroups; ++g2) o += opart[tb][g2][d];
      opart[tb][0][d] = o * w.scale;
    }
    __syncthreads();
    for (int task = warp; task < nb * kColWarps; task += C::kThreads / 32) {
      const int tb = task / kColWarps, cw = task % kColWarps;
      const float o = opart[tb][0][cw * 32 + lane];
      const float sum = detail::warp_sum(o * o);
      if (lane == 0) osq[tb][cw] = sum;
    }
    __syncthreads();
    for (int e = tid; e < nb * D; e += C::kThreads) {
      const int tb = e / D, d = e % D;
      const float ss = butterfly_lane0<kColWarps>(osq[tb]);
      const float rinv = 1.0f / sqrtf(ss / static_cast<float>(D) + w.eps);
      const int64_t row = first + t0 + tb, c = static_cast<int64_t>(h) * D + d;
      const float y =
          opart[tb][0][d] * rinv * w.o_norm[d] * sigmoid_f(__bfloat162float(z[row * ld.z + c]));
      out[row * P + c] = __float2bfloat16_rn(y);
    }
    __syncthreads();  // the block's shared arrays are rewritten by the next one
  }
#pragma unroll
  for (int r = 0; r < C::kRpt; ++r) store_state(S + (i0 + r) * D + j, s[r]);
}

template <typename StateT>
void launch(const __nv_bfloat16* u, const __nv_bfloat16* f, const __nv_bfloat16* beta_logit,
            const __nv_bfloat16* z, const KdaDecodeWeights& w, const int32_t* slot_of_row,
            __nv_bfloat16* conv_state, StateT* state, __nv_bfloat16* out, const KdaDecodeShape& sh,
            cudaStream_t stream, KdaDecodeStrides ld, const KdaSnapshots& snap) {
  K3_CHECK(sh.heads > 0 && sh.heads <= 65535, "kda_decode_step: heads = ", sh.heads);
  K3_CHECK(sh.kernel >= 1 && sh.kernel <= kMaxKernel, "kda_decode_step: kernel = ", sh.kernel,
           " (1..", kMaxKernel, ")");
  K3_CHECK(sh.rows >= 0 && sh.rows <= 65535, "kda_decode_step: rows = ", sh.rows);
  K3_CHECK(u && f && beta_logit && z && w.conv && w.dt_bias && w.a_log && w.o_norm && slot_of_row &&
               state && out && (sh.kernel == 1 || conv_state),
           "kda_decode_step: null pointer");
  const int64_t P = static_cast<int64_t>(sh.heads) * sh.head_dim;
  // 0 = packed; an explicit stride narrower than the row would alias rows.
  const auto resolve = [](int64_t given, int64_t width, const char* what) {
    K3_CHECK(given == 0 || given >= width, "kda_decode_step: ", what, " row stride ", given,
             " < row width ", width);
    return given == 0 ? width : given;
  };
  ld.u = resolve(ld.u, 3 * P, "u");
  ld.f = resolve(ld.f, P, "f");
  ld.beta = resolve(ld.beta, sh.heads, "beta_logit");
  ld.z = resolve(ld.z, P, "z");
  K3_CHECK(snap.enabled == nullptr ||
               (snap.count >= 1 && snap.slots >= 1 && snap.state && (sh.kernel == 1 || snap.conv)),
           "kda_decode_step: snapshots without buffers");
  if (sh.rows == 0) return;
  const dim3 grid(static_cast<unsigned>(sh.heads), static_cast<unsigned>(sh.rows));
  switch (sh.head_dim) {
    case 32:
      kda_decode_kernel<32, StateT>
          <<<grid, Cfg<32>::kThreads, 0, stream>>>(u, f, beta_logit, z, w, slot_of_row, conv_state,
                                                   state, out, sh.heads, sh.kernel, ld, snap);
      break;
    case 64:
      kda_decode_kernel<64, StateT>
          <<<grid, Cfg<64>::kThreads, 0, stream>>>(u, f, beta_logit, z, w, slot_of_row, conv_state,
                                                   state, out, sh.heads, sh.kernel, ld, snap);
      break;
    case 128:
      kda_decode_kernel<128, StateT>
          <<<grid, Cfg<128>::kThreads, 0, stream>>>(u, f, beta_logit, z, w, slot_of_row, conv_state,
                                                    state, out, sh.heads, sh.kernel, ld, snap);
      break;
    default:
      fail("kda_decode_step: head_dim ", sh.head_dim, " unsupported (32, 64, 128)");
  }
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace

void kda_decode_step(const __nv_bfloat16* u, const __nv_bfloat16* f,
                     const __nv_bfloat16* beta_logit, const __nv_bfloat16* z,
                     const KdaDecodeWeights& w, const int32_t* slot_of_row,
                     __nv_bfloat16* conv_state, float* state, __nv_bfloat16* out,
                     const KdaDecodeShape& shape, cudaStream_t stream,
                     const KdaDecodeStrides& strides, const KdaSnapshots& snapshots) {
  launch(u, f, beta_logit, z, w, slot_of_row, conv_state, state, out, shape, stream, strides,
         snapshots);
}
void kda_decode_step(const __nv_bfloat16* u, const __nv_bfloat16* f,
                     const __nv_bfloat16* beta_logit, const __nv_bfloat16* z,
                     const KdaDecodeWeights& w, const int32_t* slot_of_row,
                     __nv_bfloat16* conv_state, __nv_bfloat16* state, __nv_bfloat16* out,
                     const KdaDecodeShape& shape, cudaStream_t stream,
                     const KdaDecodeStrides& strides, const KdaSnapshots& snapshots) {
  launch(u, f, beta_logit, z, w, slot_of_row, conv_state, state, out, shape, stream, strides,
         snapshots);
}

}  // namespace k3::cuda
