// Which rows of each sequence the v3 forward (cuda/v3_fwd_sm90.cu) runs on a head dim's 192-row
// tile (head dims 64 and 128), where rows are interchangeable (no causal mask or window). Host
// code, so that tests/gpu/divmod_check.cu checks the launches it gives on the host.
#pragma once

#include <algorithm>
#include <cstdint>

namespace jax_flash {

// How a head dim's 192-row tile (three consumer warpgroups) is weighed against its 128-row tile
// by v3_tall_tile_rows: from how many rows on, what a round of the persistent grid costs on the
// tall tile per 100 of a 128-row tile's round, and whether the splits whose tall tiles fill
// whole rounds are candidates too.
struct TallTileRule {
  int64_t min_rows;
  int64_t tall_round;
  bool whole_rounds;
};

// Head dim 64 (192 x 128 tile): the tall tile is faster per row (harness, settled: by 8% at
// T = 1024, 19% at T = 16384), but ceil(T / 192) tall tiles pad T = 1024 by 12.5%; the largest
// even number of them that fits leaves rows that whole 128-row tiles cover where T is a multiple
// of 128 (1024 = 4 x 192 + 2 x 128). A tall round costs 1.38 of a 128-row one (14.8 against
// 10.75 us at T = 1024). That ranks the seven shapes measured in docs/perf-notes-v3.md (session
// 19) as measured: the split -3.9% time at T = 1024, -4.3..-5.4% at T = 4096 and -5.7% at
// T = 2048 against the better single tile; the tall tile alone at T = 1100 and 3000 (where both
// pad alike; the split +3.4% / +1.8%) and at T = 16384 with B = 1 (the split's 128-row part, 64
// tiles on 132 SMs, +2.1%); the 128-row tile alone at B = 1 N = 32 T = 2048 (-2.3% against the
// tall tile). Below 1024 rows (not measured) the 128-row tile runs alone.
constexpr TallTileRule kTallTileRule64 = {1024, 138, false};
// Head dim 128 (192 x 80 tile, docs/perf-notes.md session 22): a tall round costs 1.47-1.49 of a
// 128-row one at T = 16384, 1.47 at T = 4096 (harness, settled). Its gain is the rounds': with
// 16 heads of 16384 rows the tall tile alone fills 10.4 of 11 rounds, while 82 tall tiles per
// head fill 10 and the rest of the rows one 128-row round: -2.0..-2.6% time against the wide
// tile alone (the previous choice); 64 heads of 4096 rows, 20 tall tiles per head: -0.1..-0.6%
// against the 128-row tile alone. Below 4096 rows (T = 1024: a tall round costs 1.54, the split
// +5%) the 128-row tile runs alone.
constexpr TallTileRule kTallTileRule128 = {4096, 147, true};

// How many rows of each sequence run on the 192-row tile, the rest on the 128-row tile (a second
// launch): of the 128-row tile alone, the tall tile alone and the candidate splits (an even
// number of tall tiles per head, so that cluster pairs stay whole: the most that fit, and with
// rule.whole_rounds the most that fill one round fewer than the tall tile alone takes), the one
// whose rounds of the persistent grid (sm_count CTAs) cost the least.
inline int64_t v3_tall_tile_rows(int64_t batch_heads, int64_t q_len, int sm_count,
                                 const TallTileRule& rule) {
  if (q_len < rule.min_rows || batch_heads < 1) return 0;
  const auto rounds = [&](int64_t rows, int64_t block_m) {
    const int64_t tiles = batch_heads * ((rows + block_m - 1) / block_m);
    return (tiles + sm_count - 1) / sm_count;
  };
  constexpr int64_t kStandardRound = 100;
  const auto cost = [&](int64_t tall_rows) {
    return rule.tall_round * rounds(tall_rows, 192) +
           kStandardRound * rounds(q_len - tall_rows, 128);
  };
  const int64_t max_even_tiles = 2 * (q_len / 384);
  int64_t whole_round_tiles = 0;  // per head, even: fill rounds(q_len, 192) - 1 rounds
  if (rule.whole_rounds) {
    const int64_t fewer_rounds = rounds(q_len, 192) - 1;
    whole_round_tiles = std::min(max_even_tiles, fewer_rounds * sm_count / batch_heads / 2 * 2);
  }
  int64_t best = 0;
  for (const int64_t tall_rows : {192 * max_even_tiles, q_len, 192 * whole_round_tiles})
    if (cost(tall_rows) < cost(best)) best = tall_rows;
  return best;
}

}  // namespace jax_flash
