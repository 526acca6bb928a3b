// The small ops that chain the stock decode step on the GPU (cpu/backbone.cpp, cpu/layer_*.cpp):
// embedding rows, bf16 adds, the MLA absorption around the latent attention, the latent cache
// append, the MoE combine, and a generic grouped bf16 GEMM for bf16 experts. Each matches the
// CPU reference's arithmetic on the same bf16-valued inputs (fp32 math, bf16 where the CPU
// rounds). No allocation, no host sync: per-step values come from device memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// embed: [vocab, hidden] bf16; tokens: [rows] int32 (device, each in [0, vocab): a token outside
// writes a zero row, never reads out of bounds); out: [rows, hidden] bf16.
void embed_rows(const __nv_bfloat16* embed, int64_t vocab, int64_t hidden, const int32_t* tokens,
                int64_t rows, __nv_bfloat16* out, cudaStream_t stream);

// out[i] = bf16(float(a[i]) + float(b[i])) over n elements; out may alias a or b.
void add_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, __nv_bfloat16* out,
              cudaStream_t stream);

// sum[i] = bf16(a[i] + b[i]), then res[i] = bf16(res[i] + sum[i]): two add_bf16 in one launch
// (the MoE output = routed + shared, then the layer residual), rounding as they do.
void add_bf16_residual(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n,
                       __nv_bfloat16* sum, __nv_bfloat16* res, cudaStream_t stream);

// MLA query absorption (cpu::mla_absorbed_decode, q~ = W_uk^T q_nope, rounded to bf16):
// q:     [rows][heads][nope + rope] bf16 (the q_b / q_proj output)
// kv_b:  [heads * (nope + v), kv_lora] bf16; head h rows h*(nope+v) + [0, nope) are W_uk
// q_abs: [rows][heads][kv_lora] bf16 = bf16(sum_i q[r,h,i] * kv_b[h*(nope+v)+i, c]), fp32 sum
// q_pe:  [rows][heads][rope] bf16 = q[r,h,nope:] (a copy)
void mla_absorb_q(const __nv_bfloat16* q, const __nv_bfloat16* kv_b, int64_t rows, int heads,
                  int nope, int rope, int v, int kv_lora, __nv_bfloat16* q_abs, __nv_bfloat16* q_pe,
                  cudaStream_t stream);

// MLA value up-projection and output gate (cpu layer_mla.cpp after the attention):
// o_latent: [rows][heads][kv_lora] fp32 = sum_t p_t c_t (mla_decode output)
// kv_b:     as above; head h rows h*(nope+v) + nope + [0, v) are W_uv
// gate:     [rows][heads * v] bf16 g_proj output, or null (no gate)
// o:        [rows][heads * v] bf16: o = bf16(sum_c W_uv[j, c] * o_latent[r,h,c]);
//           with a gate o = bf16(o * sigmoid(gate))
void mla_unabsorb_v(const float* o_latent, const __nv_bfloat16* kv_b, const __nv_bfloat16* gate,
                    int64_t rows, int heads, int nope, int v, int kv_lora, __nv_bfloat16* o,
                    cudaStream_t stream);

// Appends each row's latent entry to a paged bf16 cache:
// kv:          [rows][width] bf16 (normed c then k_pe; width = kv_lora + rope)
// block_table: [rows][max_pages] int32 page ids (device)
// position:    [rows] int32 token index written (device); page = block_table[r][pos / page_size]
// cache:       [num_pages][page_size][width] bf16
void mla_cache_append(const __nv_bfloat16* kv, int64_t rows, int width, const int32_t* block_table,
                      int max_pages, const int32_t* position, int page_size, __nv_bfloat16* cache,
                      cudaStream_t stream);

// MoE combine (cpu layer_ffn.cpp moe_ffn): per row r,
//   acc = sum_{j < top_k, ascending} weights[r, j] * float(y[r * top_k + j])   (fp32)
//   if norm_w: acc = rms_norm(acc; norm_w, eps) (fp32)
//   out[r] = bf16(acc)
// y: [rows * top_k][width] bf16 expert outputs, row r * top_k + j holding choice j of row r,
//    or, with y_pos ([rows * top_k] int32, device), at row y_pos[r * top_k + j] (expert-grouped
//    order; y_pos < 0: the choice's expert is another rank's, left out of this rank's sum);
//    weights: [rows][top_k] fp32; norm_w: [width] fp32 or null; out: [rows][width] bf16.
void moe_combine(const __nv_bfloat16* y, const float* weights, int64_t rows, int top_k,
                 int64_t width, const float* norm_w, float eps, __nv_bfloat16* out,
                 cudaStream_t stream, const int32_t* y_pos = nullptr);

// Grouped bf16 GEMM (bf16 experts, e.g. Kimi-Linear), same slot semantics as Mxfp4Grouped:
//   for s < n_slots with e = slot_expert[s] >= 0, for r in [slot_offsets[s], slot_offsets[s+1]):
//     y[r, :] = W_e . x[row_index ? row_index[r] : r, :]      (fp32 accumulation)
struct Bf16Grouped {
  const __nv_bfloat16* const* w = nullptr;  // device [n_experts] -> [N, K] bf16
  const int32_t* slot_expert = nullptr;     // device [n_slots]
  const int32_t* slot_offsets = nullptr;    // device [n_slots + 1], non-decreasing
  const int32_t* row_index = nullptr;       // device [rows] or null
  int n_slots = 0;
};
// x: [*, K] bf16, row stride ldx; y: [rows, N] bf16 or fp32 (y_fp32), row stride ldy.
void linear_bf16_grouped(const Bf16Grouped& g, const __nv_bfloat16* x, int64_t ldx, int64_t N,
                         int64_t K, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream);

// Linear with an fp32 weight (small fp32 tensors some checkpoints ship, e.g. a router):
// x: [M, K] bf16, row stride ldx; w: [N, K] fp32; y: [M, N] bf16 or fp32, row stride ldy.
void linear_f32w(const __nv_bfloat16* x, int64_t ldx, const float* w, int64_t M, int64_t N,
                 int64_t K, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream);

}  // namespace k3::cuda
