// The stock CUDA decode step (decode_backend = auto): the CPU reference backbone
// (cpu/backbone.cpp) as a chain of one kernel (or cuBLAS-free GEMM) per op over a batch of rows,
// one token per row, each row its own request slot. Every boundary tensor is bf16 where the
// reference rounds to bf16, so both compute the same function up to fp32 summation order.
//
// A step takes only the rows' slot ids and tokens from the host (copied into device buffers);
// positions, lengths, block tables and expert ids live in device memory. So the step of each
// batch size is captured once as a CUDA graph (after its first eager run, which also sets up
// kernel attributes) and replayed from then on; replay and eager give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_state.h"
#include "cuda/device_weights.h"
#include "cuda/mla_decode.h"
#include "model/config.h"

namespace k3::cuda {

// Per-sublayer observer for diff reports (the CPU backbone's LayerObserver): layer, "attn" or
// "ffn", and that sublayer's output for every row, [rows][hidden] as floats.
using LayerTap = std::function<void(int layer, const char* part, const std::vector<float>& out)>;

struct CudaBackboneOptions {
  int max_rows = 64;   // rows (requests) per step
  SlotPoolShape pool;  // slots, context, page size, KDA state dtype
  bool use_graphs = true;
};

class CudaBackbone {
 public:
  CudaBackbone(const ModelConfig& cfg, const ModelWeights& w, const CudaBackboneOptions& opt);
  ~CudaBackbone();
  CudaBackbone(const CudaBackbone&) = delete;
  CudaBackbone& operator=(const CudaBackbone&) = delete;

  const ModelConfig& config() const { return cfg_; }
  SlotPool& pool() { return *pool_; }
  int max_rows() const { return opt_.max_rows; }
  cudaStream_t stream() const { return stream_; }

  // Zeroes a slot for a new request (ordered before the next step).
  void reset_slot(int slot);
  int64_t position(int slot) const;  // tokens the slot has consumed (host mirror, no sync)
  // Speculative verify support (SlotPool's snapshots): keep / restore slot s's KDA state as
  // copy `index`, and move its position back to an accepted length.
  void reserve_snapshots(int n) { pool_->reserve_snapshots(n); }
  void save_kda(int slot, int index) { pool_->save_kda(slot, index, stream_); }
  void restore_kda(int slot, int index) { pool_->restore_kda(slot, index, stream_); }
  void set_position(int slot, int64_t position);
  // Benchmarks: slot s as if `tokens` tokens had been decoded (SlotPool::fill_synthetic).
  void assume_context(int slot, int64_t tokens);

  // One decode step, asynchronous: row r feeds tokens[r] into slot slots[r] (slots distinct,
  // 1 <= rows <= max_rows). Afterwards logits() holds [rows][vocab] fp32.
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens);
  const float* logits() const;  // [max_rows][vocab] fp32 (device)
  // Waits for the step and copies rows x vocab logits to the host.
  void logits_to_host(int64_t rows, float* out);
  // Greedy ids of the last step's rows (argmax on the device; waits).
  void greedy(int64_t rows, int32_t* ids);

  // With a tap set, steps run eagerly and stop after each sublayer to copy its output out
  // (slow; diff reports only). An empty tap restores normal steps.
  void set_layer_tap(LayerTap tap) { tap_ = std::move(tap); }

  int graphs_captured() const { return static_cast<int>(graphs_.size()); }
  uint64_t weight_bytes() const { return weights_->bytes(); }

 private:
  struct Buffers;
  void enqueue(int64_t rows);  // every kernel of one step on stream_
  void attn_kda(int layer, int64_t rows);
  void attn_mla(int layer, int64_t rows);
  void dsa_select(int layer, int64_t rows);  // fills the rows' selected token lists
  void ffn_dense(int layer, int64_t rows);
  void ffn_moe(int layer, int64_t rows);
  void mix(int n_blocks, const float* score_w, int64_t rows, __nv_bfloat16* out);
  const MlaDecodePlan& mla_plan(int64_t rows);

  const ModelConfig& cfg_;
  CudaBackboneOptions opt_;
  std::unique_ptr<DeviceWeights> weights_;
  std::unique_ptr<SlotPool> pool_;
  std::unique_ptr<Buffers> buf_;
  cudaStream_t stream_ = nullptr;
  int sms_ = 0;
  std::map<int64_t, MlaDecodePlan> mla_plans_;
  std::map<int64_t, cudaGraphExec_t> graphs_;
  std::map<int64_t, bool> ran_eager_;
  std::vector<int64_t> host_pos_;
  LayerTap tap_;
  void tap(int layer, const char* part,
           int64_t rows);       // [slots] positions as the host has enqueued them
  int32_t* host_in_ = nullptr;  // pinned [2][max_rows]: slots then tokens
  cudaEvent_t inputs_copied_ = nullptr;
};

}  // namespace k3::cuda
