// The machine's float32 FMA peak, measured: the compute side of the kernels bench's roofline
// (a verify of 16 positions multiplies every weight 16 times; its floor is the larger of the
// bytes over the sgemv probe's bandwidth and these FLOPs over this peak).
#include "probe.h"

#include <immintrin.h>

#include <chrono>
#include <vector>

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

}  // namespace specbatch
