// A small process-wide pool of std::threads for the CPU kernel.
#pragma once

#include <cstdint>
#include <functional>

namespace jax_flash::cpu {

// Threads a parallel region uses (the caller included): JAX_FLASH_CPU_THREADS when set to a
// positive integer, else std::thread::hardware_concurrency().
int NumThreads();

// Runs body(i) for every i in [0, count), spread over the pool with the calling thread taking
// part, and returns when all are done. Indices are handed out in increasing order, one at a
// time, so uneven items (causal blocks) balance themselves. body must not throw. Regions from
// different calling threads run one after another.
void ParallelFor(int64_t count, const std::function<void(int64_t)>& body);

}  // namespace jax_flash::cpu
