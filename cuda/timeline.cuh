// Device side of the opt-in per-CTA timelines of the v3 kernels: measurement builds only
// (-DJAX_FLASH_V3_FWD_TIMELINE: cuda/v3_fwd_sm90.cu; -DJAX_FLASH_V3_BWD_TIMELINE:
// cuda/v3_bwd_sm90.cu). Include only under one of those macros; the record layouts are in
// cuda/v3.h and the host side in tests/gpu/harness_timeline.h.
//
// Each CTA owns `events` records of two uint64 at records + 2 * events * (its linear CTA id).
// A timer record holds %globaltimer (ns, common to all SMs but coarse: it steps about every
// 0.5 us on the H200) and %clock64 (cycles of the CTA's SM, exact), both read at the event; a
// value record holds two numbers the kernel stores instead (%smid and a count, a tile's shape).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_flash {
namespace timeline {

// This CTA's records (null: not recording), set by one thread before the kernel's
// __syncthreads. Kept in shared memory and loaded at each stamp: held in registers, the
// compiler kept the address live over the consumer loops and the v3 backward's H = 64 consumers
// spilled (nvcc 13.0); computed from %ctaid at each stamp, its H = 128 helper spilled in its loop.
static __shared__ uint64_t* cta_records;

__device__ __forceinline__ void set_cta_records(uint64_t* records, int events) {
  const uint32_t cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  cta_records = records != nullptr ? records + 2 * int64_t(cta) * events : nullptr;
}

// Every thread that comes here reads both timers and only `record` stores them (predicated, not
// branched: a divergent branch while wgmmas are in flight makes ptxas serialize them, C7520).
// The memory clobber keeps the stamp after the stores that precede it in program order.
__device__ __forceinline__ void stamp(int event, bool record) {
  asm volatile(
      "{\n .reg .pred p, q;\n .reg .u64 a, t, c;\n"
      " mov.u64 t, %%globaltimer;\n mov.u64 c, %%clock64;\n"
      " ld.shared.u64 a, [%0];\n setp.ne.u32 p, %2, 0;\n setp.ne.u64 q, a, 0;\n"
      " and.pred p, p, q;\n add.u64 a, a, %1;\n"
      " @p st.global.v2.u64 [a], {t, c};\n}" ::"r"(
          static_cast<uint32_t>(__cvta_generic_to_shared(&cta_records))),
      "l"(int64_t(16) * event), "r"(uint32_t(record))
      : "memory");
}

// Stores (first, second) in value record `event`, from the thread where `record` holds.
__device__ __forceinline__ void store_values(int event, uint64_t first, uint64_t second,
                                             bool record) {
  if (!record || cta_records == nullptr) return;
  *reinterpret_cast<ulonglong2*>(cta_records + 2 * event) = make_ulonglong2(first, second);
}

// Value record `event` := (%smid, count).
__device__ __forceinline__ void store_cta_info(int event, uint64_t count, bool record) {
  uint32_t smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  store_values(event, smid, count, record);
}

// Host: the record buffer a V3*SetTimeline call registered (null: none), checked against each
// launch's CTA count.
struct Buffer {
  uint64_t* records = nullptr;
  int64_t ctas = 0;
  void set(uint64_t* buffer, int64_t buffer_ctas) {
    records = buffer;
    ctas = buffer != nullptr ? buffer_ctas : 0;
  }
  bool fits(int64_t launch_ctas) const { return records == nullptr || launch_ctas <= ctas; }
};

}  // namespace timeline
}  // namespace jax_flash
