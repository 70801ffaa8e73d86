// Standalone test and benchmark of the v3 Hopper backward (cuda/v3_bwd_sm90.cu), with the v3
// forward producing out / lse and the v2 backward (cuda/backward.cu) side by side.
//
//   check  dq, dk, dv against a float64 CPU reference (every element) on small and odd shapes,
//          head dims 64, 128 and 256; outputs NaN-poisoned before each run; run in both
//          modes; deterministic mode run twice and compared bitwise
//   small  three check cases (H = 128, 64, 256) for compute-sanitizer
//   bench  the 18 configs of /work/shared/BENCHMARK.md: v3 backward against the v2 backward
//          (every element: max abs and rel. L2 between them) plus a NaN scan, then cudaEvent
//          timings (median) of fwd, bwd and fwd+bwd in TFLOP/s (fwd+bwd = 3.5 x forward
//          FLOPs, bwd = 2.5 x), v3 and v2 backward side by side; deterministic mode timed too.
//   --bench-v3  the same without the v2 timings of H = 64 / 128 (v2 is still timed at H = 256,
//          where it served the gradients before the v3 backward took that head dim)
//   --bench-one H T causal  one grid row (v2 timed when H = 256); profile H T causal: two
//          plain v3 backward runs of that row (for ncu)
//   --settled  (before the modes) every timing as the library bench's settled loop: clocks of
//          the sustained, power-capped run instead of boost (harness_v3_case.h, Timing)
//   check also runs GQA / MQA cases under every schedule of the main kernel (the default grid,
//          the GQA schedule unsplit and split over 2 / 4 CTAs, and the rule's choice), each in
//          both modes against one float64 reference; small adds two of them for memcheck
//   --bench-gqa  the GQA training shapes (B=4 T=4096 N=16 K=2, B=1 T=4096 N=32 K=8, B=2
//          T=8192 N=32 K=4; H=128, causal and not): each schedule checked against the default
//          grid's gradients, then timed (cudaEvent median of 20), schedules interleaved, two
//          rounds; deterministic mode too. "default" is the code of the build before the GQA
//          schedule (same SASS), so each row is its own A/B.
//   --bench-gqa-one B T N K H causal  the same for one shape
//   check also runs default grids of fewer CTAs than SMs with their key blocks whole and cut
//          into 2, 3, 4 CTAs each (choose_block_parts in cuda/v3_bwd_sm90.cu), each against the
//          float64 reference; small adds one of them for memcheck
//   --bench-split B T N K H causal  one shape (bf16): the default grid with whole key blocks
//          and cut as the rule says, checked against each other and timed interleaved (two
//          rounds)
//   --timeline H T causal [records.csv]  (builds of tests/gpu/build_v3_bwd_timeline.sh only)
//          one grid row on the default grid: stamps of every CTA of the main kernel (cuda/v3.h,
//          v3_bwd_timeline), summarized per phase (time since CTA entry), per CTA (duration, SM
//          gap, per-step budget), and written raw to records.csv
//
// Build: tests/gpu/build_v3_bwd.sh (static cudart; runs on the H200 unchanged).
// Exit status: 0 when every check passed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../cuda/v1v2.h"
#include "../../cuda/v3.h"
#include "harness_common.h"
#include "harness_v3_case.h"
#ifdef JAX_FLASH_V3_BWD_TIMELINE
#include "harness_timeline.h"
#endif

using jax_flash::BackwardArgs;
using jax_flash::DType;
using jax_flash::ForwardArgs;
using Case = harness::V3Case;
using harness::fill_random;
using harness::grid_cases;
using harness::median_event_ms;
using harness::parallel_for;
using harness::to_double;
using harness::to_float;

namespace {

// ---- random inputs on the device ------------------------------------------------------------

template <typename T>
T* device_alloc(int64_t count) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, std::max<int64_t>(1, count) * sizeof(T)));
  return static_cast<T*>(p);
}

std::vector<uint16_t> to_host16(const void* d, int64_t n) {
  std::vector<uint16_t> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

// ---- one problem on the device ---------------------------------------------------------------

struct Problem {
  Case c;
  uint16_t *q, *k, *v, *out, *dout, *dq, *dk, *dv;
  float* lse;
  int32_t *q_seqlens = nullptr, *kv_seqlens = nullptr;
  // v3 workspaces (deterministic sizes: a superset) and v2 workspaces.
  float *dq_accum, *dsum, *lse_log2;
  int32_t* dq_semaphore;
  float* dkv_partial;
  float *v2_dq_accum, *v2_dsum;

  int64_t q_elems() const { return c.B * c.T * c.N * c.H; }
  int64_t kv_elems() const { return c.B * c.S * c.K * c.H; }

  Problem(const Case& cs, uint64_t seed) : c(cs) {
    q = device_alloc<uint16_t>(q_elems());
    out = device_alloc<uint16_t>(q_elems());
    dout = device_alloc<uint16_t>(q_elems());
    dq = device_alloc<uint16_t>(q_elems());
    k = device_alloc<uint16_t>(kv_elems());
    v = device_alloc<uint16_t>(kv_elems());
    dk = device_alloc<uint16_t>(kv_elems());
    dv = device_alloc<uint16_t>(kv_elems());
    lse = device_alloc<float>(c.B * c.N * c.T);
    const jax_flash::AttentionShape shape{c.B, c.T, c.S, c.N, c.K, c.H};
    const jax_flash::V3BackwardWorkspaceBytes ws = jax_flash::V3BackwardWorkspaceSizes(shape, true);
    dq_accum = device_alloc<float>(ws.dq_accum / 4);
    dsum = device_alloc<float>(ws.dsum / 4);
    lse_log2 = device_alloc<float>(ws.lse_log2 / 4);
    dq_semaphore = device_alloc<int32_t>(ws.dq_semaphore / 4);
    dkv_partial = device_alloc<float>(ws.dkv_partial / 4);
    v2_dq_accum = device_alloc<float>(jax_flash::backward_dq_accum_elements(shape));
    v2_dsum = device_alloc<float>(jax_flash::backward_dsum_elements(shape));
    fill_random(c.dtype, q, q_elems(), seed * 5 + 1);
    fill_random(c.dtype, k, kv_elems(), seed * 5 + 2);
    fill_random(c.dtype, v, kv_elems(), seed * 5 + 3);
    fill_random(c.dtype, dout, q_elems(), seed * 5 + 4);
    if (!c.q_seqlens.empty()) {
      q_seqlens = device_alloc<int32_t>(c.B);
      CUDA_CHECK(cudaMemcpy(q_seqlens, c.q_seqlens.data(), c.B * 4, cudaMemcpyHostToDevice));
    }
    if (!c.kv_seqlens.empty()) {
      kv_seqlens = device_alloc<int32_t>(c.B);
      CUDA_CHECK(cudaMemcpy(kv_seqlens, c.kv_seqlens.data(), c.B * 4, cudaMemcpyHostToDevice));
    }
    CUDA_CHECK(jax_flash::V3Forward(forward_args(), 0));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~Problem() {
    for (void* p : std::initializer_list<void*>{q, k, v, out, dout, dq, dk, dv, lse, q_seqlens,
                                                kv_seqlens, dq_accum, dsum, lse_log2,
                                                dq_semaphore, dkv_partial, v2_dq_accum, v2_dsum})
      cudaFree(p);
  }

  ForwardArgs forward_args() const {
    return c.forward_args(q, k, v, q_seqlens, kv_seqlens, out, lse);
  }
  BackwardArgs backward_args() const {
    BackwardArgs a;
    a.fwd = forward_args();
    a.dout = dout;
    a.dq = dq;
    a.dk = dk;
    a.dv = dv;
    return a;
  }

  void poison() {
    CUDA_CHECK(cudaMemset(dq, 0xFF, q_elems() * 2));  // NaN in bf16 and fp16
    CUDA_CHECK(cudaMemset(dk, 0xFF, kv_elems() * 2));
    CUDA_CHECK(cudaMemset(dv, 0xFF, kv_elems() * 2));
    // Workspaces too: the kernels must not depend on their previous contents.
    const jax_flash::AttentionShape shape{c.B, c.T, c.S, c.N, c.K, c.H};
    const jax_flash::V3BackwardWorkspaceBytes ws = jax_flash::V3BackwardWorkspaceSizes(shape, true);
    CUDA_CHECK(cudaMemset(dq_accum, 0xFF, ws.dq_accum));
    CUDA_CHECK(cudaMemset(dsum, 0xFF, ws.dsum));
    CUDA_CHECK(cudaMemset(lse_log2, 0xFF, ws.lse_log2));
    CUDA_CHECK(cudaMemset(dq_semaphore, 0x7F, ws.dq_semaphore));
    CUDA_CHECK(cudaMemset(dkv_partial, 0xFF, ws.dkv_partial));
  }

  jax_flash::V3BackwardWorkspace workspace() const {
    return {dq_accum, dsum, lse_log2, dq_semaphore, dkv_partial};
  }
  cudaError_t launch_v3(bool deterministic) {
    return jax_flash::V3Backward(backward_args(), workspace(), deterministic, 0);
  }
  // kv_split: 0 = the rule (as launch_v3), -1 = the default grid, S >= 1 = the GQA schedule.
  cudaError_t launch_v3_split(bool deterministic, int kv_split) {
    return jax_flash::V3BackwardScheduled(backward_args(), workspace(), deterministic, kv_split, 0);
  }
  // The default grid with its key blocks cut into `parts` CTAs each (-1 = the rule's, 1 =
  // whole).
  cudaError_t launch_v3_parts(int parts) {
    return jax_flash::V3BackwardScheduled(backward_args(), workspace(), false, -1, 0, parts);
  }
  int chosen_block_parts() const {
    return jax_flash::V3BackwardChosenBlockParts(backward_args(), workspace(), false);
  }
  int max_block_parts() const {
    return jax_flash::V3BackwardMaxBlockParts({c.B, c.T, c.S, c.N, c.K, c.H});
  }
  int chosen_split(bool deterministic) const {
    return jax_flash::V3BackwardChosenSplit(backward_args(), workspace(), deterministic);
  }
  // The schedules this shape can run: default grid, rule, and every valid split.
  std::vector<int> schedules() const {
    std::vector<int> s = {-1, 0};
    const int max_split =
        jax_flash::V3BackwardMaxKvSplit({c.B, c.T, c.S, c.N, c.K, c.H});
    for (int k : {1, 2, 4})
      if (c.N / c.K % k == 0 && c.N > c.K && (k == 1 || k <= max_split)) s.push_back(k);
    return s;
  }
  cudaError_t launch_v2() {
    return jax_flash::launch_v2_backward(backward_args(), {v2_dq_accum, v2_dsum}, 0);
  }
  cudaError_t launch_forward() { return jax_flash::V3Forward(forward_args(), 0); }

  struct Grads {
    std::vector<uint16_t> dq, dk, dv;
    bool operator==(const Grads& o) const { return dq == o.dq && dk == o.dk && dv == o.dv; }
  };
  Grads fetch() const {
    return {to_host16(dq, q_elems()), to_host16(dk, kv_elems()), to_host16(dv, kv_elems())};
  }
};

// ---- float64 reference of the gradients ----------------------------------------------------

struct RefGrads {
  std::vector<double> dq, dk, dv;
};

// docs/architecture.md's backward in float64, from the bf16 / fp16 inputs. One task per
// (batch, kv head) owns that head's dk / dv rows and its query heads' dq rows.
RefGrads reference(const Case& c, const std::vector<uint16_t>& hq,
                   const std::vector<uint16_t>& hk, const std::vector<uint16_t>& hv,
                   const std::vector<uint16_t>& hdo) {
  RefGrads g{std::vector<double>(hq.size()), std::vector<double>(hk.size()),
             std::vector<double>(hv.size())};
  const double scale = c.scale();
  const auto f = [&](const std::vector<uint16_t>& x, int64_t i) { return double(to_float(x[i], c.dtype)); };
  parallel_for(size_t(c.B * c.K), [&](size_t task) {
    const int64_t b = int64_t(task) / c.K, kvh = int64_t(task) % c.K;
    const int64_t q_rows = c.q_seqlens.empty() ? c.T : c.q_seqlens[b];
    const int64_t kv_cols = c.kv_seqlens.empty() ? c.S : c.kv_seqlens[b];
    const auto kidx = [&](int64_t s, int64_t h) { return ((b * c.S + s) * c.K + kvh) * c.H + h; };
    std::vector<double> x(c.S), p(c.S), dp(c.S), chain(c.S);
    std::vector<char> keep(c.S);
    for (int64_t n = kvh * (c.N / c.K); n < (kvh + 1) * (c.N / c.K); ++n)
      for (int64_t t = 0; t < c.T; ++t) {
        const auto qidx = [&](int64_t h) { return ((b * c.T + t) * c.N + n) * c.H + h; };
        double mx = -INFINITY;
        for (int64_t s = 0; s < c.S; ++s) {
          keep[s] = t < q_rows && s < kv_cols && (!c.causal || s <= t) &&
                    (c.window_left < 0 || s >= t - c.window_left) &&
                    (c.window_right < 0 || s <= t + c.window_right);
          if (!keep[s]) continue;
          double dot = 0;
          for (int64_t h = 0; h < c.H; ++h) dot += f(hq, qidx(h)) * f(hk, kidx(s, h));
          x[s] = scale * dot;
          chain[s] = 1.0;
          if (c.softcap > 0) {
            const double th = std::tanh(x[s] / c.softcap);
            x[s] = c.softcap * th;
            chain[s] = 1.0 - th * th;
          }
          mx = std::max(mx, x[s]);
        }
        if (mx == -INFINITY) continue;  // no kept key: every gradient of the row is 0
        double sum = 0;
        for (int64_t s = 0; s < c.S; ++s) sum += keep[s] ? (p[s] = std::exp(x[s] - mx)) : 0.0;
        double d = 0;  // D = sum_s p dp = dout . out
        for (int64_t s = 0; s < c.S; ++s) {
          if (!keep[s]) continue;
          p[s] /= sum;
          dp[s] = 0;
          for (int64_t h = 0; h < c.H; ++h) dp[s] += f(hdo, qidx(h)) * f(hv, kidx(s, h));
          d += p[s] * dp[s];
        }
        for (int64_t s = 0; s < c.S; ++s) {
          if (!keep[s]) continue;
          const double ds = p[s] * (dp[s] - d) * chain[s] * scale;
          for (int64_t h = 0; h < c.H; ++h) {
            g.dq[qidx(h)] += ds * f(hk, kidx(s, h));
            g.dk[kidx(s, h)] += ds * f(hq, qidx(h));
            g.dv[kidx(s, h)] += p[s] * f(hdo, qidx(h));
          }
        }
      }
  });
  return g;
}

struct Errors {
  double max_abs = 0, sq_err = 0, sq_ref = 0;
  int64_t nan = 0;
  double rel_l2() const { return sq_ref > 0 ? std::sqrt(sq_err / sq_ref) : std::sqrt(sq_err); }
  void add(double got, double ref) {
    if (std::isnan(got)) {
      ++nan;
      return;
    }
    const double d = std::fabs(got - ref);
    max_abs = std::max(max_abs, d);
    sq_err += d * d;
    sq_ref += ref * ref;
  }
};

template <typename Ref>
Errors compare(const std::vector<uint16_t>& got, const Ref& ref, DType dtype) {
  Errors e;
  for (size_t i = 0; i < got.size(); ++i) e.add(to_float(got[i], dtype), double(ref[i]));
  return e;
}

// The errors of gradients g (dq, dk, dv) against ref.
void compare_grads(const Problem::Grads& g, const RefGrads& ref, DType dtype, Errors (&e)[3]) {
  e[0] = compare(g.dq, ref.dq, dtype);
  e[1] = compare(g.dk, ref.dk, dtype);
  e[2] = compare(g.dv, ref.dv, dtype);
}

// Another run's gradients, widened, as the reference of a comparison between two runs.
RefGrads as_reference(const Problem::Grads& g, DType dtype) {
  return {to_double(g.dq, dtype), to_double(g.dk, dtype), to_double(g.dv, dtype)};
}

// Gradients are O(1) here (random normal inputs and dout); bf16 rounds P, dS and the outputs.
bool within_tolerance(const Errors& e, DType dtype) {
  const double rel = dtype == DType::kBF16 ? 2e-2 : 5e-3;
  return e.nan == 0 && e.rel_l2() <= rel;
}

bool report(const char* what, const Case& c, const Errors (&e)[3], bool extra_ok,
            const char* extra) {
  bool ok = extra_ok;
  for (const Errors& x : e) ok &= within_tolerance(x, c.dtype);
  std::printf("%-4s %-14s %-62s", ok ? "ok" : "FAIL", what, c.describe().c_str());
  const char* names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i)
    std::printf(" %s max_abs=%.2e rel_l2=%.2e nan=%ld", names[i], e[i].max_abs, e[i].rel_l2(),
                long(e[i].nan));
  std::printf("%s\n", extra);
  std::fflush(stdout);
  return ok;
}

// ---- check ------------------------------------------------------------------------------------

std::vector<Case> check_cases() {
  const DType bf = DType::kBF16, hf = DType::kF16;
  std::vector<Case> cs;
  cs.push_back({bf, 1, 1, 1, 1, 1, 64});
  cs.push_back({bf, 2, 17, 17, 2, 2, 128});
  cs.push_back({hf, 1, 97, 97, 4, 4, 64, true});
  cs.push_back({bf, 1, 1030, 1030, 2, 2, 128});
  cs.push_back({bf, 1, 1030, 1030, 2, 1, 64, true});
  cs.push_back({bf, 2, 130, 333, 4, 1, 128});         // T < S, GQA 4:1
  cs.push_back({hf, 1, 333, 130, 8, 2, 128, true});  // T > S, GQA 4:1
  cs.push_back({bf, 1, 200, 300, 8, 1, 64});          // MQA
  cs.push_back(Case{bf, 1, 257, 257, 4, 1, 128}.window(50, 20));
  cs.push_back(Case{hf, 1, 600, 600, 2, 2, 64, true}.window(100, -1));
  cs.push_back(Case{bf, 2, 100, 700, 2, 2, 64}.capped(30.f));
  cs.push_back(Case{bf, 1, 300, 300, 4, 2, 128, true}.capped(5.f));
  cs.push_back(Case{bf, 3, 150, 170, 4, 2, 128, true}.ragged({150, 77, 0}, {170, 1, 90}));
  cs.push_back(Case{hf, 2, 200, 300, 4, 2, 64}.ragged({133, 200}, {300, 45}));
  // Head dim 256 (64-key blocks, the head dim split between the consumer warpgroups).
  cs.push_back({bf, 1, 1, 1, 1, 1, 256});
  cs.push_back({hf, 1, 97, 97, 4, 4, 256, true});
  cs.push_back({bf, 1, 1030, 1030, 2, 2, 256});
  cs.push_back({bf, 2, 130, 333, 4, 1, 256});         // T < S, GQA 4:1
  cs.push_back({hf, 1, 333, 130, 8, 2, 256, true});  // T > S, GQA 4:1
  cs.push_back(Case{bf, 1, 257, 257, 4, 1, 256}.window(50, 20));
  cs.push_back(Case{hf, 1, 600, 600, 2, 2, 256, true}.window(100, -1));
  cs.push_back(Case{hf, 2, 100, 700, 2, 2, 256}.capped(30.f));
  cs.push_back(Case{bf, 1, 300, 300, 4, 2, 256, true}.capped(5.f));
  cs.push_back(Case{bf, 3, 150, 170, 4, 2, 256, true}.ragged({150, 77, 0}, {170, 1, 90}));
  return cs;
}

// GQA / MQA cases with few key blocks x kv heads x batch: the GQA schedule (rule, forced
// splits) against the float64 reference; check_split_case runs every schedule.
std::vector<Case> split_cases() {
  const DType bf = DType::kBF16, hf = DType::kF16;
  std::vector<Case> cs;
  cs.push_back({bf, 2, 512, 512, 16, 2, 128, true});  // GQA 8:1, causal
  cs.push_back({bf, 1, 384, 384, 16, 2, 128});        // GQA 8:1
  cs.push_back({hf, 1, 300, 300, 8, 1, 64});          // MQA
  cs.push_back({bf, 1, 520, 520, 8, 1, 64, true});    // MQA, causal
  cs.push_back({bf, 1, 200, 200, 8, 1, 256, true});   // MQA, causal, H = 256
  cs.push_back({hf, 2, 130, 270, 8, 2, 256});         // GQA 4:1, T < S, H = 256
  cs.push_back({hf, 1, 333, 200, 8, 2, 128, true});   // GQA 4:1, T > S
  cs.push_back({bf, 1, 300, 300, 12, 2, 128, true});  // GQA 6:1 (splits 1, 2)
  cs.push_back(Case{bf, 1, 400, 400, 8, 2, 128}.window(64, 32));
  cs.push_back(Case{bf, 3, 300, 300, 8, 2, 64, true}.ragged({300, 150, 0}, {200, 300, 7}));
  // softcap at H = 64 (the branch with a spill)
  cs.push_back(Case{bf, 1, 256, 256, 8, 2, 64, true}.capped(10.f));
  cs.push_back(Case{hf, 1, 200, 300, 8, 2, 256}.capped(20.f));
  return cs;
}

// The float64 gradients of pb's inputs.
RefGrads reference_of(const Problem& pb) {
  return reference(pb.c, to_host16(pb.q, pb.q_elems()), to_host16(pb.k, pb.kv_elems()),
                   to_host16(pb.v, pb.kv_elems()), to_host16(pb.dout, pb.q_elems()));
}

// One v3 schedule (split: 0 = the rule, -1 = the default grid, S >= 1 = the GQA schedule) in one
// mode against ref, on poisoned outputs; the deterministic mode runs twice and must give bitwise
// equal gradients. A launch error is a FAIL line. `extra` goes before the repeatability note.
bool check_v3_schedule(Problem& pb, const RefGrads& ref, int split, bool det, const char* what,
                       const std::string& extra) {
  const Case& c = pb.c;
  pb.poison();
  const cudaError_t err = pb.launch_v3_split(det, split);
  CUDA_CHECK(cudaDeviceSynchronize());
  if (err != cudaSuccess) {
    std::printf("FAIL split=%d det=%d launch error %s %s\n", split, int(det),
                cudaGetErrorString(err), c.describe().c_str());
    return false;
  }
  const Problem::Grads first = pb.fetch();
  bool repeatable = true;
  if (det) {
    pb.poison();
    CUDA_CHECK(pb.launch_v3_split(det, split));
    CUDA_CHECK(cudaDeviceSynchronize());
    repeatable = first == pb.fetch();
  }
  Errors e[3];
  compare_grads(first, ref, c.dtype, e);
  const char* note = det ? (repeatable ? " bitwise-repeatable" : " NOT-REPEATABLE") : "";
  return report(what, c, e, repeatable, (extra + note).c_str());
}

bool check_split_case(const Case& c, uint64_t seed) {
  Problem pb(c, seed);
  const RefGrads ref = reference_of(pb);
  bool ok = true;
  for (const int split : pb.schedules()) {
    for (const bool det : {false, true}) {
      char what[64], extra[32];
      std::snprintf(what, sizeof what, "%s s=%d", det ? "v3-det" : "v3", split);
      std::snprintf(extra, sizeof extra, " rule=%d", pb.chosen_split(det));
      ok &= check_v3_schedule(pb, ref, split, det, what, extra);
    }
  }
  return ok;
}

// Default grids of fewer CTAs than SMs: key blocks whole and cut into every count of CTAs the
// shape can take, against the float64 reference.
std::vector<Case> block_parts_cases() {
  const DType bf = DType::kBF16, hf = DType::kF16;
  std::vector<Case> cs;
  cs.push_back({bf, 2, 300, 300, 4, 4, 128, true});
  cs.push_back({hf, 1, 1000, 1000, 2, 2, 128});
  cs.push_back({bf, 3, 97, 130, 4, 2, 64});                // GQA on the default grid
  cs.push_back({bf, 1, 50, 260, 2, 2, 128});               // fewer query blocks than parts
  cs.push_back({hf, 2, 200, 200, 2, 1, 256, true});
  cs.push_back(Case{bf, 1, 400, 400, 2, 2, 128}.window(64, 32));
  cs.push_back(Case{bf, 2, 300, 300, 2, 2, 64, true}.ragged({300, 150}, {200, 300}));
  cs.push_back(Case{bf, 1, 256, 256, 4, 2, 64, true}.capped(10.f));
  return cs;
}

bool check_block_parts_case(const Case& c, uint64_t seed) {
  Problem pb(c, seed);
  const RefGrads ref = reference_of(pb);
  bool ok = true;
  for (int parts = 1; parts <= pb.max_block_parts(); ++parts) {
    pb.poison();
    const cudaError_t err = pb.launch_v3_parts(parts);
    CUDA_CHECK(cudaDeviceSynchronize());
    if (err != cudaSuccess) {
      std::printf("FAIL parts=%d launch error %s %s\n", parts, cudaGetErrorString(err),
                  c.describe().c_str());
      ok = false;
      continue;
    }
    Errors e[3];
    compare_grads(pb.fetch(), ref, c.dtype, e);
    char what[48], extra[32];
    std::snprintf(what, sizeof what, "v3 parts=%d", parts);
    std::snprintf(extra, sizeof extra, " rule=%d", pb.chosen_block_parts());
    ok &= report(what, c, e, true, extra);
  }
  return ok;
}

// One shape on the default grid, key blocks whole and cut as the rule says: gradients compared
// (every element), then both timed, interleaved, two rounds.
bool bench_block_parts(const Case& c, int reps) {
  Problem pb(c, 4000);
  const int parts = pb.chosen_block_parts();
  pb.poison();
  CUDA_CHECK(pb.launch_v3_parts(1));
  CUDA_CHECK(cudaDeviceSynchronize());
  const RefGrads base = as_reference(pb.fetch(), c.dtype);
  pb.poison();
  CUDA_CHECK(pb.launch_v3_parts(-1));
  CUDA_CHECK(cudaDeviceSynchronize());
  Errors e[3];
  compare_grads(pb.fetch(), base, c.dtype, e);
  bool ok = report("v3 parts rule vs whole", c, e, true, "");
  double ms[2][2];
  for (int round = 0; round < 2; ++round)
    for (int with_split = 0; with_split < 2; ++with_split)
      ms[round][with_split] = median_event_ms(
          [&] { CUDA_CHECK(pb.launch_v3_parts(with_split ? -1 : 1)); }, 3, reps);
  const double f = 2.5 * c.forward_flops();
  std::printf("parts B=%ld T=%ld N=%ld K=%ld H=%ld c=%d | rule %d | whole %.3f %.3f ms | "
              "rule %.3f %.3f ms | %.1f -> %.1f TF | %+.1f%%\n",
              long(c.B), long(c.T), long(c.N), long(c.K), long(c.H), int(c.causal), parts,
              ms[0][0], ms[1][0], ms[0][1], ms[1][1],
              f / (std::min(ms[0][0], ms[1][0]) * 1e9), f / (std::min(ms[0][1], ms[1][1]) * 1e9),
              100.0 * (std::min(ms[0][1], ms[1][1]) / std::min(ms[0][0], ms[1][0]) - 1.0));
  return ok;
}

bool check_case(const Case& c, uint64_t seed) {
  Problem pb(c, seed);
  const RefGrads ref = reference_of(pb);
  bool ok = check_v3_schedule(pb, ref, 0, false, "v3", "");
  ok &= check_v3_schedule(pb, ref, 0, true, "v3-determ", "");
  pb.poison();
  CUDA_CHECK(pb.launch_v2());
  CUDA_CHECK(cudaDeviceSynchronize());
  Errors e[3];
  compare_grads(pb.fetch(), ref, c.dtype, e);
  ok &= report("v2", c, e, true, "");
  return ok;
}

// ---- bench ------------------------------------------------------------------------------------

// The v2 backward is timed for the rows with H >= v2_from_head_dim (v2 always runs once, as
// the reference of the agreement check).
bool bench(const std::vector<Case>& cases, int reps, int64_t v2_from_head_dim) {
  bool all_ok = true;
  std::vector<std::string> table;
  uint64_t seed = 2000;
  for (const Case& c : cases) {
    Problem pb(c, ++seed);
    const bool with_v2 = c.H >= v2_from_head_dim;
    const bool has_v3 = jax_flash::V3BackwardUnsupportedReason(pb.backward_args()) == nullptr;
    // v2 is the float64-verified backward: v3 must agree with it on every element.
    pb.poison();
    CUDA_CHECK(pb.launch_v2());
    CUDA_CHECK(cudaDeviceSynchronize());
    const Problem::Grads v2 = pb.fetch();
    if (has_v3) {
      pb.poison();
      CUDA_CHECK(pb.launch_v3(false));
      CUDA_CHECK(cudaDeviceSynchronize());
      const Problem::Grads v3 = pb.fetch();
      Errors e[3];
      compare_grads(v3, as_reference(v2, c.dtype), c.dtype, e);
      all_ok &= report("v3 vs v2", c, e, true, "");
    }
    const double fwd = median_event_ms([&] { CUDA_CHECK(pb.launch_forward()); }, 3, reps);
    const double bwd_v2 =
        with_v2 ? median_event_ms([&] { CUDA_CHECK(pb.launch_v2()); }, 3, reps) : NAN;
    double bwd_v3 = NAN, bwd_v3_det = NAN, both_v3 = NAN;
    if (has_v3) {
      bwd_v3 = median_event_ms([&] { CUDA_CHECK(pb.launch_v3(false)); }, 3, reps);
      bwd_v3_det = median_event_ms([&] { CUDA_CHECK(pb.launch_v3(true)); }, 3, reps);
      both_v3 = median_event_ms(
          [&] {
            CUDA_CHECK(pb.launch_forward());
            CUDA_CHECK(pb.launch_v3(false));
          },
          3, reps);
    }
    const double both_v2 = with_v2 ? median_event_ms(
                                         [&] {
                                           CUDA_CHECK(pb.launch_forward());
                                           CUDA_CHECK(pb.launch_v2());
                                         },
                                         3, reps)
                                   : NAN;
    const double f = c.forward_flops();
    const auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%4ld %6ld %d | %7.3f %7.1f | %7.3f %7.1f %7.3f %7.1f | %7.1f %7.1f | %7.3f",
                  long(c.H), long(c.T), int(c.causal), fwd, tflops(f, fwd), bwd_v3,
                  tflops(2.5 * f, bwd_v3), bwd_v2, tflops(2.5 * f, bwd_v2),
                  tflops(3.5 * f, both_v3), tflops(3.5 * f, both_v2), bwd_v3_det);
    table.push_back(buf);
    std::printf("time %s\n", buf);
    std::fflush(stdout);
  }
  std::printf(
      "\nfwd+bwd, bf16, cudaEvent median of %d (ms, TFLOP/s; bwd = 2.5x, fwd+bwd = 3.5x forward "
      "FLOPs; fwd = v3 forward; nan = not timed: v2 below H = 256 in --bench-v3 / --bench-one)\n",
      reps);
  std::printf("   H      T c |  fwd ms  fwd TF | v3b ms  v3b TF  v2b ms  v2b TF | f+b(v3) f+b(v2) "
              "| v3b-det ms\n");
  for (const std::string& l : table) std::printf("%s\n", l.c_str());
  return all_ok;
}

// The GQA schedules on the shapes of examples/train.py and two more: each schedule's
// gradients against the default grid's (the code of the build before the GQA schedule), then
// cudaEvent medians, schedules interleaved, two rounds.
std::vector<Case> gqa_bench_cases() {
  std::vector<Case> cs;
  for (bool causal : {true, false}) {
    cs.push_back({DType::kBF16, 4, 4096, 4096, 16, 2, 128, causal});
    cs.push_back({DType::kBF16, 1, 4096, 4096, 32, 8, 128, causal});
    cs.push_back({DType::kBF16, 2, 8192, 8192, 32, 4, 128, causal});
  }
  return cs;
}

const char* schedule_name(int split) {
  switch (split) {
    case -1: return "default";
    case 0: return "rule";
    case 1: return "gqa-s1";
    case 2: return "gqa-s2";
    case 4: return "gqa-s4";
  }
  return "?";
}

bool bench_gqa(const std::vector<Case>& cases, int reps) {
  bool all_ok = true;
  std::vector<std::string> table;
  uint64_t seed = 3000;
  for (const Case& c : cases) {
    Problem pb(c, ++seed);
    const std::vector<int> schedules = pb.schedules();
    pb.poison();
    CUDA_CHECK(pb.launch_v3_split(false, -1));
    CUDA_CHECK(cudaDeviceSynchronize());
    const RefGrads base = as_reference(pb.fetch(), c.dtype);
    for (const int split : schedules) {
      for (const bool det : {false, true}) {
        pb.poison();
        CUDA_CHECK(pb.launch_v3_split(det, split));
        CUDA_CHECK(cudaDeviceSynchronize());
        const Problem::Grads g = pb.fetch();
        Errors e[3];
        compare_grads(g, base, c.dtype, e);
        char what[64];
        std::snprintf(what, sizeof what, "%s%s vs default", schedule_name(split), det ? "-det" : "");
        all_ok &= report(what, c, e, true, "");
      }
    }
    const double fwd = median_event_ms([&] { CUDA_CHECK(pb.launch_forward()); }, 3, reps);
    const double f = c.forward_flops();
    std::vector<std::vector<double>> ms(schedules.size()), det_ms(schedules.size());
    for (int round = 0; round < 2; ++round) {
      for (size_t i = 0; i < schedules.size(); ++i) {
        ms[i].push_back(
            median_event_ms([&] { CUDA_CHECK(pb.launch_v3_split(false, schedules[i])); }, 3, reps));
        det_ms[i].push_back(
            median_event_ms([&] { CUDA_CHECK(pb.launch_v3_split(true, schedules[i])); }, 3, reps));
      }
    }
    for (size_t i = 0; i < schedules.size(); ++i) {
      const int s = schedules[i];
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "B=%ld T=%ld N=%ld K=%ld H=%ld c=%d | %-8s | %7.3f %7.3f | %6.1f | %7.3f %7.3f "
                    "| fwd %6.3f | rule %d det-rule %d",
                    long(c.B), long(c.T), long(c.N), long(c.K), long(c.H), int(c.causal),
                    schedule_name(s), ms[i][0], ms[i][1],
                    2.5 * f / (std::min(ms[i][0], ms[i][1]) * 1e-3) / 1e12, det_ms[i][0],
                    det_ms[i][1], fwd, pb.chosen_split(false), pb.chosen_split(true));
      table.push_back(buf);
      std::printf("gqa %s\n", buf);
      std::fflush(stdout);
    }
  }
  std::printf("\nv3 backward schedules, bf16, cudaEvent median of %d per round (ms round 1, round 2;"
              " TF = 2.5x forward FLOPs / best round; det = deterministic mode; rule = the split "
              "V3Backward picks: -1 default grid, S >= 1 GQA schedule)\n", reps);
  std::printf("shape                                | schedule | bwd ms r1 r2    | bwd TF | det ms r1 r2"
              "    | fwd ms     | rule\n");
  for (const std::string& l : table) std::printf("%s\n", l.c_str());
  return all_ok;
}

#ifdef JAX_FLASH_V3_BWD_TIMELINE
// ---- --timeline: where a CTA of the main kernel spends its time ------------------------------
//
// Built only with -DJAX_FLASH_V3_BWD_TIMELINE (tests/gpu/build_v3_bwd_timeline.sh); record
// layout: cuda/v3.h, v3_bwd_timeline. Times inside a CTA and between CTAs of one SM come from
// %clock64 (that SM's cycles), converted to ns at the SM's own rate: its clock64 span over its
// globaltimer span, first record to last (the globaltimer alone steps too coarsely for
// sub-microsecond phases). The kernel span is the globaltimer's.

namespace tl = jax_flash::v3_bwd_timeline;
using harness::timeline::print_spread;
using harness::timeline::spread;
using harness::timeline::Spread;
using tl::consumer_event;

constexpr int kTimelineUsedEvents = tl::kConsumer + 2 * tl::kConsumerEvents;

// The traced steps by slot (n = the CTA's steps).
const char* const kTimelineSlots[tl::kTracedSteps] = {"0", "1", "2", "n-3", "n-2", "n-1"};

// Column name of record e (CSV header, summary rows).
std::string timeline_event_name(int e) {
  if (e == tl::kEntry) return "entry";
  if (e == tl::kKvIssued) return "prod_kv_issued";
  if (e < tl::kConsumer) return std::string("prod_q_issued_") + kTimelineSlots[e - tl::kQIssued];
  const int w = (e - tl::kConsumer) / tl::kConsumerEvents;
  const int c = (e - tl::kConsumer) % tl::kConsumerEvents;
  const std::string role = w == 0 ? "wg1_" : "wg2_";
  if (c == tl::kKvFull) return role + "kv_full";
  if (c < tl::kScoresDone) return role + "q_full_" + kTimelineSlots[c - tl::kQFull];
  if (c < tl::kStepEnd) return role + "scores_" + kTimelineSlots[c - tl::kScoresDone];
  if (c < tl::kDrained) return role + "step_end_" + kTimelineSlots[c - tl::kStepEnd];
  if (c == tl::kDrained) return role + "drained";
  if (c == tl::kStagingRead) return role + "staging_read";
  return role + "exit";
}

struct CtaTimeline : harness::timeline::CtaRecords {  // kEvents records
  int64_t cta;
  uint32_t smid;
  int steps;
  // The CTA's end: the later consumer exit.
  int end_event() const {
    const int a = consumer_event(0, tl::kExit), b = consumer_event(1, tl::kExit);
    return !has(b) || (has(a) && clk(a) >= clk(b)) ? a : b;
  }
};

// Warpgroup w's time split per CTA of at least kTracedSteps steps (fewer: the last slots alias
// the first). Step k lasts from step k - 1's end (kv_full for step 0) to its own end;
// "steady" is the mean step of 3 .. n-3 (n - 5 steps), "fixed" what the CTA takes beyond n
// steady steps.
void print_budget(const std::vector<CtaTimeline>& all, int w) {
  const int kv = consumer_event(w, tl::kKvFull), drained = consumer_event(w, tl::kDrained);
  const int read = consumer_event(w, tl::kStagingRead), exit = consumer_event(w, tl::kExit);
  const auto end_of = [&](int slot) { return consumer_event(w, tl::kStepEnd + slot); };
  const int last = end_of(tl::kTracedSteps - 1);
  std::vector<double> head, first3, steady, last2, drain, staging, stores, fixed;
  for (const CtaTimeline& t : all) {
    if (t.steps < tl::kTracedSteps) continue;
    const double step = t.ns(end_of(2), end_of(3)) / (t.steps - 5);
    head.push_back(t.ns(tl::kEntry, kv));
    first3.push_back(t.ns(kv, end_of(2)));
    steady.push_back(step);
    last2.push_back(t.ns(end_of(3), last));
    drain.push_back(t.ns(last, drained));
    if (t.has(read)) {
      staging.push_back(t.ns(drained, read));
      stores.push_back(t.ns(read, exit));
    } else {
      stores.push_back(t.ns(drained, exit));
    }
    fixed.push_back(t.ns(tl::kEntry, exit) - t.steps * step);
  }
  std::printf(" wg%d budget (us: median p10 p90 (CTAs)):\n", w + 1);
  print_spread("entry -> kv_full", head);
  print_spread("steps 0..2 (kv_full -> end of 2)", first3);
  print_spread("steady step (mean of 3..n-3)", steady);
  print_spread("steps n-2, n-1", last2);
  print_spread("last step end -> drained", drain);
  print_spread("drained -> staging read", staging);
  print_spread("-> exit (dK / dV stores issued)", stores);
  print_spread("fixed: entry->exit - n x steady", fixed);
  // Each traced step split into the wait for its Q tile (from the previous step's end; not
  // for n-3, whose previous step is not traced unless n == 6), S^T, and the rest: each column
  // from the one before.
  std::printf("  %-8s %9s %9s %9s %9s   (medians, us)\n", "step", "duration", "-> q_full",
              "-> S^T", "-> end");
  for (int s = 0; s < tl::kTracedSteps; ++s) {
    const int q_full = consumer_event(w, tl::kQFull + s);
    const int scores = consumer_event(w, tl::kScoresDone + s);
    std::vector<double> duration, q_wait, s_wait, rest;
    for (const CtaTimeline& t : all) {
      if (t.steps < tl::kTracedSteps) continue;
      if (s != 3 || t.steps == tl::kTracedSteps) {
        const int prev = s == 0 ? kv : end_of(s - 1);
        duration.push_back(t.ns(prev, end_of(s)));
        q_wait.push_back(t.ns(prev, q_full));
      }
      s_wait.push_back(t.ns(q_full, scores));
      rest.push_back(t.ns(scores, end_of(s)));
    }
    std::printf("  %-8s %9.3f %9.3f %9.3f %9.3f\n", kTimelineSlots[s], spread(duration).p50 * 1e-3,
                spread(q_wait).p50 * 1e-3, spread(s_wait).p50 * 1e-3, spread(rest).p50 * 1e-3);
  }
}

// Writes the raw records, one row per CTA: cta, smid, steps, then (globaltimer ns, clock64)
// per event; 0 = not reached.
bool write_timeline_csv(const char* path, const std::vector<uint64_t>& host, int64_t ctas) {
  return harness::timeline::write_csv(
      path, host, ctas, tl::kEvents, kTimelineUsedEvents, [](int e) {
        return e == tl::kCtaInfo ? std::make_pair(std::string("smid"), std::string("steps"))
                                 : harness::timeline::timer_columns(timeline_event_name(e));
      });
}

// The summary of one recorded launch (host records of `ctas` CTAs). False when no CTA recorded.
bool summarize_timeline(const Case& c, const std::vector<uint64_t>& host, int64_t ctas) {
  std::vector<CtaTimeline> all;
  for (int64_t i = 0; i < ctas; ++i) {
    const uint64_t* rec = host.data() + i * 2 * tl::kEvents;
    CtaTimeline t{{rec}, i, uint32_t(rec[2 * tl::kCtaInfo]), int(rec[2 * tl::kCtaInfo + 1])};
    if (t.has(tl::kEntry) && t.has(t.end_event())) all.push_back(t);
  }
  std::printf("timeline %s: %zu of %ld CTAs recorded\n", c.describe().c_str(), all.size(),
              long(ctas));
  if (all.empty()) return false;

  // Per SM: the clock rate, and the gaps between one CTA's end and the next one's entry.
  std::vector<std::vector<size_t>> by_sm;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].smid >= by_sm.size()) by_sm.resize(all[i].smid + 1);
    by_sm[all[i].smid].push_back(i);
  }
  std::vector<double> rates, gaps, ctas_per_sm, steps;
  uint64_t first_gt = UINT64_MAX, last_gt = 0;
  for (std::vector<size_t>& on_sm : by_sm) {
    if (on_sm.empty()) continue;
    std::sort(on_sm.begin(), on_sm.end(), [&](size_t a, size_t b) {
      return all[a].clk(tl::kEntry) < all[b].clk(tl::kEntry);
    });
    const CtaTimeline &head = all[on_sm.front()], &tail = all[on_sm.back()];
    const int tail_end = tail.end_event();
    const double span_ns = double(tail.gt(tail_end)) - double(head.gt(tl::kEntry));
    const double span_clk = double(tail.clk(tail_end)) - double(head.clk(tl::kEntry));
    const double rate = span_clk / span_ns;
    rates.push_back(rate);
    ctas_per_sm.push_back(double(on_sm.size()));
    for (size_t i : on_sm) all[i].cycles_per_ns = rate;
    for (size_t k = 0; k + 1 < on_sm.size(); ++k) {
      const CtaTimeline &a = all[on_sm[k]], &b = all[on_sm[k + 1]];
      gaps.push_back((double(b.clk(tl::kEntry)) - double(a.clk(a.end_event()))) / rate);
    }
    first_gt = std::min(first_gt, head.gt(tl::kEntry));
    last_gt = std::max(last_gt, tail.gt(tail_end));
  }
  std::vector<uint64_t> stamps;
  for (const CtaTimeline& t : all) {
    steps.push_back(t.steps);
    for (int e = tl::kEntry; e < kTimelineUsedEvents; ++e)
      if (t.has(e)) stamps.push_back(t.gt(e));
  }
  const uint64_t gt_step = harness::timeline::globaltimer_step(stamps);
  const Spread rate = spread(rates);
  std::printf("SMs %zu, CTAs per SM median %.0f, steps per CTA median %.0f; SM clock %.3f GHz "
              "(p10 %.3f, p90 %.3f); globaltimer step >= %lu ns\n",
              rates.size(), spread(ctas_per_sm).p50, spread(steps).p50, rate.p50, rate.p10,
              rate.p90, (unsigned long)gt_step);
  std::printf("main kernel span (globaltimer, first entry to last exit) %.1f us\n",
              (double(last_gt) - double(first_gt)) * 1e-3);

  std::printf(" CTA (us: median p10 p90 (CTAs or gaps)):\n");
  std::vector<double> duration;
  for (const CtaTimeline& t : all) duration.push_back(t.ns(tl::kEntry, t.end_event()));
  print_spread("CTA duration (entry -> last exit)", duration);
  print_spread("SM gap (exit -> next CTA's entry)", gaps);
  std::printf(" since CTA entry (us: median p10 p90 (CTAs); consumer rows wg1 | wg2):\n");
  const auto since_entry = [&](int e) {
    std::vector<double> since;
    for (const CtaTimeline& t : all)
      if (t.has(e)) since.push_back(t.ns(tl::kEntry, e));
    return spread(since);
  };
  for (int e = tl::kKvIssued; e < tl::kConsumer; ++e) {
    const Spread s = since_entry(e);
    std::printf("  %-22s %8.3f %8.3f %8.3f (%zu)\n", timeline_event_name(e).c_str(),
                s.p50 * 1e-3, s.p10 * 1e-3, s.p90 * 1e-3, s.n);
  }
  for (int e = 0; e < tl::kConsumerEvents; ++e) {
    const Spread a = since_entry(consumer_event(0, e)), b = since_entry(consumer_event(1, e));
    if (a.n + b.n == 0) continue;
    std::printf("  %-22s %8.3f %8.3f %8.3f (%zu) | %8.3f %8.3f %8.3f (%zu)\n",
                timeline_event_name(consumer_event(0, e)).substr(4).c_str(), a.p50 * 1e-3,
                a.p10 * 1e-3, a.p90 * 1e-3, a.n, b.p50 * 1e-3, b.p10 * 1e-3, b.p90 * 1e-3, b.n);
  }
  for (int w = 0; w < 2; ++w) print_budget(all, w);
  return true;
}

// Runs grid config c on the default grid with recording, prints the summary and writes the raw
// records to csv_path (null: none).
bool timeline(const Case& c, const char* csv_path) {
  Problem pb(c, 1);
  const int64_t block_keys = c.H > 128 ? 64 : 128;
  const int64_t ctas = (c.S + block_keys - 1) / block_keys * c.K * c.B;
  // Perturbation check: compare ms_stored and ms_read with the default build's harness_v3_bwd
  // --bench-one.
  const harness::timeline::RecordedRun run = harness::timeline::record_run(
      ctas, tl::kEvents, jax_flash::V3BackwardSetTimeline,
      [&] { CUDA_CHECK(pb.launch_v3_split(false, -1)); }, [] {});
  const std::vector<uint64_t>& host = run.records;
  const double ms_stored = run.ms_stored, ms_read = run.ms_read;
  std::printf("backward (pre + main + post, cudaEvent median of 10): %.3f ms stamps stored, "
              "%.3f ms timers read only\n",
              ms_stored, ms_read);
  bool ok = summarize_timeline(c, host, ctas);
  if (csv_path != nullptr) {
    ok &= write_timeline_csv(csv_path, host, ctas);
    std::printf("raw records: %s\n", csv_path);
  }
  return ok;
}
#endif

// The bf16 case of the six arguments after argv[i] (B T N K H causal; S = T), i advanced past
// them.
Case shape_case_from_args(char** argv, int& i) {
  const Case c{DType::kBF16, std::atoll(argv[i + 1]), std::atoll(argv[i + 2]),
               std::atoll(argv[i + 2]), std::atoll(argv[i + 3]), std::atoll(argv[i + 4]),
               std::atoll(argv[i + 5]), std::atoi(argv[i + 6]) != 0};
  i += 6;
  return c;
}

}  // namespace

constexpr const char* kUsage =
    "usage: %s [--settled] [check] [small] [--bench] [--bench-v3] [--bench-one|profile H T causal]\n"
    "       [--bench-gqa] [--bench-gqa-one B T N K H causal]\n"
    "       [--bench-split B T N K H causal]\n"
#ifdef JAX_FLASH_V3_BWD_TIMELINE
    "       [--timeline H T causal [records.csv]]\n"
#endif
    ;

int main(int argc, char** argv) {
  bool ok = true;
  harness::announce_device();
  if (argc < 2) {
    std::fprintf(stderr, kUsage, argv[0]);
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string mode = argv[i];
    if (harness::settled_flag(mode)) {
      continue;
    } else if (mode == "check") {
      uint64_t seed = 1;
      for (const Case& c : check_cases()) ok &= check_case(c, ++seed);
      for (const Case& c : split_cases()) ok &= check_split_case(c, ++seed);
      for (const Case& c : block_parts_cases()) ok &= check_block_parts_case(c, ++seed);
    } else if (mode == "small") {  // for compute-sanitizer
      const DType bf = DType::kBF16;
      ok &= check_case(Case{bf, 2, 150, 200, 4, 2, 128, true}.ragged({150, 100}, {200, 120}), 7);
      ok &= check_case({DType::kF16, 1, 130, 90, 2, 1, 64}, 8);
      ok &= check_case(Case{bf, 2, 150, 200, 4, 2, 256, true}.ragged({150, 100}, {200, 120}), 9);
      // GQA schedule, every split, both modes (kv_seqlens shorter than the keys: skipped rows)
      const Case gqa{bf, 2, 150, 200, 8, 2, 128, true};
      ok &= check_split_case(gqa.ragged({150, 90}, {200, 70}), 10);
      ok &= check_split_case({DType::kF16, 1, 100, 130, 8, 1, 256}, 11);
      ok &= check_block_parts_case(
          Case{bf, 2, 150, 300, 2, 2, 128, true}.ragged({150, 90}, {300, 170}), 12);
    } else if (mode == "--bench" || mode == "bench") {
      ok &= bench(grid_cases(), 10, 0);
    } else if (mode == "--bench-gqa") {
      ok &= bench_gqa(gqa_bench_cases(), 20);
    } else if (mode == "--bench-gqa-one" && i + 6 < argc) {
      ok &= bench_gqa({shape_case_from_args(argv, i)}, 20);
    } else if (mode == "--bench-v3") {  // v2 timed only where it is today's path (H = 256)
      ok &= bench(grid_cases(), 10, 256);
#ifdef JAX_FLASH_V3_BWD_TIMELINE
    } else if (mode == "--timeline" && i + 3 < argc) {
      // One grid config: H T causal, then optionally a path ending in .csv for the records.
      Case c{};
      if (!harness::grid_case_from_args(argv, i, &c)) return 2;
      ok &= timeline(c, harness::csv_path_from_args(argc, argv, i));
#endif
    } else if (mode == "--bench-split" && i + 6 < argc) {
      ok &= bench_block_parts(shape_case_from_args(argv, i), 20);
    } else if ((mode == "--bench-one" || mode == "profile") && i + 3 < argc) {
      // One grid config: H T causal. profile: two plain v3 backward runs (for ncu).
      Case c{};
      if (!harness::grid_case_from_args(argv, i, &c)) return 2;
      const std::vector<Case> cs{c};
      if (mode == "profile") {
        Problem pb(cs[0], 1);
        for (int r = 0; r < 2; ++r) CUDA_CHECK(pb.launch_v3(false));
        CUDA_CHECK(cudaDeviceSynchronize());
      } else {
        ok &= bench(cs, 10, 256);
      }
    } else {
      std::fprintf(stderr, kUsage, argv[0]);
      return 2;
    }
  }
  std::printf("%s\n", ok ? "ALL PASSED" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
