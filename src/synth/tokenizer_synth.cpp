#include "synth/tokenizer_synth.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/base64.h"
#include "text/pretokenizer.h"

namespace k3 {

const std::vector<SpecialTokenSlot>& k3_special_tokens() {
  // K3's tokenizer_config.json: 163584 + offset. Unlisted ids are <|reserved_token_{id}|>.
  static const std::vector<SpecialTokenSlot> slots = {
      {0, "[BOS]"},
      {1, "[EOS]"},
      {2, "<|end_of_msg|>"},  // end of turn: K3's eos_token_id
      {3, "<|open|>"},
      {4, "<|close|>"},
      {5, "<|sep|>"},
      {6, "[start_header_id]"},
      {7, "[end_header_id]"},
      {9, "[EOT]"},
      {18, "<|media_begin|>"},
      {19, "<|media_content|>"},
      {20, "<|media_end|>"},
      {21, "<|media_pad|>"},
      {65, "<osagent_mode>"},
      {254, "[UNK]"},
      {255, "[PAD]"},
  };
  return slots;
}

std::vector<std::string> train_bpe(std::string_view text, int64_t num_ranks) {
  K3_CHECK(num_ranks >= 256, "a byte-level BPE needs at least 256 ranks, got ", num_ranks);
  // Distinct pieces with their counts, in a fixed (sorted) order.
  std::map<std::string, int64_t> counts;
  const PreTokenizer pre;
  for (const std::string_view piece : pre.split(text)) ++counts[std::string(piece)];
  struct Word {
    std::vector<int32_t> ids;
    int64_t count;
  };
  std::vector<Word> words;
  for (const auto& [piece, n] : counts) {
    Word w{{}, n};
    for (unsigned char c : piece) w.ids.push_back(c);
    words.push_back(std::move(w));
  }
  std::vector<std::string> tokens;
  std::unordered_map<std::string, int32_t> id_of;
  for (int b = 0; b < 256; ++b) {
    tokens.emplace_back(1, static_cast<char>(b));
    id_of.emplace(tokens.back(), b);
  }
  const auto key = [](int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); };
  while (static_cast<int64_t>(tokens.size()) < num_ranks) {
    std::unordered_map<uint64_t, int64_t> pairs;
    for (const Word& w : words)
      for (size_t i = 0; i + 1 < w.ids.size(); ++i) pairs[key(w.ids[i], w.ids[i + 1])] += w.count;
    K3_CHECK(!pairs.empty(), "the tokenizer sample yields only ", tokens.size(), " of ", num_ranks,
             " ranks");
    // The most frequent pair; ties by the smaller key, so hash order cannot matter.
    uint64_t best = 0;
    int64_t best_n = -1;
    for (const auto& [k, n] : pairs)
      if (n > best_n || (n == best_n && k < best)) best = k, best_n = n;
    const auto a = static_cast<int32_t>(best >> 32), b = static_cast<int32_t>(best & 0xffffffffu);
    const std::string merged = tokens[a] + tokens[b];
    // Two merge paths can spell the same bytes ("ab"+"c", "a"+"bc"): reuse the token then.
    int32_t id;
    if (const auto it = id_of.find(merged); it != id_of.end()) {
      id = it->second;
    } else {
      id = static_cast<int32_t>(tokens.size());
      tokens.push_back(merged);
      id_of.emplace(merged, id);
    }
    for (Word& w : words) {
      size_t out = 0;
      for (size_t i = 0; i < w.ids.size(); ++i) {
        if (i + 1 < w.ids.size() && w.ids[i] == a && w.ids[i + 1] == b) {
          w.ids[out++] = id;
          ++i;
        } else {
          w.ids[out++] = w.ids[i];
        }
      }
      w.ids.resize(out);
    }
  }
  return tokens;
}

bool uses_synthetic_tokenizer(const ModelConfig& cfg) {
  return cfg.vocab_size == kTinyVocabSize && cfg.bos_token_id == kTinyBpeRanks;
}

void write_synthetic_tokenizer(const std::string& dir, int64_t num_ranks) {
  namespace fs = std::filesystem;
  const std::vector<std::string> tokens = train_bpe(synth_tokenizer_sample(), num_ranks);
  fs::create_directories(dir);
  {
    const fs::path p = fs::path(dir) / "tiktoken.model";
    std::ofstream f(p, std::ios::binary);
    K3_CHECK(f.good(), "cannot write ", p.string());
    for (size_t r = 0; r < tokens.size(); ++r) f << base64_encode(tokens[r]) << ' ' << r << '\n';
    K3_CHECK(f.good(), "error writing ", p.string());
  }
  // Kimi's layout: only the named specials are listed; the loader names the rest reserved.
  nlohmann::ordered_json added = nlohmann::ordered_json::object();
  std::vector<std::string> additional;
  for (const SpecialTokenSlot& s : k3_special_tokens()) {
    added[std::to_string(num_ranks + s.offset)] = {{"content", s.text},    {"lstrip", false},
                                                   {"normalized", false},  {"rstrip", false},
                                                   {"single_word", false}, {"special", true}};
    const std::string t = s.text;
    if (t != "[BOS]" && t != "[EOS]" && t != "[UNK]" && t != "[PAD]") additional.push_back(t);
  }
  nlohmann::ordered_json cfg = {
      {"added_tokens_decoder", added}, {"additional_special_tokens", additional},
      {"bos_token", "[BOS]"},          {"clean_up_tokenization_spaces", false},
      {"eos_token", "[EOS]"},          {"model_max_length", 1048576},
      {"pad_token", "[PAD]"},          {"tokenizer_class", "TikTokenTokenizer"},
      {"unk_token", "[UNK]"},
  };
  const fs::path p = fs::path(dir) / "tokenizer_config.json";
  std::ofstream f(p);
  K3_CHECK(f.good(), "cannot write ", p.string());
  f << cfg.dump(2) << '\n';
  K3_CHECK(f.good(), "error writing ", p.string());
}

}  // namespace k3
