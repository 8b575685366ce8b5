// The machine's float32 FMA peak and read bandwidth, measured: the two sides of the kernels
// bench's roofline (a verify of 16 positions multiplies every weight 16 times; its floor is the
// larger of its bytes over the bandwidth and these FLOPs over this peak). The read probe is the
// physical limit of a step that only streams its weights; numpy's sgemv, the other probe the bench
// reports, reached 15-21 GB/s on a Zen 4 VM where this reads 27-35.
#include "probe.h"

#include <immintrin.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "arena.h"
#include "gemv.h"
#include "pool.h"

namespace specbatch {
namespace {

// 12 independent FMA chains (more than latency x ports on current cores), `iters` rounds;
// returns a value that depends on every chain so nothing is optimised away.
#define SPECBATCH_CHAINS(NAME, TARGET, V, FMA, SET, SUM)                                       \
  __attribute__((target(TARGET))) float NAME(long iters) {                                     \
    V a0 = SET(0.50f), a1 = SET(0.55f), a2 = SET(0.60f), a3 = SET(0.65f), a4 = SET(0.70f);     \
    V a5 = SET(0.75f), a6 = SET(0.80f), a7 = SET(0.85f), a8 = SET(0.90f), a9 = SET(0.95f);     \
    V a10 = SET(1.00f), a11 = SET(1.05f);                                                      \
    const V b = SET(0.9999f), c = SET(1e-4f);                                                  \
    for (long i = 0; i < iters; ++i) {                                                         \
      a0 = FMA(a0, b, c), a1 = FMA(a1, b, c), a2 = FMA(a2, b, c), a3 = FMA(a3, b, c);          \
      a4 = FMA(a4, b, c), a5 = FMA(a5, b, c), a6 = FMA(a6, b, c), a7 = FMA(a7, b, c);          \
      a8 = FMA(a8, b, c), a9 = FMA(a9, b, c), a10 = FMA(a10, b, c), a11 = FMA(a11, b, c);      \
      __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));       \
      __asm__ volatile("" : "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));     \
    }                                                                                          \
    return SUM(a0) + SUM(a1) + SUM(a2) + SUM(a3) + SUM(a4) + SUM(a5) + SUM(a6) + SUM(a7) +     \
           SUM(a8) + SUM(a9) + SUM(a10) + SUM(a11);                                            \
  }

__attribute__((target("avx2"))) inline float sum256(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
}

// Sum of [p, end) as floats, 4 independent vector loads a step, prefetched 4 KB ahead (into L1
// or L2, 4 or 16 KB ahead, or not at all: 33-34 GB/s alike here); the sum keeps every load live.
#define SPECBATCH_READ(NAME, TARGET, V, LOAD, ADD, ZERO, SUM)                                   \
  __attribute__((target(TARGET))) float NAME(const char* p, const char* end) {               \
    constexpr int step = 4 * static_cast<int>(sizeof(V));                                    \
    V a0 = ZERO(), a1 = a0, a2 = a0, a3 = a0;                                                 \
    for (; p + step <= end; p += step) {                                                     \
      for (int l = 0; l < step; l += 64) _mm_prefetch(p + 4096 + l, _MM_HINT_T0);            \
      a0 = ADD(a0, LOAD(reinterpret_cast<const float*>(p)));                                 \
      a1 = ADD(a1, LOAD(reinterpret_cast<const float*>(p + sizeof(V))));                     \
      a2 = ADD(a2, LOAD(reinterpret_cast<const float*>(p + 2 * sizeof(V))));                 \
      a3 = ADD(a3, LOAD(reinterpret_cast<const float*>(p + 3 * sizeof(V))));                 \
    }                                                                                        \
    return SUM(ADD(ADD(a0, a1), ADD(a2, a3)));                                               \
  }
SPECBATCH_READ(read512, "avx512f", __m512, _mm512_loadu_ps, _mm512_add_ps, _mm512_setzero_ps, _mm512_reduce_add_ps)
SPECBATCH_READ(read256, "avx2", __m256, _mm256_loadu_ps, _mm256_add_ps, _mm256_setzero_ps, sum256)
#undef SPECBATCH_READ

float read_plain(const char* p, const char* end) {
  float sum = 0.0f;
  for (; p + 64 <= end; p += 64) sum += *reinterpret_cast<const float*>(p);  // a line a load
  return sum;
}

__attribute__((target("avx2"))) inline float first256(__m256 v) { return _mm256_cvtss_f32(v); }
__attribute__((target("avx512f"))) inline float first512(__m512 v) { return _mm512_cvtss_f32(v); }
SPECBATCH_CHAINS(chains512, "avx512f", __m512, _mm512_fmadd_ps, _mm512_set1_ps, first512)
SPECBATCH_CHAINS(chains256, "avx2,fma", __m256, _mm256_fmadd_ps, _mm256_set1_ps, first256)
#undef SPECBATCH_CHAINS

}  // namespace

double fma_peak_gflops(long iters) {
  const Isa isa = detect_isa();
  if (isa == Isa::none || iters <= 0) return 0.0;
  const int lanes = isa == Isa::avx512 ? 16 : 8, parts = pool().size();
  std::vector<float> sums(parts);  // each thread's chains, kept so none is optimised away
  const auto t0 = std::chrono::steady_clock::now();
  pool().run([&](int part) { sums[part] = isa == Isa::avx512 ? chains512(iters) : chains256(iters); }, parts);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float sink = 0.0f;
  for (float v : sums) sink = sink + v;
  return 2.0 * 12 * lanes * static_cast<double>(iters) * parts / s / 1e9;
}

double read_bandwidth_gbs(long bytes, int repeats, bool small_pages) {
  if (bytes <= 0 || repeats <= 0) return 0.0;
  const Isa isa = detect_isa();
  // on the records' pages (arena.h), written once so every page is mapped
  const Span buffer = huge_span(static_cast<size_t>(bytes), arena_huge_pages() && !small_pages);
  std::memset(buffer.data, 1, buffer.size);
  const char* base = reinterpret_cast<const char*>(buffer.data);
  const int parts = pool().size();
  std::vector<float> sums(parts);
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool().run([&](int part) {
      const char* p = base + bytes * part / parts;
      const char* end = base + bytes * (part + 1) / parts;
      sums[part] = isa == Isa::avx512 ? read512(p, end) : isa == Isa::avx2 ? read256(p, end) : read_plain(p, end);
    }, parts);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0.0 && bytes / s / 1e9 > best) best = bytes / s / 1e9;
  }
  volatile float sink = 0.0f;
  for (float v : sums) sink = sink + v;
  return best;
}

}  // namespace specbatch
