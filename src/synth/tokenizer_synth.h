// The synthetic checkpoints' tokenizer: a small byte-level BPE learned deterministically on a
// built-in sample text with Kimi's pre-tokenizer, written as tiktoken.model +
// tokenizer_config.json in Kimi's format, with the special tokens at the top of the vocabulary
// in K3's order. It gives the tiny K3 presets a real tokenizer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"

namespace k3 {

// The tiny layout: 768 BPE ranks (256 bytes + 512 merges), then 256 specials at 768..1023
// placed like K3's at 163584..163839 ([BOS] 768, [EOS] 769, <|end_of_msg|> 770, ...).
constexpr int64_t kTinyBpeRanks = 768;
constexpr int64_t kTinyVocabSize = kTinyBpeRanks + 256;

// K3's named special tokens (tokenizer_config.json), by offset from the first special id.
struct SpecialTokenSlot {
  int offset;
  const char* text;
};
const std::vector<SpecialTokenSlot>& k3_special_tokens();

// The built-in sample text (English, code, numbers, CJK, emoji).
std::string_view synth_tokenizer_sample();

// Learns num_ranks tokens (the 256 bytes, rank = byte value, then merges in order) on text:
// each step merges the most frequent adjacent pair within pre-token pieces (ties: the lowest
// pair of ids). Deterministic. Returns token bytes by rank. Throws if text runs out of pairs.
std::vector<std::string> train_bpe(std::string_view text, int64_t num_ranks);

// True for configs with the tiny layout: synthesize_checkpoint writes this tokenizer for them.
bool uses_synthetic_tokenizer(const ModelConfig& cfg);

// Writes dir/tiktoken.model and dir/tokenizer_config.json for num_ranks ranks learned on the
// sample and 256 specials from id num_ranks.
void write_synthetic_tokenizer(const std::string& dir, int64_t num_ranks = kTinyBpeRanks);

}  // namespace k3
