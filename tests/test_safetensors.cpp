// SafetensorsFile / write_safetensors: round trips, header layout, and strict rejection of
// malformed files (each error must name the file and the problem, never crash).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;
using test::seed_trace;
using test::test_seed;

std::string temp_path(const std::string& tag) {
  static int counter = 0;
  return (fs::temp_directory_path() / ("k3_st_" + tag + "_" + std::to_string(::getpid()) + "_" +
                                       std::to_string(counter++) + ".safetensors"))
      .string();
}

// Removes the file when the test ends, pass or fail.
struct TempFile {
  std::string path;
  explicit TempFile(const std::string& tag) : path(temp_path(tag)) {}
  ~TempFile() {
    std::error_code ec;
    fs::remove(path, ec);
  }
};

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// A file with the given header text (length prefix `len`, default its true size) and
// `data_bytes` bytes of data section.
std::vector<uint8_t> raw_file(const std::string& header, size_t data_bytes, int64_t len = -1) {
  const uint64_t n = len < 0 ? header.size() : static_cast<uint64_t>(len);
  std::vector<uint8_t> b(8 + header.size() + data_bytes, 0xAB);
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(b.data() + 8, header.data(), header.size());
  return b;
}

std::vector<uint8_t> random_bytes(Rng& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(rng.next_u64());
  return v;
}

// Writes specs with random contents; returns the contents.
std::vector<std::vector<uint8_t>> write_random(const std::string& path,
                                               const std::vector<TensorSpec>& specs,
                                               const std::map<std::string, std::string>& meta,
                                               Rng& rng) {
  std::vector<std::vector<uint8_t>> data;
  for (const auto& s : specs) data.push_back(random_bytes(rng, s.nbytes()));
  write_safetensors(path, specs, meta, [&](size_t i, uint8_t* out, size_t n) {
    ASSERT_EQ(n, data[i].size());
    ASSERT_NE(out, nullptr);
    if (n > 0) std::memcpy(out, data[i].data(), n);
  });
  return data;
}

TEST(Safetensors, RoundTripSeveralDtypes) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_trace(seed));
  Rng rng(seed);
  const std::vector<TensorSpec> specs = {
      {"w.f32", DType::F32, {3, 5}},     {"w.bf16", DType::BF16, {7, 2}},
      {"w.u8", DType::U8, {13}},         {"w.fp8", DType::F8_E4M3, {4, 4}},
      {"scalar.i64", DType::I64, {}},    {"v.i64", DType::I64, {3}},
      {"empty.f32", DType::F32, {0, 4}},
  };
  TempFile f("roundtrip");
  const auto data = write_random(f.path, specs, {}, rng);
  EXPECT_FALSE(fs::exists(f.path + ".tmp"));
  const auto st = SafetensorsFile::open(f.path);
  ASSERT_EQ(st->names().size(), specs.size());
  EXPECT_TRUE(st->metadata().empty());
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(specs[i].name);
    EXPECT_EQ(st->names()[i], specs[i].name);  // file order == write order
    ASSERT_TRUE(st->contains(specs[i].name));
    const TensorView& t = st->tensor(specs[i].name);
    EXPECT_EQ(t.name, specs[i].name);
    EXPECT_EQ(t.dtype, specs[i].dtype);
    EXPECT_EQ(t.shape, specs[i].shape);
    ASSERT_EQ(t.nbytes, data[i].size());
    ASSERT_NE(t.data, nullptr);  // non-null even for the empty tensor
    if (t.nbytes > 0) {
      EXPECT_EQ(std::memcmp(t.data, data[i].data(), t.nbytes), 0);
    }
  }
  // Typed access sees the same floats.
  const TensorView& f32 = st->tensor("w.f32");
  float x;
  std::memcpy(&x, data[0].data() + 4 * 7, 4);
  EXPECT_EQ(std::memcmp(&x, f32.as<float>() + 7, 4), 0);
  EXPECT_FALSE(st->contains("nope"));
  EXPECT_THROW(st->tensor("nope"), Error);
}

TEST(Safetensors, MetadataRoundTripAndHeaderAligned) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_trace(seed));
  Rng rng(seed);
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "k\"3 \xc3\xa9"}};
  // Vary the name length so the JSON length hits every residue mod 8.
  for (int pad = 0; pad < 8; ++pad) {
    SCOPED_TRACE(pad);
    const std::vector<TensorSpec> specs = {{"a" + std::string(pad, 'x'), DType::BF16, {3}},
                                           {"b", DType::U8, {1}}};
    TempFile f("meta");
    write_random(f.path, specs, meta, rng);
    const auto bytes = read_bytes(f.path);
    ASSERT_GE(bytes.size(), 8u);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
    EXPECT_EQ(n % 8, 0u);
    EXPECT_EQ(bytes.size(), 8 + n + 7);  // data section is exactly the tensors
    const auto st = SafetensorsFile::open(f.path);
    EXPECT_EQ(st->metadata(), meta);
    EXPECT_EQ(st->tensor("b").data, st->tensor(specs[0].name).data + 6);
  }
}

TEST(Safetensors, ZeroTensorFile) {
  TempFile f("zero");
  write_safetensors(f.path, {}, {}, [](size_t, uint8_t*, size_t) { FAIL() << "no tensors"; });
  const auto bytes = read_bytes(f.path);
  EXPECT_EQ(bytes.size(), 16u);  // length + "{}" padded to 8
  const auto st = SafetensorsFile::open(f.path);
  EXPECT_TRUE(st->names().empty());
  EXPECT_TRUE(st->metadata().empty());
}

TEST(Safetensors, WriterRejectsBadSpecsAndCleansUp) {
  TempFile f("badspec");
  auto fill = [](size_t, uint8_t* out, size_t n) { std::memset(out, 0, n); };
  for (const auto& specs : std::vector<std::vector<TensorSpec>>{
           {{"a", DType::F32, {2}}, {"a", DType::U8, {1}}},
           {{"", DType::F32, {2}}},
           {{"neg", DType::F32, {-2}}},
       }) {
    try {
      write_safetensors(f.path, specs, {}, fill);
      ADD_FAILURE() << "bad spec accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(f.path), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(f.path));
  }
  // A throwing fill leaves neither the file nor the temporary behind.
  EXPECT_THROW(write_safetensors(f.path, {{"a", DType::F32, {2}}}, {},
                                 [](size_t, uint8_t*, size_t) { fail("boom"); }),
               Error);
  EXPECT_FALSE(fs::exists(f.path));
  EXPECT_FALSE(fs::exists(f.path + ".tmp"));
  // Unwritable location: error names the path.
  const std::string bad = "/nonexistent_k3_dir/x.safetensors";
  try {
    write_safetensors(bad, {{"a", DType::F32, {2}}}, {}, fill);
    ADD_FAILURE() << "write to a missing directory succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
}

struct BadCase {
  const char* what;
  std::vector<uint8_t> bytes;
  std::vector<std::string> keywords;
};

std::string entry(const char* dtype, const char* shape, const char* offsets) {
  return std::string("{\"dtype\":\"") + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

TEST(Safetensors, MalformedFilesAreRejectedWithClearErrors) {
  const std::string ok = entry("F32", "[2]", "[0,8]");
  const std::vector<BadCase> cases = {
      {"file shorter than 8 bytes", {1, 0, 0, 0, 0}, {"truncated"}},
      {"header length beyond EOF", raw_file("{}", 0, 1000), {"truncated", "header length"}},
      {"huge header length", raw_file("{}", 0, int64_t{1} << 40), {"unreasonably large"}},
      {"invalid JSON", raw_file("{\"a\": ", 0), {"not valid JSON"}},
      {"header not an object", raw_file("[1, 2]", 0), {"JSON object"}},
      {"entry not an object", raw_file("{\"a\": 3}", 0), {"\"a\"", "object"}},
      {"unknown dtype",
       raw_file("{\"a\":" + entry("F33", "[2]", "[0,8]") + "}", 8),
       {"\"a\"", "unknown dtype", "F33"}},
      {"negative shape entry",
       raw_file("{\"a\":" + entry("F32", "[-1,2]", "[0,8]") + "}", 8),
       {"\"a\"", "negative"}},
      {"fractional shape entry",
       raw_file("{\"a\":" + entry("F32", "[2.0]", "[0,8]") + "}", 8),
       {"\"a\"", "non-negative integer"}},
      {"shape overflow",
       raw_file("{\"a\":" + entry("F32", "[4294967296,4294967296,0]", "[0,0]") + "}", 0),
       {"\"a\"", "too many elements"}},
      {"byte length mismatch",
       raw_file("{\"a\":" + entry("F32", "[2,2]", "[0,15]") + "}", 16),
       {"\"a\"", "mismatch"}},
      {"begin > end",
       raw_file("{\"a\":" + entry("F32", "[2]", "[8,0]") + "}", 8),
       {"\"a\"", "begin"}},
      {"three data offsets",
       raw_file("{\"a\":" + entry("F32", "[2]", "[0,8,9]") + "}", 8),
       {"\"a\"", "data_offsets"}},
      {"data offsets beyond EOF",
       raw_file("{\"a\":" + entry("F32", "[4]", "[0,16]") + "}", 8),
       {"\"a\"", "truncated", "data section"}},
      {"overlapping entries",
       raw_file("{\"a\":" + ok + ",\"b\":" + entry("F32", "[2]", "[4,12]") + "}", 12),
       {"\"a\"", "\"b\"", "overlap"}},
      {"duplicate names",
       raw_file("{\"a\":" + ok + ",\"a\":" + ok + "}", 8),
       {"duplicate tensor name", "\"a\""}},
      {"duplicate key in entry",
       raw_file("{\"a\":{\"dtype\":\"F32\",\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                8),
       {"duplicate key", "dtype"}},
      {"bad __metadata__ value",
       raw_file("{\"__metadata__\":{\"k\":1},\"a\":" + ok + "}", 8),
       {"__metadata__", "\"k\"", "string"}},
      {"__metadata__ not an object", raw_file("{\"__metadata__\":[]}", 0), {"__metadata__"}},
      {"entry with an extra key",
       raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"extra\":1}}", 8),
       {"\"a\"", "unknown key", "extra"}},
      {"entry missing shape",
       raw_file("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8),
       {"\"a\"", "missing key", "shape"}},
  };
  TempFile f("bad");
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.what);
    write_bytes(f.path, c.bytes);
    try {
      SafetensorsFile::open(f.path);
      ADD_FAILURE() << "malformed file accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(f.path), std::string::npos) << msg;
      for (const auto& k : c.keywords)
        EXPECT_NE(msg.find(k), std::string::npos) << k << " in: " << msg;
    }
  }
}

TEST(Safetensors, GapsTrailingBytesAndMissingFileAreHandled) {
  TempFile f("gaps");
  // A gap between tensors and trailing bytes after the last are tolerated.
  write_bytes(f.path, raw_file("{\"b\":" + entry("U8", "[2]", "[10,12]") +
                                   ",\"a\":" + entry("U8", "[3]", "[0,3]") + "}  ",
                               20));
  const auto st = SafetensorsFile::open(f.path);
  EXPECT_EQ(st->names(), (std::vector<std::string>{"a", "b"}));  // by offset, not by name
  EXPECT_EQ(st->tensor("b").data - st->tensor("a").data, 10);
  try {
    SafetensorsFile::open(f.path + ".missing");
    ADD_FAILURE() << "missing file opened";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(f.path + ".missing"), std::string::npos) << e.what();
  }
}

// Random single-byte corruptions and truncations of a valid file: open() must either succeed
// (and then every view must be readable) or throw k3::Error; anything else fails.
TEST(Safetensors, FuzzedCorruptionsNeverCrash) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_trace(seed));
  Rng rng(seed);
  TempFile src("fuzzsrc"), f("fuzz");
  const std::vector<TensorSpec> specs = {{"layer.0.weight", DType::BF16, {4, 6}},
                                         {"layer.0.bias", DType::F32, {6}},
                                         {"ids", DType::I64, {3}}};
  write_random(src.path, specs, {{"format", "pt"}}, rng);
  const auto good = read_bytes(src.path);
  uint64_t hdr = 0;
  for (int i = 7; i >= 0; --i) hdr = (hdr << 8) | good[i];
  const char interesting[] = "\"{}[],:-0123456789eE. \\x";
  int accepted = 0, rejected = 0;
  for (int it = 0; it < 600; ++it) {
    std::vector<uint8_t> b = good;
    const int mode = static_cast<int>(rng.next_u64() % 4);
    const int edits = mode == 3 ? 1 + static_cast<int>(rng.next_u64() % 4) : 1;
    for (int e = 0; e < edits; ++e) {
      // Mostly hit the length prefix and the header, where the parsing happens.
      const size_t pos = rng.next_u64() % (rng.next_u64() % 4 == 0 ? b.size() : 8 + hdr);
      if (mode == 0 || mode == 3)
        b[pos] = static_cast<uint8_t>(rng.next_u64());
      else if (mode == 1)
        b[pos] = static_cast<uint8_t>(interesting[rng.next_u64() % (sizeof interesting - 1)]);
      else
        b.resize(rng.next_u64() % b.size());
    }
    write_bytes(f.path, b);
    try {
      const auto st = SafetensorsFile::open(f.path);
      unsigned sum = 0;
      for (const auto& name : st->names()) {
        const TensorView& t = st->tensor(name);
        for (size_t i = 0; i < t.nbytes; ++i) sum += t.data[i];
        EXPECT_EQ(t.nbytes, static_cast<size_t>(t.numel()) * dtype_size(t.dtype));
      }
      (void)sum;
      ++accepted;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << it << ": non-k3 exception: " << e.what();
    }
  }
  EXPECT_GT(rejected, 100);  // the corruptions are actually being detected
  EXPECT_GT(accepted, 0);    // and harmless ones (e.g. in tensor data) still load
}

}  // namespace
}  // namespace k3
