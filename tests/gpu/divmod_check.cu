// Host check of DivMod (cuda/divmod.h), the multiply-shift division of the v3 forward's tile
// decode, against 64-bit integer division, and of that decode itself (cuda/v3_fwd_units.h).
// Host code only: it runs on any machine.
//   nvcc -O2 -std=c++17 tests/gpu/divmod_check.cu -o /tmp/divmod_check && /tmp/divmod_check
//
//   edges    divisors 1, 2, 3, 7, every 2^k and 2^k +- 1, 2^31 - 1: dividends 0, 1, around
//            multiples of d, around 2^31 - 1, and random
//   random   log-uniform random divisors, the same dividends
//   every n  all 2^31 dividends for divisors with the largest rounding error m d - 2^p
//            relative to d (just above a power of two) and the small and largest ones
//   grid     the divisors launch() prepares (UnitGroups::of) for the 18 configs of BENCHMARK.md
//            (and GQA / odd variants): every dividend the decode can see, and the decode's
//            (order, batch, head) compared with the plain-division decode it replaced; the
//            launches of head dim 64's non-causal rows (cuda/v3_fwd_tiles.h) on 132 SMs, and
//            that rule's choice for each shape it was measured on
// Exit status: 0 when every check passed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "../../cuda/divmod.h"
#include "../../cuda/v3_fwd_tiles.h"
#include "../../cuda/v3_fwd_units.h"

using jax_flash::DivMod;
using jax_flash::UnitGroups;

namespace {

constexpr int64_t kLimit = int64_t(1) << 31;  // dividends and divisors stay below this

int64_t failures = 0;

void expect(int64_t n, int64_t d, const DivMod& dm) {
  int remainder = -1;
  const int q = dm.divmod(int(n), remainder);
  if (q != n / d || remainder != n % d || dm.divide(int(n)) != q) {
    if (++failures <= 10)
      std::printf("FAIL n=%lld d=%lld: got %d rem %d, want %lld rem %lld\n", (long long)n,
                  (long long)d, q, remainder, (long long)(n / d), (long long)(n % d));
  }
}

// Dividends where a multiply-shift division goes wrong first: next to multiples of d (the
// largest remainders), near the top of the range (the largest error n e / 2^p), and random.
int64_t check_dividends(int64_t d, std::mt19937_64& rng) {
  const DivMod dm{int(d)};
  int64_t count = 0;
  const auto at = [&](int64_t n) {
    if (n >= 0 && n < kLimit) {
      expect(n, d, dm);
      ++count;
    }
  };
  for (int64_t n = 0; n < 64; ++n) at(n);
  for (int64_t k = 1; k <= 64; ++k)
    for (int64_t delta = -1; delta <= 1; ++delta) at(k * d + delta);
  const int64_t top = (kLimit - 1) / d;  // the largest quotient
  for (int64_t k = top - 64; k <= top; ++k)
    for (int64_t delta = -1; delta <= 1; ++delta) at(k * d + delta);
  for (int64_t n = kLimit - 64; n < kLimit; ++n) at(n);
  std::uniform_int_distribution<int64_t> any(0, kLimit - 1);
  for (int i = 0; i < 256; ++i) at(any(rng));
  return count;
}

// Every dividend in [0, 2^31), the reference quotient and remainder counted up alongside.
void check_every_dividend(int64_t d) {
  const DivMod dm{int(d)};
  int64_t q = 0, r = 0;
  for (int64_t n = 0; n < kLimit; ++n) {
    int remainder;
    if (dm.divmod(int(n), remainder) != q || remainder != r) expect(n, d, dm);
    if (++r == d) {
      r = 0;
      ++q;
    }
  }
}

// A forward problem as launch() in cuda/v3_fwd_sm90.cu sees it.
struct Layout {
  int64_t batch, num_heads, num_kv_heads, seq_len, head_dim, block_m;
  bool causal;
  int64_t kv_len = 0;  // 0: seq_len (a launch of a range of the query rows has more keys)

  int units_per_head() const {
    const int m_blocks = int((seq_len + block_m - 1) / block_m);
    return causal ? (m_blocks + 1) / 2 : m_blocks;
  }
  int batch_heads() const { return int(batch * num_heads); }
};

// Every dividend of the decode's divisions for this layout, and its (order, batch, head) per
// unit (UnitGroups::order_of, then the pair split as decode_tile does) against the
// plain-division decode the kernel had before.
int64_t check_layout(const Layout& l) {
  const int batch_heads = l.batch_heads(), num_heads = int(l.num_heads);
  const int heads_per_kv = int(l.num_heads / l.num_kv_heads);
  const UnitGroups g =
      UnitGroups::of(l.units_per_head(), batch_heads, heads_per_kv,
                     l.kv_len > 0 ? l.kv_len : l.seq_len, l.head_dim);
  const int heads_per_group = int(g.group_heads.divisor);
  const int per_group = l.units_per_head() * heads_per_group;
  const DivMod heads_of_pair(num_heads), kv_heads(heads_per_kv);
  const int num_units = l.units_per_head() * batch_heads;
  for (int n = 0; n < per_group; ++n) {
    expect(n, g.group_heads.divisor, g.group_heads);
    expect(n, g.last_group_heads.divisor, g.last_group_heads);
  }
  for (int n = 0; n < batch_heads; ++n) expect(n, num_heads, heads_of_pair);
  for (int n = 0; n < num_heads; ++n) expect(n, heads_per_kv, kv_heads);
  for (int unit = 0; unit < num_units; ++unit) {
    expect(unit, per_group, g.group_units);
    const int group = unit / per_group, in_group = unit % per_group;
    const int heads = std::min(heads_per_group, batch_heads - group * heads_per_group);
    const int order = in_group / heads;
    const int bh = group * heads_per_group + in_group % heads;

    int fast_bh, fast_head;
    const int fast_order = g.order_of(unit, &fast_bh);
    const int fast_batch = heads_of_pair.divmod(fast_bh, fast_head);
    if (fast_order != order || fast_bh != bh || fast_batch != bh / num_heads ||
        fast_head != bh % num_heads) {
      if (++failures <= 10)
        std::printf("FAIL decode unit %d: order %d bh %d, fast %d %d\n", unit, order, bh,
                    fast_order, fast_bh);
    }
  }
  std::printf("grid B=%ld N=%ld K=%ld T=%ld H=%ld block_m=%ld%s: units %d, per group %d, heads "
              "per group %d, last group (number %d) %d heads\n",
              long(l.batch), long(l.num_heads), long(l.num_kv_heads), long(l.seq_len),
              long(l.head_dim), long(l.block_m), l.causal ? " causal" : "", num_units, per_group,
              heads_per_group, g.last_group, int(g.last_group_heads.divisor));
  return num_units;
}

}  // namespace

int main() {
  std::mt19937_64 rng(20261201);
  std::vector<int64_t> edges = {1, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13, 25, 100, 641, 6700417};
  for (int k = 1; k < 31; ++k)
    for (int64_t delta = -1; delta <= 1; ++delta) edges.push_back((int64_t(1) << k) + delta);
  int64_t count = 0;
  for (int64_t d : edges)
    if (d >= 1 && d < kLimit) count += check_dividends(d, rng);
  std::printf("edges: %zu divisors, %lld dividends\n", edges.size(), (long long)count);

  count = 0;
  std::uniform_real_distribution<double> log2_d(0.0, 31.0);
  for (int i = 0; i < 20000; ++i) {
    const int64_t d = std::min(kLimit - 1, int64_t(std::exp2(log2_d(rng))));
    count += check_dividends(std::max<int64_t>(1, d), rng);
  }
  std::printf("random: 20000 divisors, %lld dividends\n", (long long)count);

  for (int64_t d : {int64_t(1), int64_t(3), int64_t(7), int64_t(96), (int64_t(1) << 30) + 1,
                    kLimit - 1}) {
    check_every_dividend(d);
    std::printf("every n: d = %lld\n", (long long)d);
  }

  // The rule's choice (rows on the 192-row tile, 132 SMs) for each shape it was measured on:
  // head dim 64 in docs/perf-notes-v3.md (session 19), 128 in docs/perf-notes.md (session 22).
  // H, B, N, T, rows.
  const int64_t measured[][5] = {
      {64, 16, 32, 1024, 768},  {64, 4, 32, 4096, 3840}, {64, 1, 32, 16384, 16384},
      {64, 8, 32, 2048, 1920},  {64, 4, 32, 3000, 3000}, {64, 16, 32, 1100, 1100},
      {64, 1, 32, 2048, 0},     {128, 1, 16, 16384, 15744}, {128, 4, 16, 4096, 3840},
      {128, 16, 16, 1024, 0}};
  const auto rule_of = [](int64_t head_dim) {
    return head_dim == 64 ? jax_flash::kTallTileRule64 : jax_flash::kTallTileRule128;
  };
  for (const auto& m : measured) {
    const int64_t rows = jax_flash::v3_tall_tile_rows(m[1] * m[2], m[3], 132, rule_of(m[0]));
    if (rows != m[4] && ++failures <= 10)
      std::printf("FAIL tile rule H=%lld B=%lld N=%lld T=%lld: %lld rows on the 192-row tile, "
                  "measured best %lld\n", (long long)m[0], (long long)m[1], (long long)m[2],
                  (long long)m[3], (long long)rows, (long long)m[4]);
  }
  // BENCHMARK.md's grid: bf16, B T = 16384, N H = 2048, K = N; the launches' block rows
  // (alternative_rows, v3_fwd_sm90.cu; 132 SMs): head dim 64 runs the 192-row tile from T = 8192
  // causal on, and non-causal rows of head dims 64 and 128 as v3_tall_tile_rows splits them
  // between the two tiles.
  count = 0;
  for (int64_t h : {64, 128, 256})
    for (int64_t t : {1024, 4096, 16384})
      for (bool causal : {false, true}) {
        const int64_t b = 16384 / t, n = 2048 / h;
        if (h != 256 && !causal) {
          const int64_t tall = jax_flash::v3_tall_tile_rows(b * n, t, 132, rule_of(h));
          if (tall > 0) count += check_layout({b, n, n, tall, h, 192, false, t});
          if (tall < t) count += check_layout({b, n, n, t - tall, h, 128, false, t});
          continue;
        }
        const bool tall = h == 64 && t >= 8192;
        count += check_layout({b, n, n, t, h, tall ? 192 : 128, causal});
      }
  // GQA, a last group of one head, a single group, odd lengths.
  count += check_layout({3, 48, 6, 3000, 128, 128, true});
  count += check_layout({5, 7, 7, 20000, 128, 128, false});
  count += check_layout({1, 4, 1, 777, 64, 128, true});
  std::printf("grid: %lld units decoded\n", (long long)count);

  std::printf("%s (%lld failures)\n", failures == 0 ? "ALL PASSED" : "SOME CHECKS FAILED",
              (long long)failures);
  return failures == 0 ? 0 : 1;
}
