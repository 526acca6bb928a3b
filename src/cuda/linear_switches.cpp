// The process-wide switches of the CUDA step's kernel choices (declared in linear_plan.h): each
// takes its first value from the environment, and the linear-plan ones can be set before the
// first step (tests, benchmarks).
#include <atomic>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "cuda/linear_plan.h"

namespace k3::cuda {

namespace {
// A process-wide switch's first value, from the environment: "1" turns on a switch that is off
// by default, "0" turns off one that is on.
bool env_switch(const char* name, bool default_on) {
  const char* v = std::getenv(name);
  if (v == nullptr) return default_on;
  return default_on ? std::string(v) != "0" : std::string(v) == "1";
}

std::atomic<bool>& batch_invariant_flag() {
  static std::atomic<bool> on{env_switch("K3_BATCH_INVARIANT", false)};
  return on;
}
std::atomic<bool>& linear_tuning_flag() {
  static std::atomic<bool> on{env_switch("K3_LINEAR_TUNING", true)};
  return on;
}
std::atomic<bool>& cublas_plans_flag() {
  static std::atomic<bool> on{env_switch("K3_CUBLAS_PLANS", true)};
  return on;
}
std::atomic<int>& cublas_min_rows_value() {
  static std::atomic<int> rows{[] {
    const char* v = std::getenv("K3_CUBLAS_MIN_ROWS");
    // Default 2: one-row launches keep their GEMVs' PDL edges (bench/RESULTS.md, 23rd stop).
    if (v == nullptr || *v == '\0') return 2;
    char* end = nullptr;
    const long r = std::strtol(v, &end, 10);
    K3_CHECK(*end == '\0' && r >= 1 && r <= 65, "K3_CUBLAS_MIN_ROWS=", v,
             ": a row count 1..65 (65: never)");
    return static_cast<int>(r);
  }()};
  return rows;
}
std::atomic<bool>& mxfp4_gemv_flag() {
  static std::atomic<bool> on{env_switch("K3_MXFP4_GEMV", true)};
  return on;
}
std::atomic<bool>& mxfp4_wgmma_flag() {
  static std::atomic<bool> on{env_switch("K3_MXFP4_WGMMA", false)};
  return on;
}
std::atomic<bool>& skinny_x_async_flag() {
  static std::atomic<bool> on{env_switch("K3_SKINNY_X_ASYNC", false)};
  return on;
}
std::atomic<bool>& skinny_fast_reduce_flag() {
  static std::atomic<bool> on{env_switch("K3_SKINNY_FAST_REDUCE", false)};
  return on;
}
}  // namespace

bool mla_tensor_cores() {
  static const bool on = env_switch("K3_MLA_MMA", true);
  return on;
}

bool dsa_tensor_cores() {
  static const bool on = env_switch("K3_DSA_MMA", true);
  return on;
}

bool dsa_topk_split() {
  static const bool on = env_switch("K3_DSA_TOPK_SPLIT", true);
  return on;
}

int mla_ring_tiles() {
  static const int tiles = [] {
    const char* v = std::getenv("K3_MLA_RING");
    if (v == nullptr || *v == '\0') return 2;
    const std::string s(v);
    K3_CHECK(s == "2" || s == "4" || s == "5", "K3_MLA_RING=", s,
             ": the MLA tile ring is 2, 4 or 5");
    return std::stoi(s);
  }();
  return tiles;
}

bool log_plans() {
  static const bool on = env_switch("K3_LOG_PLANS", false);
  return on;
}

bool batch_invariant() {
  return batch_invariant_flag().load();
}
void set_batch_invariant(bool on) {
  batch_invariant_flag().store(on);
}

bool linear_tuning() {
  return linear_tuning_flag().load();
}
void set_linear_tuning(bool on) {
  linear_tuning_flag().store(on);
}

bool cublas_plans() {
  return cublas_plans_flag().load();
}
void set_cublas_plans(bool on) {
  cublas_plans_flag().store(on);
}

int cublas_min_rows() {
  return cublas_min_rows_value().load();
}
void set_cublas_min_rows(int rows) {
  K3_CHECK(rows >= 1, "set_cublas_min_rows: ", rows, " rows");
  cublas_min_rows_value().store(rows);
}

bool mxfp4_gemv_plans() {
  return mxfp4_gemv_flag().load();
}
void set_mxfp4_gemv_plans(bool on) {
  mxfp4_gemv_flag().store(on);
}

bool mxfp4_wgmma_plans() {
  return mxfp4_wgmma_flag().load();
}
void set_mxfp4_wgmma_plans(bool on) {
  mxfp4_wgmma_flag().store(on);
}

bool skinny_x_async() {
  return skinny_x_async_flag().load();
}
void set_skinny_x_async(bool on) {
  skinny_x_async_flag().store(on);
}

bool skinny_fast_reduce() {
  return skinny_fast_reduce_flag().load();
}
void set_skinny_fast_reduce(bool on) {
  skinny_fast_reduce_flag().store(on);
}

}  // namespace k3::cuda
