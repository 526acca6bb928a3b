// Checkpoint directories: an HF-style index with shards, or a lone model.safetensors. The
// index and the shards must agree exactly, so a tensor can never silently come from the
// wrong shard or be hidden by a stale index.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "io/safetensors.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// name -> shard file name, from model.safetensors.index.json.
std::map<std::string, std::string> read_weight_map(const fs::path& index_path) {
  const std::string p = index_path.string();
  std::ifstream in(index_path, std::ios::binary);
  if (!in) fail("checkpoint index ", p, ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  json j;
  try {
    j = json::parse(ss.str());
  } catch (const json::exception& e) {
    fail("checkpoint index ", p, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) fail("checkpoint index ", p, ": must be a JSON object");
  if (j.contains("metadata") && !j["metadata"].is_object())
    fail("checkpoint index ", p, ": metadata must be an object");
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    fail("checkpoint index ", p, ": missing weight_map object");
  std::map<std::string, std::string> out;
  for (const auto& [name, shard] : j["weight_map"].items()) {
    if (!shard.is_string())
      fail("checkpoint index ", p, ": weight_map value for ", name, " must be a string");
    const std::string& s = shard.get_ref<const std::string&>();
    // Shards live next to the index; refuse names that would escape the directory.
    const fs::path sp(s);
    if (s.empty() || sp.is_absolute() || sp.filename() != sp)
      fail("checkpoint index ", p, ": bad shard file name \"", s, "\" for ", name);
    out[name] = s;
  }
  return out;
}

}  // namespace

std::unique_ptr<Checkpoint> Checkpoint::open(const std::string& dir) {
  auto c = std::make_unique<Checkpoint>();
  c->dir_ = dir;
  std::error_code ec;
  const fs::path root(dir);
  const fs::path index_path = root / "model.safetensors.index.json";
  const fs::path single = root / "model.safetensors";

  if (fs::is_regular_file(root, ec)) {
    c->shards_.push_back(SafetensorsFile::open(dir));
  } else if (fs::exists(index_path, ec)) {
    const auto weight_map = read_weight_map(index_path);
    std::set<std::string> files;
    for (const auto& [_, shard] : weight_map) files.insert(shard);
    for (const std::string& f : files) {
      const fs::path sp = root / f;
      if (!fs::is_regular_file(sp, ec))
        fail("checkpoint ", dir, ": index names shard ", f, ", which is missing");
      c->shards_.push_back(SafetensorsFile::open(sp.string()));
      const SafetensorsFile& shard = *c->shards_.back();
      for (const std::string& name : shard.names()) {
        const auto it = weight_map.find(name);
        if (it == weight_map.end())
          fail("checkpoint ", dir, ": shard ", f, " has tensor ", name,
               " that the index does not list");
        if (it->second != f)
          fail("checkpoint ", dir, ": tensor ", name, " is in shard ", f,
               " but the index assigns it to shard ", it->second);
      }
    }
    // Every tensor the index lists must be present in its shard.
    std::map<std::string, const SafetensorsFile*> by_file;
    for (const auto& shard : c->shards_)
      by_file[fs::path(shard->path()).filename().string()] = shard.get();
    for (const auto& [name, f] : weight_map) {
      const SafetensorsFile* shard = by_file.at(f);
      if (!shard->contains(name))
        fail("checkpoint ", dir, ": index assigns tensor ", name, " to shard ", f,
             ", which lacks it");
      c->where_[name] = &shard->tensor(name);
    }
    return c;
  } else if (fs::is_regular_file(single, ec)) {
    c->shards_.push_back(SafetensorsFile::open(single.string()));
  } else {
    fail("no model.safetensors.index.json or model.safetensors in ", dir);
  }
  for (const std::string& name : c->shards_[0]->names())
    c->where_[name] = &c->shards_[0]->tensor(name);
  return c;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, _] : where_) out.push_back(name);
  return out;
}

const TensorView* Checkpoint::find(const std::string& name) const {
  const auto it = where_.find(name);
  return it == where_.end() ? nullptr : it->second;
}

const TensorView& Checkpoint::tensor(const std::string& name) const {
  const TensorView* t = find(name);
  if (!t) fail("tensor ", name, " not found in checkpoint ", dir_);
  return *t;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& [_, t] : where_) n += t->nbytes;
  return n;
}

}  // namespace k3
