// Standalone check and benchmark of the v1 / v2 CUDA schedules (forward and backward) against a
// float64 CPU reference, without Python. Fresh random inputs per case, outputs and workspaces
// poisoned with NaN before every launch, every CUDA call checked.
//
//   harness_v1v2            all correctness cases (exit code 1 on any failure)
//   harness_v1v2 --quick    a few small cases (for compute-sanitizer)
//   harness_v1v2 --bench    the benchmark grid's H=128 rows: TFLOP/s of v1 and v2, forward and
//                           forward+backward (BENCHMARK.md counting), outputs spot-checked
//   --head-dim H            --bench / --tune / --profile on the grid's rows of head dim H
//                           (64, 128, 256)
//   harness_v1v2 --profile  one v2 forward + backward at H=128, T=4096 (for ncu)
//   --seed N                replay a seed (printed at start)
//
// Build: bash tests/gpu/build_v1v2.sh (nvcc -O3 -std=c++17 -gencode=arch=compute_80,code=sm_80
//        -gencode=arch=compute_80,code=sm_90, static cudart) -> .carry/harness_v1v2
//
// Tuning build (TUNE=1 bash tests/gpu/build_v1v2.sh: -DJAX_FLASH_TUNE, with cuda/v1.cu only;
// v2.cu and backward.cu are included here to instantiate other tile shapes) adds
//   harness_v1v2 --tune     --bench, and on each row alternative v2 tile shapes (tune_row)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../../cuda/v1v2.h"
#include "harness_common.h"
#ifdef JAX_FLASH_TUNE
#include "../../cuda/backward.cu"
#include "../../cuda/v2.cu"
#endif

using jax_flash::AttentionShape;
using jax_flash::BackwardArgs;
using jax_flash::BackwardWorkspace;
using jax_flash::DType;
using jax_flash::ForwardArgs;
using harness::to_bits;
using harness::parallel_for;
using harness::to_float;

namespace {

// ---------------------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------------------

struct Case {
  int b, t, s, n, k, h;
  DType dtype = DType::kBF16;
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  float scale = 0.f;        // 0: 1/sqrt(h)
  std::string bias;         // "" or a pattern over "bnts" with '1' for broadcast dims
  std::string mask;         // same; keep probability mask_keep
  float mask_keep = 0.7f;
  bool seqlens = false;     // random per-batch lengths, including 0 and full

  float softmax_scale() const { return scale != 0.f ? scale : 1.f / std::sqrt(float(h)); }
  std::string name() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "B%dT%dS%dN%dK%dH%d-%s", b, t, s, n, k, h,
                  dtype == DType::kBF16 ? "bf16" : "f16");
    std::string out = buf;
    if (causal) out += "-causal";
    if (window_left >= 0 || window_right >= 0)
      out += "-win" + std::to_string(window_left) + "," + std::to_string(window_right);
    if (softcap > 0) out += "-softcap" + std::to_string(int(softcap));
    if (scale != 0) out += "-scale" + std::to_string(scale).substr(0, 5);
    if (!bias.empty()) out += "-bias" + bias;
    if (!mask.empty()) out += "-mask" + mask;
    if (seqlens) out += "-seqlens";
    return out;
  }
};

// Dims of a broadcast pattern like "1nts" for this case.
std::vector<int64_t> pattern_dims(const Case& c, const std::string& p) {
  const int64_t full[4] = {c.b, c.n, c.t, c.s};
  std::vector<int64_t> d(4);
  for (int i = 0; i < 4; ++i) d[i] = p[i] == '1' ? 1 : full[i];
  return d;
}

// ---------------------------------------------------------------------------------------------
// Host data and the float64 reference
// ---------------------------------------------------------------------------------------------

struct Tensor16 {  // a 16-bit tensor with its float values (exactly the rounded ones)
  std::vector<uint16_t> bits;
  std::vector<float> val;
};

// Chunks of 2^20 elements draw from generators seeded by `rng`, in parallel (the benchmark
// rows hold 2^25 elements per tensor).
Tensor16 random_tensor(size_t count, DType dt, std::mt19937_64& rng) {
  constexpr size_t kChunk = size_t(1) << 20;
  const uint64_t seed = rng();
  Tensor16 x;
  x.bits.resize(count);
  x.val.resize(count);
  parallel_for((count + kChunk - 1) / kChunk, [&](size_t chunk) {
    std::mt19937_64 gen(seed + chunk);
    std::normal_distribution<float> normal;
    for (size_t i = chunk * kChunk; i < std::min(count, (chunk + 1) * kChunk); ++i) {
      x.bits[i] = to_bits(normal(gen), dt);
      x.val[i] = to_float(x.bits[i], dt);
    }
  });
  return x;
}

struct Problem {
  Case c;
  Tensor16 q, k, v, dout;
  std::vector<float> bias;
  std::vector<uint8_t> mask;
  std::vector<int64_t> bias_dims, mask_dims;
  std::vector<int32_t> q_lens, kv_lens;
};

Problem make_problem(const Case& c, std::mt19937_64& rng) {
  Problem p;
  p.c = c;
  const size_t nq = size_t(c.b) * c.t * c.n * c.h, nk = size_t(c.b) * c.s * c.k * c.h;
  p.q = random_tensor(nq, c.dtype, rng);
  p.k = random_tensor(nk, c.dtype, rng);
  p.v = random_tensor(nk, c.dtype, rng);
  p.dout = random_tensor(nq, c.dtype, rng);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform;
  p.bias_dims = c.bias.empty() ? std::vector<int64_t>{1, 1, 1, 1} : pattern_dims(c, c.bias);
  p.mask_dims = c.mask.empty() ? std::vector<int64_t>{1, 1, 1, 1} : pattern_dims(c, c.mask);
  p.bias.resize(p.bias_dims[0] * p.bias_dims[1] * p.bias_dims[2] * p.bias_dims[3]);
  for (float& x : p.bias) x = c.bias.empty() ? 0.f : normal(rng);
  p.mask.resize(p.mask_dims[0] * p.mask_dims[1] * p.mask_dims[2] * p.mask_dims[3]);
  for (uint8_t& x : p.mask) x = c.mask.empty() ? 1 : uniform(rng) < c.mask_keep;
  p.q_lens.assign(c.b, c.t);
  p.kv_lens.assign(c.b, c.s);
  if (c.seqlens) {
    for (int b = 0; b < c.b; ++b) {
      p.q_lens[b] = std::uniform_int_distribution<int>(0, c.t)(rng);
      p.kv_lens[b] = std::uniform_int_distribution<int>(0, c.s)(rng);
    }
    // Always cover the edges: an empty key set, and full lengths.
    p.kv_lens[0] = 0;
    if (c.b > 1) p.q_lens[1] = c.t, p.kv_lens[1] = c.s;
  }
  return p;
}

int64_t broadcast_index(const std::vector<int64_t>& d, int b, int n, int t, int s) {
  const int64_t bb = d[0] == 1 ? 0 : b, nn = d[1] == 1 ? 0 : n, tt = d[2] == 1 ? 0 : t,
                ss = d[3] == 1 ? 0 : s;
  return ((bb * d[1] + nn) * d[2] + tt) * d[3] + ss;
}

struct ScoreRef {
  bool kept;
  double x;           // natural-log score
  double saturation;  // softcap's tanh (0 when off)
};

ScoreRef ref_score(const Problem& p, int b, int n, int t, int s) {
  const Case& c = p.c;
  const int kv = n / (c.n / c.k);
  bool kept = t < p.q_lens[b] && s < p.kv_lens[b];
  if (c.causal) kept = kept && s <= t;
  if (c.window_left >= 0) kept = kept && s >= t - c.window_left;
  if (c.window_right >= 0) kept = kept && s <= t + c.window_right;
  if (!c.mask.empty()) kept = kept && p.mask[broadcast_index(p.mask_dims, b, n, t, s)];
  if (!kept) return {false, 0, 0};
  const float* q = &p.q.val[((size_t(b) * c.t + t) * c.n + n) * c.h];
  const float* k = &p.k.val[((size_t(b) * c.s + s) * c.k + kv) * c.h];
  double dot = 0;
  for (int i = 0; i < c.h; ++i) dot += double(q[i]) * k[i];
  double x = dot * c.softmax_scale(), sat = 0;
  if (c.softcap > 0) {
    sat = std::tanh(x / c.softcap);
    x = c.softcap * sat;
  }
  if (!c.bias.empty()) x += p.bias[broadcast_index(p.bias_dims, b, n, t, s)];
  return {true, x, sat};
}

struct RowRef {
  double lse;                // -inf when no key is kept
  std::vector<double> out;   // [h]
};

RowRef ref_row(const Problem& p, int b, int n, int t) {
  const Case& c = p.c;
  const int kv = n / (c.n / c.k);
  std::vector<double> x(c.s);
  std::vector<char> kept(c.s);
  double mx = -INFINITY;
  for (int s = 0; s < c.s; ++s) {
    ScoreRef r = ref_score(p, b, n, t, s);
    kept[s] = r.kept;
    x[s] = r.x;
    if (r.kept) mx = std::max(mx, r.x);
  }
  RowRef row{-INFINITY, std::vector<double>(c.h, 0.0)};
  if (mx == -INFINITY) return row;
  double sum = 0;
  for (int s = 0; s < c.s; ++s)
    if (kept[s]) sum += std::exp(x[s] - mx);
  row.lse = mx + std::log(sum);
  for (int s = 0; s < c.s; ++s) {
    if (!kept[s]) continue;
    const double w = std::exp(x[s] - row.lse);
    const float* v = &p.v.val[((size_t(b) * c.s + s) * c.k + kv) * c.h];
    for (int i = 0; i < c.h; ++i) row.out[i] += w * v[i];
  }
  return row;
}

struct ForwardRef {
  std::vector<double> out, lse;  // [B,T,N,H], [B,N,T]
};

ForwardRef ref_forward(const Problem& p) {
  const Case& c = p.c;
  ForwardRef r;
  r.out.assign(size_t(c.b) * c.t * c.n * c.h, 0.0);
  r.lse.assign(size_t(c.b) * c.n * c.t, 0.0);
  parallel_for(c.b * c.n * c.t, [&](int i) {
    const int t = i % c.t, n = i / c.t % c.n, b = i / (c.t * c.n);
    RowRef row = ref_row(p, b, n, t);
    r.lse[(size_t(b) * c.n + n) * c.t + t] = row.lse;
    std::copy(row.out.begin(), row.out.end(), &r.out[((size_t(b) * c.t + t) * c.n + n) * c.h]);
  });
  return r;
}

struct BackwardRef {
  std::vector<double> dq, dk, dv, dbias;
};

BackwardRef ref_backward(const Problem& p, const ForwardRef& f) {
  const Case& c = p.c;
  const int group = c.n / c.k;
  BackwardRef r;
  r.dq.assign(size_t(c.b) * c.t * c.n * c.h, 0.0);
  r.dk.assign(size_t(c.b) * c.s * c.k * c.h, 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  if (!c.bias.empty()) r.dbias.assign(size_t(c.b) * c.n * c.t * c.s, 0.0);
  const double scale = c.softmax_scale();
  // One task per (batch, kv head): it owns that head's dk, dv and its query heads' dq.
  parallel_for(c.b * c.k, [&](int task) {
    const int b = task / c.k, kv = task % c.k;
    for (int n = kv * group; n < (kv + 1) * group; ++n)
      for (int t = 0; t < c.t; ++t) {
        const double lse = f.lse[(size_t(b) * c.n + n) * c.t + t];
        if (lse == -INFINITY) continue;
        const size_t qrow = ((size_t(b) * c.t + t) * c.n + n) * c.h;
        const float* dout = &p.dout.val[qrow];
        double d = 0;
        for (int i = 0; i < c.h; ++i) d += dout[i] * f.out[qrow + i];
        for (int s = 0; s < c.s; ++s) {
          ScoreRef sc = ref_score(p, b, n, t, s);
          if (!sc.kept) continue;
          const double prob = std::exp(sc.x - lse);
          const size_t krow = ((size_t(b) * c.s + s) * c.k + kv) * c.h;
          double dp = 0;
          for (int i = 0; i < c.h; ++i) dp += double(dout[i]) * p.v.val[krow + i];
          const double ds = prob * (dp - d);
          if (!c.bias.empty()) r.dbias[((size_t(b) * c.n + n) * c.t + t) * c.s + s] = ds;
          const double ds_qk = ds * (1 - sc.saturation * sc.saturation) * scale;
          for (int i = 0; i < c.h; ++i) {
            r.dv[krow + i] += prob * dout[i];
            r.dq[qrow + i] += ds_qk * p.k.val[krow + i];
            r.dk[krow + i] += ds_qk * p.q.val[qrow + i];
          }
        }
      }
  });
  return r;
}

// ---------------------------------------------------------------------------------------------
// Device side
// ---------------------------------------------------------------------------------------------

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n) : count(std::max<size_t>(n, 1)) {
    CUDA_CHECK(cudaMalloc(&ptr, count * sizeof(T)));
  }
  DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    CUDA_CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  void poison() { CUDA_CHECK(cudaMemset(ptr, 0xFF, count * sizeof(T))); }  // NaN in every type
  std::vector<T> download() const {
    std::vector<T> host(count);
    CUDA_CHECK(cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

struct Device {
  DeviceBuffer<uint16_t> q, k, v, dout, out, dq, dk, dv;
  DeviceBuffer<float> bias, lse, dbias, o_accum, dq_accum, dsum;
  DeviceBuffer<uint8_t> mask;
  DeviceBuffer<int32_t> q_lens, kv_lens;

  explicit Device(const Problem& p)
      : q(p.q.bits), k(p.k.bits), v(p.v.bits), dout(p.dout.bits), out(p.q.bits.size()),
        dq(p.q.bits.size()), dk(p.k.bits.size()), dv(p.k.bits.size()), bias(p.bias),
        lse(size_t(p.c.b) * p.c.n * p.c.t),
        dbias(p.c.bias.empty() ? 1 : size_t(p.c.b) * p.c.n * p.c.t * p.c.s),
        o_accum(p.q.bits.size()),
        dq_accum(jax_flash::backward_dq_accum_elements({p.c.b, p.c.t, p.c.s, p.c.n, p.c.k, p.c.h})),
        dsum(size_t(p.c.b) * p.c.n * p.c.t),
        mask(p.mask), q_lens(p.q_lens), kv_lens(p.kv_lens) {}

  ForwardArgs forward_args(const Problem& p) {
    const Case& c = p.c;
    ForwardArgs a;
    a.shape = AttentionShape{c.b, c.t, c.s, c.n, c.k, c.h};
    a.spec.scale = c.softmax_scale();
    a.spec.softcap = c.softcap;
    a.spec.is_causal = c.causal;
    a.spec.window_left = c.window_left;
    a.spec.window_right = c.window_right;
    a.dtype = c.dtype;
    a.q = q.ptr, a.k = k.ptr, a.v = v.ptr;
    const auto strides = [](const std::vector<int64_t>& d, auto& x) {
      int64_t running = 1;
      int64_t st[4];
      for (int i = 3; i >= 0; --i) st[i] = d[i] == 1 ? 0 : running, running *= d[i];
      x.stride_b = st[0], x.stride_n = st[1], x.stride_t = st[2], x.stride_s = st[3];
    };
    if (!c.bias.empty()) a.bias.data = bias.ptr, strides(p.bias_dims, a.bias);
    if (!c.mask.empty()) a.mask.data = mask.ptr, strides(p.mask_dims, a.mask);
    a.q_seqlens = q_lens.ptr, a.kv_seqlens = kv_lens.ptr;
    a.out = out.ptr, a.lse = lse.ptr;
    return a;
  }
  BackwardArgs backward_args(const Problem& p) {
    BackwardArgs a;
    a.fwd = forward_args(p);
    a.dout = dout.ptr, a.dq = dq.ptr, a.dk = dk.ptr, a.dv = dv.ptr;
    a.dbias = p.c.bias.empty() ? nullptr : dbias.ptr;
    return a;
  }
  BackwardWorkspace workspace() { return {dq_accum.ptr, dsum.ptr}; }
};

enum class Schedule { kV1, kV2 };
const char* schedule_name(Schedule s) { return s == Schedule::kV1 ? "v1" : "v2"; }

cudaError_t run_forward(Schedule s, Device& d, const ForwardArgs& a) {
  return s == Schedule::kV1 ? jax_flash::launch_v1_forward(a, d.o_accum.ptr, 0)
                            : jax_flash::launch_v2_forward(a, 0);
}
cudaError_t run_backward(Schedule s, Device& d, const BackwardArgs& a) {
  return s == Schedule::kV1 ? jax_flash::launch_v1_backward(a, d.workspace(), 0)
                            : jax_flash::launch_v2_backward(a, d.workspace(), 0);
}

// ---------------------------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------------------------

struct Error {
  double max_abs = 0, ref_norm = 0, diff_norm = 0, ref_max = 0;
  size_t bad = 0;  // NaN / inf where the reference is finite, or the reverse
  void add(double got, double want) {
    if (std::isinf(want) || std::isinf(got)) {
      if (got != want) ++bad;
      return;
    }
    if (!std::isfinite(got)) {
      ++bad;
      return;
    }
    const double d = std::fabs(got - want);
    max_abs = std::max(max_abs, d);
    ref_max = std::max(ref_max, std::fabs(want));
    diff_norm += d * d;
    ref_norm += want * want;
  }
  double rel_l2() const { return ref_norm > 0 ? std::sqrt(diff_norm / ref_norm) : std::sqrt(diff_norm); }
};

Error compare16(const std::vector<uint16_t>& got, const std::vector<double>& want, DType dt) {
  Error e;
  for (size_t i = 0; i < want.size(); ++i) e.add(to_float(got[i], dt), want[i]);
  return e;
}
Error compare32(const std::vector<float>& got, const std::vector<double>& want) {
  Error e;
  for (size_t i = 0; i < want.size(); ++i) e.add(got[i], want[i]);
  return e;
}

// Tolerances as in tests/attention_cases.py: max abs error on outputs of magnitude ~1, relative
// L2 on gradients.
double out_atol(DType dt) { return dt == DType::kBF16 ? 2.5e-2 : 4e-3; }
double grad_rel(DType dt) { return dt == DType::kBF16 ? 3e-2 : 6e-3; }
constexpr double kLseAtol = 2e-3;

int failures = 0;

void report(const std::string& what, const Error& e, bool ok) {
  std::printf("  %-9s max_abs %.3e  rel_l2 %.3e  ref_max %.2e  nonfinite %zu  %s\n",
              what.c_str(), e.max_abs, e.rel_l2(), e.ref_max, e.bad, ok ? "ok" : "FAIL");
  if (!ok) ++failures;
}

void check_case(const Case& c, std::mt19937_64& rng, bool backward) {
  const Problem p = make_problem(c, rng);
  std::printf("%s\n", c.name().c_str());
  const ForwardRef f = ref_forward(p);
  const BackwardRef g = backward ? ref_backward(p, f) : BackwardRef{};
  Device d(p);
  for (Schedule s : {Schedule::kV1, Schedule::kV2}) {
    const ForwardArgs fa = d.forward_args(p);
    d.out.poison(), d.lse.poison(), d.o_accum.poison();
    CUDA_CHECK(run_forward(s, d, fa));
    CUDA_CHECK(cudaDeviceSynchronize());
    const Error eo = compare16(d.out.download(), f.out, c.dtype);
    const Error el = compare32(d.lse.download(), f.lse);
    std::printf(" %s forward\n", schedule_name(s));
    report("out", eo, eo.bad == 0 && eo.max_abs <= out_atol(c.dtype));
    report("lse", el, el.bad == 0 && el.max_abs <= kLseAtol);
    if (!backward) continue;
    const BackwardArgs ba = d.backward_args(p);
    d.dq.poison(), d.dk.poison(), d.dv.poison(), d.dbias.poison();
    d.dq_accum.poison(), d.dsum.poison();
    CUDA_CHECK(run_backward(s, d, ba));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::printf(" %s backward\n", schedule_name(s));
    const double tol = grad_rel(c.dtype);
    for (auto [name, got, want] :
         {std::tuple{"dq", &d.dq, &g.dq}, std::tuple{"dk", &d.dk, &g.dk},
          std::tuple{"dv", &d.dv, &g.dv}}) {
      const Error e = compare16(got->download(), *want, c.dtype);
      report(name, e, e.bad == 0 && e.rel_l2() <= tol);
    }
    if (!c.bias.empty()) {
      const Error e = compare32(d.dbias.download(), g.dbias);
      report("dbias", e, e.bad == 0 && e.rel_l2() <= tol);
    }
  }
}

std::vector<Case> quick_cases() {
  return {
      Case{2, 17, 23, 4, 2, 64},
      Case{1, 70, 70, 2, 1, 128, DType::kBF16, true},
      Case{2, 33, 45, 2, 2, 32, DType::kF16, false, -1, -1, 3.f, 0.f, "b1ts", "1nts"},
      Case{2, 40, 70, 2, 1, 256, DType::kBF16, true, 16, -1, 0.f, 0.f, "", "", 0.7f, true},
  };
}

std::vector<Case> all_cases() {
  const DType bf = DType::kBF16, fp = DType::kF16;
  std::vector<Case> cases = {
      // odd sizes
      Case{1, 1, 1, 1, 1, 64},
      Case{2, 17, 17, 4, 2, 32, fp},
      Case{1, 97, 55, 6, 3, 64, fp},
      Case{1, 1030, 1030, 2, 1, 128},
      Case{1, 1030, 1030, 2, 2, 128, bf, true},
      Case{1, 40, 1100, 2, 2, 64, bf, true},
      Case{1, 1100, 40, 2, 2, 64, fp, true},
      Case{2, 1031, 1029, 4, 2, 128, bf, true, -1, -1, 0.f, 0.f, "", "", 0.7f, true},
      Case{1, 2048, 2048, 2, 2, 64, fp, false, 300, 200},
      Case{1, 600, 700, 2, 1, 256, bf, true},
      // GQA / MQA
      Case{2, 17, 97, 8, 1, 64},
      Case{1, 129, 300, 6, 2, 128, fp},
      // windows
      Case{1, 97, 97, 2, 2, 64, bf, false, 5, 3},
      Case{1, 20, 20, 2, 2, 32, bf, false, 0, 0},
      Case{1, 300, 300, 2, 1, 64, bf, true, 16, -1},
      Case{1, 300, 300, 2, 1, 128, fp, false, -1, 7},
      Case{1, 300, 300, 2, 1, 128, bf, false, 100, -1},
      // bias, mask, softcap, scale
      Case{2, 31, 45, 4, 2, 64, bf, false, -1, -1, 0.f, 0.f, "1nts"},
      Case{2, 31, 45, 4, 2, 64, fp, false, -1, -1, 0.f, 0.f, "b11s"},
      Case{2, 31, 45, 4, 2, 64, bf, false, -1, -1, 0.f, 0.f, "", "b1ts"},
      Case{2, 45, 45, 4, 2, 64, bf, true, -1, -1, 0.f, 0.f, "bnts", "11ts"},
      Case{2, 17, 17, 2, 2, 64, fp, false, -1, -1, 0.f, 0.f, "", "bnts", 0.05f},  // empty rows
      Case{1, 33, 40, 2, 2, 64, bf, false, -1, -1, 5.f},
      Case{1, 33, 33, 2, 2, 64, fp, true, -1, -1, 3.f, 0.f, "11ts"},
      Case{1, 200, 300, 2, 2, 128, bf, false, -1, -1, 30.f, 0.f, "bnts", "b1ts"},
      Case{1, 17, 20, 2, 2, 64, bf, false, -1, -1, 0.f, 0.5f},
      Case{1, 17, 20, 2, 2, 64, fp, false, -1, -1, 0.f, -0.2f},
      // sequence lengths
      Case{3, 40, 70, 2, 2, 64, bf, false, -1, -1, 0.f, 0.f, "", "", 0.7f, true},
      Case{3, 170, 170, 2, 1, 128, fp, true, -1, -1, 0.f, 0.f, "", "", 0.7f, true},
      Case{3, 300, 500, 4, 2, 64, bf, false, 0, 0, 0.f, 0.f, "", "", 0.7f, true},
  };
  // Head dims: multiples of 8 up to 256 land in the 64 / 128 / 256 instantiations.
  for (int h : {8, 16, 24, 40, 72, 96, 136, 160, 192, 200, 224, 256})
    cases.push_back(Case{1, 97, 211, 2, 1, h, h % 16 ? DType::kF16 : DType::kBF16, h > 150});
  return cases;
}

// ---------------------------------------------------------------------------------------------
// Benchmark
// ---------------------------------------------------------------------------------------------

// Median of per-call times (ms) of `fn`, each bracketed by events.
double median_ms(const std::function<void()>& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    CUDA_CHECK(cudaEventRecord(start));
    fn();
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    CUDA_CHECK(cudaEventElapsedTime(&ms[i], start, stop));
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

// Spot checks of a benchmark run against float64: sampled rows of out / lse / dq, sampled keys
// of dk / dv (computed with the GPU's lse and out, themselves checked on the sampled rows).
struct SpotErrors {
  Error out, lse, dq, dk, dv;
};

// `forward` / `backward` select the outputs checked (the other part may hold stale values).
SpotErrors spot_check(const Problem& p, Device& d, std::mt19937_64& rng, bool forward = true,
                      bool backward = true) {
  const Case& c = p.c;
  SpotErrors e;
  const auto out = d.out.download();
  const auto lse = d.lse.download();
  const std::vector<uint16_t> dq = backward ? d.dq.download() : std::vector<uint16_t>{},
                              dk = backward ? d.dk.download() : std::vector<uint16_t>{},
                              dv = backward ? d.dv.download() : std::vector<uint16_t>{};
  const int group = c.n / c.k;
  std::uniform_int_distribution<int> rb(0, c.b - 1), rn(0, c.n - 1), rt(0, c.t - 1),
      rs(0, c.s - 1);
  const double scale = c.softmax_scale();
  const auto out_row = [&](int b, int t, int n) { return ((size_t(b) * c.t + t) * c.n + n) * c.h; };
  const auto d_of = [&](int b, int t, int n) {  // D from the GPU's out
    double acc = 0;
    for (int i = 0; i < c.h; ++i)
      acc += double(p.dout.val[out_row(b, t, n) + i]) * to_float(out[out_row(b, t, n) + i], c.dtype);
    return acc;
  };
  std::vector<std::array<int, 3>> rows(12);
  for (auto& r : rows) r = {rb(rng), rn(rng), rt(rng)};
  for (auto [b, n, t] : rows) {
    const RowRef ref = ref_row(p, b, n, t);
    const size_t o = out_row(b, t, n);
    if (forward) {
      for (int i = 0; i < c.h; ++i) e.out.add(to_float(out[o + i], c.dtype), ref.out[i]);
      e.lse.add(lse[(size_t(b) * c.n + n) * c.t + t], ref.lse);
    }
    if (!backward) continue;
    // dq row
    std::vector<double> want(c.h, 0.0);
    if (ref.lse != -INFINITY) {
      double dsum = 0;
      for (int i = 0; i < c.h; ++i) dsum += double(p.dout.val[o + i]) * ref.out[i];
      const int kv = n / group;
      for (int s = 0; s < c.s; ++s) {
        ScoreRef sc = ref_score(p, b, n, t, s);
        if (!sc.kept) continue;
        const size_t kr = ((size_t(b) * c.s + s) * c.k + kv) * c.h;
        double dp = 0;
        for (int i = 0; i < c.h; ++i) dp += double(p.dout.val[o + i]) * p.v.val[kr + i];
        const double ds = std::exp(sc.x - ref.lse) * (dp - dsum) * (1 - sc.saturation * sc.saturation);
        for (int i = 0; i < c.h; ++i) want[i] += scale * ds * p.k.val[kr + i];
      }
    }
    for (int i = 0; i < c.h; ++i) e.dq.add(to_float(dq[o + i], c.dtype), want[i]);
  }
  // dk / dv of sampled keys: sum over every query row of the kv head's group.
  for (int sample = 0; sample < (backward ? 4 : 0); ++sample) {
    const int b = rb(rng), kv = rn(rng) % c.k, s = rs(rng);
    std::vector<double> want_dk(c.h, 0.0), want_dv(c.h, 0.0);
    std::mutex mu;
    parallel_for(group * c.t, [&](int i) {
      const int n = kv * group + i / c.t, t = i % c.t;
      const double l = lse[(size_t(b) * c.n + n) * c.t + t];
      ScoreRef sc = ref_score(p, b, n, t, s);
      if (!sc.kept || l == -INFINITY) return;
      const size_t o = out_row(b, t, n), kr = ((size_t(b) * c.s + s) * c.k + kv) * c.h;
      const double prob = std::exp(sc.x - l);
      double dp = 0;
      for (int h = 0; h < c.h; ++h) dp += double(p.dout.val[o + h]) * p.v.val[kr + h];
      const double ds = prob * (dp - d_of(b, t, n)) * (1 - sc.saturation * sc.saturation);
      std::lock_guard<std::mutex> lock(mu);
      for (int h = 0; h < c.h; ++h) {
        want_dv[h] += prob * p.dout.val[o + h];
        want_dk[h] += scale * ds * p.q.val[o + h];
      }
    });
    const size_t kr = ((size_t(b) * c.s + s) * c.k + kv) * c.h;
    for (int h = 0; h < c.h; ++h) {
      e.dk.add(to_float(dk[kr + h], c.dtype), want_dk[h]);
      e.dv.add(to_float(dv[kr + h], c.dtype), want_dv[h]);
    }
  }
  return e;
}

bool spot_ok(const SpotErrors& e, DType dt) {
  return e.out.bad + e.lse.bad + e.dq.bad + e.dk.bad + e.dv.bad == 0 &&
         e.out.max_abs <= out_atol(dt) && e.lse.max_abs <= kLseAtol &&
         e.dq.rel_l2() <= grad_rel(dt) && e.dk.rel_l2() <= grad_rel(dt) &&
         e.dv.rel_l2() <= grad_rel(dt);
}

#ifdef JAX_FLASH_TUNE
void tune_row(const Problem& p, Device& d, const ForwardArgs& fa, const BackwardArgs& ba,
              double flops, std::mt19937_64& rng);
#endif

// A row of BENCHMARK.md's grid: bf16, B * T = 16384, N * H = 2048.
Case grid_case(int t, bool causal, int head_dim) {
  const int heads = 2048 / head_dim;
  return Case{16384 / t, t, t, heads, heads, head_dim, DType::kBF16, causal};
}

// With `variants` (tuning build), each row also times the alternative v2 schedules.
void bench(std::mt19937_64& rng, bool variants, int head_dim) {
  std::printf("\nbench: bf16, B*T = 16384, N*H = 2048, H = %d (TFLOP/s; fwd = 4BNTSH, halved "
              "when causal; fwd+bwd = 3.5x)\n", head_dim);
  std::printf("%-28s %9s %9s %11s %11s   spot-check max_abs (out lse dq dk dv)\n", "config",
              "v1 fwd", "v2 fwd", "v1 fwd+bwd", "v2 fwd+bwd");
  for (int t : {1024, 4096, 16384})
    for (bool causal : {false, true}) {
      const Case c = grid_case(t, causal, head_dim);
      const Problem p = make_problem(c, rng);
      Device d(p);
      const ForwardArgs fa = d.forward_args(p);
      const BackwardArgs ba = d.backward_args(p);
      const double flops = 4.0 * c.b * c.n * double(c.t) * c.s * c.h * (causal ? 0.5 : 1.0);
      double tflops[2][2];
      std::string checks;
      for (Schedule s : {Schedule::kV1, Schedule::kV2}) {
        const bool slow = s == Schedule::kV1;
        const int warmup = 1, reps = slow ? 1 : 20;
        const double fwd_ms = median_ms([&] { CUDA_CHECK(run_forward(s, d, fa)); }, warmup, reps);
        const double both_ms = median_ms(
            [&] {
              CUDA_CHECK(run_forward(s, d, fa));
              CUDA_CHECK(run_backward(s, d, ba));
            },
            warmup, reps);
        tflops[int(s)][0] = flops / fwd_ms * 1e-9;
        tflops[int(s)][1] = 3.5 * flops / both_ms * 1e-9;
        CUDA_CHECK(cudaDeviceSynchronize());
        const SpotErrors e = spot_check(p, d, rng);
        const bool ok = spot_ok(e, c.dtype);
        if (!ok) ++failures;
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s %.1e %.1e %.1e %.1e %.1e %s  ", schedule_name(s),
                      e.out.max_abs, e.lse.max_abs, e.dq.max_abs, e.dk.max_abs, e.dv.max_abs,
                      ok ? "ok" : "FAIL");
        checks += buf;
      }
      std::printf("T=%-5d B=%-2d causal=%d        %9.1f %9.1f %11.1f %11.1f   %s\n", t, c.b,
                  int(causal), tflops[0][0], tflops[1][0], tflops[0][1], tflops[1][1],
                  checks.c_str());
      std::fflush(stdout);
#ifdef JAX_FLASH_TUNE
      if (variants) tune_row(p, d, fa, ba, flops, rng);
#endif
    }
}

// One v2 forward and backward of the benchmark grid's T=4096 row of head dim H, for a profiler.
void profile_once(std::mt19937_64& rng, int head_dim) {
  const Case c = grid_case(4096, false, head_dim);
  const Problem p = make_problem(c, rng);
  Device d(p);
  const ForwardArgs fa = d.forward_args(p);
  CUDA_CHECK(run_forward(Schedule::kV2, d, fa));
  CUDA_CHECK(run_backward(Schedule::kV2, d, d.backward_args(p)));
  CUDA_CHECK(cudaDeviceSynchronize());
}

#ifdef JAX_FLASH_TUNE
using ForwardLaunch = cudaError_t (*)(const jax_flash::ForwardArgs&, cudaStream_t);
using BackwardLaunch = cudaError_t (*)(const jax_flash::BackwardArgs&,
                                       const jax_flash::BackwardWorkspace&, bool, cudaStream_t);

template <typename Shape>
std::string forward_shape_name() {
  return "M" + std::to_string(Shape::kBlockM) + " N" + std::to_string(Shape::kBlockN) + " W" +
         std::to_string(Shape::kWarps);
}
template <typename Shape>
std::string backward_shape_name() {
  return "M" + std::to_string(Shape::kBlockM) + " N" + std::to_string(Shape::kBlockN) + " stages" +
         std::to_string(Shape::kStages) + " dq-chunks" + std::to_string(Shape::kDqChunks) +
         " kv-key-warps" + std::to_string(Shape::kKvKeyWarps);
}

// The library's shape for head dim H first, then the alternatives (bf16).
template <int H, typename... Alternatives>
std::vector<std::pair<std::string, ForwardLaunch>> forward_variants() {
  using Default = jax_flash::V2DefaultShape<H>;
  return {{"fwd " + forward_shape_name<Default>() + " (default)",
           jax_flash::launch_v2_forward_typed<__nv_bfloat16, H, Default>},
          {"fwd " + forward_shape_name<Alternatives>(),
           jax_flash::launch_v2_forward_typed<__nv_bfloat16, H, Alternatives>}...};
}
template <int H, typename... Alternatives>
std::vector<std::pair<std::string, BackwardLaunch>> backward_variants() {
  using Default = jax_flash::BwdDefaultShape<H, false>;
  return {{"bwd " + backward_shape_name<Default>() + " (default)",
           jax_flash::launch_backward_typed<__nv_bfloat16, H, Default>},
          {"bwd " + backward_shape_name<Alternatives>(),
           jax_flash::launch_backward_typed<__nv_bfloat16, H, Alternatives>}...};
}

// Times alternative v2 tile shapes on one grid row.
// Forward variants: TFLOP/s of the forward alone. Backward variants: the backward alone, and
// forward (default) + backward (variant), BENCHMARK.md counting. Every variant's outputs are
// spot-checked against float64.
void tune_row(const Problem& p, Device& d, const ForwardArgs& fa, const BackwardArgs& ba,
              double flops, std::mt19937_64& rng) {
  using namespace jax_flash;
  std::vector<std::pair<std::string, ForwardLaunch>> forwards;
  std::vector<std::pair<std::string, BackwardLaunch>> backwards;
  switch (p.c.h) {
    case 64:
      forwards = forward_variants<64, V2Shape<128, 64, 4>>();
      backwards = backward_variants<64, BwdShape<64, 128, 2>>();
      break;
    case 128:
      forwards = forward_variants<128, V2Shape<64, 64, 4>>();
      backwards = backward_variants<128, BwdShape<64, 128, 2, 1, 4>, BwdShape<64, 128, 1, 1, 2>>();
      break;
    default:  // stages1: what sm_80's shared memory allows (launch_backward)
      forwards = forward_variants<256, V2Shape<128, 64, 8>>();
      backwards = backward_variants<256, BwdShape<64, 64, 1>, BwdShape<64, 64, 2>>();
  }
  const auto status = [&](const SpotErrors& e, const char* which) {
    static char buf[160];
    std::snprintf(buf, sizeof buf, "%s %s", which, spot_ok(e, p.c.dtype) ? "ok" : "FAIL");
    if (!spot_ok(e, p.c.dtype)) ++failures;
    return buf;
  };
  for (const auto& [name, launch_ref] : forwards) {
    const ForwardLaunch launch = launch_ref;
    const double ms = median_ms([&] { CUDA_CHECK(launch(fa, 0)); }, 3, 20);
    d.out.poison(), d.lse.poison();
    CUDA_CHECK(launch(fa, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    const SpotErrors e = spot_check(p, d, rng, true, false);
    std::printf("    %-34s fwd %7.1f TFLOP/s %8.3f ms  out %.1e lse %.1e %s\n", name.c_str(),
                flops / ms * 1e-9, ms, e.out.max_abs, e.lse.max_abs, status(e, "check"));
  }
  CUDA_CHECK(launch_v2_forward(fa, 0));  // the default's out / lse feed the backward variants
  for (const auto& [name, launch_ref] : backwards) {
    const BackwardLaunch launch = launch_ref;
    const double bwd_ms = median_ms([&] { CUDA_CHECK(launch(ba, d.workspace(), false, 0)); }, 2, 10);
    const double both_ms = median_ms(
        [&] {
          CUDA_CHECK(launch_v2_forward(fa, 0));
          CUDA_CHECK(launch(ba, d.workspace(), false, 0));
        },
        1, 10);
    d.dq.poison(), d.dk.poison(), d.dv.poison();
    CUDA_CHECK(launch(ba, d.workspace(), false, 0));
    CUDA_CHECK(cudaDeviceSynchronize());
    const SpotErrors e = spot_check(p, d, rng, false, true);
    std::printf("    %-34s bwd %7.1f TFLOP/s %8.3f ms  fwd+bwd %7.1f  dq %.1e dk %.1e dv %.1e %s\n",
                name.c_str(), 2.5 * flops / bwd_ms * 1e-9, bwd_ms, 3.5 * flops / both_ms * 1e-9,
                e.dq.max_abs, e.dk.max_abs, e.dv.max_abs, status(e, "check"));
  }
  std::fflush(stdout);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, run_bench = false, run_tune = false, run_profile = false;
  int head_dim = 128;
  uint64_t seed = std::random_device{}();
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--bench")) run_bench = true;
    else if (!std::strcmp(argv[i], "--head-dim") && i + 1 < argc) head_dim = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--tune")) run_tune = true;
    else if (!std::strcmp(argv[i], "--profile")) run_profile = true;
    else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else {
      std::fprintf(stderr, "usage: %s [--quick] [--bench] [--tune] [--profile] [--head-dim H] [--seed N]\n", argv[0]);
      return 2;
    }
  }
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) {
    std::fprintf(stderr, "--head-dim: the grid has 64, 128 and 256, got %d\n", head_dim);
    return 2;
  }
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs)  seed %llu\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  if (run_profile) {
    profile_once(rng, head_dim);
  } else if (run_tune) {
#ifdef JAX_FLASH_TUNE
    bench(rng, true, head_dim);
#else
    std::fprintf(stderr, "--tune needs a -DJAX_FLASH_TUNE build\n");
    return 2;
#endif
  } else if (run_bench) {
    bench(rng, false, head_dim);
  } else {
    const auto start = std::chrono::steady_clock::now();
    for (const Case& c : quick ? quick_cases() : all_cases()) check_case(c, rng, true);
    std::printf("checked in %.1f s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
