// Standalone test and benchmark of the v3 Hopper forward (cuda/v3_fwd_sm90.cu).
//
//   check  correctness on small and odd shapes against a float64 CPU reference (every row),
//          for every compiled tuning variant; outputs poisoned first; run twice, compared
//          bitwise (a difference between identical runs is a race)
//   small  five small cases (for compute-sanitizer), two with several tiles per CTA
//   bench  the 18 configs of /work/shared/BENCHMARK.md: a float64 check of sampled rows plus a
//          NaN scan of every output, then cudaEvent timings (median of repeats) in TFLOP/s,
//          for every compiled tuning variant
//
// Build (static cudart, runs on the H200 unchanged):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I<cutlass include>
//        -DJAX_FLASH_V3_TUNING_VARIANTS tests/gpu/harness_v3.cu cuda/v3_fwd_sm90.cu
//        -o .carry/harness_v3
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
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../cuda/v3.h"
#include "harness_common.h"
#include "harness_v3_case.h"

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
  // Head dim 64 from these lengths on runs the 192-row tile (use_tall_tile in the kernel).
  cs.push_back({bf, 1, 2100, 2100, 2, 1, 64});
  cs.push_back({hf, 1, 8200, 8200, 1, 1, 64, true});
  // More work units than SMs, so that every CTA runs several tiles: the two-buffer Q ring wraps
  // (its phases flip, outputs are stored by TMA from a buffer the producer refills two tiles
  // later), and q_seqlens put empty tiles (output from registers) between staged ones.
  cs.push_back({bf, 16, 256, 256, 16, 4, 64});
  cs.push_back(
      Case{hf, 8, 640, 640, 8, 8, 128, true}.ragged({640, 0, 300, 640, 1, 640, 129, 500}, {}));
  cs.push_back({bf, 12, 256, 256, 8, 2, 256});
  // Several tiles per CTA where the v3 forward fuses a tile's last PV with the next tile's first
  // S: the 192-row tile (three consumer warpgroups, 352 units: the Q ring wraps), and a causal
  // left window with softcap, whose tiles alternate between one key block (not fused) and two.
  cs.push_back({bf, 1, 2048, 2048, 32, 8, 64});
  cs.push_back(Case{bf, 8, 512, 512, 8, 2, 128, true}.window(60, -1).capped(30.f));
  return cs;
}

bool check_case(const Case& c, uint64_t seed) {
  Problem pb(c, seed);
  const std::vector<RowId> rows = all_rows(c);
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
    all_ok &= report(var.name, c, compare_rows(pb, rows, refs), count_nan(pb), repeatable, "");
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

bool bench(int reps) {
  bool all_ok = true;
  std::vector<std::string> table;
  uint64_t seed = 1000;
  for (const Case& c : grid_cases()) {
    Problem pb(c, ++seed);
    const std::vector<RowId> rows = sampled_rows(c, 96, seed);
    const std::vector<RowRef> refs = reference_rows(pb, rows);
    std::string line;
    char buf[96];
    std::snprintf(buf, sizeof buf, "%4ld %6ld %d", long(c.H), long(c.T), int(c.causal));
    line = buf;
    for (const Variant& var : kVariants) {
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
      const V3Tuning d = jax_flash::V3DefaultTuning(c.H);
      const bool is_default = d.conditional_rescale == var.tuning.conditional_rescale &&
                              d.exp2_emulation_period == var.tuning.exp2_emulation_period;
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

}  // namespace

int main(int argc, char** argv) {
  bool ok = true;
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  for (int i = 1; i < argc; ++i) {
    const std::string mode = argv[i];
    if (mode == "check") {
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
    } else if (mode == "bench") {
      ok &= bench(10);
    } else {
      std::fprintf(stderr, "usage: %s [check] [small] [bench]\n", argv[0]);
      return 2;
    }
  }
  std::printf("%s\n", ok ? "ALL PASSED" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
