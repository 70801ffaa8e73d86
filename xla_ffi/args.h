// Decoding of the standard attention FFI convention (docs/architecture.md) for every schedule,
// CPU and GPU. Handlers bind, decode and launch; they never re-check shapes themselves.
//
// API (everything in namespace jax_flash):
//
//   struct AttentionAttrs { scale, softcap, is_causal, window_left, window_right,
//                           has_bias, has_mask, deterministic };  // the 8 attributes, exact types
//   struct StandardInputs { q, k, v, bias, mask, q_seqlens, kv_seqlens };  // ffi::AnyBuffer each
//   using InBuffer = ffi::AnyBuffer;  using OutBuffer = ffi::Result<ffi::AnyBuffer>;
//
//   BindForward(binding)  appends  7 inputs, AttentionAttrs, out, lse
//   BindBackward(binding) appends  7 inputs, out, lse, dout, AttentionAttrs, dq, dk, dv, dbias
//     `binding` is `ffi::Ffi::Bind()` with the handler's context already added, e.g.
//     `ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()`; append workspace outputs
//     with `.Ret<ffi::AnyBuffer>()` after the call. The handler's parameters follow that order:
//
//   ffi::Error V2Forward(cudaStream_t stream,
//                        InBuffer q, InBuffer k, InBuffer v, InBuffer bias, InBuffer mask,
//                        InBuffer q_seqlens, InBuffer kv_seqlens, AttentionAttrs attrs,
//                        OutBuffer out, OutBuffer lse, OutBuffer workspace) {
//     ForwardArgs args;
//     ffi::Error err = DecodeForward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, attrs,
//                                    *out, *lse, &args);
//     if (err.failure()) return err;
//     ...
//   }
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(V2ForwardHandler, V2Forward,
//       BindForward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
//           .Ret<ffi::AnyBuffer>());
//
//   Backward handlers take (ctx..., q, k, v, bias, mask, q_seqlens, kv_seqlens, out, lse, dout
//   as InBuffer, AttentionAttrs attrs, dq, dk, dv, dbias as OutBuffer, workspaces...) and call
//   DecodeBackward({q, k, v, bias, mask, q_seqlens, kv_seqlens}, out, lse, dout, attrs,
//                  *dq, *dk, *dv, *dbias, &args).
//   (Pass the binding as a temporary: ffi::Binding is move-only through its own methods.)
//
//   ffi::Error DecodeForward(const StandardInputs&, const AttentionAttrs&,
//                            ffi::AnyBuffer out, ffi::AnyBuffer lse, ForwardArgs*);
//   ffi::Error DecodeBackward(const StandardInputs&, ffi::AnyBuffer out, ffi::AnyBuffer lse,
//                             ffi::AnyBuffer dout, const AttentionAttrs&, ffi::AnyBuffer dq,
//                             ffi::AnyBuffer dk, ffi::AnyBuffer dv, ffi::AnyBuffer dbias,
//                             BackwardArgs*);
//     Validate every rank, dimension and dtype against the convention and fill the args
//     (broadcast bias/mask strides included). They only store data pointers, never read
//     them, so they work on device buffers. Return InvalidArgument naming the buffer.
//
//   int64_t ElementBytes(DType)   bytes of one q/k/v element
//   ffi::Error TargetError(target, what)   InvalidArgument "<target>: <what>" (handler checks)
//   ffi::Error CheckWorkspace(target, name, buffer, type, elements)   a workspace output's size
//   std::string ShapeString(buffer or buffer.dimensions())   "[2, 3, 4]"
//   bool HasShape(buffer, {dims...})   exact shape comparison
//
// No CUDA header is included here; GPU handlers add their stream context themselves.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "../cuda/attention_args.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

namespace ffi = ::xla::ffi;

struct AttentionAttrs {
  float scale;
  float softcap;
  bool is_causal;
  int32_t window_left;
  int32_t window_right;
  bool has_bias;
  bool has_mask;
  // Backward only: dq must be bitwise repeatable across runs. Forwards are always deterministic
  // and ignore it; a backward that cannot honour it refuses the call.
  bool deterministic;
};

}  // namespace jax_flash

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_flash::AttentionAttrs, StructMember<float>("scale"),
                                      StructMember<float>("softcap"),
                                      StructMember<bool>("is_causal"),
                                      StructMember<int32_t>("window_left"),
                                      StructMember<int32_t>("window_right"),
                                      StructMember<bool>("has_bias"),
                                      StructMember<bool>("has_mask"),
                                      StructMember<bool>("deterministic"));

namespace jax_flash {

using InBuffer = ffi::AnyBuffer;
using OutBuffer = ffi::Result<ffi::AnyBuffer>;

struct StandardInputs {
  ffi::AnyBuffer q, k, v, bias, mask, q_seqlens, kv_seqlens;
};

template <typename Binding>
auto BindStandardInputs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()   // q
      .template Arg<ffi::AnyBuffer>()   // k
      .template Arg<ffi::AnyBuffer>()   // v
      .template Arg<ffi::AnyBuffer>()   // bias
      .template Arg<ffi::AnyBuffer>()   // mask
      .template Arg<ffi::AnyBuffer>()   // q_seqlens
      .template Arg<ffi::AnyBuffer>();  // kv_seqlens
}

template <typename Binding>
auto BindForward(Binding&& binding) {
  return BindStandardInputs(std::forward<Binding>(binding))
      .template Attrs<AttentionAttrs>()
      .template Ret<ffi::AnyBuffer>()   // out
      .template Ret<ffi::AnyBuffer>();  // lse
}

template <typename Binding>
auto BindBackward(Binding&& binding) {
  return BindStandardInputs(std::forward<Binding>(binding))
      .template Arg<ffi::AnyBuffer>()  // out
      .template Arg<ffi::AnyBuffer>()  // lse
      .template Arg<ffi::AnyBuffer>()  // dout
      .template Attrs<AttentionAttrs>()
      .template Ret<ffi::AnyBuffer>()   // dq
      .template Ret<ffi::AnyBuffer>()   // dk
      .template Ret<ffi::AnyBuffer>()   // dv
      .template Ret<ffi::AnyBuffer>();  // dbias
}

inline int64_t ElementBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// Returns the error of `expr` from the enclosing function (which declares `ffi::Error err`).
#define JAX_FLASH_TRY(expr) \
  if ((err = (expr)).failure()) return err

// A check a handler adds beyond the convention failed: InvalidArgument naming the target.
inline ffi::Error TargetError(const char* target, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
}

// A workspace output (an extra result a handler's kernels use as scratch) must hold exactly
// `elements` elements of `type`; InvalidArgument naming the target and the workspace otherwise.
inline ffi::Error CheckWorkspace(const char* target, const char* name, ffi::AnyBuffer buffer,
                                 ffi::DataType type, int64_t elements) {
  if (buffer.element_type() == type && static_cast<int64_t>(buffer.element_count()) == elements)
    return ffi::Error::Success();
  const char* type_name = type == ffi::DataType::F32 ? "float32"
                          : type == ffi::DataType::S32 ? "int32"
                                                       : "the declared type";
  return TargetError(target, std::string("workspace `") + name + "` must have " +
                                 std::to_string(elements) + " elements of " + type_name);
}

inline std::string ShapeString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

inline std::string ShapeString(ffi::AnyBuffer buffer) { return ShapeString(buffer.dimensions()); }

inline bool HasShape(ffi::AnyBuffer buffer, std::initializer_list<int64_t> shape) {
  auto dims = buffer.dimensions();
  if (dims.size() != shape.size()) return false;
  size_t i = 0;
  for (int64_t d : shape)
    if (dims[i++] != d) return false;
  return true;
}

namespace args_detail {

inline ffi::Error Invalid(const char* name, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jax_flash: `") + name + "` " + what);
}

inline ffi::Error CheckShape(const char* name, ffi::AnyBuffer buf,
                             std::initializer_list<int64_t> expected) {
  if (HasShape(buf, expected)) return ffi::Error::Success();
  std::string want = "[";
  size_t i = 0;
  for (int64_t e : expected) want += (i++ ? ", " : "") + std::to_string(e);
  return Invalid(name, "has shape " + ShapeString(buf.dimensions()) + ", expected " + want + "]");
}

inline ffi::Error CheckDType(const char* name, ffi::AnyBuffer buf, ffi::DataType expected,
                             const char* expected_name) {
  if (buf.element_type() == expected) return ffi::Error::Success();
  return Invalid(name, std::string("must have dtype ") + expected_name);
}

inline ffi::Error CheckLike(const char* name, ffi::AnyBuffer buf, ffi::AnyBuffer like,
                            const char* like_name) {
  if (buf.element_type() != like.element_type())
    return Invalid(name, std::string("must have the dtype of `") + like_name + "`");
  auto a = buf.dimensions(), b = like.dimensions();
  bool same = a.size() == b.size();
  for (size_t i = 0; same && i < a.size(); ++i) same = a[i] == b[i];
  if (same) return ffi::Error::Success();
  return Invalid(name, "has shape " + ShapeString(a) + ", expected the shape of `" + like_name +
                           "` " + ShapeString(b));
}

inline ffi::Error CheckRank4(const char* name, ffi::AnyBuffer buf) {
  if (buf.dimensions().size() == 4) return ffi::Error::Success();
  return Invalid(name, "must be rank 4, got shape " + ShapeString(buf.dimensions()));
}

// Fills element strides of a row-major [b, n, t, s] tensor whose dims are each 1 or `full`;
// a broadcast dim gets stride 0 so kernels index it with the full coordinates.
template <typename T>
ffi::Error DecodeBroadcast(const char* name, ffi::AnyBuffer buf, const int64_t (&full)[4],
                           Broadcast4D<T>* out) {
  ffi::Error err = CheckRank4(name, buf);
  if (err.failure()) return err;
  auto dims = buf.dimensions();
  int64_t strides[4];
  int64_t running = 1;
  for (int i = 3; i >= 0; --i) {
    if (dims[i] != 1 && dims[i] != full[i])
      return Invalid(name, "has shape " + ShapeString(dims) + "; each dim must be 1 or [" +
                               std::to_string(full[0]) + ", " + std::to_string(full[1]) + ", " +
                               std::to_string(full[2]) + ", " + std::to_string(full[3]) + "]");
    strides[i] = dims[i] == 1 ? 0 : running;
    running *= dims[i];
  }
  out->data = static_cast<const T*>(buf.untyped_data());
  out->stride_b = strides[0];
  out->stride_n = strides[1];
  out->stride_t = strides[2];
  out->stride_s = strides[3];
  return ffi::Error::Success();
}

inline ffi::Error DecodeDType(ffi::AnyBuffer q, DType* dtype) {
  switch (q.element_type()) {
    case ffi::DataType::F32: *dtype = DType::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *dtype = DType::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *dtype = DType::kF16; return ffi::Error::Success();
    default: return Invalid("q", "must have dtype float32, bfloat16 or float16");
  }
}

inline ffi::Error DecodeAttrs(const AttentionAttrs& attrs, MaskSpec* spec) {
  if (!(attrs.softcap >= 0.f)) return Invalid("softcap", "must be >= 0 (0 = off)");
  if (attrs.window_left < -1) return Invalid("window_left", "must be >= -1 (-1 = unbounded)");
  if (attrs.window_right < -1) return Invalid("window_right", "must be >= -1 (-1 = unbounded)");
  spec->scale = attrs.scale;
  spec->softcap = attrs.softcap;
  spec->is_causal = attrs.is_causal;
  spec->window_left = attrs.window_left;
  spec->window_right = attrs.window_right;
  return ffi::Error::Success();
}

// Decodes the 7 standard inputs and the attributes (everything but out / lse).
inline ffi::Error DecodeInputs(const StandardInputs& in, const AttentionAttrs& attrs,
                               ForwardArgs* args) {
  ffi::Error err;
  JAX_FLASH_TRY(DecodeDType(in.q, &args->dtype));
  JAX_FLASH_TRY(CheckRank4("q", in.q));
  JAX_FLASH_TRY(CheckRank4("k", in.k));
  auto qd = in.q.dimensions(), kd = in.k.dimensions();
  AttentionShape& shape = args->shape;
  shape = {qd[0], qd[1], kd[1], qd[2], kd[2], qd[3]};
  if (in.k.element_type() != in.q.element_type()) return Invalid("k", "must have the dtype of `q`");
  if (kd[0] != shape.batch || kd[3] != shape.head_dim)
    return Invalid("k", "has shape " + ShapeString(kd) + ", expected [" +
                            std::to_string(shape.batch) + ", S, K, " +
                            std::to_string(shape.head_dim) + "] to match `q` " + ShapeString(qd));
  if (shape.num_kv_heads <= 0 || shape.num_heads % shape.num_kv_heads != 0)
    return Invalid("k", "has " + std::to_string(shape.num_kv_heads) +
                            " heads, which must divide the query heads (" +
                            std::to_string(shape.num_heads) + ")");
  JAX_FLASH_TRY(CheckLike("v", in.v, in.k, "k"));
  const int64_t full[4] = {shape.batch, shape.num_heads, shape.q_len, shape.kv_len};
  if (attrs.has_bias) {
    JAX_FLASH_TRY(CheckDType("bias", in.bias, ffi::DataType::F32, "float32"));
    JAX_FLASH_TRY(DecodeBroadcast("bias", in.bias, full, &args->bias));
  } else {
    args->bias = {};
  }
  if (attrs.has_mask) {
    JAX_FLASH_TRY(CheckDType("mask", in.mask, ffi::DataType::PRED, "bool"));
    JAX_FLASH_TRY(DecodeBroadcast("mask", in.mask, full, &args->mask));
  } else {
    args->mask = {};
  }
  JAX_FLASH_TRY(CheckDType("q_seqlens", in.q_seqlens, ffi::DataType::S32, "int32"));
  JAX_FLASH_TRY(CheckShape("q_seqlens", in.q_seqlens, {shape.batch}));
  JAX_FLASH_TRY(CheckDType("kv_seqlens", in.kv_seqlens, ffi::DataType::S32, "int32"));
  JAX_FLASH_TRY(CheckShape("kv_seqlens", in.kv_seqlens, {shape.batch}));
  JAX_FLASH_TRY(DecodeAttrs(attrs, &args->spec));
  args->q = in.q.untyped_data();
  args->k = in.k.untyped_data();
  args->v = in.v.untyped_data();
  args->q_seqlens = static_cast<const int32_t*>(in.q_seqlens.untyped_data());
  args->kv_seqlens = static_cast<const int32_t*>(in.kv_seqlens.untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error CheckLse(const char* name, ffi::AnyBuffer lse, const AttentionShape& shape) {
  ffi::Error err = CheckDType(name, lse, ffi::DataType::F32, "float32");
  if (err.failure()) return err;
  return CheckShape(name, lse, {shape.batch, shape.num_heads, shape.q_len});
}

}  // namespace args_detail

inline ffi::Error DecodeForward(const StandardInputs& in, const AttentionAttrs& attrs,
                                ffi::AnyBuffer out, ffi::AnyBuffer lse, ForwardArgs* args) {
  using namespace args_detail;
  ffi::Error err;
  JAX_FLASH_TRY(DecodeInputs(in, attrs, args));
  JAX_FLASH_TRY(CheckLike("out", out, in.q, "q"));
  JAX_FLASH_TRY(CheckLse("lse", lse, args->shape));
  args->out = out.untyped_data();
  args->lse = static_cast<float*>(lse.untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error DecodeBackward(const StandardInputs& in, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                                 ffi::AnyBuffer dout, const AttentionAttrs& attrs,
                                 ffi::AnyBuffer dq, ffi::AnyBuffer dk, ffi::AnyBuffer dv,
                                 ffi::AnyBuffer dbias, BackwardArgs* args) {
  using namespace args_detail;
  ffi::Error err;
  JAX_FLASH_TRY(DecodeInputs(in, attrs, &args->fwd));
  const AttentionShape& shape = args->fwd.shape;
  JAX_FLASH_TRY(CheckLike("out", out, in.q, "q"));
  JAX_FLASH_TRY(CheckLse("lse", lse, shape));
  JAX_FLASH_TRY(CheckLike("dout", dout, in.q, "q"));
  JAX_FLASH_TRY(CheckLike("dq", dq, in.q, "q"));
  JAX_FLASH_TRY(CheckLike("dk", dk, in.k, "k"));
  JAX_FLASH_TRY(CheckLike("dv", dv, in.v, "v"));
  args->dbias = nullptr;
  if (attrs.has_bias) {
    JAX_FLASH_TRY(CheckDType("dbias", dbias, ffi::DataType::F32, "float32"));
    JAX_FLASH_TRY(CheckShape("dbias", dbias,
                             {shape.batch, shape.num_heads, shape.q_len, shape.kv_len}));
    args->dbias = static_cast<float*>(dbias.untyped_data());
  }
  args->fwd.out = out.untyped_data();
  args->fwd.lse = static_cast<float*>(lse.untyped_data());
  args->dout = dout.untyped_data();
  args->dq = dq.untyped_data();
  args->dk = dk.untyped_data();
  args->dv = dv.untyped_data();
  return ffi::Error::Success();
}
#undef JAX_FLASH_TRY

}  // namespace jax_flash
