// The order of the v3 forward's work units (cuda/v3_fwd_sm90.cu, decode_tile): units come in
// groups of (batch, head) pairs whose K / V fit in L2 together, the last group possibly smaller;
// inside a group the unit's rank `order` (0: the longest m-block) is outer and the pair inner.
// The divisions of that decode are multiply-shifts (cuda/divmod.h) prepared on the host. Host
// and device code, so that tests/gpu/divmod_check.cu checks this very decode on the host.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "divmod.h"

namespace jax_flash {

// Heads whose K and V together take about this much L2 are scheduled as one group.
constexpr int64_t kV3UnitGroupL2Bytes = 24ll << 20;

struct UnitGroups {
  DivMod group_units;       // units of a group: units per head * heads per group
  DivMod group_heads;       // heads per group: (batch, head) pairs of a group
  DivMod last_group_heads;  // pairs of the last group, fewer when the heads per group do not
                            // divide batch * num_heads
  int last_group;           // the last group's index

  // Host: the groups of batch_heads (batch, head) pairs of units_per_head units each, for K / V
  // of kv_len x head_dim 2-byte elements shared by heads_per_kv query heads. DivMod needs
  // divisors and dividends below 2^31: the decode's dividends are below units_per_head *
  // batch_heads, which the caller keeps below 2^31, and so are its divisors.
  static UnitGroups of(int units_per_head, int64_t batch_heads, int heads_per_kv,
                       int64_t kv_len, int64_t head_dim) {
    const int64_t kv_bytes_per_head = 2 * kv_len * head_dim * 2;
    const int64_t fitting = kV3UnitGroupL2Bytes / kv_bytes_per_head * heads_per_kv;
    const int heads = int(std::max<int64_t>(1, std::min<int64_t>(batch_heads, fitting)));
    UnitGroups g;
    g.group_units = DivMod(units_per_head * heads);
    g.group_heads = DivMod(heads);
    g.last_group = int((batch_heads - 1) / heads);
    g.last_group_heads = DivMod(int(batch_heads) - g.last_group * heads);
    return g;
  }

  // The rank of `unit` in its group's order, and (in *pair) its (batch, head) pair index.
  __host__ __device__ __forceinline__ int order_of(int unit, int* pair) const {
    int in_group, head_in_group;
    const int group = group_units.divmod(unit, in_group);
    // One call per divisor rather than a DivMod picked first: a picked copy made ptxas spill
    // (~110 bytes) in the 192-row tile's consumers, which have 128 registers (nvcc 13.0).
    const int order = group == last_group ? last_group_heads.divmod(in_group, head_in_group)
                                          : group_heads.divmod(in_group, head_in_group);
    *pair = group * int(group_heads.divisor) + head_in_group;
    return order;
  }
};

}  // namespace jax_flash
