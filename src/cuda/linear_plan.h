// Launch plans for the skinny decode GEMMs y[M, N] = x[M, K] . W[N, K]^T (M <= 64): how the
// weight is tiled over warps, CTAs and clusters. Host-only; the kernels are in linear_bf16.cu
// and linear_mxfp4.cu, their shared body in skinny_gemm.cuh; the process-wide switches declared
// here are defined in linear_switches.cpp.
//
// Tiling. A warp owns 16 * mt rows of W and a contiguous run of k "chunks" (64 k for bf16,
// 256 k for MXFP4: 128 B of every row) and streams them through its own `stages`-deep cp.async
// ring in shared memory. A CTA holds wn x wk warps: wn side by side along N, wk along K, and
// stages its slice of x (all M rows) in shared memory once. ck CTAs along K form a cluster;
// partial sums meet in fixed order through shared memory (warps) and distributed shared memory
// (the cluster), so results are deterministic and there is no workspace or second pass.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace k3::cuda {

enum class LinearWeight : uint8_t { BF16, MXFP4 };

struct DeviceLimits {
  int sms = 132;
  size_t smem_per_block_optin = 227 * 1024;
  size_t smem_per_sm = 228 * 1024;
  int regs_per_sm = 65536;
  int max_threads_per_sm = 2048;
};
// The current device's limits (queried once per device).
DeviceLimits device_limits();

struct LinearPlan {
  LinearWeight weight = LinearWeight::BF16;
  int m = 0;  // token rows (<= 64 for one launch)
  int64_t n = 0, k = 0;
  int groups = 1;  // grouped (MoE) launches: slots; dense: 1
  // Grouped: slots expected to hold rows (0: all). The model sizes the tiling for the work of
  // these (an EP rank at batch 1 has ~1 of its 16 compact slots busy: one expert must then be
  // spread over the whole GPU); the launch has that many rows of CTAs, which take turns over all
  // `groups` slots and skip the idle ones.
  int active_groups = 0;
  // Knobs.
  bool fallback = false;  // generic kernel: K or alignment the tiled kernel cannot take
  int nt = 1;             // 8-token mma column tiles: m <= 8 * nt (1, 2, 4, 6 or 8)
  int mt = 1;             // 16-row mma row tiles per warp (1 or 2)
  // Warpgroup MMA (MXFP4 only; wgmma.cuh): each 4 warps side by side along N multiply their 64
  // dequantized rows by the staged x with one wgmma per 16 k instead of 2 * nt mma.sync per warp
  // (fewer instructions and accumulator registers than mt 2). Needs mt 1 and wn % 4 == 0.
  bool wg = false;
  int wn = 1, wk = 1;  // warps per CTA along N and K
  int ck = 1;          // CTAs per cluster along K (1..8)
  int stages = 4;      // per-warp cp.async ring depth (2..7)
  // A GEMV plan instead (bf16, 1..4 token rows, dense; gemv_bf16.cu): 8 warps per CTA, ks k
  // segments x (8 / ks) row lanes, each warp streaming rpw rows with its x segment in
  // registers. 0: a tiled mma plan (the knobs above).
  int gemv_ks = 0, gemv_rpw = 0;
  // An MXFP4 GEMV plan instead (1..8 token rows per slot, dense or grouped, plain or GLU x;
  // gemv_mxfp4.cu): a CTA per 16 weight rows, each warp holding gemv_fp4_pieces 128-k pieces of
  // them in registers. 0: not one.
  int gemv_fp4_pieces = 0;
  // cuBLAS instead (bf16, dense, no folded epilogue; cublas_linear.h): a plan only the tuner
  // picks, by measuring it beside the kernels.
  bool cublas = false;
  // Derived by finalize_plan.
  int chunks = 0;   // k chunks over K
  int x_pitch = 0;  // bytes per staged x row
  // The fast form of the tiled kernel's reduction (skinny_reduce.cuh; skinny_fast_reduce() when
  // the plan was finalized): its tile pitch sizes the plan's shared memory.
  bool fast_reduce = false;
  size_t x_bytes = 0;     // staged x slice (offset of the W rings)
  size_t smem_bytes = 0;  // dynamic shared memory per CTA
  double model_us = 0;    // the planner's cost estimate

  bool gemv() const { return gemv_ks > 0; }
  bool gemv_fp4() const { return gemv_fp4_pieces > 0; }
  // Either GEMV kind (weights streamed into registers; no mma tiling knobs).
  bool streams_rows() const { return gemv() || gemv_fp4(); }
  int threads() const;
  int rows_per_cta() const {
    return gemv() ? 8 / gemv_ks * gemv_rpw : gemv_fp4() ? 16 : 16 * mt * wn;
  }
  int64_t row_tiles() const { return (n + rows_per_cta() - 1) / rows_per_cta(); }
  int64_t grid_x() const { return row_tiles() * ck; }
  // Grouped: rows of CTAs along y, each taking its turn over the slots (skinny_gemm.cuh): one
  // per expected busy slot, so idle slots cost no CTAs.
  int slot_ctas() const {
    return active_groups > 0 && active_groups < groups ? active_groups : groups;
  }
  std::string str() const;
};

// Phase stamps of the tiled skinny kernel, for profiling (k3_bench_ops --phases): given a stamp
// buffer, thread 0 of every CTA of a dense launch writes %globaltimer (ns) at its entry and exit
// and clock64 at each boundary between: prologue issued and the producer waited for, x staged,
// main loop done, CTA partial sums reduced, cluster synced, cluster sums stored, exit (without a
// cluster the output stores fall before "cluster synced", which follows them at once). Layout:
// [grid_x][kSkinnyStamps] int64. Launches without a buffer pay one uniform branch per boundary.
enum SkinnyStamp : int {
  kStampGlobalEntry,
  kStampEntry,
  kStampWaited,
  kStampXStaged,
  kStampLooped,
  kStampReduced,
  kStampClusterSynced,
  kStampSummed,
  kStampEnd,
  kStampGlobalEnd,
  kSkinnyStamps
};

// Static shared memory the skinny kernels may hold beside a plan's dynamic smem_bytes (the
// grouped launch's busy-slot list): finalize_plan keeps the sum within the device's opt-in.
constexpr size_t kSkinnyStaticSmem = 1024;

// Float pitch of the reduction tile's rows (skinny_reduce.cuh): bn output rows, 4 more in the
// fast form.
constexpr int skinny_red_pitch(int bn, bool fast) {
  return fast ? bn + 4 : bn;
}

// Format constants.
int linear_chunk_k(LinearWeight w);                                // k per chunk: 64 / 256
int linear_stage_bytes(LinearWeight w, int mt);                    // one warp's ring slot
double linear_weight_bytes(LinearWeight w, int64_t n, int64_t k);  // N*K*2 or N*K/2 + N*K/32
// The tiled kernel's __launch_bounds__: warpgroup kernels hold nt * 4 accumulators and 32
// dequantized A registers a thread, the mma.sync ones 4 * nt * mt accumulators.
constexpr int linear_max_threads(int nt, int mt, bool wg = false) {
  return wg ? 256 : nt * mt >= 8 ? 256 : 512;
}
// GEMV: 16-byte units of one row's k segment per lane (K / 8 units over ks segments, 32 lanes).
int gemv_units_per_lane(int64_t k, int ks);
constexpr int kGemvMaxRows = 4;  // token rows of one GEMV launch (gemv_bf16.cu)
// The kernel instance that runs m token rows (gemv_bf16.cu: 1, 2 and 4; 3 runs on the 4-row one).
constexpr int gemv_rows_instance(int m) {
  return m <= 2 ? m : 4;
}
// Units per lane the kernel holds in registers for m token rows (x and two rows of W).
constexpr int gemv_max_units_per_lane(int m) {
  return m == 1 ? 8 : 4;
}

// MXFP4 GEMV (gemv_mxfp4.cu): k per piece, token rows per slot, and the threads its instance
// for p pieces per warp allows (a warp per p pieces of K / 128).
constexpr int kGemvMxfp4PieceK = 128;
constexpr int kGemvMxfp4MaxRows = 8;
constexpr int gemv_mxfp4_max_threads(int pieces) {
  return pieces >= 4 ? 512 : 1024;
}
int gemv_mxfp4_warps(int64_t k, int pieces);

// Fills the derived fields of a plan whose knobs are set; false when it cannot run (shared
// memory, threads, more k workers than chunks).
bool finalize_plan(LinearPlan& p, const DeviceLimits& d);

// Registers per thread of the (nt, mt, wg) kernel instantiation, for occupancy (0: unknown).
using LinearRegs = std::function<int(int nt, int mt, bool wg)>;
// Clusters of tiled plan p's kernel (ck > 1) that the device holds at once, p's CTAs fitting
// ctas_per_sm to an SM (cudaOccupancyMaxActiveClusters; 0: unknown). A cluster's CTAs must share
// one GPC, so fewer fit than SMs x CTAs per SM / ck suggests: on an H100, 15 clusters of 8
// one-CTA-per-SM CTAs, not 16, and a 16-cluster plan ran as two waves (47 against 25 us for the
// one-wave plan, bench/RESULTS.md, twenty-fourth stop). The model prices the waves with it.
using LinearClusterFit = std::function<int(const LinearPlan& p, int ctas_per_sm)>;

// Batch-invariant GEMMs (K3_BATCH_INVARIANT=1, or set_batch_invariant before the first step):
// every row count of a weight shape sums K in the order of the shape's one-row plan (its warps
// along K and cluster split; the row and token tiling is free), so a row's output does not depend
// on the rows beside it, e.g. a verify's q rows equal q one-row steps bit for bit. Costs speed
// where a wide batch wants another K split. Where no tiling with that order fits, the generic
// kernel runs (its order is per row too).
bool batch_invariant();
void set_batch_invariant(bool on);
// Measured plan choice (linear_launch.cuh; K3_LINEAR_TUNING=0, or set_linear_tuning(false)
// before the first step, keeps the model's pick). Ranks of one multi-rank layout turn it off:
// timing noise would give each process its own plans, and the computations every rank
// replicates (router, latent projections) must give every rank the same bits.
bool linear_tuning();
void set_linear_tuning(bool on);
// cuBLAS among the measured candidates (on by default; K3_CUBLAS_PLANS=0, or
// set_cublas_plans(false) before the first step, leaves it out; cublas_linear.h). Both step
// paths gained 4.7% at 8 rows with it and nothing at one, and stay bit-identical: they launch
// the same GEMMs, so each shape tunes to one plan for both (bench/RESULTS.md, fourteenth stop).
bool cublas_plans();
void set_cublas_plans(bool on);
// The fewest rows for which cuBLAS is offered (K3_CUBLAS_MIN_ROWS, or set_cublas_min_rows before
// the first step; default 2). Why: cuBLAS's kernels do not wait on their producers, so its nodes
// keep full edges in the specialized step's programmatic graph (the kernel after a full edge
// launches ~3 us after its producer completes), which the tuner's timing of the launch alone
// does not see. At one row the tuner picked cuBLAS for the o-projection (7168x768, 5.2 against
// the GEMV's 5.8 us alone), yet the 60-layer step ran 7% faster with the GEMV (H100, 7.26 against
// 7.81 ms); from 8 rows cuBLAS wins in the step too.
int cublas_min_rows();
void set_cublas_min_rows(int rows);
// MXFP4 GEMV plans among the candidates (on by default; K3_MXFP4_GEMV=0, or
// set_mxfp4_gemv_plans(false) before the first step, leaves them out). At one row the stock
// step measured 2.5% faster with them, the specialized one no slower (bench/RESULTS.md,
// thirteenth stop).
bool mxfp4_gemv_plans();
void set_mxfp4_gemv_plans(bool on);
// Warpgroup (wgmma) MXFP4 tilings among the candidates (LinearPlan::wg; K3_MXFP4_WGMMA=1, or
// set_mxfp4_wgmma_plans(true) before the first step, offers them; explicit plans run anyway).
// Off by default: correct on an H100, but no faster yet (64 rows of 3072x3584: 23.2 against
// 23.6 us for the best mma.sync tiling, bench/RESULTS.md, twenty-fifth stop), and the step with
// them is unmeasured.
bool mxfp4_wgmma_plans();
void set_mxfp4_wgmma_plans(bool on);
// The tiled kernel stages x with cp.async, every unit of a thread in flight at once, instead of
// through registers, one unit of a thread after another (skinny_gemm.cuh; K3_SKINNY_X_ASYNC=1,
// or set_skinny_x_async(true)). Read at each launch, and by finalize_plan for the warpgroup
// plans' staging space. Off by default: written for the x staging the phase stamps measured
// leading the 8- and 64-row launches, not yet run on a GPU (bench/RESULTS.md, 27th stop).
bool skinny_x_async();
void set_skinny_x_async(bool on);
// The fast form of the tiled kernel's reduction (skinny_reduce.cuh: padded tile rows, no
// write-back of a one-warp K sum, 4 elements' cluster loads in flight; the same sums in the same
// order). K3_SKINNY_FAST_REDUCE=1, or set_skinny_fast_reduce(true) before plans are made (it
// is part of a plan). Off by default: not yet run on a GPU (bench/RESULTS.md, 27th stop).
bool skinny_fast_reduce();
void set_skinny_fast_reduce(bool on);
// The MLA decode's tensor-core split kernel (MlaDecodePlan::tensor_cores, mla_decode.h) for the
// steps' attention (on by default; K3_MLA_MMA=0 keeps the fp32 CUDA-core kernel).
bool mla_tensor_cores();
// The DSA index scores on fp8 tensor cores (dsa_index_scores's tensor_cores, dsa_indexer.h) for
// the steps' K3.1 layers (on by default; K3_DSA_MMA=0 keeps the CUDA-core kernel).
bool dsa_tensor_cores();
// The DSA top-k over many CTAs per row (dsa_topk's split, dsa_indexer.h) for the steps' K3.1
// layers (on by default; K3_DSA_TOPK_SPLIT=0 keeps one CTA per row).
bool dsa_topk_split();
// Cache tiles in the tensor-core MLA split kernel's ring (MlaDecodePlan::ring_tiles; K3_MLA_RING
// = 2, the default, 4 or 5; anything else raises k3::Error).
int mla_ring_tiles();
// Each plan the tuner settles on is printed to stderr (K3_LOG_PLANS=1; off by default), so a
// benchmark shows which kernel and shape every GEMM of the step runs.
bool log_plans();
// The plans of c that sum K in anchor's order (same wk and ck), in c's order.
std::vector<LinearPlan> same_k_order(const std::vector<LinearPlan>& c, const LinearPlan& anchor);

// The cuBLAS plan of a shape, and whether a launch may take one: a dense bf16 GEMM that stages
// plain x (no GLU input), outside batch invariance (cuBLAS's K order depends on the row count);
// the tuner offers it where this holds and cublas_plans() is on.
// A launch of m rows (the plan's row count) takes part only from cublas_min_rows() rows.
LinearPlan cublas_plan(int m, int64_t n, int64_t k);
bool cublas_plan_applies(LinearWeight w, int m, int groups, bool glu_input, bool invariant);

// Every valid plan for the problem, cheapest model estimate first (empty when only the fallback
// applies); dense bf16 launches of 1..4 rows and MXFP4 launches of 1..8 rows per slot (outside
// batch invariance) also get GEMV plans, first for one row and after the tilings otherwise. The
// best is what the launchers use untuned; the tuner and the bench time the others.
std::vector<LinearPlan> linear_candidates(LinearWeight w, int m, int64_t n, int64_t k, int groups,
                                          const DeviceLimits& d, const LinearRegs& regs,
                                          int active_groups = 0,
                                          const LinearClusterFit& cluster_fit = {});

namespace detail {
// The plans the tuner times (linear_launch.cuh), from a model-ranked candidate list: the best
// six GEMV plans of either kind (where the shape has any), then up to 12 tilings (the top six, then
// the best of each cluster size and warps-along-K count not yet in), up to two warpgroup tilings
// of distinct cluster sizes for each of one and two warpgroups a CTA, then, with_cublas, the
// cuBLAS plan.
std::vector<LinearPlan> tuning_shortlist(const std::vector<LinearPlan>& ranked,
                                         bool with_cublas = false);
}  // namespace detail

// A read curve's rate (TB/s) at `bytes`, from n >= 1 points (sizes in MiB, ascending, and their
// rates): log-linear between points, the last rate above them, and below the first the first
// size's time (a fixed latency: the rate scales with the bytes).
double read_curve_tbps(const double* mib, const double* tbps, int n, double bytes);

// The H200 cold-L2 read bandwidth for a kernel reading `bytes` (h200-ceilings.md: 1/4/8/16/32/
// 64/128 MB -> 0.8/1.8/2.7/3.1/3.7/4.1/4.2 TB/s, read_curve_tbps between them).
double h200_read_curve_tbps(double bytes);

}  // namespace k3::cuda
