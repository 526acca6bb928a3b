// Groups a step's routed (row, choice) pairs by expert, so each expert's weights are read once
// per step for all the rows that chose it (instead of once per pair): the grouped expert GEMMs
// then run one slot per expert with up to `rows` gathered rows each.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// The experts this rank holds: global ids [begin, begin + count) of the router's E (all of them
// without expert parallelism). Slots and weight tables use local ids (global - begin); pairs
// routed to other ranks' experts are not grouped here (position -1: their owners add them).
struct LocalExperts {
  int begin = 0, count = 0;
};

// The most (row, choice) pairs one grouping takes (one CTA's shared memory).
constexpr int kMaxGroupedPairs = 4096;

// ids:          [rows][top_k] int32 global expert ids (the router's output, device)
// E below is local.count; e a local id.
// slot_expert:  [E] int32: e when some pair chose e, else -1 (the slot is skipped)
// slot_offsets: [E + 1] int32: pairs of expert e are grouped positions
//               [slot_offsets[e], slot_offsets[e+1])
// row_index:    [rows * top_k] int32: token row of grouped position p
// position:     [rows * top_k] int32: grouped position of pair (r, j) at r * top_k + j, -1 when
//               its expert is not local
// Within an expert, pairs keep ascending (r, j) order (deterministic). One CTA; E <= 1024,
// rows * top_k <= kMaxGroupedPairs. No allocation, no host sync.
void moe_group_by_expert(const int32_t* ids, int64_t rows, int top_k, LocalExperts local,
                         int32_t* slot_expert, int32_t* slot_offsets, int32_t* row_index,
                         int32_t* position, cudaStream_t stream);

// The same grouping with the active experts packed to the front, so the grouped GEMMs can run
// over min(E, rows * top_k) slots instead of E (what both step paths run; the plain form above
// is its reference in the tests):
// slot_expert:  [E] int32: slot i < n_active holds the i-th active expert (ascending id);
//               slots n_active..E-1 hold -1
// slot_offsets: [E + 1] int32: slot i's pairs are [slot_offsets[i], slot_offsets[i+1]); from
//               slot n_active on, every entry equals the grouped pair count (empty slots)
// row_index, position: identical to moe_group_by_expert (pairs by expert id, then stable).
void moe_group_by_expert_compact(const int32_t* ids, int64_t rows, int top_k, LocalExperts local,
                                 int32_t* slot_expert, int32_t* slot_offsets, int32_t* row_index,
                                 int32_t* position, cudaStream_t stream);

}  // namespace k3::cuda
