// Entry points of the CPU kernel: one instantiation of the work items (kernel.h) per
// instruction set, chosen at run time, spread over the thread pool.
#include "xla_ffi/cpu/attention.h"

#include <atomic>
#include <vector>

#include "xla_ffi/cpu/kernel.h"
#include "xla_ffi/cpu/thread_pool.h"

namespace jax_flash::cpu {
namespace {

using ForwardFn = void (*)(const ForwardArgs&, int64_t item);
using BackwardFn = void (*)(const BackwardArgs&, const float* delta, int64_t item);

// Defines Forward_<NAME> / Backward_<NAME>: the always_inline templates of kernel.h compiled
// with vector width W under the function attribute ATTRIBUTE (a `target` for x86 ISAs).
#define JAX_FLASH_DEFINE_VARIANT(NAME, W, ATTRIBUTE)                                      \
  ATTRIBUTE void Forward_##NAME(const ForwardArgs& a, int64_t item) {                     \
    switch (a.dtype) {                                                                    \
      case DType::kF32: return ForwardItem<W, float>(a, item);                            \
      case DType::kBF16: return ForwardItem<W, BF16>(a, item);                            \
      case DType::kF16: return ForwardItem<W, F16>(a, item);                              \
    }                                                                                     \
  }                                                                                       \
  ATTRIBUTE void Backward_##NAME(const BackwardArgs& g, const float* delta, int64_t item) { \
    switch (g.fwd.dtype) {                                                                \
      case DType::kF32: return BackwardItem<W, float>(g, delta, item);                    \
      case DType::kBF16: return BackwardItem<W, BF16>(g, delta, item);                    \
      case DType::kF16: return BackwardItem<W, F16>(g, delta, item);                      \
    }                                                                                     \
  }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JAX_FLASH_X86_VARIANTS 1
JAX_FLASH_DEFINE_VARIANT(avx512, 16, __attribute__((target("avx512f,avx2,fma"))))
JAX_FLASH_DEFINE_VARIANT(avx2, 8, __attribute__((target("avx2,fma"))))
#endif
JAX_FLASH_DEFINE_VARIANT(generic, 4, )
#undef JAX_FLASH_DEFINE_VARIANT

struct Variant {
  const char* name;
  bool (*supported)();
  ForwardFn forward;
  BackwardFn backward;
};

const Variant kVariants[] = {
#ifdef JAX_FLASH_X86_VARIANTS
    {"avx512",
     [] {
       return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
              __builtin_cpu_supports("fma");
     },
     Forward_avx512, Backward_avx512},
    {"avx2", [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); },
     Forward_avx2, Backward_avx2},
#endif
    {"generic", [] { return true; }, Forward_generic, Backward_generic},
};

const Variant* BestVariant() {
  for (const Variant& v : kVariants) {
    if (v.supported()) return &v;
  }
  return &kVariants[sizeof(kVariants) / sizeof(kVariants[0]) - 1];
}

std::atomic<const Variant*>& Active() {
  static std::atomic<const Variant*> active{BestVariant()};
  return active;
}

std::string CheckHeadDim(const AttentionShape& shape) {
  if (shape.head_dim < 1 || shape.head_dim > kMaxHeadDim) {
    return "jax_flash: the CPU kernel supports head dims 1.." + std::to_string(kMaxHeadDim) +
           ", got " + std::to_string(shape.head_dim);
  }
  return "";
}

template <typename T>
void ComputeDelta(const BackwardArgs& g, float* delta) {
  const AttentionShape& s = g.fwd.shape;
  ParallelFor(s.batch * CeilDiv(s.q_len, kQueryTile),
              [&](int64_t item) { DeltaItem<T>(g, delta, item); });
}

}  // namespace

std::string Forward(const ForwardArgs& args) {
  if (std::string error = CheckHeadDim(args.shape); !error.empty()) return error;
  const Variant* variant = Active().load();
  ParallelFor(QueryBlockCount(args.shape),
              [&](int64_t item) { variant->forward(args, item); });
  return "";
}

std::string Backward(const BackwardArgs& args) {
  const AttentionShape& s = args.fwd.shape;
  if (std::string error = CheckHeadDim(s); !error.empty()) return error;
  std::vector<float> delta(static_cast<size_t>(s.batch * s.num_heads * s.q_len));
  switch (args.fwd.dtype) {
    case DType::kF32: ComputeDelta<float>(args, delta.data()); break;
    case DType::kBF16: ComputeDelta<BF16>(args, delta.data()); break;
    case DType::kF16: ComputeDelta<F16>(args, delta.data()); break;
  }
  const Variant* variant = Active().load();
  ParallelFor(KeyBlockCount(s) + QueryBlockCount(s),
              [&](int64_t item) { variant->backward(args, delta.data(), item); });
  return "";
}

std::vector<std::string> SupportedVariants() {
  std::vector<std::string> names;
  for (const Variant& v : kVariants) {
    if (v.supported()) names.push_back(v.name);
  }
  return names;
}

std::string ActiveVariant() { return Active().load()->name; }

bool SetActiveVariant(const std::string& name) {
  for (const Variant& v : kVariants) {
    if (name == v.name && v.supported()) {
      Active().store(&v);
      return true;
    }
  }
  return false;
}

}  // namespace jax_flash::cpu
