// Host side of the harnesses' --timeline modes (harness_v3.cu: the forward kernel,
// harness_v3_bwd.cu: the backward main kernel): a CTA's records as cuda/timeline.cuh writes
// them, the recorded run, spreads over CTAs, the globaltimer's step and the raw CSV. Included
// by the timeline builds only, after harness_v3_case.h (median_event_ms, CUDA_CHECK).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace harness {
namespace timeline {

// One CTA's records: pairs (globaltimer ns, clock64); a timer record of 0 was not reached.
struct CtaRecords {
  const uint64_t* rec;
  double cycles_per_ns = 0;  // of its SM, calibrated by the caller
  bool has(int e) const { return rec[2 * e] != 0; }
  uint64_t gt(int e) const { return rec[2 * e]; }
  uint64_t clk(int e) const { return rec[2 * e + 1]; }
  // ns from event a to event b.
  double ns(int a, int b) const { return (double(clk(b)) - double(clk(a))) / cycles_per_ns; }
};

// A --timeline run: the timed launch with the stamps stored and with the timers read but not
// stored (cudaEvent medians of 10, for the perturbation check against the default build), then
// the records of one launch. set_timeline registers a record buffer for `ctas` CTAs (null: none);
// before_recorded runs just before the recorded launch.
struct RecordedRun {
  double ms_stored = 0, ms_read = 0;
  std::vector<uint64_t> records;
};
inline RecordedRun record_run(int64_t ctas, int events,
                              const std::function<void(uint64_t*, int64_t)>& set_timeline,
                              const std::function<void()>& launch,
                              const std::function<void()>& before_recorded) {
  const int64_t words = ctas * 2 * events;
  uint64_t* records = nullptr;
  CUDA_CHECK(cudaMalloc(&records, words * 8));
  RecordedRun run;
  set_timeline(records, ctas);
  run.ms_stored = median_event_ms(launch, 3, 10);
  set_timeline(nullptr, 0);
  run.ms_read = median_event_ms(launch, 3, 10);
  set_timeline(records, ctas);
  CUDA_CHECK(cudaMemset(records, 0, words * 8));
  before_recorded();
  launch();
  CUDA_CHECK(cudaDeviceSynchronize());
  set_timeline(nullptr, 0);
  run.records.resize(size_t(words));
  CUDA_CHECK(cudaMemcpy(run.records.data(), records, words * 8, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(records));
  return run;
}

struct Spread {
  double p10 = NAN, p50 = NAN, p90 = NAN;
  size_t n = 0;
};
inline Spread spread(std::vector<double> x) {
  Spread s;
  s.n = x.size();
  if (x.empty()) return s;
  std::sort(x.begin(), x.end());
  const auto at = [&](double q) { return x[size_t(q * double(x.size() - 1) + 0.5)]; };
  s.p10 = at(0.1);
  s.p50 = at(0.5);
  s.p90 = at(0.9);
  return s;
}
// One summary row: median, p10, p90 in us (from ns), and how many values; none when empty.
inline void print_spread(const std::string& what, const std::vector<double>& ns) {
  const Spread s = spread(ns);
  if (s.n > 0)
    std::printf("  %-36s %8.3f %8.3f %8.3f  (%zu)\n", what.c_str(), s.p50 * 1e-3, s.p10 * 1e-3,
                s.p90 * 1e-3, s.n);
}

// The globaltimer's step: the smallest nonzero difference between recorded values (0: none).
inline uint64_t globaltimer_step(std::vector<uint64_t> stamps) {
  std::sort(stamps.begin(), stamps.end());
  uint64_t step = 0;
  for (size_t i = 1; i < stamps.size(); ++i)
    if (stamps[i] != stamps[i - 1] && (step == 0 || stamps[i] - stamps[i - 1] < step))
      step = stamps[i] - stamps[i - 1];
  return step;
}

// The two CSV columns of timer record `event`.
inline std::pair<std::string, std::string> timer_columns(const std::string& event) {
  return {event + "_gt_ns", event + "_clk"};
}

// Writes the raw records of `ctas` CTAs (events_per_cta records each), one row per CTA: cta,
// then both words of records 0 .. used_records - 1, under the names columns(record) gives.
inline bool write_csv(const char* path, const std::vector<uint64_t>& host, int64_t ctas,
                      int events_per_cta, int used_records,
                      const std::function<std::pair<std::string, std::string>(int)>& columns) {
  FILE* f = std::fopen(path, "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path);
    return false;
  }
  std::fprintf(f, "cta");
  for (int e = 0; e < used_records; ++e) {
    const std::pair<std::string, std::string> names = columns(e);
    std::fprintf(f, ",%s,%s", names.first.c_str(), names.second.c_str());
  }
  std::fprintf(f, "\n");
  for (int64_t i = 0; i < ctas; ++i) {
    const uint64_t* rec = host.data() + i * 2 * events_per_cta;
    std::fprintf(f, "%ld", long(i));
    for (int e = 0; e < used_records; ++e)
      std::fprintf(f, ",%lu,%lu", (unsigned long)rec[2 * e], (unsigned long)rec[2 * e + 1]);
    std::fprintf(f, "\n");
  }
  return std::fclose(f) == 0;
}

}  // namespace timeline
}  // namespace harness
