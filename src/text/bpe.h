// Byte-level BPE over a rank table (tiktoken's mergeable_ranks): a token is a byte string, its
// rank is its id, and encoding a piece repeatedly merges the adjacent pair whose concatenation
// has the lowest rank (leftmost on ties) until no adjacent pair is a token.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace k3 {

class BpeRanks {
 public:
  BpeRanks() = default;
  BpeRanks(const BpeRanks&) = delete;  // by_rank_ points into by_bytes_' nodes
  BpeRanks& operator=(const BpeRanks&) = delete;
  BpeRanks(BpeRanks&&) = default;  // moving keeps the nodes
  BpeRanks& operator=(BpeRanks&&) = default;

  // False (and no change) when the bytes or the rank are already present. 0 <= rank < kMaxRank.
  bool add(std::string bytes, int64_t rank);
  static constexpr int64_t kMaxRank = int64_t{1} << 24;
  std::optional<int64_t> rank(std::string_view bytes) const;
  // The bytes of rank r; nullptr when r is not a rank.
  const std::string* bytes(int64_t r) const;
  size_t size() const { return by_bytes_.size(); }
  int64_t max_rank() const { return max_rank_; }  // -1 when empty

  // Appends the ranks of one pre-token piece to out. Like tiktoken, a piece that is itself a
  // token is emitted whole without merging. Every byte of piece must be a token (load checks
  // that all 256 are). O(n log n) in the piece length.
  void encode_piece(std::string_view piece, std::vector<int64_t>& out) const;

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int64_t, Hash, std::equal_to<>> by_bytes_;
  std::vector<const std::string*> by_rank_;  // [max_rank + 1], into by_bytes_' (stable) keys
  int64_t max_rank_ = -1;
};

}  // namespace k3
