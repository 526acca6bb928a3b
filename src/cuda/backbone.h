// The stock CUDA decode step (decode_backend = auto): the CPU reference backbone
// (cpu/backbone.cpp) as a chain of one kernel (or GEMM) per op over a batch of rows, one token
// per row, each row its own request slot; the projections of one input whose weights are stored
// concatenated (a KDA layer's q|k|v|g|f_a|b, gate|up, each expert's w1|w3) are one GEMM, as
// merged projections are in vLLM, and the specialized step launches the very same GEMMs. Every
// boundary tensor is bf16 where the reference rounds to bf16, so both compute the same function
// up to fp32 summation order.
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
#include <initializer_list>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/device_communicator.h"
#include "cuda/device_state.h"
#include "cuda/device_weights.h"
#include "cuda/kda_decode.h"
#include "cuda/mla_decode.h"
#include "cuda/step_executor.h"
#include "model/config.h"
#include "parallel/layout.h"

namespace k3::cuda {

struct RouterGrouping;  // router.h
struct ExpertGroups;    // backbone_ops.h

// Where a KDA layer's projections of x lie for the KDA kernel (kda_decode.h): u = [rows][q|k|v],
// the beta logits and the output gate z, each by its row stride in `strides` (0: packed).
struct KdaProjected {
  const __nv_bfloat16* u = nullptr;
  const __nv_bfloat16* beta = nullptr;
  const __nv_bfloat16* z = nullptr;
  KdaDecodeStrides strides;
};

// Per-sublayer observer for diff reports (the CPU backbone's LayerObserver): layer, "attn" or
// "ffn", and that sublayer's output for every row, [rows][hidden] as floats.
using LayerTap = std::function<void(int layer, const char* part, const std::vector<float>& out)>;

// The L2 prefetch budget of the specialized path (and what k3_bench_step flips it against).
constexpr size_t kL2PrefetchTrialBytes = 24u << 20;

// Choices of the specialized path kept only where they measure faster (k3_bench_step times each
// against the default on the full rank; bench/RESULTS.md).
struct SpecializedTuning {
  bool pdl = true;  // programmatic kernel -> kernel edges in the graphs (graph_pdl.h)
  // Bytes of the next weights (o_proj) warmed into L2 beside the latency-bound KDA recurrence;
  // 0: off. Within run-to-run noise: +5% (run 12), -3.6% (run 11), +2.4% (run 12 of the third
  // stop, against it on) at batch 1, so it stays off.
  size_t l2_prefetch_bytes = 0;
  // Bytes of the latent up-projection read into L2 on the side stream after the shared experts,
  // beside the latency-bound routed experts (l2_prefetch by loads); 0: off.
  size_t l2_warm_latent_up_bytes = 0;
  // The latent down-projection on the side stream beside the router GEMM and top-k (the shared
  // experts then follow it there) instead of after them on the main stream. On: -1.1% / -1.8%
  // at batch 1, 1k, in two runs (one earlier run saw no gain).
  bool latent_beside_router = true;
  // With latent_beside_router: the router GEMM and top-k on the side stream and the latent down
  // on the main one instead (the experts' input then leads the main chain): +7.5% (run 17).
  bool router_beside_latent = false;
  // The expert down-projection applies the GLU while staging its input (no GLU launch).
  bool glu_in_down_proj = true;
  // The attention residual add (P += sub, or P = sub at a restart) in the o-projection's store
  // instead of a kernel after it: within noise (-1.8% as a kernel in one run, +2.9% in the
  // next); folded saves a launch per layer.
  bool fold_residual_adds = true;
  // The shared experts' output and the layer residual added in the latent up-projection's store
  // (that store then waits for the side stream: no programmatic edge into it). Measured +3.7%
  // against two add kernels while the latent up ran the tiled GEMM (run 16), -2.6% with the
  // one-row GEMV (run 17), so on.
  bool fold_moe_residual = true;
  // pdl, glu_in_down_proj and fold_moe_residual hold for steps of up to narrow_rows rows; wider
  // steps run without them. Each measured faster off at batch 8 in two runs (19, 20: PDL edges
  // -1.2% / -2.2%, the GLU kernel -1.6% / -1.3%, the two add kernels -2.7% / -3.6%; all three
  // off: -3.0% in run 21) and slower at batch 1 (+4.9%, +0.3%, +2.1%; all three: +8.3%). The
  // q = 4 verify step (4 rows) took 18.06 ms without them (run 21) and 17.10-18.43 ms with them
  // in runs 17-20: not decided, nor are 2..7 rows.
  int narrow_rows = 1;
  // With the folded MoE residual: the side stream (shared experts) joins the main one before the
  // combine instead of before the latent up-projection, so the latent up follows the combine by
  // a programmatic edge and streams its first weight rows while the routed experts finish (the
  // join's plain edge otherwise held its launch until the combine ended: kernel trace of run 22).
  bool join_before_combine = true;
  // With the folded MoE residual: the combine (+ latent norm) computed by the latent up
  // GEMV as it stages its input (linear_bf16_combined) where that shape runs the GEMV, instead
  // of a combine kernel before it. Off until it has run on a GPU (written in a session whose
  // device calls found no machine; its op test is CudaFusedEpilogue.CombineInGemv*).
  bool combine_in_latent_up = false;
  // The expert down-projection reads its slot arrays and requests its first weight chunks
  // before waiting on w1|w3 (Mxfp4Grouped::slots_ready).
  bool early_down_weights = true;
  bool pdl_for(int64_t rows) const { return pdl && rows <= narrow_rows; }
  bool glu_in_down_proj_for(int64_t rows) const { return glu_in_down_proj && rows <= narrow_rows; }
  bool fold_moe_residual_for(int64_t rows) const {
    return fold_moe_residual && rows <= narrow_rows;
  }
  // The expert grouping in the router top-k kernel's last CTA (router_topk_grouped) instead of
  // a grouping kernel after it: one launch fewer per MoE layer on the critical path (not under
  // EP, whose grouping waits for the gathered ids; up to kMaxRouterGroupedPairs pairs).
  bool group_in_router = true;
  // MLA: the kv path (kv_a, its norm, the cache append) and then the output gate's projection
  // on the side stream beside the query path (q_a, norm, q_b, absorb); they read x only, and
  // the attention waits for the append, the un-absorb for the gate.
  bool mla_kv_beside = true;
  // The router top-k selects by the warp merge tree (RouterPlan::merge_tree; same outputs)
  // instead of the radix select (the stock step's). H100: 3.6 against 5.5 us per launch at
  // 1-64 rows; the batch-1 step within its spread (+0.1%), the router running beside the longer
  // latent down (bench/RESULTS.md, seventeenth stop).
  bool router_merge_tree = true;
};

// This backbone as one rank of a multi-rank layout (parallel/layout.h; DESIGN.md "Multi-rank"):
// its weights are the rank's parallel::RankWeights (the config with the local head counts), and
// the step runs the layout's collectives on these communicators: the TP sum after each sharded
// sublayer (attention o_proj, dense down, shared experts, TP-sliced routed experts), the EP
// gather of every rank's expert inputs and the reduce-scatter of the pairs' outputs, and DCP's
// query gather and partial-attention exchange. Communicators given (even of one rank) are used;
// a missing one means that dimension is not split.
struct RankSetup {
  parallel::ParallelLayout layout;
  int rank = 0;                         // dp_rank * tp + tp_rank
  DeviceCommunicator* world = nullptr;  // every rank (EP), or null
  DeviceCommunicator* tp = nullptr;     // this replica's tp ranks (TP sums, DCP), or null
  bool any() const { return world != nullptr || tp != nullptr; }
  int tp_rank() const { return rank % layout.tp; }
  bool ep() const { return layout.ep && world != nullptr; }
  bool dcp() const { return layout.dcp > 1; }
};

// An MTP / EAGLE draft model's input (spec/draft_model.h): layer 0 reads
// eh_proj(concat(RMSNorm_e(embed(token)), RMSNorm_h(h))), h a hidden row given with each step
// (CudaBackbone::step_fused), instead of the token's embedding. The host data must outlive the
// backbone's construction (it is uploaded).
struct FusedInputWeights {
  const WeightMatrix* eh_proj = nullptr;      // [hidden, 2 * hidden] bf16
  const std::vector<float>* enorm = nullptr;  // [hidden]
  const std::vector<float>* hnorm = nullptr;  // [hidden]
  bool enabled() const { return eh_proj != nullptr; }
};

struct CudaBackboneOptions {
  int max_rows = 64;   // rows (requests) per step
  SlotPoolShape pool;  // slots, context, page size, KDA state dtype
  bool use_graphs = true;
  // Row counts whose specialized step is captured as a graph once, right after the weights
  // load (ascending; empty: the specialized path is off). A specialized step takes at most the
  // largest size (each row count its own graph).
  std::vector<int> capture_sizes;
  SpecializedTuning tuning;  // the specialized path's measured choices
  // One rank's slice of the weights run alone, its collectives stubbed (k3_bench_step's TP16 /
  // EP16 rank): experts held by no rank here (weights left empty, as parallel::RankWeights
  // leaves another EP rank's) drop out of the routed sum, and the latent norm sees this rank's
  // partial sum where a multi-GPU step would first all-reduce it. Without it such weights are
  // refused: a single-GPU step must hold every expert.
  bool stub_collectives = false;
  RankSetup ranks;  // one rank of a multi-rank layout (default: the whole model on this GPU)
  // A slot the multi-rank driver pads steps with (-1: none): its run may be longer than the
  // reserved KDA snapshots (the kernel keeps none past them) and nothing of it is ever read.
  int padding_slot = -1;
  FusedInputWeights fused_input;  // a draft model's input fusion (then steps use step_fused)
};

// Time per stage of one step (profile_step), summed over layers: where the time goes.
struct StageTime {
  std::string stage;
  double ms = 0;
};

class CudaBackbone final : public StepExecutor {
 public:
  CudaBackbone(const ModelConfig& cfg, const ModelWeights& w, const CudaBackboneOptions& opt);
  ~CudaBackbone() override;
  CudaBackbone(const CudaBackbone&) = delete;
  CudaBackbone& operator=(const CudaBackbone&) = delete;

  const ModelConfig& config() const { return cfg_; }
  SlotPool& pool() { return *pool_; }
  int max_rows() const override { return opt_.max_rows; }
  int slots() const override { return opt_.pool.slots; }
  int64_t max_context() const override { return opt_.pool.max_context; }
  cudaStream_t stream() const { return stream_; }

  // Zeroes a slot for a new request (ordered before the next step).
  void reset_slot(int slot) override;
  int64_t position(int slot) const override;  // tokens consumed (host mirror, no sync)
  // Speculative verify support (SlotPool's snapshots): keep / restore slot s's KDA state as
  // copy `index`, and move its position back to an accepted length. Growing the snapshots
  // reallocates them, so it drops the captured graphs (recaptured on their next step).
  void reserve_snapshots(int n) override;
  void save_kda(int slot, int index) { pool_->save_kda(slot, index, stream_); }
  void restore_kda(int slot, int index) override { pool_->restore_kda(slot, index, stream_); }
  void set_position(int slot, int64_t position) override;
  // Benchmarks: slot s as if `tokens` tokens had been decoded (SlotPool::fill_synthetic).
  void assume_context(int slot, int64_t tokens);

  // One step, asynchronous: row r feeds tokens[r] into slot slots[r] (1 <= rows <= max_rows).
  // Rows of one slot must be consecutive: such a run is the request's next tokens in order (a
  // verify's q positions, a prefill chunk), at positions position(slot) + 0, 1, ... Afterwards
  // logits() holds [rows][vocab] fp32. keep_kda_states: each run's KDA state after its row t
  // (t < run - 1) is kept as snapshot t of its slot (restore_kda commits a verified prefix);
  // needs reserve_snapshots(longest run - 1).
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
            StepPath path = StepPath::Stock, bool keep_kda_states = false) override;
  // The same step for a backbone built with fused_input: row r's layer-0 input fuses tokens[r]
  // with hidden[r] ([rows][hidden] fp32, host; bf16-valued, as the target's hidden states are).
  void step_fused(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                  const float* hidden, StepPath path = StepPath::Stock);
  const float* logits() const;  // [max_rows][vocab] fp32 (device)
  // Waits for the step and copies rows x vocab logits to the host.
  void logits_to_host(int64_t rows, float* out);
  // Waits for the step and copies the logits of step row rows[i] to out[i] ([vocab] fp32 each).
  void logits_rows_to_host(std::span<const int64_t> rows, std::span<float* const> out) override;
  // Waits for the step and copies the rows' final-normed hidden states (the lm_head input,
  // [rows][hidden] bf16 on the device) to the host as fp32: a draft model's input.
  void hidden_to_host(int64_t rows, float* out) override;
  // Greedy ids of the last step's rows (argmax on the device; waits).
  void greedy(int64_t rows, int32_t* ids);

  // With a tap set, steps run eagerly and stop after each sublayer to copy its output out
  // (slow; diff reports only). An empty tap restores normal steps.
  void set_layer_tap(LayerTap tap) { tap_ = std::move(tap); }

  // Per-stage times of one step of `path` (median over `replays` graph replays with an event
  // between stages; the events cut the programmatic edges at stage boundaries, so the sum is a
  // little above the plain step). Advances the slots like a step each replay.
  std::vector<StageTime> profile_step(std::span<const int32_t> slots,
                                      std::span<const int32_t> tokens, StepPath path, int replays);

  // Replaces the slot pool (a new cache binding: slots, context, page size, cache dtypes) and
  // rebuilds every graph that baked in the old one; all slots start empty. Rows per step stay
  // within the new slot count; capture sizes above it are dropped.
  void rebind_cache(const SlotPoolShape& shape);
  // Benchmarks (measure on and off): the specialized path's PDL edges and L2 prefetch budget;
  // the specialized graphs are recaptured (which resets the capture slots 0..largest size-1).
  void set_specialized_tuning(const SpecializedTuning& t);

  int graphs_captured() const { return static_cast<int>(graphs_.size()); }
  bool specialized_ready() const override { return !opt_.capture_sizes.empty(); }
  int max_capture_rows() const override {
    return opt_.capture_sizes.empty() ? 0 : opt_.capture_sizes.back();
  }
  uint64_t weight_bytes() const { return weights_->bytes(); }

 private:
  struct Buffers;
  void enqueue(int64_t rows, StepPath path);    // every kernel of one step on stream_
  void run_graph(int64_t rows, StepPath path);  // capture on first use, then replay
  void capture_specialized();                   // every capture size, at load / rebind
  void bind_pool();  // slot pool, host positions and step buffers for opt_.pool
  void enqueue_stock(int64_t rows);
  // Checks a step's rows and stages its inputs (hidden: fused-input rows or null), then runs it.
  void run_step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                const float* hidden, StepPath path, bool keep_kda_states);
  void embed_input(int64_t rows);        // P = the rows' embeddings (or the fused draft input)
  void prepare_step_rows(int64_t rows);  // positions, lengths, block tables (and DCP's) per row
  // Checks opt_.ranks against the layout; graph-unsafe communicators turn graphs off and ranks
  // turn the measured GEMM plan choice off (backbone_ranks.cu).
  void setup_ranks();
  // The MoE layers hold all experts, or this EP rank's share (or a stubbed slice).
  void check_expert_slices() const;
  void upload_fused_input();  // opt_.fused_input's weights on the device (a draft backbone)
  // Graph capture mode: relaxed when collectives run in the graph (NCCL calls CUDA APIs a
  // thread-local capture would refuse), else thread-local.
  cudaStreamCaptureMode capture_mode() const {
    return opt_.ranks.any() ? cudaStreamCaptureModeRelaxed : cudaStreamCaptureModeThreadLocal;
  }
  void write_bank_block(int j, int64_t rows);      // AttnRes bank block j = P
  void attn_residual(bool restart, int64_t rows);  // P = sub (restart) or P += sub
  // x = RMSNorm(the AttnRes mix of the bank's first n_blocks blocks and P), one kernel (both
  // paths; without AttnRes, of P alone).
  void mix_norm(int n_blocks, const float* score_w, const float* norm_w, int64_t rows);
  void enqueue_specialized(int64_t rows);
  // Specialized providers (backbone_fused.cu).
  // True when the layer's residual add (P += sub) is done: in the latent up-projection's store
  // (fold_moe_residual) or in one launch with the shared experts' add.
  bool ffn_moe_fused(int layer, int64_t rows);
  void fork_side();  // side_ waits for stream_'s work so far
  void join_side();  // stream_ waits for side_
  void prefetch_l2(std::initializer_list<const DevMatrix*> next);
  void mark(const char* stage);  // stage boundary (profile_step only)
  // Both paths. out: the o-projection's store epilogue (the specialized step folds the residual
  // in); warm_o_proj: o_proj read into L2 on the side stream beside the KDA kernel
  // (SpecializedTuning::l2_prefetch_bytes, the specialized path).
  void attn_kda(int layer, int64_t rows, const LinearEpilogue& out = {}, bool warm_o_proj = false);
  // Every projection of x a KDA layer reads (both paths): where the KDA kernel finds them.
  KdaProjected kda_project(int layer, int64_t rows);
  // The fused KDA kernel over the step's runs (both paths): inputs in place with row strides.
  void kda_core(int layer, int64_t rows, const __nv_bfloat16* u, const __nv_bfloat16* beta,
                const __nv_bfloat16* z, const KdaDecodeStrides& strides);
  // The MLA output gate's projection of x ([rows][heads * v_head_dim] bf16), or null.
  const __nv_bfloat16* gate_projection(const DevMla& m, int64_t rows, cudaStream_t stream);
  // kv_beside: SpecializedTuning::mla_kv_beside (the specialized path).
  void attn_mla(int layer, int64_t rows, const LinearEpilogue& out = {}, bool kv_beside = false);
  // Multi-rank pieces (backbone_ranks.cu). A collective on stream_: in a capture, the nodes it
  // adds are remembered so the graph's programmatic edges skip them.
  void collective(const std::function<void()>& run);
  // sub = in . w^T (a sublayer's output projection, `out` its store epilogue); on a TP rank the
  // fp32 partial sums are all-reduced first and `out`'s residual applied after the sum.
  void project_out(const DevMatrix& w, const __nv_bfloat16* in, int64_t K, int64_t rows,
                   const LinearEpilogue& out);
  // partial [n] fp32 summed over the TP ranks into out [n] bf16 (no-op copy-round alone).
  void tp_sum_to_bf16(float* partial, int64_t n, __nv_bfloat16* out);
  bool tp_sums() const { return opt_.ranks.tp != nullptr; }
  // The routed experts' input rows: this rank's (z, expert ids), or under EP every rank's,
  // gathered (pairs replicated over a replica's tp ranks kept by one of them). Returns rows.
  int64_t expert_rows(const __nv_bfloat16*& z, const int32_t*& ids, int64_t L, int64_t rows);
  // The w2 output buffer: bf16 moe_y, or fp32 moe_y32 when TP-sliced experts are summed after.
  void* expert_out() const;
  bool expert_out_fp32() const { return tp_sums() && !opt_.ranks.ep(); }
  // After w2 over expert_rows' rows: the pair outputs moe_combine reads (y, and y_pos for
  // expert-grouped order or null for (row, choice) order), summed over the ranks as needed.
  std::pair<const __nv_bfloat16*, const int32_t*> routed_outputs(int64_t rows, int64_t L);
  // The shared experts' down-projection output (fp32 partials on a TP rank, else bf16
  // b.shared), and its end: the partial sums reduced into b.shared.
  void* shared_out() const;
  void finish_shared(int64_t rows);
  // DCP: the MLA attention of this rank's heads over every rank's tokens (o_latent).
  void mla_attend_dcp(int layer, int64_t rows, float scale);
  void dsa_select(int layer, int64_t rows);  // fills the rows' selected token lists
  void ffn_dense(int layer, int64_t rows);   // both paths
  void ffn_moe(int layer, int64_t rows);
  // Pieces of the MoE both paths launch alike (backbone_layers.cu), so their GEMMs have the same
  // shapes and tuned plans and the paths agree bit for bit.
  void shared_experts(const DevMoe& m, int64_t rows, cudaStream_t stream);
  void routed_experts(const DevMoe& m, const ExpertGroups& eg, const ExpertGroups& eg_down,
                      const __nv_bfloat16* z, int64_t L, int pairs, bool glu_in_down);
  ExpertGroups expert_groups(const DevMoe& m, int64_t expert_rows) const;
  // Router + top-k, then the experts' input (latent down or x), width L: both paths.
  // With `group`, the top-k kernel also groups the pairs (router_topk_grouped).
  const __nv_bfloat16* route_and_project(const DevMoe& m, int64_t rows, int64_t& L,
                                         cudaStream_t latent_stream,
                                         const RouterGrouping* group = nullptr,
                                         cudaStream_t router_stream = nullptr,
                                         bool router_merge_tree = false);
  const MlaDecodePlan& mla_plan(int64_t rows);  // for the current batch_invariant()
  const MlaDecodePlan& mla_plan(int64_t rows, bool invariant);

  const ModelConfig& cfg_;
  CudaBackboneOptions opt_;
  std::unique_ptr<DeviceWeights> weights_;
  std::unique_ptr<SlotPool> pool_;
  std::unique_ptr<Buffers> buf_;
  cudaStream_t stream_ = nullptr;
  int sms_ = 0;
  std::map<int64_t, MlaDecodePlan> mla_plans_;
  // Keyed by rows * 2 + path.
  std::map<int64_t, cudaGraphExec_t> graphs_;
  std::map<int64_t, bool> ran_eager_;
  cudaStream_t side_ = nullptr;  // shared experts and L2 prefetch beside the main chain
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  cudaEvent_t kv_ready_ = nullptr;  // MLA beside: the side stream's cache append is done
  // profile_step: stage names and their (timing) events, recorded on stream_ in order.
  struct Marks {
    std::vector<std::string> names;
    std::vector<cudaEvent_t> events;
    size_t used = 0;
  };
  Marks* marks_ = nullptr;
  std::vector<int64_t> host_pos_;
  LayerTap tap_;
  void tap(int layer, const char* part,
           int64_t rows);       // [slots] positions as the host has enqueued them
  int32_t* host_in_ = nullptr;  // pinned [2 * max_rows + 1]: slots, tokens, keep_kda flag
  void bf16_to_host(const __nv_bfloat16* src, size_t n, float* out);  // waits for the stream
  cudaEvent_t inputs_copied_ = nullptr;
  std::set<cudaGraphNode_t> foreign_nodes_;  // collectives' nodes of the capture in progress
  // fused_input: eh_proj [hidden][2 * hidden] bf16, enorm / hnorm [hidden] fp32, and pinned
  // staging for the step's hidden rows [max_rows][hidden] bf16 bits.
  DeviceBuffer<__nv_bfloat16> eh_proj_;
  DeviceBuffer<float> enorm_, hnorm_;
  uint16_t* host_hidden_ = nullptr;
};

}  // namespace k3::cuda
