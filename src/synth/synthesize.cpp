#include "synth/synthesize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/numeric.h"
#include "core/progress.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "model/weight_matrix.h"
#include "model/weight_table.h"
#include "synth/tokenizer_synth.h"

namespace k3 {
namespace {

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Approximately normal (Irwin-Hall of 4 uniforms): 4x faster than Box-Muller, plenty for
// synthetic weights, and bit-identical on every platform.
inline float fast_normal(Rng& r) {
  const uint64_t u = r.next_u64();
  const float s =
      static_cast<float>((u & 0xffff) + ((u >> 16) & 0xffff) + ((u >> 32) & 0xffff) + (u >> 48)) *
      (1.0f / 65536.0f);
  return (s - 2.0f) * 1.7320508f;  // variance 4/12 -> 1
}

// How the values of one tensor are drawn.
struct Init {
  enum class Kind { Normal, OnePlusNormal, Uniform, ALog, Mxfp4 } kind = Kind::Normal;
  float a = 0, b = 1;  // Normal: mean a, std b; Uniform: [a, b)
};

Init init_for(const ModelConfig& c, const WeightEntry& e, const Shape& shape) {
  const std::string& n = e.names[0];
  if (e.kind == WeightKind::RoutedExpert && e.dtypes[0] == DType::U8) return {Init::Kind::Mxfp4};
  if (ends_with(n, "A_log")) return {Init::Kind::ALog};
  if (ends_with(n, "dt_bias")) return {Init::Kind::Uniform, -4.0f, 1.0f};
  if (ends_with(n, "conv1d.weight")) return {Init::Kind::Normal, 0.0f, 0.5f};
  if (ends_with(n, "e_score_correction_bias")) return {Init::Kind::Normal, 0.0f, 0.05f};
  if (ends_with(n, "k_norm.bias")) return {Init::Kind::Normal, 0.0f, 0.1f};
  if (ends_with(n, "_res_proj.weight"))  // AttnRes scores of O(1) against unit-RMS inputs
    return {Init::Kind::Normal, 0.0f, 1.0f / std::sqrt(float(c.hidden_size))};
  if (shape.size() == 1 || ends_with(n, "norm.weight")) return {Init::Kind::OnePlusNormal, 0, 0.1f};
  if (e.kind == WeightKind::Embedding) return {Init::Kind::Normal, 0.0f, 1.0f};
  const float fan_in = static_cast<float>(shape.back());
  // Sharper logits than unit scale so sampling has something to choose between. KDA values get
  // a larger gain: with random (untrained) q and k, |S^T q| is ~|v|/head_dim, and at unit scale
  // the per-head RMS of the KDA output would sit below the gated norm's epsilon.
  float gain = 1.0f;
  if (e.kind == WeightKind::LmHead) gain = 2.0f;
  if (e.kind == WeightKind::KdaProj && ends_with(n, "v_proj.weight")) gain = 4.0f;
  return {Init::Kind::Normal, 0.0f, gain / std::sqrt(fan_in)};
}

void store(DType t, float v, uint8_t* out, size_t i) {
  if (t == DType::F32) {
    std::memcpy(out + 4 * i, &v, 4);
  } else if (t == DType::BF16) {
    const uint16_t h = float_to_bf16(v);
    std::memcpy(out + 2 * i, &h, 2);
  } else {
    fail("internal: synth cannot write dtype ", dtype_name(t));
  }
}

constexpr size_t kBlock = 1 << 16;  // elements per independently seeded block

// Dense tensor: blocks of kBlock elements, each seeded from (tensor, block), filled in parallel.
void fill_dense(const std::string& name, DType t, const Shape& shape, const Init& init,
                uint64_t seed, int heads, uint8_t* out, int threads) {
  const size_t n = static_cast<size_t>(numel(shape));
  if (init.kind == Init::Kind::ALog) {
    // exp(A_log) in [1, 16] for the real heads, zero padding beyond num_heads (K3 layout).
    Rng r(derive_seed(seed, name.c_str()));
    for (size_t i = 0; i < n; ++i)
      store(t, i < static_cast<size_t>(heads) ? std::log(r.uniform(1.0f, 16.0f)) : 0.0f, out, i);
    return;
  }
  const size_t blocks = (n + kBlock - 1) / kBlock;
  auto work = [&](size_t first) {
    for (size_t blk = first; blk < blocks; blk += static_cast<size_t>(threads)) {
      Rng r(derive_seed(seed, name.c_str()) + blk * 0x9e3779b97f4a7c15ull);
      const size_t end = std::min(n, (blk + 1) * kBlock);
      for (size_t i = blk * kBlock; i < end; ++i) {
        float v;
        switch (init.kind) {
          case Init::Kind::Uniform:
            v = r.uniform(init.a, init.b);
            break;
          case Init::Kind::OnePlusNormal:
            v = 1.0f + init.b * fast_normal(r);
            break;
          default:
            v = init.a + init.b * fast_normal(r);
            break;
        }
        store(t, v, out, i);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads && static_cast<size_t>(i) < blocks; ++i) pool.emplace_back(work, i);
  work(0);
  for (auto& th : pool) th.join();
}

// MXFP4 expert matrix [rows, cols]: quantized from N(0, 1/sqrt(cols)) rows. Packed and scale
// tensors are written by separate calls; both re-derive the same rows from the same seed.
void fill_mxfp4(const std::string& stem, bool packed, int64_t rows, int64_t cols, uint64_t seed,
                uint8_t* out, int threads) {
  const float std_dev = 1.0f / std::sqrt(static_cast<float>(cols));
  auto work = [&](int first) {
    std::vector<float> row(static_cast<size_t>(cols));
    std::vector<uint8_t> p(static_cast<size_t>(cols / 2)), s(static_cast<size_t>(cols / 32));
    for (int64_t r = first; r < rows; r += threads) {
      Rng rng(derive_seed(seed, stem.c_str()) + static_cast<uint64_t>(r) * 0x9e3779b97f4a7c15ull);
      for (auto& x : row) x = std_dev * fast_normal(rng);
      quantize_mxfp4(row.data(), 1, cols, p.data(), s.data());
      if (packed)
        std::memcpy(out + r * (cols / 2), p.data(), p.size());
      else
        std::memcpy(out + r * (cols / 32), s.data(), s.size());
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads && i < rows; ++i) pool.emplace_back(work, i);
  work(0);
  for (auto& th : pool) th.join();
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream f(p);
  K3_CHECK(f.good(), "cannot write ", p.string());
  f << text;
  K3_CHECK(f.good(), "error writing ", p.string());
}

}  // namespace

uint64_t checkpoint_bytes(const ModelConfig& cfg) {
  uint64_t total = 0;
  for (const auto& e : weight_table(cfg))
    total += static_cast<uint64_t>(numel(e.shapes[0])) * dtype_size(e.dtypes[0]);
  return total;
}

void synthesize_checkpoint(const ModelConfig& cfg, const std::string& dir, const SynthOptions& o) {
  const std::vector<WeightEntry> table = weight_table(cfg);
  std::vector<TensorSpec> specs;
  specs.reserve(table.size());
  uint64_t total = 0;
  for (const auto& e : table) {
    specs.push_back({e.names[0], e.dtypes[0], e.shapes[0]});
    total += specs.back().nbytes();
  }
  const int threads = o.threads > 0
                          ? o.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::filesystem::create_directories(dir);
  write_text(std::filesystem::path(dir) / "config.json", model_config_to_json(cfg).dump(2) + "\n");
  // Tiny K3 layouts get a real (small) BPE tokenizer; other vocabularies none, so their
  // checkpoints fall back to byte-level tokens.
  if (uses_synthetic_tokenizer(cfg)) write_synthetic_tokenizer(dir);

  ProgressBar bar("synth " + dir, total, o.progress);
  write_sharded_checkpoint(
      dir, specs, o.max_shard_bytes,
      [&](size_t i, uint8_t* out, size_t nbytes) {
        const WeightEntry& e = table[i];
        const Shape& shape = e.shapes[0];
        const Init init = init_for(cfg, e, shape);
        if (init.kind == Init::Kind::Mxfp4) {
          const std::string& n = e.names[0];
          const bool packed = ends_with(n, ".weight_packed");
          const std::string stem = n.substr(0, n.rfind('.'));
          const int64_t cols = packed ? shape[1] * 2 : shape[1] * 32;
          fill_mxfp4(stem, packed, shape[0], cols, o.seed, out, threads);
        } else {
          fill_dense(e.names[0], e.dtypes[0], shape, init, o.seed, cfg.linear_attn_config.num_heads,
                     out, threads);
        }
        (void)nbytes;
      },
      [&](uint64_t bytes) { bar.advance(bytes); });
  bar.finish();
}

}  // namespace k3
