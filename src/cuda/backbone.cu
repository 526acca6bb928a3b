#include "cuda/backbone.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "cuda/attn_res_norm.h"
#include "cuda/backbone_buffers.h"
#include "cuda/check.h"
#include "cuda/graph_pdl.h"
#include "cuda/linear_plan.h"
#include "cuda/rank_ops.h"
#include "cuda/rms_norm.h"
#include "cuda/step_ops.h"

namespace k3::cuda {

CudaBackbone::CudaBackbone(const ModelConfig& cfg, const ModelWeights& w,
                           const CudaBackboneOptions& opt)
    : cfg_(cfg), opt_(opt) {
  K3_CHECK(opt.max_rows >= 1, "max_rows must be >= 1, got ", opt.max_rows);
  check_cuda_support(cfg, w);
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  K3_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev));
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  K3_CUDA_CHECK(cudaEventCreateWithFlags(&inputs_copied_, cudaEventDisableTiming));
  K3_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_in_),
                               (2 * static_cast<size_t>(opt.max_rows) + 1) * sizeof(int32_t)));
  setup_ranks();
  weights_ = std::make_unique<DeviceWeights>(cfg, w);
  upload_fused_input();
  check_expert_slices();
  bind_pool();
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  K3_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  K3_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  K3_CUDA_CHECK(cudaEventCreateWithFlags(&kv_ready_, cudaEventDisableTiming));
  for (size_t i = 0; i < opt.capture_sizes.size(); ++i)
    K3_CHECK(opt.capture_sizes[i] >= 1 && opt.capture_sizes[i] <= opt.max_rows &&
                 (i == 0 || opt.capture_sizes[i] > opt.capture_sizes[i - 1]),
             "capture sizes must ascend within 1..max_rows (", opt.max_rows, ")");
  capture_specialized();
}

void CudaBackbone::upload_fused_input() {
  const FusedInputWeights& f = opt_.fused_input;
  if (!f.enabled()) return;
  const int64_t H = cfg_.hidden_size;
  K3_CHECK(f.eh_proj->format == WeightFormat::BF16 && f.eh_proj->rows == H &&
               f.eh_proj->cols == 2 * H && f.enorm && f.hnorm &&
               static_cast<int64_t>(f.enorm->size()) == H &&
               static_cast<int64_t>(f.hnorm->size()) == H,
           "fused input: eh_proj must be bf16 [", H, ", ", 2 * H, "] and enorm / hnorm [", H, "]");
  eh_proj_ = DeviceBuffer<__nv_bfloat16>(static_cast<size_t>(H * 2 * H));
  copy_to_device(eh_proj_, static_cast<const uint16_t*>(f.eh_proj->data),
                 static_cast<size_t>(H * 2 * H));
  enorm_ = to_device<float>(*f.enorm);
  hnorm_ = to_device<float>(*f.hnorm);
  K3_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_hidden_),
                               static_cast<size_t>(opt_.max_rows * H) * sizeof(uint16_t)));
}

void CudaBackbone::capture_specialized() {
  if (opt_.capture_sizes.empty() || !opt_.use_graphs) return;
  // Warm-up steps (kernel attributes, plans) and captures run on the first slots, which are
  // reset afterwards: no request exists yet. With fewer slots than rows, rows share slots in
  // runs (as a verify's do).
  std::vector<int32_t> slots, tokens;
  const int S = pool_->slots();
  for (const int n : opt_.capture_sizes) {
    slots.resize(static_cast<size_t>(n));
    tokens.resize(static_cast<size_t>(n));
    const int per_slot = (n + S - 1) / S;
    for (int r = 0; r < n; ++r) {
      slots[static_cast<size_t>(r)] = r / per_slot;
      // Spread tokens: the warm-up step also times the GEMM plans (linear_launch.cuh), and the
      // grouped expert GEMMs should see a routing like a real batch's, not one token's.
      tokens[static_cast<size_t>(r)] =
          static_cast<int32_t>((static_cast<int64_t>(r) * 7919 + 11) % cfg_.vocab_size);
    }
    // A draft backbone warms up on zero hidden rows.
    const std::vector<float> zeros(
        opt_.fused_input.enabled() ? static_cast<size_t>(n * cfg_.hidden_size) : 0, 0.0f);
    const float* hidden = opt_.fused_input.enabled() ? zeros.data() : nullptr;
    run_step(slots, tokens, hidden, StepPath::Specialized, false);  // eager
    run_step(slots, tokens, hidden, StepPath::Specialized, false);  // captured
  }
  for (int r = 0; r < std::min(S, opt_.capture_sizes.back()); ++r) reset_slot(r);
  K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackbone::reserve_snapshots(int n) {
  if (n <= pool_->snapshots()) return;
  K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
  // The KDA kernels of the captured graphs point at the old copies.
  for (auto& [key, exec] : graphs_) K3_CUDA_CHECK(cudaGraphExecDestroy(exec));
  graphs_.clear();
  pool_->reserve_snapshots(n);
}

void CudaBackbone::set_specialized_tuning(const SpecializedTuning& t) {
  K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (auto it = graphs_.begin(); it != graphs_.end();) {
    if (it->first % 2 == 1) {
      K3_CUDA_CHECK(cudaGraphExecDestroy(it->second));
      it = graphs_.erase(it);
    } else {
      ++it;
    }
  }
  opt_.tuning = t;
  capture_specialized();
}

void CudaBackbone::rebind_cache(const SlotPoolShape& shape) {
  K3_CHECK(shape.slots >= 1, "rebind_cache: at least one slot");
  K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const int snapshots = pool_->snapshots();
  for (auto& [key, exec] : graphs_) K3_CUDA_CHECK(cudaGraphExecDestroy(exec));
  graphs_.clear();
  ran_eager_.clear();
  mla_plans_.clear();
  opt_.pool = shape;
  buf_.reset();
  pool_.reset();
  bind_pool();
  pool_->reserve_snapshots(snapshots);
  capture_specialized();
}

void CudaBackbone::bind_pool() {
  // DCP: this rank caches every dcp-th token of each context.
  opt_.pool.cache_shards = opt_.ranks.dcp() ? opt_.ranks.layout.dcp : 1;
  pool_ = std::make_unique<SlotPool>(cfg_, opt_.pool);
  host_pos_.assign(static_cast<size_t>(opt_.pool.slots), 0);
  size_t mla_ws = 0;
  // Attention rows: the step's, or under DCP every rank's queries over this rank's tokens.
  const int attn_rows = opt_.max_rows * opt_.pool.cache_shards;
  if (cfg_.num_hidden_layers > static_cast<int>(cfg_.linear_attn_config.kda_layers.size()))
    for (int r = 1; r <= attn_rows; ++r)
      for (const bool invariant : {false, true})
        mla_ws = std::max(mla_ws, mla_decode_workspace_bytes(mla_plan(r, invariant)));
  buf_ = std::make_unique<Buffers>(cfg_, *weights_, opt_.max_rows, pool_->pages_per_slot(),
                                   opt_.pool.max_context, mla_ws, opt_.ranks);
}

CudaBackbone::~CudaBackbone() {
  // Destructors must not throw: errors here are left for the next checked call.
  for (auto& [key, exec] : graphs_) (void)cudaGraphExecDestroy(exec);
  if (fork_) (void)cudaEventDestroy(fork_);
  if (join_) (void)cudaEventDestroy(join_);
  if (kv_ready_) (void)cudaEventDestroy(kv_ready_);
  if (side_) (void)cudaStreamDestroy(side_);
  if (host_in_) (void)cudaFreeHost(host_in_);
  if (host_hidden_) (void)cudaFreeHost(host_hidden_);
  if (inputs_copied_) (void)cudaEventDestroy(inputs_copied_);
  if (stream_) (void)cudaStreamDestroy(stream_);
}

const float* CudaBackbone::logits() const {
  return buf_->logits.data();
}

void CudaBackbone::reset_slot(int slot) {
  pool_->reset(slot, stream_);
  host_pos_[static_cast<size_t>(slot)] = 0;
}

void CudaBackbone::assume_context(int slot, int64_t tokens) {
  pool_->fill_synthetic(slot, tokens, stream_);
  host_pos_[static_cast<size_t>(slot)] = tokens;
}

void CudaBackbone::set_position(int slot, int64_t position) {
  pool_->set_position(slot, position, stream_);
  host_pos_[static_cast<size_t>(slot)] = position;
}

int64_t CudaBackbone::position(int slot) const {
  K3_CHECK(slot >= 0 && slot < pool_->slots(), "slot ", slot, " outside the pool");
  return host_pos_[static_cast<size_t>(slot)];
}

const MlaDecodePlan& CudaBackbone::mla_plan(int64_t rows) {
  return mla_plan(rows, batch_invariant());
}

const MlaDecodePlan& CudaBackbone::mla_plan(int64_t rows, bool invariant) {
  const int64_t key = rows * 2 + (invariant ? 1 : 0);
  auto it = mla_plans_.find(key);
  if (it != mla_plans_.end()) return it->second;
  MlaDecodePlan p;
  p.rows = static_cast<int>(rows);
  p.heads = cfg_.num_attention_heads;
  p.kv_lora = cfg_.kv_lora_rank;
  p.rope = cfg_.qk_rope_head_dim;
  p.page_size = opt_.pool.page_size;
  p.max_pages = pool_->pages_per_slot();
  p.tensor_cores = mla_tensor_cores();
  p.ring_tiles = mla_ring_tiles();
  if (cfg_.dsa_config.enabled) {
    p.max_sel = cfg_.dsa_config.index_topk;
    p.max_tokens = std::min<int64_t>(cfg_.dsa_config.index_topk, opt_.pool.max_context);
  } else {
    p.max_tokens = opt_.pool.cached_tokens();
  }
  MlaDecodePlan plan = plan_mla_decode(p, sms_);
  // Batch-invariant: the one-row split of the tokens, so a row's sum order is its own.
  if (invariant && rows != 1) plan.splits = mla_plan(1, true).splits;
  return mla_plans_.emplace(key, plan).first->second;
}

void CudaBackbone::step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                        StepPath path, bool keep_kda_states) {
  K3_CHECK(!opt_.fused_input.enabled(),
           "this backbone is a draft model's (fused input): it steps with hidden rows "
           "(step_fused)");
  run_step(slots, tokens, nullptr, path, keep_kda_states);
}

void CudaBackbone::step_fused(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                              const float* hidden, StepPath path) {
  K3_CHECK(opt_.fused_input.enabled() && hidden != nullptr,
           "step_fused: a backbone built with fused_input, and hidden rows, are needed");
  run_step(slots, tokens, hidden, path, false);
}

void CudaBackbone::run_step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                            const float* hidden, StepPath path, bool keep_kda_states) {
  const int64_t rows = static_cast<int64_t>(slots.size());
  const int64_t longest = check_step_rows(slots, tokens, opt_.max_rows, cfg_.vocab_size, host_pos_,
                                          opt_.pool.max_context, opt_.padding_slot);
  K3_CHECK(path == StepPath::Stock || rows <= max_capture_rows(), "a specialized step takes 1..",
           max_capture_rows(), " rows (the largest capture size), got ", rows);
  K3_CHECK(!keep_kda_states || longest - 1 <= pool_->snapshots(), "a run of ", longest,
           " rows keeps ", longest - 1, " KDA snapshots; ", pool_->snapshots(),
           " are reserved (reserve_snapshots)");
  for (int64_t r = 0; r < rows; ++r)
    ++host_pos_[static_cast<size_t>(slots[static_cast<size_t>(r)])];

  // The pinned staging buffer is reused: the previous step's copy must have left it.
  K3_CUDA_CHECK(cudaEventSynchronize(inputs_copied_));
  std::copy(slots.begin(), slots.end(), host_in_);
  std::copy(tokens.begin(), tokens.end(), host_in_ + opt_.max_rows);
  host_in_[2 * opt_.max_rows] = keep_kda_states ? 1 : 0;
  copy_to_device_async(buf_->slots.data(), host_in_, static_cast<size_t>(rows), stream_);
  copy_to_device_async(buf_->tokens.data(), host_in_ + opt_.max_rows, static_cast<size_t>(rows),
                       stream_);
  copy_to_device_async(buf_->keep_kda.data(), host_in_ + 2 * opt_.max_rows, 1, stream_);
  if (hidden) {
    const size_t n = static_cast<size_t>(rows * cfg_.hidden_size);
    for (size_t i = 0; i < n; ++i) host_hidden_[i] = float_to_bf16(hidden[i]);
    copy_to_device_async(buf_->in_hidden.data(), host_hidden_, n, stream_);
  }
  K3_CUDA_CHECK(cudaEventRecord(inputs_copied_, stream_));

  if (!opt_.use_graphs || tap_ || marks_)
    enqueue(rows, path);
  else
    run_graph(rows, path);
}

void CudaBackbone::run_graph(int64_t rows, StepPath path) {
  const int64_t key = rows * 2 + (path == StepPath::Specialized ? 1 : 0);
  auto it = graphs_.find(key);
  if (it == graphs_.end() && !ran_eager_[key]) {
    // First step of this size runs eagerly: it sets kernel attributes and caches plans, which
    // must not happen inside a capture.
    enqueue(rows, path);
    ran_eager_[key] = true;
    return;
  }
  if (it == graphs_.end()) {
    cudaGraph_t graph = nullptr;
    foreign_nodes_.clear();
    const ForeignNodeScope foreign(foreign_nodes_);  // cuBLAS plans of the tuner
    K3_CUDA_CHECK(cudaStreamBeginCapture(stream_, capture_mode()));
    try {
      enqueue(rows, path);
    } catch (...) {
      (void)cudaStreamEndCapture(stream_, &graph);
      if (graph) (void)cudaGraphDestroy(graph);
      throw;
    }
    K3_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    if (path == StepPath::Specialized && opt_.tuning.pdl_for(rows)) {
      try {
        make_kernel_edges_programmatic(graph, foreign_nodes_);
      } catch (...) {
        (void)cudaGraphDestroy(graph);
        throw;
      }
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    K3_CUDA_CHECK(inst);
    it = graphs_.emplace(key, exec).first;
  }
  K3_CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
}

void CudaBackbone::enqueue(int64_t rows, StepPath path) {
  if (path == StepPath::Specialized)
    enqueue_specialized(rows);
  else
    enqueue_stock(rows);
}

void CudaBackbone::mix_norm(int n_blocks, const float* score_w, const float* norm_w, int64_t R) {
  Buffers& b = *buf_;
  const int64_t H = cfg_.hidden_size;
  if (!cfg_.has_attn_res()) {
    rms_norm(b.P.data(), H, norm_w, R, H, cfg_.rms_norm_eps, b.x.data(), H, stream_);
    return;
  }
  AttnResSources src;
  K3_CHECK(n_blocks + 1 <= AttnResSources::kMax, "AttnRes bank of ", n_blocks, " blocks");
  for (int j = 0; j < n_blocks; ++j) src.src[j] = b.bank_block(j);
  src.src[n_blocks] = b.P.data();
  attn_res_mix_norm(src, n_blocks + 1, H, score_w, R, H, cfg_.rms_norm_eps, norm_w, b.x.data(), H,
                    stream_);
}

// AttnRes: the residual stream so far becomes bank block j (a restart layer's write).
void CudaBackbone::write_bank_block(int j, int64_t R) {
  Buffers& b = *buf_;
  K3_CUDA_CHECK(cudaMemcpyAsync(b.bank_block(j), b.P.data(),
                                static_cast<size_t>(R * cfg_.hidden_size) * sizeof(__nv_bfloat16),
                                cudaMemcpyDeviceToDevice, stream_));
}

// After the attention sublayer: a restart layer starts the stream anew from its output
// (P = sub), any other adds it (P += sub).
void CudaBackbone::attn_residual(bool restart, int64_t R) {
  Buffers& b = *buf_;
  const int64_t n = R * cfg_.hidden_size;
  if (restart)
    K3_CUDA_CHECK(cudaMemcpyAsync(b.P.data(), b.sub.data(),
                                  static_cast<size_t>(n) * sizeof(__nv_bfloat16),
                                  cudaMemcpyDeviceToDevice, stream_));
  else
    add_bf16(b.P.data(), b.sub.data(), n, b.P.data(), stream_);
}

void CudaBackbone::prepare_step_rows(int64_t R) {
  Buffers& b = *buf_;
  prepare_rows(b.slots.data(), R, pool_->positions(), pool_->block_table(), pool_->pages_per_slot(),
               b.row_pos.data(), b.row_seq.data(), b.row_table.data(), stream_);
  if (opt_.ranks.dcp())
    dcp_rows(b.row_pos.data(), b.row_table.data(), R, pool_->pages_per_slot(),
             opt_.ranks.layout.dcp, opt_.ranks.tp_rank(), b.dcp_pos.data(), b.dcp_seq.data(),
             b.dcp_table.data(), stream_);
}

void CudaBackbone::embed_input(int64_t R) {
  Buffers& b = *buf_;
  const int64_t H = cfg_.hidden_size;
  const bool fused = opt_.fused_input.enabled();
  embed_rows(weights_->embed.bf16(), cfg_.vocab_size, H, b.tokens.data(), R,
             fused ? b.h.data() : b.P.data(), stream_);
  if (!fused) return;
  // concat(RMSNorm_e(embed), RMSNorm_h(hidden)) (each a bf16 GEMM input), then eh_proj.
  const float eps = cfg_.rms_norm_eps;
  rms_norm(b.h.data(), H, enorm_.data(), R, H, eps, b.fuse_cat.data(), 2 * H, stream_);
  rms_norm(b.in_hidden.data(), H, hnorm_.data(), R, H, eps, b.fuse_cat.data() + H, 2 * H, stream_);
  DevMatrix eh;
  eh.rows = H;
  eh.cols = 2 * H;
  eh.data = eh_proj_.data();
  linear(eh, b.fuse_cat.data(), 2 * H, R, b.P.data(), H, false, stream_);
}

void CudaBackbone::enqueue_stock(int64_t R) {
  Buffers& b = *buf_;
  const DeviceWeights& W = *weights_;
  const int64_t H = cfg_.hidden_size;
  const float eps = cfg_.rms_norm_eps;
  prepare_step_rows(R);
  embed_input(R);

  int n_blocks = 0;
  for (int l = 0; l < cfg_.num_hidden_layers; ++l) {
    const DevLayer& L = W.layers[static_cast<size_t>(l)];
    // Attention side: AttnRes mix of the bank (or the residual stream), norm, KDA or MLA.
    mark("attn_norm");
    // The AttnRes mix and its norm as one kernel (mix_norm), as in the specialized step: the
    // norm's sum of squares then reduces in the same order in both (the RMSNorm kernel's order
    // differs from the mix + norm kernel's at hidden 7168: bench/RESULTS.md, fourteenth stop).
    if (cfg_.has_attn_res() && n_blocks > 0)
      mix_norm(n_blocks, L.attn_res_attn, L.input_norm, R);
    else
      rms_norm(b.P.data(), H, L.input_norm, R, H, eps, b.x.data(), H, stream_);
    bool restart = false;
    if (cfg_.is_attn_res_write_layer(l)) {
      write_bank_block(n_blocks++, R);
      restart = true;
    }
    if (L.kind == LayerKind::KDA)
      attn_kda(l, R);
    else
      attn_mla(l, R);
    tap(l, "attn", R);
    attn_residual(restart, R);

    // MLP side.
    mark("ffn_norm");
    mix_norm(n_blocks, L.attn_res_mlp, L.post_attn_norm, R);
    if (L.moe)
      ffn_moe(l, R);
    else
      ffn_dense(l, R);
    tap(l, "ffn", R);
    add_bf16(b.P.data(), b.sub.data(), R * H, b.P.data(), stream_);
  }

  mark("lm_head");
  mix_norm(n_blocks, W.output_attn_res, W.final_norm, R);
  linear(W.lm_head, b.x.data(), H, R, buf_->logits.data(), cfg_.vocab_size, /*y_fp32=*/true,
         stream_);
  advance_rows(b.slots.data(), R, pool_->positions(), stream_);
}

}  // namespace k3::cuda
