// The problem description and timing shared by the v3 harnesses (harness_v3.cu: forward,
// harness_v3_bwd.cu: backward): one attention case, its ForwardArgs, the benchmark grid of
// ../shared/BENCHMARK.md, and event timing.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "harness_common.h"

namespace harness {

struct V3Case {
  jax_flash::DType dtype;
  int64_t B, T, S, N, K, H;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  std::vector<int32_t> q_seqlens, kv_seqlens;  // empty: not passed

  // This case with a sliding window (-1: unbounded on that side), a softcap, or per-batch
  // lengths: the check lists build their cases with these.
  V3Case window(int left, int right) const {
    V3Case c = *this;
    c.window_left = left;
    c.window_right = right;
    return c;
  }
  V3Case capped(float cap) const {
    V3Case c = *this;
    c.softcap = cap;
    return c;
  }
  V3Case ragged(std::vector<int32_t> q_lens, std::vector<int32_t> kv_lens) const {
    V3Case c = *this;
    c.q_seqlens = std::move(q_lens);
    c.kv_seqlens = std::move(kv_lens);
    return c;
  }

  std::string describe() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s B=%ld T=%ld S=%ld N=%ld K=%ld H=%ld%s win=(%d,%d)%s%s",
                  dtype == jax_flash::DType::kBF16 ? "bf16" : "f16", long(B), long(T), long(S),
                  long(N), long(K), long(H), causal ? " causal" : "", window_left, window_right,
                  softcap > 0 ? " softcap" : "", q_seqlens.empty() ? "" : " varlen");
    return buf;
  }
  // BENCHMARK.md's count: 4·B·N·T·S·H, halved when causal (T == S).
  double forward_flops() const {
    return 4.0 * B * N * T * S * H * (causal && T == S ? 0.5 : 1.0);
  }
  float scale() const { return float(1.0 / std::sqrt(double(H))); }

  // The forward's arguments over these device buffers (seqlens may be null: full lengths).
  jax_flash::ForwardArgs forward_args(const void* q, const void* k, const void* v,
                                      const int32_t* q_lens, const int32_t* kv_lens, void* out,
                                      float* lse) const {
    jax_flash::ForwardArgs a;
    a.shape = {B, T, S, N, K, H};
    a.spec.scale = scale();
    a.spec.softcap = softcap;
    a.spec.is_causal = causal;
    a.spec.window_left = window_left;
    a.spec.window_right = window_right;
    a.dtype = dtype;
    a.q = q;
    a.k = k;
    a.v = v;
    a.q_seqlens = q_lens;
    a.kv_seqlens = kv_lens;
    a.out = out;
    a.lse = lse;
    return a;
  }
};

// BENCHMARK.md's grid: bf16, H in {64, 128, 256} x T = S in {1024, 4096, 16384} x causal,
// B·T = 16384, N·H = 2048.
inline std::vector<V3Case> grid_cases() {
  std::vector<V3Case> cases;
  for (int64_t h : {64, 128, 256})
    for (int64_t t : {1024, 4096, 16384})
      for (bool causal : {false, true}) {
        const int64_t n = 2048 / h, b = 16384 / t;
        cases.push_back({jax_flash::DType::kBF16, b, t, t, n, n, h, causal});
      }
  return cases;
}

// The grid config named by the three arguments after argv[i] (H, T, causal), i advanced past
// them; false, with a message, when the grid has no such config.
inline bool grid_case_from_args(char** argv, int& i, V3Case* out) {
  const int64_t h = std::atoll(argv[i + 1]), t = std::atoll(argv[i + 2]);
  const bool causal = std::atoi(argv[i + 3]) != 0;
  i += 3;
  for (const V3Case& g : grid_cases())
    if (g.H == h && g.T == t && g.causal == causal) {
      *out = g;
      return true;
    }
  std::fprintf(stderr, "no grid config H=%ld T=%ld causal=%d\n", long(h), long(t), causal);
  return false;
}

// The argument after argv[i] when it is a path ending in .csv (i advanced past it), else null.
inline const char* csv_path_from_args(int argc, char** argv, int& i) {
  if (i + 1 >= argc) return nullptr;
  const std::string next = argv[i + 1];
  if (next.size() <= 4 || next.compare(next.size() - 4, 4, ".csv") != 0) return nullptr;
  return argv[++i];
}

// How median_event_ms times (set once, from the harness's --settled flag):
//   kEachLaunch: a few warm-up launches, then every launch between its own pair of events. The
//     card is mostly idle before, so it runs at boost clocks.
//   kSettled: first ~0.4 s of back-to-back launches, then every repeat times ~0.1 s of
//     back-to-back launches between one pair of events (per call: the span / launches), as the
//     library bench's settled loop does (../shared/BENCHMARK.md). The H200 then runs at its
//     700 W cap, where a kernel that draws more power per FLOP is clocked lower: a head dim 64
//     tile won 4% with kEachLaunch and lost 5% in the bench (docs/perf-notes-v3.md, "two CTAs
//     per SM"), so A/Bs of changes that shift work between units should be read settled too.
enum class Timing { kEachLaunch, kSettled };
inline Timing& timing() {
  static Timing t = Timing::kEachLaunch;
  return t;
}

// Milliseconds per call of `launch`: the median over reps (see Timing for what one rep is).
inline double median_event_ms(const std::function<void()>& launch, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) launch();
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CUDA_CHECK(cudaEventCreate(&e));
  int calls = 1;  // launches per rep
  if (timing() == Timing::kSettled) {
    CUDA_CHECK(cudaEventRecord(ev[0], 0));
    launch();
    CUDA_CHECK(cudaEventRecord(ev[1], 0));
    CUDA_CHECK(cudaEventSynchronize(ev[1]));
    float one_ms;
    CUDA_CHECK(cudaEventElapsedTime(&one_ms, ev[0], ev[1]));
    const auto launches_for = [&](double ms) {
      return int(std::clamp(std::ceil(ms / std::max(one_ms, 1e-3f)), 1.0, 100000.0));
    };
    for (int i = launches_for(400.0); i > 0; --i) launch();
    calls = launches_for(100.0);
  }
  for (int i = 0; i < reps; ++i) {
    CUDA_CHECK(cudaEventRecord(ev[2 * i], 0));
    for (int c = 0; c < calls; ++c) launch();
    CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], 0));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> ms(reps);
  for (int i = 0; i < reps; ++i) {
    float m;
    CUDA_CHECK(cudaEventElapsedTime(&m, ev[2 * i], ev[2 * i + 1]));
    ms[i] = m / calls;
  }
  for (auto& e : ev) CUDA_CHECK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

// Consumes a leading --settled flag (argv[i]): true when it was one.
inline bool settled_flag(const std::string& arg) {
  if (arg != "--settled") return false;
  timing() = Timing::kSettled;
  return true;
}

}  // namespace harness
