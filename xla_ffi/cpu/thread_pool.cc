#include "xla_ffi/cpu/thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace jax_flash::cpu {
namespace {

class ThreadPool {
 public:
  explicit ThreadPool(int num_workers) {
    for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  void Run(int64_t count, const std::function<void(int64_t)>& body) {
    std::lock_guard<std::mutex> region(region_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      body_ = &body;
      count_ = count;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    Drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return active_ == 0; });
    body_ = nullptr;
  }

 private:
  void WorkerLoop() {
    uint64_t seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
      }
      Drain();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--active_ == 0) done_.notify_one();
    }
  }

  void Drain() {
    for (int64_t i = next_.fetch_add(1); i < count_; i = next_.fetch_add(1)) (*body_)(i);
  }

  std::mutex region_mutex_;  // serializes regions started by different threads
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* body_ = nullptr;
  int64_t count_ = 0;
  std::atomic<int64_t> next_{0};
  uint64_t generation_ = 0;
  int active_ = 0;
  std::vector<std::thread> workers_;
};

ThreadPool& Pool() {
  // Never destroyed: joining threads during static destruction of an unloading extension can
  // hang; the process exit reclaims them.
  static ThreadPool* pool = new ThreadPool(NumThreads() - 1);
  return *pool;
}

}  // namespace

int NumThreads() {
  static const int threads = [] {
    if (const char* env = std::getenv("JAX_FLASH_CPU_THREADS")) {
      const int requested = std::atoi(env);
      if (requested > 0) return requested;
    }
    const int hardware = static_cast<int>(std::thread::hardware_concurrency());
    return hardware > 0 ? hardware : 1;
  }();
  return threads;
}

void ParallelFor(int64_t count, const std::function<void(int64_t)>& body) {
  if (count <= 0) return;
  if (count == 1 || NumThreads() == 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  Pool().Run(count, body);
}

}  // namespace jax_flash::cpu
