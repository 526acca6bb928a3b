#include "cuda/step_executor.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace k3::cuda {

int64_t check_step_rows(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                        int max_rows, int64_t vocab, std::span<const int64_t> positions,
                        int64_t max_context, int padding_slot) {
  const int64_t rows = static_cast<int64_t>(slots.size());
  K3_CHECK(rows >= 1 && rows <= max_rows, "a step takes 1..", max_rows, " rows, got ", rows);
  K3_CHECK(tokens.size() == slots.size(), "step: ", slots.size(), " slots but ", tokens.size(),
           " tokens");
  const int n_slots = static_cast<int>(positions.size());
  std::vector<bool> seen(positions.size(), false);
  int64_t longest = 0;
  for (int64_t r = 0, run = 0; r < rows; ++r) {
    const int32_t s = slots[static_cast<size_t>(r)], t = tokens[static_cast<size_t>(r)];
    K3_CHECK(s >= 0 && s < n_slots, "slot ", s, " outside the ", n_slots, " slots");
    const bool continues = r > 0 && slots[static_cast<size_t>(r - 1)] == s;
    K3_CHECK(continues || !seen[static_cast<size_t>(s)], "slot ", s,
             " has two separate runs of rows in one step (its rows must be consecutive)");
    seen[static_cast<size_t>(s)] = true;
    run = continues ? run + 1 : 1;
    if (s != padding_slot) longest = std::max(longest, run);
    K3_CHECK(t >= 0 && t < vocab, "token id ", t, " is outside the vocabulary [0, ", vocab, ")");
    K3_CHECK(positions[static_cast<size_t>(s)] + run <= max_context, "context length ", max_context,
             " exceeded in slot ", s);
  }
  return longest;
}

}  // namespace k3::cuda
