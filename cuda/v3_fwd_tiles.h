// Which rows of each sequence the v3 forward (cuda/v3_fwd_sm90.cu) runs on head dim 64's 192-row
// tile, where rows are interchangeable (no causal mask or window). Host code, so that
// tests/gpu/divmod_check.cu checks the launches it gives on the host.
#pragma once

#include <cstdint>

namespace jax_flash {

// From 1024 rows on: how many rows of each sequence run on the 192-row tile, the rest on the
// 128-row tile (a second launch). The tall tile is faster per row (harness, settled: by 8% at
// T = 1024, 19% at T = 16384), but ceil(T / 192) tall tiles pad T = 1024 by 12.5%; the largest
// even number of them that fits leaves rows that whole 128-row tiles cover where T is a multiple
// of 128 (1024 = 4 x 192 + 2 x 128). Of the 128-row tile alone, that split and the 192-row tile
// alone, the one the fewest rounds of the persistent grid (sm_count CTAs) cost, a 192-row tile's
// round counting 1.38 of a 128-row tile's (14.8 against 10.75 µs at T = 1024). That ranks the
// seven shapes measured in docs/perf-notes-v3.md (session 19) as measured: the split -3.9% time
// at T = 1024, -4.3..-5.4% at T = 4096 and -5.7% at T = 2048 against the better single tile; the
// tall tile alone at T = 1100 and 3000 (where both pad alike; the split +3.4% / +1.8%) and at
// T = 16384 with B = 1 (the split's 128-row part, 64 tiles on 132 SMs, +2.1%); the 128-row tile
// alone at B = 1 N = 32 T = 2048 (-2.3% against the tall tile). Below 1024 rows (not measured)
// the 128-row tile runs alone.
inline int64_t v3_tall_tile_rows(int64_t batch_heads, int64_t q_len, int sm_count) {
  if (q_len < 1024) return 0;
  const auto rounds = [&](int64_t rows, int64_t block_m) {
    const int64_t tiles = batch_heads * ((rows + block_m - 1) / block_m);
    return (tiles + sm_count - 1) / sm_count;
  };
  constexpr int64_t kTallRound = 138, kStandardRound = 100;  // 14.8 and 10.75 µs at T = 1024
  const auto cost = [&](int64_t tall_rows) {
    return kTallRound * rounds(tall_rows, 192) + kStandardRound * rounds(q_len - tall_rows, 128);
  };
  int64_t best = 0;
  for (const int64_t tall_rows : {192 * (2 * (q_len / 384)), q_len})
    if (cost(tall_rows) < cost(best)) best = tall_rows;
  return best;
}

}  // namespace jax_flash
