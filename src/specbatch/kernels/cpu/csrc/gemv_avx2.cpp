#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv.h"
#include "reduce_avx2.h"

namespace specbatch {
namespace {

// Prefetch the weights kAheadTiles tiles ahead, the line each row of that tile reads at this k:
// exactly the lines later tiles consume. A/B on a loaded machine, against 4 KB ahead in each
// row: M=1 5%, M=4 10-20%, M=8 8-22% faster (4 and 8 tiles alike; 1 and 2 less). Into L2
// (kWeightPrefetch, gemv.h: the float tiles' numbers there); 8 and 16 tiles ahead were slower.
constexpr int kAheadTiles = 4;

// Lanes [0, r) of a tail load; the masked load never touches memory past K.
__attribute__((target("avx2,fma"))) inline __m256i tail_mask(int r) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(r), lanes);
}

// 8 weights widened to float32 (float16 converts exactly: see gemv_avx512.cpp); F16C comes
// with every AVX2 CPU made, and half weights are only handed over where the CPU reports it.
__attribute__((target("avx2,fma"))) inline __m256 load_w(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_w(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((target("avx2,fma"))) inline __m256 load_w_tail(const float* p, int r) {
  return _mm256_maskload_ps(p, tail_mask(r));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_w_tail(const uint16_t* p, int r) {
  alignas(16) uint16_t buf[8] = {};
  std::memcpy(buf, p, sizeof(uint16_t) * r);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}

// acc[i][j] += sum over k in [k0, k1) of w row i * x row j, in k order (the lane split and
// the masked tail the same wherever a range starts), optionally prefetching the weights ahead.
template <int NB, int MB, bool Prefetch, typename W>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void accumulate(const float* x, int K, const W* w,
                                                                          int k0, int k1, __m256 (&acc)[NB][MB]) {
  int k = k0;
  for (; k + 8 <= k1; k += 8) {
    __m256 wv[NB];
    for (int i = 0; i < NB; ++i) {
      wv[i] = load_w(w + (long)i * K + k);
      if (Prefetch && (sizeof(W) == 4 || k % 32 == 0))  // half weights: once per 64-byte line
        _mm_prefetch(reinterpret_cast<const char*>(w + (long)(NB * kAheadTiles + i) * K + k), kWeightPrefetch);
    }
    for (int j = 0; j < MB; ++j) {
      __m256 xv = _mm256_loadu_ps(x + (long)j * K + k);
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  if (k < k1) {  // K's tail (only the last range has one)
    const __m256i mask = tail_mask(k1 - k);
    __m256 wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = load_w_tail(w + (long)i * K + k, k1 - k);
    for (int j = 0; j < MB; ++j) {
      __m256 xv = _mm256_maskload_ps(x + (long)j * K + k, mask);
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
}

// NB weight rows x MB token rows per tile: 8 accumulators, 4 weight and 1 x register.
template <int NB, int MB, typename W>
__attribute__((target("avx2,fma,f16c"))) void tile(const float* x, int K, const W* w, float* y, int N) {
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  accumulate<NB, MB, true>(x, K, w, 0, K, acc);
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(long)j * N + i] = hsum(acc[i][j]);
}

template <int NB, typename W>
__attribute__((target("avx2,fma,f16c"))) void rows(const float* x, int M, int K, const W* w, float* y, int N) {
  int m = 0;
  for (; m + 2 <= M; m += 2) tile<NB, 2>(x + (long)m * K, K, w, y + (long)m * N, N);
  if (m < M) tile<NB, 1>(x + (long)m * K, K, w, y + (long)m * N, N);
}

// From 3 rows on, the weight rows' reuse is what limits (the data is in cache): 3 weight x 4
// token rows (12 accumulators, 16 registers in all) over K in blocks of kBlock, so the x rows
// of a block stay in L1 across every row tile. The lane accumulators persist across blocks
// in `acc`, so each (m, n) sums k in the same order as `tile` (`accumulate`: bitwise the same).
// Measured here (Zen 3, 2 threads, 30 layers' linears): M=8 55 -> 46 ms, 16 79 -> 60, 32 130 -> 86.
constexpr int kBlock = 192;

template <int NB, int MB, bool Prefetch, typename W>
__attribute__((target("avx2,fma,f16c"))) void tile_block(const float* x, int K, const W* w, int k0, int k1,
                                                     float* acc_mem) {
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_loadu_ps(acc_mem + (i * MB + j) * 8);
  accumulate<NB, MB, Prefetch>(x, K, w, k0, k1, acc);
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) _mm256_storeu_ps(acc_mem + (i * MB + j) * 8, acc[i][j]);
}

// Row tile at m of `tile_block`, the first of each block prefetching the weights ahead.
template <int NB, int MB, typename W>
__attribute__((target("avx2,fma,f16c"))) void block_tile(const float* x, int m, int K, const W* w, int k0, int k1,
                                                     float* acc) {
  if (m == 0) return tile_block<NB, MB, true>(x, K, w, k0, k1, acc);
  tile_block<NB, MB, false>(x + (long)m * K, K, w, k0, k1, acc + m * NB * 8);
}

template <int NB, typename W>
__attribute__((target("avx2,fma,f16c"))) void rows_blocked(const float* x, int M, int K, const W* w, float* y, int N) {
  static thread_local std::vector<float> acc;
  acc.assign(static_cast<size_t>(M) * NB * 8, 0.0f);  // tile at m: [NB][rows of the tile][8 lanes]
  const int tail = M % 4, full = M - tail;
  for (int k0 = 0; k0 < K; k0 += kBlock) {
    const int k1 = std::min(K, k0 + kBlock);
    for (int m = 0; m < full; m += 4) block_tile<NB, 4>(x, m, K, w, k0, k1, acc.data());
    if (tail == 3) block_tile<NB, 3>(x, full, K, w, k0, k1, acc.data());
    if (tail == 2) block_tile<NB, 2>(x, full, K, w, k0, k1, acc.data());
    if (tail == 1) block_tile<NB, 1>(x, full, K, w, k0, k1, acc.data());
  }
  for (int m = 0; m < M; m += 4) {
    const int mb = std::min(4, M - m);
    for (int i = 0; i < NB; ++i)
      for (int j = 0; j < mb; ++j) y[(long)(m + j) * N + i] = hsum(_mm256_loadu_ps(acc.data() + (m * NB + i * mb + j) * 8));
  }
}

template <typename W>
void gemv(const float* x, int M, int K, const W* w, int n0, int n1, float* y, int N) {
  int n = n0;
  // 3 rows (a k = 2 verify) too: 2 + 1 row tiles read each weight row twice (best of 5 here,
  // K = 1536: 0.20 -> 0.16 ms, as fast as 4 rows; K = 576 level).
  if (M >= 3) {
    for (; n + 3 <= n1; n += 3) rows_blocked<3>(x, M, K, w + (long)n * K, y + n, N);
    for (; n < n1; ++n) rows_blocked<1>(x, M, K, w + (long)n * K, y + n, N);
    return;
  }
  for (; n + 4 <= n1; n += 4) rows<4>(x, M, K, w + (long)n * K, y + n, N);
  for (; n < n1; ++n) rows<1>(x, M, K, w + (long)n * K, y + n, N);
}

}  // namespace

void gemv_avx2(const float* x, int M, int K, const float* w, int n0, int n1, float* y, int N) {
  gemv(x, M, K, w, n0, n1, y, N);
}
void gemv_avx2(const float* x, int M, int K, const uint16_t* w, int n0, int n1, float* y, int N) {
  gemv(x, M, K, w, n0, n1, y, N);
}

}  // namespace specbatch
