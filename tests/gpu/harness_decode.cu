// Standalone check and benchmark of the split-KV decoding kernels (cuda/decode.cu).
//
//   bash tests/gpu/build_decode.sh    (-> .carry/harness_decode)
//   harness_decode check        small odd cases vs a float64 reference (sanitizer-sized)
//   harness_decode bench        the BENCHMARK.md decode grid (T=1, bf16): correctness vs float64,
//                               then the KV-cache read rate for the automatic split count (per
//                               layout) and the previous rule's count, contiguous and paged (16
//                               and 256 rows a page), next to ceilings measured in the same run:
//                               2 GiB copy / read, and back-to-back reads of each config's bytes
//   harness_decode bench-auto   the same with the automatic split count only
//
// Every output is poisoned (NaN bytes) before a run and every CUDA call is checked; a case
// fails on any NaN, on a relative L2 error over its tolerance, or on a wrong cache byte after
// an in-place append.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../cuda/decode.h"
#include "harness_common.h"

using jax_flash::DecodeArgs;
using jax_flash::DType;
using harness::to_bits;
using harness::to_float;

namespace {

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n = 0) { resize(n); }
  void resize(size_t n) {
    if (ptr) CUDA_CHECK(cudaFree(ptr));
    ptr = nullptr;
    count = n;
    if (n) CUDA_CHECK(cudaMalloc(&ptr, n * sizeof(T)));
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& h) {
    CUDA_CHECK(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(count);
    CUDA_CHECK(cudaMemcpy(h.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void poison() { CUDA_CHECK(cudaMemset(ptr, 0xFF, count * sizeof(T))); }
};

// Deterministic approximately-normal bf16/f16 values on the device (large caches).
__global__ void fill_normal(uint16_t* out, size_t n, uint64_t seed, int is_bf16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 32;
    const float u1 = ((x & 0xFFFFFF) + 1) * (1.f / 16777217.f);
    const float u2 = ((x >> 24) & 0xFFFFFF) * (1.f / 16777216.f);
    const float v = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    if (is_bf16) {
      __nv_bfloat16 b = __float2bfloat16(v);
      out[i] = reinterpret_cast<__nv_bfloat16_raw&>(b).x;
    } else {
      __half h = __float2half(v);
      out[i] = reinterpret_cast<__half_raw&>(h).x;
    }
  }
}

// ---- a decoding problem on the host ------------------------------------------------------

struct Problem {
  std::string name;
  int B = 1, T = 1, N = 8, K = 2, H = 128;
  int capacity = 256;     // rows per sequence (contiguous) or max_pages * page_size
  int page_size = 0;      // 0 = contiguous
  std::vector<int> cache_lens;  // per sequence (may exceed capacity or be negative: clamped)
  std::vector<int> q_lens;      // per sequence valid query rows; empty = all
  bool append = false;
  bool is_causal = true, from_end = true;
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  float scale = 0.f;  // 0 = 1/sqrt(H)
  DType dtype = DType::kBF16;
  int splits = 1;
  bool unused_pages_invalid = false;  // table entries past each sequence's keys are -1
};

struct HostData {
  std::vector<uint16_t> q, k, v, k_new, v_new;
  std::vector<int32_t> table, cache_lens, q_lens;
  int max_pages = 0, num_pages = 0;
};

int page_log2(int page_size) {
  int l = 0;
  while ((1 << l) < page_size) ++l;
  return l;
}

size_t cache_elems(const Problem& p) { return size_t(p.B) * p.capacity * p.K * p.H; }

// Page pool = the contiguous cache's bytes; the block table is a random permutation of pages.
void make_table(const Problem& p, HostData& d, std::mt19937& rng) {
  if (!p.page_size) return;
  d.max_pages = p.capacity / p.page_size;
  d.num_pages = p.B * d.max_pages;
  d.table.resize(d.num_pages);
  std::iota(d.table.begin(), d.table.end(), 0);
  std::shuffle(d.table.begin(), d.table.end(), rng);
}

// Element offset of logical row `pos` of sequence b, kv head h, in the cache.
int64_t host_cache_row(const Problem& p, const HostData& d, int b, int pos, int h) {
  int64_t row;
  if (p.page_size) {
    row = int64_t(d.table[size_t(b) * d.max_pages + pos / p.page_size]) * p.page_size +
          pos % p.page_size;
  } else {
    row = int64_t(b) * p.capacity + pos;
  }
  return (row * p.K + h) * p.H;
}

int clamped_cache_len(const Problem& p, const HostData& d, int b) {
  return std::clamp(d.cache_lens[b], 0, p.capacity);
}

// Float64 attention of one problem, written from the definition (no intervals, no splits).
void reference(const Problem& p, const HostData& d, std::vector<double>& out,
               std::vector<double>& lse) {
  const int G = p.N / p.K;
  const double scale = p.scale ? p.scale : 1.0 / std::sqrt(double(p.H));
  out.assign(size_t(p.B) * p.T * p.N * p.H, 0.0);
  lse.assign(size_t(p.B) * p.N * p.T, -INFINITY);
  auto work = [&](int job) {
    const int b = job / p.N, n = job % p.N, h = n / G;
    const int cache_len = clamped_cache_len(p, d, b);
    const int kv_len = cache_len + (p.append ? p.T : 0);
    const int q_valid = d.q_lens.empty() ? p.T : std::clamp(d.q_lens[b], 0, p.T);
    std::vector<double> x(kv_len);
    for (int t = 0; t < q_valid; ++t) {
      const int64_t qpos = t + (p.from_end ? kv_len - p.T : 0);
      const uint16_t* q = &d.q[((size_t(b) * p.T + t) * p.N + n) * p.H];
      double m = -INFINITY;
      std::vector<int> kept;
      for (int s = 0; s < kv_len; ++s) {
        if (p.is_causal && s > qpos) continue;
        if (p.window_left >= 0 && s < qpos - p.window_left) continue;
        if (p.window_right >= 0 && s > qpos + p.window_right) continue;
        const uint16_t* k = s < cache_len ? &d.k[host_cache_row(p, d, b, s, h)]
                                          : &d.k_new[((size_t(b) * p.T + s - cache_len) * p.K + h) * p.H];
        double dot = 0;
        for (int i = 0; i < p.H; ++i) dot += double(to_float(q[i], p.dtype)) * to_float(k[i], p.dtype);
        double xs = scale * dot;
        if (p.softcap > 0) xs = p.softcap * std::tanh(xs / p.softcap);
        x[s] = xs;
        m = std::max(m, xs);
        kept.push_back(s);
      }
      if (kept.empty()) continue;
      double total = 0;
      for (int s : kept) total += std::exp(x[s] - m);
      double* o = &out[((size_t(b) * p.T + t) * p.N + n) * p.H];
      for (int s : kept) {
        const double w = std::exp(x[s] - m) / total;
        const uint16_t* v = s < cache_len ? &d.v[host_cache_row(p, d, b, s, h)]
                                          : &d.v_new[((size_t(b) * p.T + s - cache_len) * p.K + h) * p.H];
        for (int i = 0; i < p.H; ++i) o[i] += w * to_float(v[i], p.dtype);
      }
      lse[(size_t(b) * p.N + n) * p.T + t] = m + std::log(total);
    }
  };
  const int jobs = p.B * p.N;
  const int workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int j = w; j < jobs; j += workers) work(j);
    });
  for (auto& th : pool) th.join();
}

// Device copies of one problem plus the call arguments.
struct DeviceProblem {
  DeviceBuffer<uint16_t> q, k, v, k_new, v_new, out;
  DeviceBuffer<int32_t> table, cache_lens, q_lens, counters;
  DeviceBuffer<float> lse, partial_out, partial_lse;
  DecodeArgs args;
};

void prepare(const Problem& p, const HostData& d, DeviceProblem& dp, bool upload_cache) {
  if (upload_cache) {
    dp.k.resize(d.k.size());
    dp.v.resize(d.v.size());
    dp.k.upload(d.k);
    dp.v.upload(d.v);
  }
  dp.q.resize(d.q.size());
  dp.q.upload(d.q);
  dp.cache_lens.resize(p.B);
  dp.cache_lens.upload(d.cache_lens);
  if (!d.q_lens.empty()) {
    dp.q_lens.resize(p.B);
    dp.q_lens.upload(d.q_lens);
  }
  if (p.page_size) {
    dp.table.resize(d.table.size());
    dp.table.upload(d.table);
  }
  if (p.append) {
    dp.k_new.resize(d.k_new.size());
    dp.v_new.resize(d.v_new.size());
    dp.k_new.upload(d.k_new);
    dp.v_new.upload(d.v_new);
  }
  dp.out.resize(size_t(p.B) * p.T * p.N * p.H);
  dp.lse.resize(size_t(p.B) * p.N * p.T);
  DecodeArgs& a = dp.args;
  a = DecodeArgs{};
  a.batch = p.B;
  a.q_len = p.T;
  a.num_heads = p.N;
  a.num_kv_heads = p.K;
  a.head_dim = p.H;
  a.dtype = p.dtype;
  a.scale = p.scale ? p.scale : 1.f / std::sqrt(float(p.H));
  a.softcap = p.softcap;
  a.is_causal = p.is_causal;
  a.causal_from_end = p.from_end;
  a.window_left = p.window_left;
  a.window_right = p.window_right;
  a.q = dp.q.ptr;
  a.k = dp.k.ptr;
  a.v = dp.v.ptr;
  a.capacity = p.capacity;
  if (p.page_size) {
    a.block_table = dp.table.ptr;
    a.max_pages = d.max_pages;
    a.page_size_log2 = page_log2(p.page_size);
    a.num_pages = d.num_pages;
  }
  a.cache_seqlens = dp.cache_lens.ptr;
  a.q_seqlens = d.q_lens.empty() ? nullptr : dp.q_lens.ptr;
  a.k_new = p.append ? dp.k_new.ptr : nullptr;
  a.v_new = p.append ? dp.v_new.ptr : nullptr;
  a.out = dp.out.ptr;
  a.lse = dp.lse.ptr;
  a.num_splits = p.splits;
  if (p.splits > 1) {
    dp.partial_out.resize(size_t(p.splits) * p.B * p.T * p.N * p.H);
    dp.partial_lse.resize(size_t(p.splits) * p.B * p.N * p.T);
    a.partial_out = dp.partial_out.ptr;
    a.partial_lse = dp.partial_lse.ptr;
    dp.counters.resize(jax_flash::DecodeCounterCount(a));
    dp.counters.poison();  // LaunchDecode must zero them itself
    a.counters = dp.counters.ptr;
  }
}

struct Errors {
  double max_abs = 0, rel_l2 = 0, lse_max_abs = 0;
  bool nan = false, lse_bad = false;
};

Errors compare(const Problem& p, const std::vector<uint16_t>& out, const std::vector<float>& lse,
               const std::vector<double>& ref_out, const std::vector<double>& ref_lse) {
  Errors e;
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double got = to_float(out[i], p.dtype);
    if (std::isnan(got)) e.nan = true;
    const double diff = std::abs(got - ref_out[i]);
    e.max_abs = std::max(e.max_abs, diff);
    num += diff * diff;
    den += ref_out[i] * ref_out[i];
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) {
      if (!(std::isinf(lse[i]) && lse[i] < 0)) e.lse_bad = true;
      continue;
    }
    if (std::isnan(lse[i])) e.lse_bad = true;
    e.lse_max_abs = std::max(e.lse_max_abs, std::abs(lse[i] - ref_lse[i]));
  }
  return e;
}

// Expected cache after the append, compared bytewise with the device cache.
bool append_is_exact(const Problem& p, const HostData& d, const std::vector<uint16_t>& k_after,
                     const std::vector<uint16_t>& v_after) {
  std::vector<uint16_t> k_want = d.k, v_want = d.v;
  for (int b = 0; b < p.B; ++b) {
    const int cache_len = clamped_cache_len(p, d, b);
    for (int t = 0; t < p.T; ++t) {
      if (cache_len + t >= p.capacity) continue;
      for (int h = 0; h < p.K; ++h) {
        const int64_t dst = host_cache_row(p, d, b, cache_len + t, h);
        const size_t src = ((size_t(b) * p.T + t) * p.K + h) * p.H;
        std::copy_n(&d.k_new[src], p.H, &k_want[dst]);
        std::copy_n(&d.v_new[src], p.H, &v_want[dst]);
      }
    }
  }
  return k_want == k_after && v_want == v_after;
}

HostData random_problem_data(const Problem& p, std::mt19937& rng) {
  HostData d;
  std::normal_distribution<float> normal(0.f, 1.f);
  auto fill = [&](std::vector<uint16_t>& x, size_t n) {
    x.resize(n);
    for (auto& e : x) e = to_bits(normal(rng), p.dtype);
  };
  fill(d.q, size_t(p.B) * p.T * p.N * p.H);
  fill(d.k, cache_elems(p));
  fill(d.v, cache_elems(p));
  if (p.append) {
    fill(d.k_new, size_t(p.B) * p.T * p.K * p.H);
    fill(d.v_new, size_t(p.B) * p.T * p.K * p.H);
  }
  d.cache_lens = p.cache_lens;
  d.q_lens = p.q_lens;
  make_table(p, d, rng);
  if (p.unused_pages_invalid)
    for (int b = 0; b < p.B; ++b) {
      const int used = (clamped_cache_len(p, d, b) + (p.append ? p.T : 0) + p.page_size - 1) /
                       p.page_size;
      for (int j = used; j < d.max_pages; ++j) d.table[size_t(b) * d.max_pages + j] = -1;
    }
  return d;
}

bool run_check(const Problem& p, std::mt19937& rng) {
  const HostData d = random_problem_data(p, rng);
  DeviceProblem dp;
  prepare(p, d, dp, true);
  dp.out.poison();
  dp.lse.poison();
  if (p.splits > 1) {
    dp.partial_out.poison();
    dp.partial_lse.poison();
  }
  CUDA_CHECK(jax_flash::LaunchDecode(dp.args, 0));
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> ref_out, ref_lse;
  reference(p, d, ref_out, ref_lse);
  const Errors e = compare(p, dp.out.download(), dp.lse.download(), ref_out, ref_lse);
  const double tol = p.dtype == DType::kBF16 ? 1.2e-2 : 2e-3;
  bool ok = !e.nan && !e.lse_bad && e.rel_l2 < tol && e.lse_max_abs < 2e-3;
  bool cache_ok = true;
  if (p.append) cache_ok = append_is_exact(p, d, dp.k.download(), dp.v.download());
  ok = ok && cache_ok;
  std::printf("%-44s %s  rel_l2 %.2e  max_abs %.2e  lse_max_abs %.2e%s%s%s\n", p.name.c_str(),
              ok ? "PASS" : "FAIL", e.rel_l2, e.max_abs, e.lse_max_abs, e.nan ? "  NaN!" : "",
              e.lse_bad ? "  bad -inf/NaN lse" : "",
              p.append ? (cache_ok ? "  cache exact" : "  CACHE WRONG") : "");
  return ok;
}

std::vector<Problem> small_cases() {
  std::vector<Problem> cases;
  auto add = [&](Problem p) { cases.push_back(p); };
  Problem p;
  p.name = "T1 GQA4 H128 ragged contiguous";
  p.B = 3; p.T = 1; p.N = 8; p.K = 2; p.H = 128; p.capacity = 1000;
  p.cache_lens = {1000, 17, 1}; p.splits = 3;
  add(p);
  p.name = "  ... same, 1 split"; p.splits = 1; add(p);
  p.name = "  ... same, 40 splits (empty splits)"; p.splits = 40; add(p);
  p.name = "  ... paged 16, shuffled"; p.splits = 3; p.page_size = 16; p.capacity = 1024;
  p.cache_lens = {1000, 97, 1}; add(p);
  p.name = "  ... paged 1 (one row per page)"; p.page_size = 1; p.capacity = 128;
  p.cache_lens = {128, 5, 77}; add(p);
  p.name = "  ... f16 paged 64"; p.dtype = DType::kF16; p.page_size = 64; p.capacity = 1024;
  p.cache_lens = {1000, 97, 1}; add(p);
  p.name = "  ... paged 16, unused table entries -1"; p.dtype = DType::kBF16; p.page_size = 16;
  p.unused_pages_invalid = true; add(p);
  p.name = "  ... paged 256, unused entries -1, T2 window 100"; p.page_size = 256;
  p.capacity = 2048; p.cache_lens = {2000, 300, 1}; p.T = 2; p.window_left = 100; p.splits = 5;
  add(p);
  p = Problem();
  p.name = "T4 GQA4 H64 softcap append ragged";
  p.B = 2; p.T = 4; p.N = 8; p.K = 2; p.H = 64; p.capacity = 600;
  p.cache_lens = {500, 3}; p.append = true; p.softcap = 5.f; p.splits = 4; p.scale = 0.3f;
  add(p);
  p.name = "  ... paged 32 append"; p.page_size = 32; p.capacity = 640; add(p);
  p.name = "  ... append at capacity (dropped rows)"; p.page_size = 0; p.capacity = 502;
  p.cache_lens = {500, 3}; add(p);
  p = Problem();
  p.name = "T3 MHA H256 window_left 50";
  p.B = 2; p.T = 3; p.N = 3; p.K = 3; p.H = 256; p.capacity = 333;
  p.cache_lens = {333, 2}; p.window_left = 50; p.splits = 2;
  add(p);
  p = Problem();
  p.name = "T5 GQA8 H128 (40 rows, 2 row tiles)";
  p.B = 2; p.T = 5; p.N = 16; p.K = 2; p.H = 128; p.capacity = 300;
  p.cache_lens = {300, 129}; p.splits = 5; p.append = true; p.capacity = 305;
  add(p);
  p = Problem();
  p.name = "T9 GQA8 H64 (72 rows, 2 row blocks)";
  p.B = 1; p.T = 9; p.N = 8; p.K = 1; p.H = 64; p.capacity = 200;
  p.cache_lens = {200}; p.splits = 2;
  add(p);
  p = Problem();
  p.name = "standard: top-left causal, q_seqlens, window";
  p.B = 3; p.T = 6; p.N = 4; p.K = 2; p.H = 128; p.capacity = 97;
  p.cache_lens = {97, 40, 0}; p.q_lens = {6, 2, 6}; p.from_end = false; p.window_left = 3;
  p.window_right = 1; p.splits = 2;
  add(p);
  p.name = "  ... non-causal, no window"; p.is_causal = false; p.window_left = -1;
  p.window_right = -1; add(p);
  p = Problem();
  p.name = "decode with cache_len < T (rows see nothing)";
  p.B = 2; p.T = 4; p.N = 2; p.K = 1; p.H = 64; p.capacity = 64;
  p.cache_lens = {2, -5}; p.splits = 2;
  add(p);
  return cases;
}

// ---- benchmark ---------------------------------------------------------------------------

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Milliseconds per call: `iters` back-to-back launches between two events, median of `reps`.
template <typename F>
float time_ms(F&& launch, int iters, int reps) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch(i);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> samples;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaEventRecord(start));
    for (int i = 0; i < iters; ++i) launch(i);
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    samples.push_back(ms / iters);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  return median(samples);
}

__global__ void read_unrolled(const uint4* src, size_t n, unsigned* sink) {
  uint32_t x = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 v0 = __ldcs(src + i), v1 = __ldcs(src + i + stride);
    const uint4 v2 = __ldcs(src + i + 2 * stride), v3 = __ldcs(src + i + 3 * stride);
    x ^= v0.x ^ v1.y ^ v2.z ^ v3.w ^ v0.w ^ v1.x ^ v2.y ^ v3.z;
  }
  for (; i < n; i += stride) x ^= __ldcs(src + i).x;
  if (x == 0x12345678u) sink[0] = x;
}

__global__ void empty_kernel() {}

// What one launch of this size can reach: back-to-back reads of exactly `bytes` (rotated over
// buffers past L2), launch gaps included like the decode timings, and the back-to-back launch
// periods of an empty kernel and of the 32-byte memset LaunchDecode enqueues. Returns the read
// rate in TB/s.
double floors(int sms, size_t bytes) {
  DeviceBuffer<int32_t> small(8);
  DeviceBuffer<unsigned> sink(1);
  const int copies = std::max<int>(1, int((size_t(600) << 20) / bytes + 1));
  std::vector<DeviceBuffer<uint8_t>> bufs(copies);
  for (auto& b : bufs) {
    b.resize(bytes);
    CUDA_CHECK(cudaMemset(b.ptr, 1, bytes));
  }
  const float ms = time_ms([&](int i) {
    read_unrolled<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(bufs[i % copies].ptr),
                                    bytes / 16, sink.ptr);
    CUDA_CHECK(cudaGetLastError());
  }, std::max(20, int(2e-3 / (bytes / 4.3e12))), 9);
  const double rate = bytes / (ms * 1e-3) / 1e12;
  const float empty = time_ms([&](int) { empty_kernel<<<1, 32>>>(); }, 200, 9);
  const float memset = time_ms([&](int) { CUDA_CHECK(cudaMemsetAsync(small.ptr, 0, 32)); }, 200, 9);
  std::printf("FLOOR read %5.0f MB back-to-back: %7.2f us  %.3f TB/s   (launch periods: empty "
              "kernel %.2f us, 32-byte memset %.2f us)\n",
              bytes / 1e6, ms * 1e3, rate, empty * 1e3, memset * 1e3);
  return rate;
}

__global__ void read_all(const uint4* src, size_t n, unsigned* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345678u) sink[0] = x;  // keeps the loads
}

double ceilings(int sms) {
  const size_t bytes = size_t(2) << 30;
  DeviceBuffer<uint8_t> a(bytes), b(bytes);
  CUDA_CHECK(cudaMemset(a.ptr, 1, bytes));
  DeviceBuffer<unsigned> sink(1);
  const float copy = time_ms([&](int) {
    CUDA_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice));
  }, 5, 5);
  const float read = time_ms([&](int) {
    read_all<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(a.ptr), bytes / 16, sink.ptr);
    CUDA_CHECK(cudaGetLastError());
  }, 5, 5);
  const float unrolled = time_ms([&](int) {
    read_unrolled<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(a.ptr), bytes / 16, sink.ptr);
    CUDA_CHECK(cudaGetLastError());
  }, 5, 5);
  std::printf("CEILING copy (read+write) %.3f TB/s   read-only kernels %.3f / %.3f TB/s   (2 GiB)\n",
              2.0 * bytes / (copy * 1e-3) / 1e12, bytes / (read * 1e-3) / 1e12,
              bytes / (unrolled * 1e-3) / 1e12);
  return bytes / (std::min(read, unrolled) * 1e-3) / 1e12;
}

struct BenchConfig {
  int B, N, K, S, H;
  std::vector<int> other_splits;  // measured next to the automatic choice
};

struct BenchRow {
  std::string config;
  int splits[3] = {0, 0, 0};  // per layout (the automatic count depends on the page size)
  bool automatic = false;
  double floor = 0;  // back-to-back read of the same bytes, TB/s
  double tbps[3] = {0, 0, 0};  // contiguous, paged 256, paged 16
  double us[3] = {0, 0, 0};
};

bool bench_config(const BenchConfig& c, bool auto_only, int sms, std::vector<BenchRow>& table) {
  Problem p;
  p.B = c.B; p.T = 1; p.N = c.N; p.K = c.K; p.H = c.H; p.capacity = c.S;
  p.cache_lens.assign(c.B, c.S);
  const size_t elems = cache_elems(p);
  const double kv_bytes = 2.0 * elems * 2;
  // Rotate over enough cache copies that one pass is well past the 60 MB L2.
  const int copies = std::max(1, int(std::ceil(512e6 / kv_bytes)));
  std::vector<DeviceBuffer<uint16_t>> ks(copies), vs(copies);
  for (int i = 0; i < copies; ++i) {
    ks[i].resize(elems);
    vs[i].resize(elems);
    fill_normal<<<sms * 16, 256>>>(ks[i].ptr, elems, 1000 + 2 * i, 1);
    fill_normal<<<sms * 16, 256>>>(vs[i].ptr, elems, 1001 + 2 * i, 1);
    CUDA_CHECK(cudaGetLastError());
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  std::mt19937 rng(c.B * 7 + c.S);
  HostData d;
  d.k = ks[0].download();
  d.v = vs[0].download();
  std::normal_distribution<float> normal(0.f, 1.f);
  d.q.resize(size_t(p.B) * p.N * p.H);
  for (auto& e : d.q) e = to_bits(normal(rng), p.dtype);
  d.cache_lens = p.cache_lens;

  const double floor = floors(sms, size_t(kv_bytes));
  const int page_sizes[3] = {0, 256, 16};
  char name[96];
  std::snprintf(name, sizeof name, "B=%-2d N=%d K=%-2d S=%-6d H=%d", c.B, c.N, c.K, c.S, c.H);
  std::vector<BenchRow> rows(1);
  rows[0].automatic = true;
  if (!auto_only)
    for (int s : c.other_splits) {
      rows.emplace_back();
      for (int& n : rows.back().splits) n = s;
    }
  for (BenchRow& row : rows) {
    row.config = name;
    row.floor = floor;
  }

  std::vector<double> ref_out, ref_lse;
  bool all_ok = true;
  for (int layout = 0; layout < 3; ++layout) {
    Problem pp = p;
    pp.page_size = page_sizes[layout];
    HostData dd = d;
    make_table(pp, dd, rng);
    {
      DeviceProblem probe;
      prepare(pp, dd, probe, false);
      CUDA_CHECK(jax_flash::DecodeAutoSplits(probe.args, c.S, 1 << 16, &rows[0].splits[layout]));
    }
    reference(pp, dd, ref_out, ref_lse);
    for (BenchRow& row : rows) {
      pp.splits = row.splits[layout];
      pp.name = "bench";
      DeviceProblem dp;
      prepare(pp, dd, dp, false);
      dp.args.k = ks[0].ptr;
      dp.args.v = vs[0].ptr;
      dp.out.poison();
      dp.lse.poison();
      CUDA_CHECK(jax_flash::LaunchDecode(dp.args, 0));
      CUDA_CHECK(cudaDeviceSynchronize());
      const Errors e = compare(pp, dp.out.download(), dp.lse.download(), ref_out, ref_lse);
      const bool ok = !e.nan && !e.lse_bad && e.rel_l2 < 1.2e-2 && e.lse_max_abs < 2e-3;
      all_ok = all_ok && ok;
      const int iters = std::max(20, int(2e-3 / (kv_bytes / 4.3e12)));
      const float ms = time_ms([&](int i) {
        DecodeArgs a = dp.args;
        a.k = ks[i % copies].ptr;
        a.v = vs[i % copies].ptr;
        CUDA_CHECK(jax_flash::LaunchDecode(a, 0));
      }, iters, 9);
      row.us[layout] = ms * 1e3;
      row.tbps[layout] = kv_bytes / (ms * 1e-3) / 1e12;
      std::printf("BENCH %s %-10s splits=%-3d%s %8.2f us  %.3f TB/s   rel_l2 %.1e lse_err %.1e %s\n",
                  name, layout ? ("paged" + std::to_string(page_sizes[layout])).c_str() : "contiguous",
                  row.splits[layout], row.automatic ? "(auto)" : "      ", ms * 1e3, row.tbps[layout],
                  e.rel_l2, e.lse_max_abs, ok ? "ok" : "FAIL");
      std::fflush(stdout);
    }
  }
  table.insert(table.end(), rows.begin(), rows.end());
  return all_ok;
}

// Paged costs are against the automatic contiguous row of the same config.
void print_table(const std::vector<BenchRow>& table, double read_ceiling) {
  std::printf("\n| config | splits (contiguous/256/16) | contiguous | %% of read ceiling %.2f | "
              "same-size read | paged 256 | paged 16 | paged cost (256 / 16) |\n", read_ceiling);
  std::printf("|---|---|---|---|---|---|---|---|\n");
  const BenchRow* base = nullptr;
  for (const BenchRow& r : table) {
    if (r.automatic) base = &r;
    std::printf("| %s | %d/%d/%d%s | %.2f TB/s (%.1f us) | %.0f%% | %.2f TB/s | %.2f TB/s | "
                "%.2f TB/s | %+.1f%% / %+.1f%% |\n",
                r.config.c_str(), r.splits[0], r.splits[1], r.splits[2],
                r.automatic ? " auto" : "", r.tbps[0], r.us[0], 100.0 * r.tbps[0] / read_ceiling,
                r.floor, r.tbps[1], r.tbps[2], 100.0 * (r.us[1] / base->us[0] - 1),
                100.0 * (r.us[2] / base->us[0] - 1));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("device %s, %d SMs\n", prop.name, sms);
  bool ok = true;
  if (mode == "check") {
    std::mt19937 rng(12345);
    for (const Problem& p : small_cases()) ok = run_check(p, rng) && ok;
  } else if (mode == "bench" || mode == "bench-auto") {
    // Next to the automatic count: what the previous rule (every block slot filled) picked.
    const BenchConfig configs[] = {{1, 32, 8, 32768, 128, {33}},
                                   {8, 32, 8, 32768, 128, {4}},
                                   {1, 32, 8, 131072, 128, {33}},
                                   {16, 32, 32, 8192, 128, {2}}};
    double ceiling = ceilings(sms);
    std::vector<BenchRow> table;
    for (const BenchConfig& c : configs) ok = bench_config(c, mode == "bench-auto", sms, table) && ok;
    ceiling = std::max(ceiling, ceilings(sms));
    print_table(table, ceiling);
  } else {
    std::fprintf(stderr, "usage: %s check | bench | bench-auto\n", argv[0]);
    return 2;
  }
  std::printf("%s\n", ok ? "ALL PASS" : "SOME FAILED");
  return ok ? 0 : 1;
}
