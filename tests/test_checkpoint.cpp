// write_sharded_checkpoint + Checkpoint::open: packing into shards, the index file, lookup
// across shards, and rejection of indexes that disagree with their shards.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::seed_trace;
using test::test_seed;

// A fresh directory removed when the test ends.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("k3_ckpt_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
};

struct Written {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<uint8_t>> data;
  std::vector<uint64_t> progress;
};

// Seven tensors of 24..400 bytes, one larger than the 256-byte shard limit.
Written write_ckpt(const fs::path& dir, Rng& rng, uint64_t max_shard_bytes = 256) {
  Written w;
  w.specs = {{"embed", DType::BF16, {8, 6}},     {"l0.q", DType::F32, {4, 6}},
             {"l0.k", DType::F8_E4M3, {10, 10}}, {"l0.ids", DType::I64, {3}},
             {"l1.big", DType::F32, {100}},      {"l1.mask", DType::U8, {70}},
             {"norm", DType::BF16, {12}}};
  for (const auto& s : w.specs) {
    std::vector<uint8_t> v(s.nbytes());
    for (auto& x : v) x = static_cast<uint8_t>(rng.next_u64());
    w.data.push_back(std::move(v));
  }
  write_sharded_checkpoint(
      dir.string(), w.specs, max_shard_bytes,
      [&](size_t i, uint8_t* out, size_t n) {
        ASSERT_EQ(n, w.data[i].size());
        std::memcpy(out, w.data[i].data(), n);
      },
      [&](uint64_t n) { w.progress.push_back(n); });
  return w;
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

void write_json(const fs::path& p, const json& j) {
  std::ofstream(p) << j.dump(2);
}

// Expects Checkpoint::open(dir) to fail with a message containing every keyword.
void expect_open_error(const std::string& dir, const std::vector<std::string>& keywords) {
  try {
    Checkpoint::open(dir);
    ADD_FAILURE() << "bad checkpoint accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& k : keywords) EXPECT_NE(msg.find(k), std::string::npos) << k << " in: " << msg;
  }
}

TEST(Checkpoint, ShardedRoundTripAcrossShards) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_trace(seed));
  Rng rng(seed);
  TempDir dir("sharded");
  const Written w = write_ckpt(dir.path / "sub", rng);  // also creates the missing directory
  const fs::path root = dir.path / "sub";

  // Greedy packing with a 256-byte limit: [96, 96] [100, 24] [400] [70, 24].
  uint64_t total = 0;
  for (const auto& d : w.data) total += d.size();
  const json index = read_json(root / "model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  const json& wm = index["weight_map"];
  ASSERT_EQ(wm.size(), w.specs.size());
  EXPECT_EQ(wm["embed"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(wm["l0.q"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(wm["l0.k"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(wm["l0.ids"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(wm["l1.big"], "model-00003-of-00004.safetensors");  // oversized: alone
  EXPECT_EQ(wm["l1.mask"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(wm["norm"], "model-00004-of-00004.safetensors");
  for (int i = 1; i <= 4; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-00004.safetensors", i);
    EXPECT_TRUE(fs::exists(root / name)) << name;
    EXPECT_FALSE(fs::exists(root / (std::string(name) + ".tmp"))) << name;
  }

  ASSERT_EQ(w.progress.size(), w.specs.size());
  for (size_t i = 0; i < w.specs.size(); ++i) EXPECT_EQ(w.progress[i], w.data[i].size());

  const auto ckpt = Checkpoint::open(root.string());
  EXPECT_EQ(ckpt->num_shards(), 4u);
  EXPECT_EQ(ckpt->total_bytes(), total);
  EXPECT_EQ(ckpt->names(), (std::vector<std::string>{"embed", "l0.ids", "l0.k", "l0.q", "l1.big",
                                                     "l1.mask", "norm"}));
  for (size_t i = 0; i < w.specs.size(); ++i) {
    SCOPED_TRACE(w.specs[i].name);
    ASSERT_TRUE(ckpt->contains(w.specs[i].name));
    const TensorView& t = ckpt->tensor(w.specs[i].name);
    EXPECT_EQ(ckpt->find(w.specs[i].name), &t);
    EXPECT_EQ(t.dtype, w.specs[i].dtype);
    EXPECT_EQ(t.shape, w.specs[i].shape);
    ASSERT_EQ(t.nbytes, w.data[i].size());
    EXPECT_EQ(std::memcmp(t.data, w.data[i].data(), t.nbytes), 0);
  }
  EXPECT_EQ(ckpt->find("ghost"), nullptr);
  try {
    ckpt->tensor("ghost");
    ADD_FAILURE() << "missing tensor found";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor ghost not found in checkpoint " + root.string()),
              std::string::npos)
        << e.what();
  }
}

TEST(Checkpoint, SingleFileDirectoryAndFilePath) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_trace(seed));
  Rng rng(seed);
  TempDir dir("single");
  fs::create_directories(dir.path);
  const fs::path file = dir.path / "model.safetensors";
  const std::vector<uint8_t> bytes = {1, 2, 3, 4, 5, 6};
  write_safetensors(file.string(), {{"x", DType::U8, {2, 3}}}, {},
                    [&](size_t, uint8_t* out, size_t n) { std::memcpy(out, bytes.data(), n); });
  for (const std::string& p : {dir.str(), file.string()}) {
    SCOPED_TRACE(p);
    const auto ckpt = Checkpoint::open(p);
    EXPECT_EQ(ckpt->num_shards(), 1u);
    EXPECT_EQ(ckpt->names(), std::vector<std::string>{"x"});
    EXPECT_EQ(ckpt->total_bytes(), 6u);
    EXPECT_EQ(std::memcmp(ckpt->tensor("x").data, bytes.data(), 6), 0);
  }
  (void)rng;
}

TEST(Checkpoint, EmptyDirectoryIsAnError) {
  TempDir dir("empty");
  fs::create_directories(dir.path);
  expect_open_error(dir.str(),
                    {"no model.safetensors.index.json or model.safetensors in", dir.str()});
}

TEST(Checkpoint, IndexThatDisagreesWithShardsIsRejected) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_trace(seed));
  Rng rng(seed);
  const std::string s1 = "model-00001-of-00004.safetensors";
  const std::string s2 = "model-00002-of-00004.safetensors";
  {
    SCOPED_TRACE("index names a missing shard");
    TempDir dir("missing_shard");
    write_ckpt(dir.path, rng);
    fs::remove(dir.path / s2);
    expect_open_error(dir.str(), {s2, "missing"});
  }
  {
    SCOPED_TRACE("index assigns a tensor to a shard that lacks it");
    TempDir dir("lacks");
    write_ckpt(dir.path, rng);
    json index = read_json(dir.path / "model.safetensors.index.json");
    index["weight_map"]["ghost"] = s1;
    write_json(dir.path / "model.safetensors.index.json", index);
    expect_open_error(dir.str(), {"ghost", s1, "lacks"});
  }
  {
    SCOPED_TRACE("shard has a tensor the index does not list");
    TempDir dir("unlisted");
    write_ckpt(dir.path, rng);
    json index = read_json(dir.path / "model.safetensors.index.json");
    index["weight_map"].erase("l0.q");
    write_json(dir.path / "model.safetensors.index.json", index);
    expect_open_error(dir.str(), {"l0.q", s1, "does not list"});
  }
  {
    SCOPED_TRACE("tensor in two shards");
    TempDir dir("two_shards");
    write_ckpt(dir.path, rng);
    // Rewrite shard 2 so it also holds "embed", which the index places in shard 1.
    write_safetensors((dir.path / s2).string(),
                      {{"l0.k", DType::F8_E4M3, {10, 10}}, {"embed", DType::BF16, {8, 6}}}, {},
                      [](size_t, uint8_t* out, size_t n) { std::memset(out, 0, n); });
    expect_open_error(dir.str(), {"embed", s2, s1});
  }
  {
    SCOPED_TRACE("index without weight_map / not JSON / escaping shard name");
    TempDir dir("bad_index");
    write_ckpt(dir.path, rng);
    const fs::path ip = dir.path / "model.safetensors.index.json";
    write_json(ip, json{{"metadata", json::object()}});
    expect_open_error(dir.str(), {"weight_map", ip.string()});
    std::ofstream(ip) << "{\"weight_map\": {";
    expect_open_error(dir.str(), {"not valid JSON", ip.string()});
    write_json(ip, json{{"weight_map", {{"embed", "../model-00001-of-00004.safetensors"}}}});
    expect_open_error(dir.str(), {"bad shard file name", "embed"});
  }
}

TEST(Checkpoint, RewritingWithFewerShardsReplacesTheIndex) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(seed_trace(seed));
  Rng rng(seed);
  TempDir dir("rewrite");
  write_ckpt(dir.path, rng);
  const Written w = write_ckpt(dir.path, rng, 1 << 20);  // everything in one shard now
  const auto ckpt = Checkpoint::open(dir.str());
  EXPECT_EQ(ckpt->num_shards(), 1u);
  EXPECT_EQ(std::memcmp(ckpt->tensor("norm").data, w.data.back().data(), 24), 0);
}

}  // namespace
}  // namespace k3
