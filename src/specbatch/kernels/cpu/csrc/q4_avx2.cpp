// The 4-bit blocks' tile for AVX2 CPUs (q4.h): no 16-lane table lookup here, so each 8-weight
// half chunk is computed, q * scale + bias in one FMA, the same value the AVX-512 table holds.
// Lane l sums k = l (mod 8) in k order and the lanes end in the same sum as gemv_avx2's, so
// every row's bits are the float32 matrix's on this path too.
#include <immintrin.h>

#include <algorithm>

#include "gemv.h"
#include "q4.h"
#include "reduce_avx2.h"

namespace specbatch {
namespace {

constexpr int kAhead = 64;  // blocks read ahead in both streams, as the AVX-512 tile

// Weights 16c + 8h + 0..7 of the block at p (word l holds nibble c of weight 16c + l) as
// float32: q * s + b, rounded once.
template <int C, int H>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 weights(const uint16_t* p, const float* sb) {
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * H)));
  const __m256i q = _mm256_and_si256(_mm256_srli_epi32(words, 4 * C), _mm256_set1_epi32(15));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_broadcast_ss(sb), _mm256_broadcast_ss(sb + 1));
}

// Half chunk (C, H) of one block for NB weight rows and MB token rows.
template <int NB, int MB, int C, int H>
__attribute__((target("avx2,fma"), always_inline)) inline void half_chunk(const float* x, int K, int k0,
                                                                         const uint16_t* const (&p)[NB],
                                                                         const float* const (&sb)[NB],
                                                                         __m256 (&acc)[NB][MB]) {
  __m256 wv[NB];
  for (int i = 0; i < NB; ++i) wv[i] = weights<C, H>(p[i], sb[i] + 2 * (C / 2));
  for (int j = 0; j < MB; ++j) {
    __m256 xv = _mm256_loadu_ps(x + (long)j * K + k0 + 16 * C + 8 * H);
    asm("" : "+x"(xv));  // one load per x vector, not one folded into each FMA
    for (int i = 0; i < NB; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
  }
}

template <int NB, int MB, int CHUNKS>
__attribute__((target("avx2,fma"), always_inline)) inline void block(const float* x, int K, int k0,
                                                                    const uint16_t* const (&p)[NB],
                                                                    const float* const (&sb)[NB],
                                                                    __m256 (&acc)[NB][MB]) {
  half_chunk<NB, MB, 0, 0>(x, K, k0, p, sb, acc);
  half_chunk<NB, MB, 0, 1>(x, K, k0, p, sb, acc);
  half_chunk<NB, MB, 1, 0>(x, K, k0, p, sb, acc);
  half_chunk<NB, MB, 1, 1>(x, K, k0, p, sb, acc);
  if constexpr (CHUNKS == 4) {
    half_chunk<NB, MB, 2, 0>(x, K, k0, p, sb, acc);
    half_chunk<NB, MB, 2, 1>(x, K, k0, p, sb, acc);
    half_chunk<NB, MB, 3, 0>(x, K, k0, p, sb, acc);
    half_chunk<NB, MB, 3, 1>(x, K, k0, p, sb, acc);
  }
}

template <int NB, int MB>
__attribute__((target("avx2,fma"))) void tile(const float* x, int K, const Q4View& w, int n, float* y, int N) {
  const int G = K / 32, blocks = (K + 63) / 64, whole = G / 2;
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  const uint16_t* p[NB];
  const float* sb[NB];
  for (int i = 0; i < NB; ++i) p[i] = w.packed + (long)(n + i) * blocks * 16, sb[i] = w.sb + (long)(n + i) * G * 2;
  for (int b = 0; b < whole; ++b) {
    for (int i = 0; i < NB; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(p[i] + kAhead * 16), _MM_HINT_T0);
      if (b % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(sb[i] + kAhead * 4), _MM_HINT_T0);
    }
    block<NB, MB, 4>(x, K, 64 * b, p, sb, acc);
    for (int i = 0; i < NB; ++i) p[i] += 16, sb[i] += 4;
  }
  if (whole < blocks) block<NB, MB, 2>(x, K, 64 * whole, p, sb, acc);  // K / 32 odd
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(long)j * N + n + i] = hsum(acc[i][j]);
}

// Token rows [0, rows) (at most 4) against the 2-row weight tile at n: 8 accumulators, 2
// weight vectors and x within the 16 registers.
void slab(const float* x, int rows, int K, const Q4View& w, int n, float* y, int N) {
  switch (rows) {
    case 1: return tile<2, 1>(x, K, w, n, y, N);
    case 2: return tile<2, 2>(x, K, w, n, y, N);
    case 3: return tile<2, 3>(x, K, w, n, y, N);
    default: return tile<2, 4>(x, K, w, n, y, N);
  }
}

constexpr int kPassRows = 4, kBlockRows = 48;

}  // namespace

void gemv_q4_avx2(const float* x, int M, int K, const Q4View& w, int n0, int n1, float* y, int N) {
  int n = n0;
  if (M == 1) {  // one token row: 4 weight rows a pass, for independent accumulator chains
    for (; n + 4 <= n1; n += 4) tile<4, 1>(x, K, w, n, y, N);
  }
  const int even = n + (n1 - n) / 2 * 2;
  for (int b0 = n; b0 < even; b0 += kBlockRows) {  // weight blocks in L2, 4-row slabs of x in L1
    const int b1 = std::min(even, b0 + kBlockRows);
    for (int m = 0; m < M; m += kPassRows)
      for (int r = b0; r < b1; r += 2) slab(x + (long)m * K, std::min(kPassRows, M - m), K, w, r, y + (long)m * N, N);
  }
  if (even < n1)
    for (int m = 0; m < M; ++m) tile<1, 1>(x + (long)m * K, K, w, even, y + (long)m * N, N);
}

}  // namespace specbatch
