// Latent cache formats on the GPU (cuda/latent_cache.h) against the CPU encoder / decoder
// (cpu/latent_format.h) on fresh random bf16 rows (the seed is printed; K3_TEST_SEED replays).
// Both sides compute the same IEEE fp32 ops (amax, one division, one conversion), so the bytes
// must be equal, not just close; bytes outside the written entries must stay untouched.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "cpu/latent_format.h"
#include "cuda/device_buffer.h"
#include "cuda/latent_cache.h"
#include "test_util.h"

namespace k3 {
namespace {

using cpu::LatentFormat;
using cuda::DeviceBuffer;

constexpr uint8_t kPoison = 0xab;  // cache bytes nobody may write
const LatentFormat kFormats[] = {LatentFormat::F32, LatentFormat::BF16, LatentFormat::FP8,
                                 LatentFormat::FP8_DS_MLA, LatentFormat::NVFP4_DS_MLA};

struct Shape {
  int kvl, rope, page;
};
const Shape kShapes[] = {{512, 64, 64}, {32, 8, 16}, {256, 64, 1}};

// Rows of bf16 values: N(0,1) with a few features that hit edge cases: one row x 200 (the
// fp8 per-tensor format saturates at 448), one with a zero scale block, one with tiny values
// (e4m3 subnormals after scaling).
std::vector<uint16_t> make_rows(Rng& rng, int rows, int n, int kvl) {
  std::vector<uint16_t> kv(static_cast<size_t>(rows) * n);
  for (int r = 0; r < rows; ++r) {
    const float s = r == 1 ? 200.0f : r == 3 ? 1e-3f : 1.0f;
    for (int i = 0; i < n; ++i) {
      float v = rng.normal() * s;
      if (r == 2 && i < std::min(kvl, 16)) v = 0.0f;
      kv[static_cast<size_t>(r) * n + i] = float_to_bf16(v);
    }
  }
  return kv;
}

// A random page assignment: rows x max_pages distinct pages from a pool with spare pages.
std::vector<int32_t> make_table(Rng& rng, int rows, int max_pages, int pool) {
  std::vector<int32_t> perm(static_cast<size_t>(pool));
  std::iota(perm.begin(), perm.end(), 0);
  for (int i = pool - 1; i > 0; --i)
    std::swap(perm[static_cast<size_t>(i)], perm[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
  perm.resize(static_cast<size_t>(rows) * max_pages);
  return perm;
}

TEST(CudaLatentCache, AppendWritesTheCpuEncodersBytes) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (const Shape& sh : kShapes) {
    for (LatentFormat f : kFormats) {
      SCOPED_TRACE(std::string(cpu::latent_format_name(f)) + " kv_lora " + std::to_string(sh.kvl) +
                   " page " + std::to_string(sh.page));
      const int rows = 6, max_pages = 3, pool = rows * max_pages + 2, n = sh.kvl + sh.rope;
      const size_t eb = cpu::latent_entry_bytes(f, sh.kvl, sh.rope);
      const auto kv = make_rows(rng, rows, n, sh.kvl);
      const auto table = make_table(rng, rows, max_pages, pool);
      std::vector<int32_t> pos(rows);
      for (int r = 0; r < rows; ++r)
        pos[r] = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(max_pages * sh.page));
      pos[4] = -1;                       // a padding row: skipped
      pos[5] = max_pages * sh.page + 3;  // beyond its block table: skipped
      std::vector<uint8_t> cache(static_cast<size_t>(pool) * sh.page * eb, kPoison);
      auto d_kv = cuda::to_device<cuda::bf16>(kv);
      auto d_table = cuda::to_device<int32_t>(table);
      auto d_pos = cuda::to_device<int32_t>(pos);
      auto d_cache = cuda::to_device<uint8_t>(cache);
      cuda::latent_cache_append(f, d_kv.data(), rows, sh.kvl, sh.rope, d_table.data(), max_pages,
                                d_pos.data(), sh.page, d_cache.data(), nullptr);
      K3_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = cuda::to_host<uint8_t>(d_cache);
      // Expected: the poisoned cache with the CPU's entries written in.
      std::vector<float> row(static_cast<size_t>(n));
      for (int r = 0; r < 4; ++r) {
        for (int i = 0; i < n; ++i) row[i] = bf16_to_float(kv[static_cast<size_t>(r) * n + i]);
        const int page = table[static_cast<size_t>(r) * max_pages + pos[r] / sh.page];
        const size_t off = (static_cast<size_t>(page) * sh.page + pos[r] % sh.page) * eb;
        cpu::encode_latent_row(f, row.data(), sh.kvl, sh.rope, cache.data() + off);
      }
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < cache.size(); ++i)
        if (got[i] != cache[i] && bad++ == 0) first = i;
      EXPECT_EQ(bad, 0u) << "first differing byte " << first << " (entry byte " << first % eb
                         << "): got " << int(got[first]) << " want " << int(cache[first]);
    }
  }
}

TEST(CudaLatentCache, ToBf16EqualsTheCpuDecoder) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (const Shape& sh : kShapes) {
    for (LatentFormat f : kFormats) {
      SCOPED_TRACE(std::string(cpu::latent_format_name(f)) + " kv_lora " + std::to_string(sh.kvl) +
                   " page " + std::to_string(sh.page));
      const int rows = 4, max_pages = 4, pool = rows * max_pages + 1, n = sh.kvl + sh.rope;
      const size_t eb = cpu::latent_entry_bytes(f, sh.kvl, sh.rope);
      const auto table = make_table(rng, rows, max_pages, pool);
      const int cap = max_pages * sh.page;
      const std::vector<int32_t> seq = {cap, 0, 1 + static_cast<int32_t>(rng.next_u64() % cap),
                                        std::max(1, cap - sh.page + 1)};
      // Every slot of the pool holds a valid encoded row (slots past seq_len too: the kernel
      // must not decode them, which the untouched bf16 output shows).
      std::vector<uint8_t> cache(static_cast<size_t>(pool) * sh.page * eb);
      std::vector<float> row(static_cast<size_t>(n));
      for (size_t slot = 0; slot < static_cast<size_t>(pool) * sh.page; ++slot) {
        const auto bits = make_rows(rng, 1, n, sh.kvl);
        for (int i = 0; i < n; ++i) row[i] = bf16_to_float(bits[i]);
        cpu::encode_latent_row(f, row.data(), sh.kvl, sh.rope, cache.data() + slot * eb);
      }
      std::vector<uint16_t> want(static_cast<size_t>(pool) * sh.page * n, 0xffff);  // NaN
      for (int r = 0; r < rows; ++r) {
        for (int t = 0; t < seq[r]; ++t) {
          const int page = table[static_cast<size_t>(r) * max_pages + t / sh.page];
          const size_t slot = static_cast<size_t>(page) * sh.page + t % sh.page;
          cpu::decode_latent_row(f, cache.data() + slot * eb, sh.kvl, sh.rope, row.data());
          for (int i = 0; i < n; ++i) want[slot * n + i] = float_to_bf16(row[i]);
        }
      }
      auto d_cache = cuda::to_device<uint8_t>(cache);
      auto d_table = cuda::to_device<int32_t>(table);
      auto d_seq = cuda::to_device<int32_t>(seq);
      DeviceBuffer<cuda::bf16> d_out(want.size());
      d_out.fill_bytes(0xff);
      cuda::latent_cache_to_bf16(f, d_cache.data(), sh.kvl, sh.rope, d_table.data(), max_pages,
                                 d_seq.data(), rows, sh.page, d_out.data(), nullptr);
      K3_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = cuda::to_host<uint16_t>(d_out);
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < want.size(); ++i)
        if (got[i] != want[i] && bad++ == 0) first = i;
      EXPECT_EQ(bad, 0u) << "first differing value " << first << ": got " << got[first] << " want "
                         << want[first];
    }
  }
}

TEST(CudaLatentCache, RefusesWidthsTheFormatCannotHold) {
  EXPECT_THROW(cuda::latent_cache_append(LatentFormat::NVFP4_DS_MLA, nullptr, 1, 40, 8, nullptr, 1,
                                         nullptr, 16, nullptr, nullptr),
               Error);
  EXPECT_THROW(cuda::latent_cache_to_bf16(LatentFormat::FP8_DS_MLA, nullptr, 200, 64, nullptr, 1,
                                          nullptr, 1, 16, nullptr, nullptr),
               Error);
}

}  // namespace
}  // namespace k3
