// Standalone test and benchmark of the v3 Hopper forward (cuda/v3_fwd_sm90.cu).
//
//   check  correctness on small and odd shapes against a float64 CPU reference (every row),
//          for every compiled tuning variant; outputs poisoned first; run twice, compared
//          bitwise (a difference between identical runs is a race)
//   small  ten small cases (for compute-sanitizer), two with several tiles per CTA
//   bench  the 18 configs of /work/shared/BENCHMARK.md: a float64 check of sampled rows plus a
//          NaN scan of every output, then cudaEvent timings (median of repeats) in TFLOP/s,
//          for every compiled tuning variant
//   --bench-one H T causal  the same for one grid config
//   --bench-shape B T N K H causal  the same for any bf16 shape with S = T
//   --bench-cross B T S N K H  the same, non-causal, with its own key length S
//   --settled  (before the modes) every timing as the library bench's settled loop: clocks of
//          the sustained, power-capped run instead of boost (harness_v3_case.h, Timing)
//   --default-tuning  (before the modes) bench modes time the library default tuning only
//   --timeline H T causal [records.csv]  (builds of tests/gpu/build_v3_timeline.sh only)
//          one grid config, library default tuning: the forward timed with and without the
//          stamps stored, then one recorded launch (cuda/v3.h, v3_fwd_timeline), its output
//          checked on sampled rows, summarized per CTA and per tile (durations, key blocks,
//          time per key block, the tile's budget from its start to the next tile's), and
//          written raw to records.csv
//
// Build (static cudart, runs on the H200 unchanged):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I<cutlass include>
//        -DJAX_FLASH_V3_TUNING_VARIANTS tests/gpu/harness_v3.cu cuda/v3_fwd_sm90.cu
//        -o .carry/harness_v3
// (tests/gpu/build_v3_timeline.sh runs this line and builds the timeline variant.)
// Exit status: 0 when every check passed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../cuda/v3.h"
#include "harness_common.h"
#include "harness_v3_case.h"
#ifdef JAX_FLASH_V3_FWD_TIMELINE
#include "harness_timeline.h"
#endif

using jax_flash::DType;
using jax_flash::ForwardArgs;
using jax_flash::V3Tuning;
using Case = harness::V3Case;
using harness::fill_random;
using harness::grid_cases;
using harness::median_event_ms;
using harness::parallel_for;
using harness::to_float;

namespace {

struct Variant {
  const char* name;
  V3Tuning tuning;
};
const Variant kVariants[] = {
    {"base", {false, 0}},
    {"cond", {true, 0}},
    {"emu4", {false, 4}},
    {"cond+emu4", {true, 4}},
};

// ---- random inputs, generated on the device -------------------------------------------

// ---- the problem on the device and its host copies --------------------------------------

struct Problem {
  Case c;
  void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
  float* lse = nullptr;
  int32_t *q_seqlens = nullptr, *kv_seqlens = nullptr;
  std::vector<uint16_t> hq, hk, hv, hout;
  std::vector<float> hlse;

  int64_t q_elems() const { return c.B * c.T * c.N * c.H; }
  int64_t kv_elems() const { return c.B * c.S * c.K * c.H; }

  explicit Problem(const Case& cs, uint64_t seed) : c(cs) {
    CUDA_CHECK(cudaMalloc(&q, q_elems() * 2));
    CUDA_CHECK(cudaMalloc(&k, std::max<int64_t>(1, kv_elems()) * 2));
    CUDA_CHECK(cudaMalloc(&v, std::max<int64_t>(1, kv_elems()) * 2));
    CUDA_CHECK(cudaMalloc(&out, q_elems() * 2));
    CUDA_CHECK(cudaMalloc(&lse, c.B * c.N * c.T * 4));
    fill_random(c.dtype, q, q_elems(), seed * 3 + 1);
    fill_random(c.dtype, k, kv_elems(), seed * 3 + 2);
    fill_random(c.dtype, v, kv_elems(), seed * 3 + 3);
    if (!c.q_seqlens.empty()) {
      CUDA_CHECK(cudaMalloc(&q_seqlens, c.B * 4));
      CUDA_CHECK(cudaMemcpy(q_seqlens, c.q_seqlens.data(), c.B * 4, cudaMemcpyHostToDevice));
    }
    if (!c.kv_seqlens.empty()) {
      CUDA_CHECK(cudaMalloc(&kv_seqlens, c.B * 4));
      CUDA_CHECK(cudaMemcpy(kv_seqlens, c.kv_seqlens.data(), c.B * 4, cudaMemcpyHostToDevice));
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    hq.resize(q_elems());
    hk.resize(kv_elems());
    hv.resize(kv_elems());
    CUDA_CHECK(cudaMemcpy(hq.data(), q, q_elems() * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(hk.data(), k, kv_elems() * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(hv.data(), v, kv_elems() * 2, cudaMemcpyDeviceToHost));
  }
  ~Problem() {
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(out);
    cudaFree(lse);
    cudaFree(q_seqlens);
    cudaFree(kv_seqlens);
  }

  ForwardArgs args() const {
    return c.forward_args(q, k, v, q_seqlens, kv_seqlens, out, lse);
  }

  void poison() {
    CUDA_CHECK(cudaMemset(out, 0xFF, q_elems() * 2));  // NaN in bf16 and fp16
    CUDA_CHECK(cudaMemset(lse, 0xFF, c.B * c.N * c.T * 4));
  }

  // Returns the launcher's status (cudaErrorNotSupported: variant not compiled).
  cudaError_t run(const V3Tuning& tuning) {
    const cudaError_t err = jax_flash::V3ForwardTuned(args(), tuning, 0);
    if (err != cudaSuccess) return err;
    CUDA_CHECK(cudaDeviceSynchronize());
    return cudaSuccess;
  }

  void fetch() {
    hout.resize(q_elems());
    hlse.resize(c.B * c.N * c.T);
    CUDA_CHECK(cudaMemcpy(hout.data(), out, q_elems() * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(hlse.data(), lse, hlse.size() * 4, cudaMemcpyDeviceToHost));
  }
};

// ---- float64 reference --------------------------------------------------------------------

struct RowRef {
  std::vector<double> out;
  double lse;
};

// The semantics of docs/architecture.md for one (b, t, n) row.
RowRef reference_row(const Problem& pb, int64_t b, int64_t t, int64_t n) {
  const Case& c = pb.c;
  const double scale = double(float(1.0 / std::sqrt(double(c.H))));
  const int64_t kvh = n / (c.N / c.K);
  const int64_t q_rows = c.q_seqlens.empty() ? c.T : c.q_seqlens[b];
  const int64_t kv_cols = c.kv_seqlens.empty() ? c.S : c.kv_seqlens[b];
  RowRef r{std::vector<double>(c.H, 0.0), -std::numeric_limits<double>::infinity()};
  std::vector<double> q(c.H);
  for (int64_t h = 0; h < c.H; ++h) q[h] = to_float(pb.hq[((b * c.T + t) * c.N + n) * c.H + h], c.dtype);
  std::vector<double> x(c.S);
  std::vector<char> keep(c.S);
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t s = 0; s < c.S; ++s) {
    keep[s] = t < q_rows && s < kv_cols && (!c.causal || s <= t) &&
              (c.window_left < 0 || s >= t - c.window_left) &&
              (c.window_right < 0 || s <= t + c.window_right);
    if (!keep[s]) continue;
    const uint16_t* krow = &pb.hk[((b * c.S + s) * c.K + kvh) * c.H];
    double dot = 0;
    for (int64_t h = 0; h < c.H; ++h) dot += q[h] * to_float(krow[h], c.dtype);
    double v = scale * dot;
    if (c.softcap > 0) v = c.softcap * std::tanh(v / c.softcap);
    x[s] = v;
    mx = std::max(mx, v);
  }
  if (mx == -std::numeric_limits<double>::infinity()) return r;
  double sum = 0;
  for (int64_t s = 0; s < c.S; ++s) {
    if (!keep[s]) continue;
    const double p = std::exp(x[s] - mx);
    sum += p;
    const uint16_t* vrow = &pb.hv[((b * c.S + s) * c.K + kvh) * c.H];
    for (int64_t h = 0; h < c.H; ++h) r.out[h] += p * to_float(vrow[h], c.dtype);
  }
  for (double& o : r.out) o /= sum;
  r.lse = mx + std::log(sum);
  return r;
}

struct RowId {
  int64_t b, t, n;
};

struct Errors {
  double max_abs = 0, sq_err = 0, sq_ref = 0, lse_max_abs = 0;
  int64_t bad_lse = 0;  // -inf mismatches or NaN
  double rel_l2() const { return sq_ref > 0 ? std::sqrt(sq_err / sq_ref) : std::sqrt(sq_err); }
};

std::vector<RowRef> reference_rows(const Problem& pb, const std::vector<RowId>& rows) {
  std::vector<RowRef> refs(rows.size());
  parallel_for(rows.size(), [&](size_t i) {
    refs[i] = reference_row(pb, rows[i].b, rows[i].t, rows[i].n);
  });
  return refs;
}

Errors compare_rows(const Problem& pb, const std::vector<RowId>& rows,
                    const std::vector<RowRef>& refs) {
  const Case& c = pb.c;
  Errors e;
  for (size_t i = 0; i < rows.size(); ++i) {
    const RowId id = rows[i];
    const RowRef& ref = refs[i];
    const int64_t base = ((id.b * c.T + id.t) * c.N + id.n) * c.H;
    for (int64_t h = 0; h < c.H; ++h) {
      const double got = to_float(pb.hout[base + h], c.dtype);
      const double d = std::isnan(got) ? std::numeric_limits<double>::infinity()
                                       : std::fabs(got - ref.out[h]);
      e.max_abs = std::max(e.max_abs, d);
      e.sq_err += d * d;
      e.sq_ref += ref.out[h] * ref.out[h];
    }
    const double got_lse = pb.hlse[(id.b * c.N + id.n) * c.T + id.t];
    if (std::isinf(ref.lse) || std::isinf(got_lse) || std::isnan(got_lse)) {
      if (!(std::isinf(ref.lse) && std::isinf(got_lse) && got_lse < 0)) ++e.bad_lse;
    } else {
      e.lse_max_abs = std::max(e.lse_max_abs, std::fabs(got_lse - ref.lse));
    }
  }
  return e;
}

int64_t count_nan(const Problem& pb) {
  int64_t n = 0;
  for (uint16_t x : pb.hout) n += std::isnan(to_float(x, pb.c.dtype));
  for (float x : pb.hlse) n += std::isnan(x);
  return n;
}

struct Tolerance {
  double max_abs, rel_l2, lse;
};
Tolerance tolerance_for(const Case& c) {
  // bf16 / fp16 rounding of P and of the output; tanh.approx adds ~2^-11 relative per score.
  const double capped = c.softcap > 0 ? 1e-2 : 0.0;
  if (c.dtype == DType::kBF16) return {2.5e-2 + capped, 1e-2, 2e-3 + capped};
  return {6e-3 + capped, 3e-3, 2e-3 + capped};
}

bool report(const char* variant, const Case& c, const Errors& e, int64_t nans, bool repeatable,
            const char* extra) {
  const Tolerance tol = tolerance_for(c);
  const bool ok = nans == 0 && e.bad_lse == 0 && e.max_abs <= tol.max_abs &&
                  e.rel_l2() <= tol.rel_l2 && e.lse_max_abs <= tol.lse && repeatable;
  std::printf("%-4s %-10s %-62s max_abs=%.2e rel_l2=%.2e lse_err=%.2e nan=%ld bad_lse=%ld%s%s\n",
              ok ? "ok" : "FAIL", variant, c.describe().c_str(), e.max_abs, e.rel_l2(),
              e.lse_max_abs, long(nans), long(e.bad_lse), repeatable ? "" : " NOT-REPEATABLE",
              extra);
  return ok;
}

std::vector<RowId> all_rows(const Case& c) {
  std::vector<RowId> rows;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t n = 0; n < c.N; ++n) rows.push_back({b, t, n});
  return rows;
}

std::vector<RowId> sampled_rows(const Case& c, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<RowId> rows = {{0, 0, 0}, {c.B - 1, c.T - 1, c.N - 1}};
  while (int(rows.size()) < count) {
    rows.push_back({int64_t(rng() % c.B), int64_t(rng() % c.T), int64_t(rng() % c.N)});
  }
  return rows;
}

// Every compiled switch combination for bf16; fp16 has only the library's default.
std::vector<Variant> variants_for(const Case& c) {
  if (c.dtype == DType::kBF16) return {std::begin(kVariants), std::end(kVariants)};
  return {{"default", jax_flash::V3DefaultTuning(c.H)}};
}

// ---- check ----------------------------------------------------------------------------------

std::vector<Case> check_cases() {
  const DType bf = DType::kBF16, hf = DType::kF16;
  std::vector<Case> cs;
  cs.push_back({bf, 2, 197, 197, 4, 2, 64});
  cs.push_back({hf, 1, 300, 300, 2, 1, 128, true});
  cs.push_back({bf, 2, 130, 333, 4, 4, 256, true});
  cs.push_back({bf, 1, 333, 130, 2, 1, 128, true});
  cs.push_back(Case{bf, 1, 257, 257, 4, 1, 128}.window(50, 20));
  cs.push_back(Case{bf, 2, 100, 1000, 2, 2, 64}.capped(30.f));
  cs.push_back(Case{bf, 3, 150, 170, 2, 1, 128, true}.ragged({150, 77, 0}, {170, 1, 90}));
  cs.push_back({bf, 1, 1, 1, 1, 1, 128});
  cs.push_back({hf, 1, 17, 1029, 8, 1, 256});
  cs.push_back(Case{bf, 1, 1000, 1000, 1, 1, 64, true}.window(100, -1));
  cs.push_back(Case{hf, 2, 64, 64, 2, 2, 256}.window(-1, 10));
  cs.push_back(Case{bf, 1, 512, 512, 2, 2, 128, true}.capped(20.f));
  cs.push_back(Case{hf, 2, 200, 300, 4, 2, 64}.ragged({133, 200}, {300, 45}));
  cs.push_back({bf, 1, 2048, 2048, 4, 4, 128, true});
  cs.push_back({bf, 2, 700, 1500, 2, 2, 256});
  cs.push_back({hf, 1, 1024, 1024, 4, 4, 64, true});
  // Head dim 64's 192-row tile (alternative_rows in the kernel): causal from 8192 rows on;
  // non-causal from 1024 on where its rounds of the persistent grid cost least on 132 SMs (12
  // heads of 2100 rows: 132 tiles, one round), or for the first rows of each sequence, the rest
  // on the 128-row tile in a second launch: [0, 768) of 1024 rows, [0, 1152) of 1252 (the last
  // 128-row tile partial; query lengths end batch 0 in the first part, batch 1 in the second).
  cs.push_back({hf, 1, 8200, 8200, 1, 1, 64, true});
  cs.push_back({bf, 1, 2100, 300, 12, 2, 64});
  cs.push_back({bf, 1, 1024, 128, 66, 66, 64});
  cs.push_back(Case{hf, 2, 1252, 100, 66, 6, 64}.ragged({700, 1200}, {100, 77}));
  // More work units than SMs, so that every CTA runs several tiles: the two-buffer Q ring wraps
  // (its phases flip, outputs are stored by TMA from a buffer the producer refills two tiles
  // later), and q_seqlens put empty tiles (output zero-filled) between staged ones.
  cs.push_back({bf, 16, 256, 256, 16, 4, 64});
  cs.push_back(
      Case{hf, 8, 640, 640, 8, 8, 128, true}.ragged({640, 0, 300, 640, 1, 640, 129, 500}, {}));
  cs.push_back({bf, 12, 256, 256, 8, 2, 256});
  // Head dim 256 (one Q buffer, reloaded for each tile once both warpgroups' last S is done):
  // 256 causal units over 8 m-blocks, ~4 tiles per CTA, with empty tiles from q_seqlens between
  // them (GQA 8:4).
  cs.push_back(Case{bf, 8, 1024, 1024, 8, 4, 256, true}.ragged(
      {1024, 0, 300, 1024, 1, 1024, 129, 700}, {}));
  // Several tiles per CTA where the v3 forward fuses a tile's last PV with the next tile's first
  // S: the 192-row tile (three consumer warpgroups, 396 units: the Q ring wraps), and a causal
  // left window with softcap, whose tiles alternate between one key block (not fused) and two.
  cs.push_back({bf, 1, 2048, 2048, 36, 9, 64});
  cs.push_back(Case{bf, 8, 512, 512, 8, 2, 128, true}.window(60, -1).capped(30.f));
  // Units in more than one L2 group, the last one short (decode_tile): K / V of 40000 keys at
  // head dim 64 put 2 of the 3 heads in a group; the causal one pairs its m-blocks.
  cs.push_back({bf, 1, 200, 40000, 3, 3, 64});
  cs.push_back({hf, 1, 600, 40000, 3, 3, 64, true});
  // Head dim 128's 192 x 80 tile (three consumer warpgroups; alternative_rows in the kernel):
  // non-causal from 4096 rows on where its rounds of the persistent grid cost least on 132 SMs.
  // 66 heads of 4096 rows: the first 3840 rows of each (10 rounds of 192-row tiles), the rest on
  // the 128-row tile; 66 heads of 4100 rows (GQA 11:1, ragged): all rows, the last tile partial.
  cs.push_back({bf, 1, 4096, 400, 66, 66, 128});
  cs.push_back(Case{hf, 2, 4100, 300, 33, 3, 128}.ragged({4100, 2000}, {300, 77}));
  // Head dim 128's wide tile (128 x 192 key blocks, one Q buffer): causal from 16384 rows on
  // (m-block pairs, a diagonal inside a 192-key block).
  cs.push_back({bf, 1, 16384, 16384, 1, 1, 128, true});
  // Clusters of two CTAs sharing K / V loads (non-causal, no window, an even number of
  // m-blocks; use_cluster in the kernel): several tiles per CTA at head dim 128 and on the
  // 192-row tile (12 m-blocks); key lengths by kv_seqlens, one of them 0 (both CTAs of the pair
  // skip the empty tiles); query lengths that leave one tile of a pair without rows (it runs
  // masked beside the other) or both (skipped). The cases above with two m-blocks (197 rows at
  // head dim 64, 16 x 256 GQA, the ragged 200 x 300, the 40000-key L2 groups) and head dim
  // 128's 192-row tiles run clustered too.
  cs.push_back({bf, 16, 512, 512, 16, 16, 128});
  cs.push_back({bf, 2, 2304, 2304, 16, 4, 64});
  cs.push_back(Case{hf, 4, 512, 700, 8, 2, 128}.ragged({}, {700, 1, 0, 333}));
  cs.push_back(Case{bf, 4, 512, 300, 8, 2, 128}.ragged({512, 100, 0, 300}, {300, 300, 200, 1}));
  // ... and causal or with a right window (no left one; use_cluster: head dim 256, head dim 64's
  // 128-row tile, head dim 128 from 4096 query rows): the pair's tiles end at different key blocks,
  // which the longer one loads alone while the other passes the stage. Several units per CTA (256
  // cluster units) with a query length that leaves the higher m-block of a band without rows
  // (masked beside the other); 6 m-blocks (3 bands: the last unit has no second tile), ragged; more
  // query rows than keys at head dim 64; head dim 256's 80-key blocks (a band's m-blocks end one or
  // two blocks apart); a right window alone.
  cs.push_back(Case{bf, 4, 4096, 4096, 8, 2, 128, true}.ragged({4096, 2100, 1, 4096}, {}));
  cs.push_back(Case{bf, 3, 768, 768, 4, 2, 256, true}.ragged({768, 200, 300}, {768, 768, 100}));
  cs.push_back({hf, 1, 4352, 4000, 4, 4, 64, true});
  cs.push_back({bf, 1, 1536, 1536, 2, 1, 256, true});
  cs.push_back(Case{bf, 2, 512, 512, 4, 2, 256}.window(-1, 30));
  cs.push_back(Case{bf, 1, 4096, 4096, 2, 1, 128}.window(-1, 100));
  return cs;
}

bool check_case(const Case& c, uint64_t seed) {
  Problem pb(c, seed);
  // Every row, but 1024 sampled ones (the first and last among them) where the float64
  // reference of every row would take the CPU minutes (the 16384-row causal case).
  const bool sampled = c.B * c.T * c.N * c.S >= (int64_t(1) << 28);
  const std::vector<RowId> rows = sampled ? sampled_rows(c, 1024, seed) : all_rows(c);
  const std::vector<RowRef> refs = reference_rows(pb, rows);
  bool all_ok = true;
  for (const Variant& var : variants_for(c)) {
    pb.poison();
    const cudaError_t err = pb.run(var.tuning);
    if (err == cudaErrorNotSupported) continue;
    CUDA_CHECK(err);
    pb.fetch();
    const std::vector<uint16_t> first_out = pb.hout;
    const std::vector<float> first_lse = pb.hlse;
    pb.poison();
    CUDA_CHECK(pb.run(var.tuning));
    pb.fetch();
    const bool repeatable =
        first_out == pb.hout &&
        std::memcmp(first_lse.data(), pb.hlse.data(), first_lse.size() * 4) == 0;
    all_ok &= report(var.name, c, compare_rows(pb, rows, refs), count_nan(pb), repeatable,
                     sampled ? " (sampled)" : "");
  }
  return all_ok;
}

// ---- bench ----------------------------------------------------------------------------------

// Median time of one launch in milliseconds.
double time_launches(Problem& pb, const V3Tuning& tuning, int warmup, int reps) {
  const ForwardArgs a = pb.args();
  return median_event_ms([&] { CUDA_CHECK(jax_flash::V3ForwardTuned(a, tuning, 0)); }, warmup,
                         reps);
}

// --default-tuning: the bench modes time only the library's default tuning (A/Bs of a change,
// where the other variants would only make the call longer).
bool& default_tuning_only() {
  static bool only = false;
  return only;
}

bool bench(const std::vector<Case>& cases, int reps) {
  bool all_ok = true;
  std::vector<std::string> table;
  uint64_t seed = 1000;
  for (const Case& c : cases) {
    Problem pb(c, ++seed);
    const std::vector<RowId> rows = sampled_rows(c, 96, seed);
    const std::vector<RowRef> refs = reference_rows(pb, rows);
    std::string line;
    char buf[96];
    std::snprintf(buf, sizeof buf, "%4ld %6ld %d", long(c.H), long(c.T), int(c.causal));
    line = buf;
    for (const Variant& var : kVariants) {
      const bool is_default = var.tuning == jax_flash::V3DefaultTuning(c.H);
      if (default_tuning_only() && !is_default) {
        line += "        .";
        continue;
      }
      pb.poison();
      const cudaError_t err = pb.run(var.tuning);
      if (err == cudaErrorNotSupported) {
        line += "        -";
        continue;
      }
      CUDA_CHECK(err);
      pb.fetch();
      all_ok &= report(var.name, c, compare_rows(pb, rows, refs), count_nan(pb), true,
                       " (sampled)");
      const double ms = time_launches(pb, var.tuning, 3, reps);
      std::snprintf(buf, sizeof buf, " %7.1f%s", c.forward_flops() / (ms * 1e-3) / 1e12,
                    is_default ? "*" : " ");
      line += buf;
      std::printf("time %-10s %-50s %.4f ms  %.1f TFLOP/s\n", var.name, c.describe().c_str(), ms,
                  c.forward_flops() / (ms * 1e-3) / 1e12);
      std::fflush(stdout);
    }
    table.push_back(line);
  }
  std::printf("\nv3 forward TFLOP/s (bf16, cudaEvent median of %d launches; * = library default)\n",
              reps);
  std::printf("   H      T c");
  for (const Variant& var : kVariants) std::printf(" %8s", var.name);
  std::printf("\n");
  for (const std::string& l : table) std::printf("%s\n", l.c_str());
  return all_ok;
}

#ifdef JAX_FLASH_V3_FWD_TIMELINE
// ---- --timeline: where a tile of the forward kernel spends its time -------------------------
//
// Built only with -DJAX_FLASH_V3_FWD_TIMELINE (tests/gpu/build_v3_timeline.sh); record layout:
// cuda/v3.h, v3_fwd_timeline. The grid is persistent (one CTA per SM, running n tiles), so
// every duration below is inside one CTA and comes from %clock64, converted to ns at one rate
// for all CTAs: the median over CTAs of clock64 span / globaltimer span (entry to last exit).
// All SMs run on one clock, and the median is steadier than each CTA's own rate, which the
// globaltimer's ~0.5 us steps leave ~0.5% uncertain over a T = 1024 CTA (~0.2-0.35 ms); the
// p10 / p90 of those rates are printed as the check. The kernel span, entry skew and idle time
// at the end compare CTAs, so they come from the globaltimer.

namespace tl = jax_flash::v3_fwd_timeline;
using harness::timeline::print_spread;
using harness::timeline::spread;
using harness::timeline::Spread;

// The traced tiles of a CTA of n tiles, by kind: tiles 0, 1, n-2, n-1. The per-tile tables
// take CTAs of at least kTimelineTileKinds tiles, where the kinds are four different tiles.
constexpr int kTimelineTileKinds = 4;
const char* const kTimelineTileKindNames[kTimelineTileKinds] = {"0", "1", "n-2", "n-1"};

// Unsized, so that an event added to cuda/v3.h without its name fails to compile here instead
// of leaving a null name.
const char* const kTimelineProducerEventNames[] = {"prod_q_issued", "prod_first_kv_issued",
                                                   "prod_last_kv_issued"};
static_assert(std::size(kTimelineProducerEventNames) == tl::kConsumer - tl::kQIssued);
const char* const kTimelineConsumerEventNames[] = {
    "q_wait",       "q_full",       "first_turn",   "first_scores", "first_block_done", "loop_done",
    "last_pv_turn", "last_pv_done", "staging_free", "staged",       "stored"};
static_assert(std::size(kTimelineConsumerEventNames) == tl::kConsumerEvents);

// Column names of record e (CSV header). Slot s holds tile s for s < 2, else the CTA's last
// tile k with k % 2 == s - 2 (see tl::kTileSlots).
std::pair<std::string, std::string> timeline_columns(int e) {
  using harness::timeline::timer_columns;
  if (e == tl::kCtaInfo) return {"smid", "tiles"};
  if (e == tl::kEntry) return timer_columns("entry");
  if (e < tl::kTiles) return timer_columns("wg" + std::to_string(e - tl::kConsumerExit + 1) + "_exit");
  const int slot = (e - tl::kTiles) / tl::kTileEvents, te = (e - tl::kTiles) % tl::kTileEvents;
  const std::string prefix = "slot" + std::to_string(slot) + "_";
  if (te == tl::kTileShape) return {prefix + "m_block", prefix + "key_blocks"};
  if (te < tl::kConsumer) return timer_columns(prefix + kTimelineProducerEventNames[te - tl::kQIssued]);
  const int w = (te - tl::kConsumer) / tl::kConsumerEvents;
  return timer_columns(prefix + "wg" + std::to_string(w + 1) + "_" +
                       kTimelineConsumerEventNames[(te - tl::kConsumer) % tl::kConsumerEvents]);
}

struct FwdCtaTimeline : harness::timeline::CtaRecords {  // tl::kEvents records
  int64_t cta;
  uint32_t smid;
  int tiles;      // n: the CTA's non-empty tiles
  int consumers;  // consumer warpgroups that recorded an exit
  bool traced(int tile) const { return tile >= 0 && tile < tiles && (tile < 2 || tile >= tiles - 2); }
  // Tile number of kind k (0, 1, n-2, n-1).
  int tile_of_kind(int k) const { return k < 2 ? k : tiles - kTimelineTileKinds + k; }
  int key_blocks(int tile) const {
    return int(rec[2 * tl::tile_event(tile, tl::kTileShape) + 1]);
  }
  int producer(int tile, int e) const { return tl::tile_event(tile, e); }
  int consumer(int w, int tile, int e) const {
    return tl::consumer_tile_event(tile, w, e);
  }
  // The CTA's end: the latest consumer exit.
  int exit_event() const {
    int last = tl::kConsumerExit;
    for (int w = 1; w < consumers; ++w)
      if (clk(tl::kConsumerExit + w) > clk(last)) last = tl::kConsumerExit + w;
    return last;
  }
};

// The median of ns values in us, 8 characters wide; "-" when there are none.
std::string median_us(const std::vector<double>& ns) {
  char cell[32];
  if (ns.empty()) return "       -";
  std::snprintf(cell, sizeof cell, "%8.3f", spread(ns).p50 * 1e-3);
  return cell;
}

// Consumer warpgroup w's tiles, one row per kind (CTAs of at least 4 tiles): each column from
// the event before it, so that q_wait .. to_next add up to the duration, and the tile's last
// PV (fused: issued in the next tile's first turn) shown apart.
void print_tile_budget(const std::vector<FwdCtaTimeline>& all, int w) {
  std::printf(" wg%d tiles (us, medians over CTAs; the tile starts when its Q wait begins):\n",
              w + 1);
  std::printf("  %-10s %6s %8s %8s %8s %8s %8s %8s %8s | %8s %8s %8s | %8s | %8s %8s %8s\n",
              "tile", "blocks", "duration", "q_wait", "turn", "S_0", "blk0", "per_blk", "to_next",
              "pv_turn", "pv", "store", "fixed", "st_free", "st_smem", "st_issue");
  const auto c_ev = [&](const FwdCtaTimeline& t, int tile, int e) { return t.consumer(w, tile, e); };
  for (int kind = 0; kind < kTimelineTileKinds; ++kind) {
    std::vector<double> blocks, duration, q_wait, turn, s0, blk0, per_blk, to_next, pv_turn, pv,
        store, fixed, store_free, store_staged, store_issued;
    for (const FwdCtaTimeline& t : all) {
      if (t.tiles < kTimelineTileKinds || w >= t.consumers) continue;
      const int k = t.tile_of_kind(kind), n_blocks = t.key_blocks(k);
      const int start = c_ev(t, k, tl::kQWait), loop_done = c_ev(t, k, tl::kLoopDone);
      const int first_done = c_ev(t, k, tl::kFirstBlockDone);
      blocks.push_back(n_blocks);
      q_wait.push_back(t.ns(start, c_ev(t, k, tl::kQFull)));
      turn.push_back(t.ns(c_ev(t, k, tl::kQFull), c_ev(t, k, tl::kFirstTurn)));
      s0.push_back(t.ns(c_ev(t, k, tl::kFirstTurn), c_ev(t, k, tl::kFirstScores)));
      blk0.push_back(t.ns(c_ev(t, k, tl::kFirstScores), first_done));
      pv_turn.push_back(t.ns(loop_done, c_ev(t, k, tl::kLastPvTurn)));
      pv.push_back(t.ns(c_ev(t, k, tl::kLastPvTurn), c_ev(t, k, tl::kLastPvDone)));
      store.push_back(t.ns(c_ev(t, k, tl::kLastPvDone), c_ev(t, k, tl::kStored)));
      store_free.push_back(t.ns(c_ev(t, k, tl::kLastPvDone), c_ev(t, k, tl::kStagingFree)));
      store_staged.push_back(t.ns(c_ev(t, k, tl::kStagingFree), c_ev(t, k, tl::kStaged)));
      store_issued.push_back(t.ns(c_ev(t, k, tl::kStaged), c_ev(t, k, tl::kStored)));
      const double step = n_blocks > 1 ? t.ns(first_done, loop_done) / (n_blocks - 1) : NAN;
      if (n_blocks > 1) per_blk.push_back(step);
      // The tile ends where the next one starts; the CTA's last one when its output is stored.
      // Tile 1's next (tile 2) is traced only when n = 4.
      int end = -1;
      if (t.traced(k + 1)) {
        end = c_ev(t, k + 1, tl::kQWait);
      } else if (k == t.tiles - 1) {
        end = c_ev(t, k, tl::kStored);
      }
      if (end < 0) continue;
      duration.push_back(t.ns(start, end));
      to_next.push_back(t.ns(loop_done, end));
      if (n_blocks > 1) fixed.push_back(t.ns(start, end) - n_blocks * step);
    }
    if (blocks.empty()) continue;
    std::printf("  %-10s %6.0f %s %s %s %s %s %s %s | %s %s %s | %s | %s %s %s\n",
                kind == kTimelineTileKinds - 1 ? "n-1 (*)" : kTimelineTileKindNames[kind],
                spread(blocks).p50, median_us(duration).c_str(), median_us(q_wait).c_str(),
                median_us(turn).c_str(), median_us(s0).c_str(), median_us(blk0).c_str(),
                median_us(per_blk).c_str(), median_us(to_next).c_str(),
                median_us(pv_turn).c_str(), median_us(pv).c_str(), median_us(store).c_str(),
                median_us(fixed).c_str(), median_us(store_free).c_str(),
                median_us(store_staged).c_str(), median_us(store_issued).c_str());
  }
  // Tiles 1 .. n-3 together (CTAs of at least 4 tiles): from tile 1's start to tile n-2's.
  std::vector<double> mean_duration, mean_fixed;
  for (const FwdCtaTimeline& t : all) {
    if (t.tiles < kTimelineTileKinds || w >= t.consumers) continue;
    const int last_middle = t.tiles - 2;
    const double mean = t.ns(t.consumer(w, 1, tl::kQWait), t.consumer(w, last_middle, tl::kQWait)) /
                        (t.tiles - 3);
    mean_duration.push_back(mean);
    // The fixed part where tiles 1 and n-2 have the same key blocks (the untraced tiles between
    // them are assumed alike: not under causal masking), at their mean time per block.
    const int n_blocks = t.key_blocks(1);
    if (n_blocks > 1 && n_blocks == t.key_blocks(last_middle)) {
      const auto step = [&](int tile) {
        return t.ns(t.consumer(w, tile, tl::kFirstBlockDone), t.consumer(w, tile, tl::kLoopDone)) /
               (n_blocks - 1);
      };
      mean_fixed.push_back(mean - n_blocks * 0.5 * (step(1) + step(last_middle)));
    }
  }
  // Aligned under "duration" and "fixed" of the header.
  std::printf("  %-10s %6s %s%85s %s\n", "1..n-3 avg", "-", median_us(mean_duration).c_str(), "",
              median_us(mean_fixed).c_str());
  std::printf("  (*) to its output stored; tile 1 (n > 4): its next tile is not traced. blk0: "
              "block 0's softmax and, fused, the previous tile's last PV and output; to_next: lse, "
              "next tile's decode and, unfused, the last PV and output; fixed = duration - blocks "
              "x per_blk; store = st_free (one Q buffer: row sums, lse, wait for the staging "
              "tile) + st_smem (stmatrix, proxy fence) + st_issue (the warpgroup's barrier, TMA "
              "store issue)\n");
}

// The steady key blocks of tile kind `kind` (CTAs of at least 4 tiles), per consumer warpgroup:
// from each block's turn to its S wait's return ("S"), to the return of the wait for the PV
// issued with it ("PV"), to its softmax's end ("softmax"), and on to the next block's turn ("to
// turn"); "period" is turn to turn, and "after wg1" how long after wg1's turn of the same block
// this warpgroup's came. Without the softmax stamps (builds without
// -DJAX_FLASH_V3_FWD_TIMELINE_SOFTMAX, whose stamps can move ptxas's schedule), "to turn" runs
// from the S wait's return. Medians over CTAs, us.
void print_block_budget(const std::vector<FwdCtaTimeline>& all, int consumers, int kind) {
  std::printf(" tile %s, steady key blocks (us, medians over CTAs):\n",
              kTimelineTileKindNames[kind]);
  std::printf("  %-4s %5s %8s %8s %8s %8s %8s %9s\n", "wg", "block", "period", "S", "PV", "softmax",
              "to turn", "after wg1");
  for (int w = 0; w < consumers; ++w) {
    for (int j = 0; j < tl::kLoggedBlocks; ++j) {
      std::vector<double> period, s_wait, softmax, pv, to_turn, after;
      for (const FwdCtaTimeline& t : all) {
        if (t.tiles < kTimelineTileKinds || w >= t.consumers) continue;
        const int k = t.tile_of_kind(kind);
        if (j > t.key_blocks(k) - 2) continue;  // blocks past this tile's are an older tile's
        const auto ev = [&](int ww, int jj, int e) {
          return tl::consumer_block_event(k, ww, jj, e);
        };
        if (j > 0) period.push_back(t.ns(ev(w, j - 1, tl::kBlockTurn), ev(w, j, tl::kBlockTurn)));
        s_wait.push_back(t.ns(ev(w, j, tl::kBlockTurn), ev(w, j, tl::kBlockScores)));
        const bool stamped = t.has(ev(w, j, tl::kBlockSoftmax));  // TIMELINE_SOFTMAX builds
        if (stamped) {
          pv.push_back(t.ns(ev(w, j, tl::kBlockScores), ev(w, j, tl::kBlockPvDone)));
          softmax.push_back(t.ns(ev(w, j, tl::kBlockPvDone), ev(w, j, tl::kBlockSoftmax)));
        }
        if (j + 1 <= t.key_blocks(k) - 2 && j + 1 < tl::kLoggedBlocks) {
          to_turn.push_back(t.ns(ev(w, j, stamped ? tl::kBlockSoftmax : tl::kBlockScores),
                                 ev(w, j + 1, tl::kBlockTurn)));
        }
        if (w > 0) after.push_back(t.ns(ev(0, j, tl::kBlockTurn), ev(w, j, tl::kBlockTurn)));
      }
      if (s_wait.empty()) continue;
      std::printf("  wg%-2d %5d %s %s %s %s %s  %s\n", w + 1, j + 1, median_us(period).c_str(),
                  median_us(s_wait).c_str(), median_us(pv).c_str(), median_us(softmax).c_str(),
                  median_us(to_turn).c_str(), median_us(after).c_str());
    }
  }
}

// Each event of tile kind `kind` as time since that tile's start (consumer warpgroup w),
// median p10 p90, with the producer's events of that tile and the next tile's first events.
void print_tile_events(const std::vector<FwdCtaTimeline>& all, int w, int kind) {
  std::printf(" wg%d tile %s, since its start (us: median p10 p90 (CTAs)):\n", w + 1,
              kTimelineTileKindNames[kind]);
  const auto row = [&](const std::string& what, int next, auto event_of) {
    std::vector<double> since;
    for (const FwdCtaTimeline& t : all) {
      if (t.tiles < kTimelineTileKinds || w >= t.consumers) continue;
      const int k = t.tile_of_kind(kind);
      if (!t.traced(k + next)) continue;
      const int e = event_of(t, k + next);
      if (t.has(e)) since.push_back(t.ns(t.consumer(w, k, tl::kQWait), e));
    }
    print_spread(what, since);
  };
  for (int e = tl::kQIssued; e < tl::kConsumer; ++e)
    row(kTimelineProducerEventNames[e - tl::kQIssued], 0,
        [&](const FwdCtaTimeline& t, int k) { return t.producer(k, e); });
  for (int e = tl::kQFull; e < tl::kConsumerEvents; ++e)
    row(kTimelineConsumerEventNames[e], 0,
        [&](const FwdCtaTimeline& t, int k) { return t.consumer(w, k, e); });
  for (int e : {int(tl::kQWait), int(tl::kQFull), int(tl::kFirstTurn)})
    row(std::string("next tile ") + kTimelineConsumerEventNames[e], 1,
        [&](const FwdCtaTimeline& t, int k) { return t.consumer(w, k, e); });
  row("next tile prod_q_issued", 1,
      [&](const FwdCtaTimeline& t, int k) { return t.producer(k, tl::kQIssued); });
}

// The summary of one recorded launch (host records of `ctas` CTAs). False when no CTA recorded.
bool summarize_timeline(const Case& c, const std::vector<uint64_t>& host, int64_t ctas) {
  std::vector<FwdCtaTimeline> all;
  for (int64_t i = 0; i < ctas; ++i) {
    const uint64_t* rec = host.data() + i * 2 * tl::kEvents;
    FwdCtaTimeline t{{rec}, i, uint32_t(rec[2 * tl::kCtaInfo]), int(rec[2 * tl::kCtaInfo + 1]), 0};
    while (t.consumers < tl::kMaxConsumers && t.has(tl::kConsumerExit + t.consumers)) ++t.consumers;
    if (t.has(tl::kEntry) && t.consumers > 0 && t.tiles > 0) all.push_back(t);
  }
  std::printf("timeline %s: %zu CTAs recorded (room for %ld)\n", c.describe().c_str(), all.size(),
              long(ctas));
  if (all.empty()) return false;

  std::vector<double> rates, tiles, blocks, consumers;
  std::vector<uint64_t> stamps;
  uint64_t first_gt = UINT64_MAX, last_gt = 0;
  for (const FwdCtaTimeline& t : all) {
    const int exit = t.exit_event();
    rates.push_back((double(t.clk(exit)) - double(t.clk(tl::kEntry))) /
                    (double(t.gt(exit)) - double(t.gt(tl::kEntry))));
    tiles.push_back(t.tiles);
    consumers.push_back(t.consumers);
    for (int k = 0; k < t.tiles; ++k)
      if (t.traced(k)) blocks.push_back(t.key_blocks(k));
    for (int e = tl::kEntry; e < tl::kEvents; ++e)
      if (t.has(e) && (e < tl::kTiles || (e - tl::kTiles) % tl::kTileEvents != tl::kTileShape))
        stamps.push_back(t.gt(e));
    first_gt = std::min(first_gt, t.gt(tl::kEntry));
    last_gt = std::max(last_gt, t.gt(exit));
  }
  const Spread rate = spread(rates), n = spread(tiles);
  for (FwdCtaTimeline& t : all) t.cycles_per_ns = rate.p50;
  std::printf("consumer warpgroups %.0f; tiles per CTA median %.0f (p10 %.0f, p90 %.0f); key blocks "
              "per traced tile median %.0f (p10 %.0f, p90 %.0f)\n",
              spread(consumers).p50, n.p50, n.p10, n.p90, spread(blocks).p50, spread(blocks).p10,
              spread(blocks).p90);
  std::printf("SM clock %.3f GHz (per CTA p10 %.3f, p90 %.3f); globaltimer step >= %lu ns\n",
              rate.p50, rate.p10, rate.p90,
              (unsigned long)harness::timeline::globaltimer_step(stamps));
  std::printf("forward kernel span (globaltimer, first entry to last exit) %.1f us\n",
              (double(last_gt) - double(first_gt)) * 1e-3);

  std::printf(" CTA (us: median p10 p90 (CTAs); gt: from the globaltimer):\n");
  std::vector<double> duration, skew, idle, first_q, first_start, drain;
  for (const FwdCtaTimeline& t : all) {
    const int exit = t.exit_event();
    duration.push_back(t.ns(tl::kEntry, exit));
    skew.push_back(double(t.gt(tl::kEntry)) - double(first_gt));
    idle.push_back(double(last_gt) - double(t.gt(exit)));
    first_q.push_back(t.ns(tl::kEntry, t.producer(0, tl::kQIssued)));
    first_start.push_back(t.ns(tl::kEntry, t.consumer(0, 0, tl::kQFull)));
    drain.push_back(t.ns(t.consumer(0, t.tiles - 1, tl::kStored), tl::kConsumerExit));
  }
  print_spread("CTA duration (entry -> last exit)", duration);
  print_spread("entry skew vs first entry (gt)", skew);
  print_spread("idle after exit, to last exit (gt)", idle);
  print_spread("entry -> producer's tile 0 Q issued", first_q);
  print_spread("entry -> wg1 tile 0 Q full", first_start);
  print_spread("wg1 last output stored -> exit", drain);
  for (int w = 0; w < tl::kMaxConsumers; ++w) {
    if (w >= int(spread(consumers).p50)) break;
    print_tile_budget(all, w);
  }
  for (int kind = 1; kind < kTimelineTileKinds - 1; ++kind)
    print_block_budget(all, int(spread(consumers).p50), kind);
  for (int w = 0; w < tl::kMaxConsumers; ++w) {
    if (w >= int(spread(consumers).p50)) break;
    for (int kind = 0; kind < kTimelineTileKinds; ++kind) print_tile_events(all, w, kind);
  }
  return true;
}

// Runs grid config c (library default tuning) with recording, prints the summary and writes
// the raw records to csv_path (null: none). sm_count: the most CTAs the persistent grid has.
bool timeline(const Case& c, const char* csv_path, int sm_count) {
  Problem pb(c, 1);
  const int64_t ctas = sm_count;
  const ForwardArgs a = pb.args();
  // Perturbation check: compare ms_stored and ms_read with the default build's harness_v3
  // --bench-one (`*` column).
  const harness::timeline::RecordedRun run = harness::timeline::record_run(
      ctas, tl::kEvents, jax_flash::V3ForwardSetTimeline,
      [&] { CUDA_CHECK(jax_flash::V3Forward(a, 0)); }, [&] { pb.poison(); });
  const std::vector<uint64_t>& host = run.records;
  const double ms_stored = run.ms_stored, ms_read = run.ms_read;
  pb.fetch();
  const std::vector<RowId> rows = sampled_rows(c, 96, 1);
  bool ok = report("timeline", c, compare_rows(pb, rows, reference_rows(pb, rows)), count_nan(pb),
                   true, " (recorded launch, sampled)");
  std::printf("forward (cudaEvent median of 10): %.4f ms stamps stored, %.4f ms timers read only "
              "(%.1f / %.1f TFLOP/s)\n",
              ms_stored, ms_read, c.forward_flops() / (ms_stored * 1e-3) / 1e12,
              c.forward_flops() / (ms_read * 1e-3) / 1e12);
  ok &= summarize_timeline(c, host, ctas);
  if (csv_path != nullptr) {
    ok &= harness::timeline::write_csv(csv_path, host, ctas, tl::kEvents, tl::kEvents,
                                       timeline_columns);
    std::printf("raw records: %s\n", csv_path);
  }
  return ok;
}
#endif

}  // namespace

constexpr const char* kUsage =
    "usage: %s [--settled] [--default-tuning] [check] [small] [bench] [--bench-one H T causal]\n"
    "       [--bench-shape B T N K H causal] [--bench-cross B T S N K H]\n"
#ifdef JAX_FLASH_V3_FWD_TIMELINE
    "       [--timeline H T causal [records.csv]]\n"
#endif
    ;

int main(int argc, char** argv) {
  bool ok = true;
  [[maybe_unused]] const cudaDeviceProp prop = harness::announce_device();  // --timeline: SMs
  const std::vector<Case> grid = grid_cases();
  for (int i = 1; i < argc; ++i) {
    const std::string mode = argv[i];
    if (harness::settled_flag(mode)) {
      continue;
    } else if (mode == "--default-tuning") {
      default_tuning_only() = true;
    } else if (mode == "check") {
      uint64_t seed = 1;
      for (const Case& c : check_cases()) ok &= check_case(c, ++seed);
    } else if (mode == "small") {
      const Case c{DType::kBF16, 2, 150, 200, 4, 2, 128, true};
      ok &= check_case(c.ragged({150, 100}, {200, 120}), 7);
      ok &= check_case({DType::kF16, 1, 70, 90, 2, 1, 256}, 8);
      ok &= check_case({DType::kBF16, 1, 130, 130, 2, 2, 64, true}, 9);
      ok &= check_case({DType::kBF16, 8, 384, 384, 12, 4, 64}, 10);  // 288 tiles: several per CTA
      // 192 causal units: one-block tiles (m-block 0) between fused multi-block ones
      ok &= check_case({DType::kBF16, 4, 640, 640, 16, 4, 128, true}, 11);
      // Head dim 128's 192 x 80 tile (alternative_rows: 6 heads of 4096 rows are one round of
      // 132 tall tiles, against two of 128-row tiles), two key blocks per tile, in clusters
      ok &= check_case({DType::kBF16, 1, 4096, 160, 6, 2, 128}, 12);
      // Clusters of two sharing K / V (use_cluster), an empty batch by kv_seqlens, and one by
      // q_seqlens beside one with rows for the first m-block only
      const Case pairs{DType::kBF16, 4, 256, 300, 8, 2, 128};
      ok &= check_case(pairs.ragged({256, 90, 0, 200}, {300, 0, 77, 256}), 13);
      // ... causal: the longer tile of a band loads its last blocks alone
      const Case causal_pairs{DType::kBF16, 2, 512, 512, 4, 2, 256, true};
      ok &= check_case(causal_pairs.ragged({512, 300}, {512, 400}), 14);
      ok &= check_case(Case{DType::kBF16, 1, 4096, 4096, 1, 1, 128}.window(-1, 100), 15);
      // Head dim 64's rows split over two launches (alternative_rows, 132 SMs): 1152 on the
      // 192-row tile, 100 on the 128-row tile (one partial tile); query lengths end batch 0
      // inside the second part
      const Case split{DType::kBF16, 2, 1252, 64, 66, 6, 64};
      ok &= check_case(split.ragged({1200, 1252}, {}), 16);
    } else if (mode == "bench") {
      ok &= bench(grid, 10);
    } else if (mode == "--bench-one" && i + 3 < argc) {
      Case c{};
      if (!harness::grid_case_from_args(argv, i, &c)) return 2;
      ok &= bench({c}, 10);
    } else if ((mode == "--bench-shape" || mode == "--bench-cross") && i + 6 < argc) {
      // Any bf16 shape: B T N K H causal with S = T (GQA, e.g. the example model's training
      // shape), or B T S N K H non-causal with its own key length.
      const auto arg = [&](int k) { return std::atoll(argv[i + k]); };
      const Case c =
          mode == "--bench-shape"
              ? Case{DType::kBF16, arg(1), arg(2), arg(2), arg(3), arg(4), arg(5), arg(6) != 0}
              : Case{DType::kBF16, arg(1), arg(2), arg(3), arg(4), arg(5), arg(6), false};
      i += 6;
      ok &= bench({c}, 10);
#ifdef JAX_FLASH_V3_FWD_TIMELINE
    } else if (mode == "--timeline" && i + 3 < argc) {
      // One grid config: H T causal, then optionally a path ending in .csv for the records.
      Case c{};
      if (!harness::grid_case_from_args(argv, i, &c)) return 2;
      ok &= timeline(c, harness::csv_path_from_args(argc, argv, i), prop.multiProcessorCount);
#endif
    } else {
      std::fprintf(stderr, kUsage, argv[0]);
      return 2;
    }
  }
  std::printf("%s\n", ok ? "ALL PASSED" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
