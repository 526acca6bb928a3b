// One fused Kimi Delta Attention decode step (spec 3.2) for a batch of tokens: short conv
// + SiLU (conv window updated), per-head L2 norm of q and k, decay gate, beta = sigmoid, the
// delta-rule recurrence on the stored state, gated RMSNorm. Matches the CPU chain of
// cpu/layer_kda.cpp (kda_short_conv_step, l2_normalize, kda_decay_gate, sigmoid,
// kda_recurrence_step, kda_gated_norm, bf16 rounding of the output) on the same inputs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// Per-layer weights and constants, all device pointers (P = heads * head_dim).
struct KdaDecodeWeights {
  const float* conv = nullptr;     // [3 (q,k,v)][P][kernel] fp32; tap kernel-1 = current token
  const float* dt_bias = nullptr;  // [P] fp32
  const float* a_log = nullptr;    // [>= heads] fp32 (only the first `heads` are read)
  const float* o_norm = nullptr;   // [head_dim] fp32, shared by every head
  float gate_lower_bound = 0.0f;   // K3 form lb * sigmoid(exp(a_log) a); NaN: softplus form
  float eps = 1e-6f;               // rms_norm_eps (gated norm); the q/k L2 norm uses 1e-6
  float scale = 1.0f;              // 1 / sqrt(head_dim)
};

struct KdaDecodeShape {
  int64_t rows = 0;  // tokens in the batch (runs of consecutive rows may share a slot)
  int heads = 0;     // any count
  int head_dim = 0;  // 32, 64 or 128
  int kernel = 0;    // short conv taps, 1..8
};

// Row strides (elements between consecutive rows) of the four inputs, so the outputs of one
// fused projection GEMM can be read in place. 0 = the packed default: u 3P, f P, beta heads,
// z P. A non-zero stride must be at least the row width. The out tensor is always packed.
struct KdaDecodeStrides {
  int64_t u = 0, f = 0, beta = 0, z = 0;
};

// Copies of the KDA state after the tokens of a run (speculative verify: commit restores the
// accepted prefix's copy). When *enabled is nonzero, the CTA of a run of n rows writes the state
// after its token t < n - 1 (t < count) into copy t of its slot; the run's last state goes to
// the slot as always. enabled lives in device memory, so one captured graph serves verify steps
// and plain ones.
struct KdaSnapshots {
  __nv_bfloat16* conv = nullptr;     // [count][slots][3][P][kernel-1] bf16
  void* state = nullptr;             // [count][slots][heads][D][D], the state's dtype
  int64_t slots = 0;                 // slots per copy
  int count = 0;                     // copies reserved
  const int32_t* enabled = nullptr;  // device int32; null: never
};

// u:           [rows][3][P] bf16 (row stride strides.u), pre-conv q, k, v projections
// f:           [rows][P] bf16 (row stride strides.f), f_b(f_a(x)) (decay-gate pre-activation,
//              before dt_bias)
// beta_logit:  [rows][heads] bf16 (row stride strides.beta), b_proj(x)
// z:           [rows][P] bf16 (row stride strides.z), output-gate projection
// slot_of_row: [rows] int32 in DEVICE memory (a captured graph reads the mapping at replay);
//              rows of one slot must be consecutive (a run: that request's tokens in order)
// conv_state:  [slots][3][P][kernel-1] bf16, oldest first; updated in place
// state:       [slots][heads][head_dim][head_dim] fp32 or bf16, rows = key channel; in place
// out:         [rows][P] bf16 = rms_norm(o_h; o_norm, eps) * sigmoid(z), the o_proj input
// One CTA per (row, head), of which the first row of each run works (the others exit), so the
// launch never depends on the runs; no allocation, no host sync; other slots are untouched.
void kda_decode_step(const __nv_bfloat16* u, const __nv_bfloat16* f,
                     const __nv_bfloat16* beta_logit, const __nv_bfloat16* z,
                     const KdaDecodeWeights& w, const int32_t* slot_of_row,
                     __nv_bfloat16* conv_state, float* state, __nv_bfloat16* out,
                     const KdaDecodeShape& shape, cudaStream_t stream,
                     const KdaDecodeStrides& strides = {}, const KdaSnapshots& snapshots = {});
void kda_decode_step(const __nv_bfloat16* u, const __nv_bfloat16* f,
                     const __nv_bfloat16* beta_logit, const __nv_bfloat16* z,
                     const KdaDecodeWeights& w, const int32_t* slot_of_row,
                     __nv_bfloat16* conv_state, __nv_bfloat16* state, __nv_bfloat16* out,
                     const KdaDecodeShape& shape, cudaStream_t stream,
                     const KdaDecodeStrides& strides = {}, const KdaSnapshots& snapshots = {});

}  // namespace k3::cuda
