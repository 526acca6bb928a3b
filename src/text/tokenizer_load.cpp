// Tokenizer::load: tiktoken.model (one "<base64 token bytes> <rank>" per line, as tiktoken's
// load_tiktoken_bpe reads it) and the added_tokens_decoder of tokenizer_config.json.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/base64.h"
#include "text/tokenizer.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  K3_CHECK(f.good(), "cannot read ", p.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  K3_CHECK(!f.bad(), "error reading ", p.string());
  return ss.str();
}

// A line quoted in an error message: cut short, control bytes escaped.
std::string quote(std::string_view line) {
  std::string q = "\"";
  for (size_t i = 0; i < line.size() && i < 60; ++i) {
    const auto c = static_cast<unsigned char>(line[i]);
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      q += buf;
    } else {
      q.push_back(static_cast<char>(c));
    }
  }
  return q + (line.size() > 60 ? "...\"" : "\"");
}

void read_ranks(const fs::path& path, BpeRanks& ranks) {
  const std::string text = read_file(path);
  const std::string file = path.string();
  std::unordered_map<int64_t, size_t> line_of_rank;  // for duplicate messages
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;  // tiktoken skips empty lines too
    const auto where = [&] { return file + " line " + std::to_string(line_no) + ": "; };
    // Exactly two fields separated by spaces or tabs.
    std::vector<std::string_view> fields;
    for (size_t i = 0; i < line.size();) {
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
      size_t j = i;
      while (j < line.size() && line[j] != ' ' && line[j] != '\t') ++j;
      if (j > i) fields.push_back(line.substr(i, j - i));
      i = j;
    }
    if (fields.size() != 2) fail(where(), "expected \"<base64 token> <rank>\", got ", quote(line));
    const std::optional<std::string> bytes = base64_decode(fields[0]);
    if (!bytes || bytes->empty()) fail(where(), "bad base64 token ", quote(fields[0]));
    int64_t rank = 0;
    bool ok = fields[1].size() <= 9;
    for (char c : fields[1]) {
      ok = ok && c >= '0' && c <= '9';
      rank = rank * 10 + (c - '0');
    }
    if (!ok || rank >= BpeRanks::kMaxRank)
      fail(where(), "rank ", quote(fields[1]), " is not an integer in [0, ", BpeRanks::kMaxRank,
           ")");
    if (const auto prev = line_of_rank.find(rank); prev != line_of_rank.end())
      fail(where(), "duplicate rank ", rank, " (also on line ", prev->second, ")");
    if (const auto same = ranks.rank(*bytes))
      fail(where(), "duplicate token ", quote(fields[0]), " (also rank ", *same, ")");
    K3_CHECK(ranks.add(*bytes, rank), "internal: rank ", rank, " not added");
    line_of_rank.emplace(rank, line_no);
  }
  K3_CHECK(ranks.size() > 0, file, ": no tokens");
  // Byte-level BPE must be able to encode any byte.
  for (int b = 0; b < 256; ++b)
    if (!ranks.rank(std::string(1, static_cast<char>(b))))
      fail(file, ": no token for the byte 0x", std::hex, b, " (a byte-level BPE needs all 256)");
}

struct NamedSpecial {
  int64_t id;
  std::string text, where;
};

// added_tokens_decoder: {"<id>": {"content": "<text>", ...}, ...}; nothing else is read.
std::vector<NamedSpecial> read_config(const fs::path& path) {
  const std::string file = path.string();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::parse_error& e) {
    fail(file, ": invalid JSON: ", e.what());  // nlohmann names the line and column
  }
  std::vector<NamedSpecial> out;
  if (!j.is_object() || !j.contains("added_tokens_decoder")) return out;
  const auto& d = j["added_tokens_decoder"];
  K3_CHECK(d.is_object(), file, ": \"added_tokens_decoder\" must be an object");
  for (const auto& [key, v] : d.items()) {
    const std::string where = file + ": added_tokens_decoder[\"" + key + "\"]";
    const bool digits =
        !key.empty() && key.size() <= 9 &&
        std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    K3_CHECK(digits, where, ": the key is not a token id");
    K3_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(), where,
             ": needs a string \"content\"");
    out.push_back({std::stoll(key), v["content"].get<std::string>(), where});
  }
  return out;
}

}  // namespace

void Tokenizer::add_special(const std::string& text, int64_t id, const std::string& where) {
  K3_CHECK(!text.empty(), where, ": empty special token");
  if (const auto it = special_ids_.find(text); it != special_ids_.end())
    fail(where, ": special token \"", text, "\" already has id ", it->second);
  if (const auto it = special_text_.find(id); it != special_text_.end())
    fail(where, ": id ", id, " is already the special token \"", it->second, "\"");
  special_ids_.emplace(text, id);
  special_text_.emplace(id, text);
}

void Tokenizer::finish_specials() {
  vocab_size_ = byte_fallback_ ? 256 : ranks_.max_rank() + 1;
  for (const auto& [id, text] : special_text_) {
    vocab_size_ = std::max(vocab_size_, id + 1);
    by_first_byte_[static_cast<uint8_t>(text[0])].emplace_back(text, id);
  }
  for (auto& v : by_first_byte_)  // longest first; ties by text, so the order is fixed
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
      return a.first.size() != b.first.size() ? a.first.size() > b.first.size() : a.first < b.first;
    });
}

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& dir) {
  K3_CHECK(fs::is_directory(dir), "tokenizer: ", dir, " is not a directory");
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  const fs::path model = fs::path(dir) / "tiktoken.model";
  const fs::path config = fs::path(dir) / "tokenizer_config.json";
  const std::vector<NamedSpecial> named =
      fs::exists(config) ? read_config(config) : std::vector<NamedSpecial>{};
  if (!fs::exists(model)) {
    t->byte_fallback_ = true;
    for (const auto& s : named) {
      K3_CHECK(s.id >= 256, s.where, ": special id ", s.id,
               " clashes with a byte token (the byte-level fallback uses ids 0..255)");
      t->add_special(s.text, s.id, s.where);
    }
  } else {
    read_ranks(model, t->ranks_);
    for (const auto& s : named) {
      if (t->ranks_.bytes(s.id))
        fail(s.where, ": special id ", s.id, " clashes with BPE rank ", s.id, " of ",
             model.string());
      t->add_special(s.text, s.id, s.where);
    }
    // Unnamed ids of the reserved range get tokenization_kimi.py's placeholder names.
    const int64_t first = t->ranks_.max_rank() + 1;
    for (int64_t id = first; id < first + kReservedSpecials; ++id) {
      const std::string name = "<|reserved_token_" + std::to_string(id) + "|>";
      if (!t->special_text_.count(id) && !t->special_ids_.count(name))
        t->add_special(name, id, "reserved");
    }
    t->pre_ = std::make_unique<PreTokenizer>();
  }
  t->finish_specials();
  return t;
}

}  // namespace k3
