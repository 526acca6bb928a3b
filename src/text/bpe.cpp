#include "text/bpe.h"

#include <algorithm>
#include <queue>

#include "core/error.h"

namespace k3 {

bool BpeRanks::add(std::string bytes, int64_t rank) {
  K3_CHECK(rank >= 0 && rank < kMaxRank, "internal: BPE rank ", rank, " out of range");
  if (rank < static_cast<int64_t>(by_rank_.size()) && by_rank_[static_cast<size_t>(rank)])
    return false;
  const auto [it, inserted] = by_bytes_.emplace(std::move(bytes), rank);
  if (!inserted) return false;
  if (rank >= static_cast<int64_t>(by_rank_.size())) by_rank_.resize(static_cast<size_t>(rank) + 1);
  by_rank_[static_cast<size_t>(rank)] = &it->first;
  max_rank_ = std::max(max_rank_, rank);
  return true;
}

std::optional<int64_t> BpeRanks::rank(std::string_view bytes) const {
  const auto it = by_bytes_.find(bytes);
  if (it == by_bytes_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeRanks::bytes(int64_t r) const {
  if (r < 0 || r >= static_cast<int64_t>(by_rank_.size())) return nullptr;
  return by_rank_[static_cast<size_t>(r)];
}

void BpeRanks::encode_piece(std::string_view piece, std::vector<int64_t>& out) const {
  if (piece.empty()) return;
  if (const auto whole = rank(piece)) {
    out.push_back(*whole);
    return;
  }
  // The current tokens as a linked list of start offsets: next[i] is where the token starting
  // at i ends (n at the end), prev[i] the start of the token before it (kNone at the front).
  // pair_rank[i] is the rank of the token at i merged with its successor, kNone if no token.
  constexpr int64_t kNone = -1;
  constexpr uint32_t kNoPrev = ~0u;
  const auto n = static_cast<uint32_t>(piece.size());
  std::vector<uint32_t> next(n), prev(n);
  std::vector<int64_t> pair_rank(n, kNone);
  std::vector<char> alive(n, 1);
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i == 0 ? kNoPrev : i - 1;
  }
  const auto pair_of = [&](uint32_t i) -> int64_t {
    if (next[i] >= n) return kNone;
    const uint32_t end = next[next[i]];
    const auto r = rank(piece.substr(i, end - i));
    return r ? *r : kNone;
  };
  // Min-heap on (rank, start): the lowest rank first, the leftmost among equal ranks, which is
  // the pair tiktoken's linear scan picks. Entries go stale when a neighbour merges; they are
  // recognised by the pair rank no longer matching (a (start, rank) fixes the span).
  using Entry = std::pair<int64_t, uint32_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (uint32_t i = 0; i + 1 < n; ++i) {
    pair_rank[i] = pair_of(i);
    if (pair_rank[i] != kNone) heap.emplace(pair_rank[i], i);
  }
  while (!heap.empty()) {
    const auto [r, i] = heap.top();
    heap.pop();
    if (!alive[i] || pair_rank[i] != r) continue;
    const uint32_t j = next[i];
    alive[j] = 0;
    next[i] = next[j];
    if (next[j] < n) prev[next[j]] = i;
    pair_rank[i] = pair_of(i);
    if (pair_rank[i] != kNone) heap.emplace(pair_rank[i], i);
    if (prev[i] != kNoPrev) {
      const uint32_t p = prev[i];
      pair_rank[p] = pair_of(p);
      if (pair_rank[p] != kNone) heap.emplace(pair_rank[p], p);
    }
  }
  for (uint32_t i = 0; i < n; i = next[i]) {
    const auto r = rank(piece.substr(i, next[i] - i));
    K3_CHECK(r.has_value(), "BPE: byte 0x", std::hex, static_cast<int>(uint8_t(piece[i])),
             " has no token in the rank file");
    out.push_back(*r);
  }
}

}  // namespace k3
