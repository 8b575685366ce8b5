#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv.h"

namespace specbatch {
namespace {

// Prefetch the weights kAheadTiles tiles ahead, the line each row of that tile reads at this k:
// exactly the lines later tiles consume. A/B on a loaded machine, against 4 KB ahead in each
// row: M=1 5%, M=4 10-20%, M=8 8-22% faster (4 and 8 tiles alike; 1 and 2 less). Into L2
// (kWeightPrefetch, gemv.h: the float tiles' numbers there); 8 and 16 tiles ahead were slower.
constexpr int kAheadTiles = 4;

// out[a] = _mm512_reduce_add_ps(acc[a]) for 16 accumulators, bit for bit (the same pairs
// added in the same tree: lanes p and p+8, then +4, +2, +1), by shuffles that add two
// accumulators' halves at once: 30 shuffles and 15 adds instead of 16 x 8 operations.
__attribute__((target("avx512f"))) inline void reduce16(const __m512* acc, float* out) {
  __m512 v[8], u[4], t[2];
  for (int k = 0; k < 8; ++k)  // lanes 0-7: acc 2k's p + (p+8); lanes 8-15: acc 2k+1's
    v[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)  // 128-bit lane q: acc 4k+q's four partial sums
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)  // lane q, elements 0-1: acc 8k+q; 2-3: acc 8k+4+q
    t[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 total = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, total);
  for (int q = 0; q < 4; ++q)
    for (int e = 0; e < 4; ++e) out[4 * e + q] = lanes[4 * q + e];  // lane (q, e) holds acc 4e+q
}

// 16 weights widened to float32: float16 values convert exactly, so a half-stored matrix whose
// values are half-exact gives the float32 matrix's sums bit for bit, at half the bytes streamed.
__attribute__((target("avx512f"))) inline __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load_w(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// The first r < 16 weights at p (zeros after them), never reading past p + r.
__attribute__((target("avx512f"))) inline __m512 load_w_tail(const float* p, int r) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << r) - 1u), p);
}
__attribute__((target("avx512f"))) inline __m512 load_w_tail(const uint16_t* p, int r) {
  alignas(32) uint16_t buf[16] = {};
  std::memcpy(buf, p, sizeof(uint16_t) * r);
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)));
}

// NB weight rows x MB token rows per tile (NB * MB accumulators, NB + MB loads per NB * MB
// FMAs). Only a weight tile's first pass prefetches: later passes over more token rows find
// the tile in L1 already.
template <int NB, int MB, bool Prefetch, typename W>
__attribute__((target("avx512f"))) void tile(const float* x, int K, const W* w, float* y, int N) {
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NB];
    for (int i = 0; i < NB; ++i) {
      wv[i] = load_w(w + (long)i * K + k);
      // one prefetch per 64-byte line: every k for float32 weights, every other for half
      if (Prefetch && (sizeof(W) == 4 || k % 32 == 0))
        _mm_prefetch(reinterpret_cast<const char*>(w + (long)(NB * kAheadTiles + i) * K + k), kWeightPrefetch);
    }
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      __m512 xv = _mm512_loadu_ps(x + (long)j * K + k);
      // one load per x vector: GCC otherwise folds it into each of the NB FMAs (NB loads),
      // which made the tile load-bound (~half the FMA peak with hot weights)
      asm("" : "+v"(xv));
#pragma GCC unroll 4
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = load_w_tail(w + (long)i * K + k, K - k);
    for (int j = 0; j < MB; ++j) {
      __m512 xv = _mm512_maskz_loadu_ps(mask, x + (long)j * K + k);
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  constexpr int n = NB * MB, whole = n / 16 * 16;
  float sums[n];
  for (int c = 0; c < whole; c += 16) reduce16(&acc[0][0] + c, sums + c);
  for (int c = whole; c < n; ++c) sums[c] = _mm512_reduce_add_ps((&acc[0][0])[c]);
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(long)j * N + i] = sums[i * MB + j];
}

// One tile pass; a weight tile's first pass over token rows prefetches the tiles ahead.
template <int NB, int MB, typename W>
__attribute__((target("avx512f"))) inline void pass(bool first, const float* x, int K, const W* w, float* y, int N) {
  if (first) tile<NB, MB, true>(x, K, w, y, N);
  else tile<NB, MB, false>(x, K, w, y, N);
}

// Token rows in tiles of Wide (where there are that many), then 4, then the rest.
template <int NB, int Wide, typename W>
__attribute__((target("avx512f"))) void rows(const float* x, int M, int K, const W* w, float* y, int N) {
  int m = 0;
  for (; m + Wide <= M; m += Wide) pass<NB, Wide>(m == 0, x + (long)m * K, K, w, y + (long)m * N, N);
  for (; m + 4 <= M; m += 4) pass<NB, 4>(m == 0, x + (long)m * K, K, w, y + (long)m * N, N);
  const bool first = m == 0;
  x += (long)m * K, y += (long)m * N;
  switch (M - m) {
    case 3: pass<NB, 3>(first, x, K, w, y, N); break;
    case 2: pass<NB, 2>(first, x, K, w, y, N); break;
    case 1: pass<NB, 1>(first, x, K, w, y, N); break;
    default: break;
  }
}

template <int NB, int Wide, typename W>
__attribute__((target("avx512f"))) void columns(const float* x, int M, int K, const W* w, int n0, int n1,
                                                float* y, int N) {
  int n = n0;
  for (; n + NB <= n1; n += NB) rows<NB, Wide>(x, M, K, w + (long)n * K, y + n, N);
  for (; n < n1; ++n) rows<1, Wide>(x, M, K, w + (long)n * K, y + n, N);
}

// 16, 24 or 32 rows and prefill's (M a multiple of 8): 8-row slabs of x against blocks of
// kBlockRows weight rows, so a block stays in L2 across every slab and a slab in L1 across the
// block's tiles. One core, 512 rows: 139-202 GFLOP/s against 117-120 for OpenBLAS's Haswell
// sgemm; a forward of 16 rows (two threads, in one process) 13-15% faster than 3-row columns.
constexpr int kBlockRows = 96;  // one core, 16-64 rows: 1-4% faster than 48, 192 lost at K = 1536

template <typename W>
__attribute__((target("avx512f"))) void blocked(const float* x, int M, int K, const W* w, int n0, int n1,
                                                float* y, int N) {
  for (int b0 = n0; b0 < n1; b0 += kBlockRows) {
    const int b1 = std::min(n1, b0 + kBlockRows);
    for (int m = 0; m < M; m += 8) {
      int n = b0;
      for (; n + 3 <= b1; n += 3) pass<3, 8>(m == 0, x + (long)m * K, K, w + (long)n * K, y + (long)m * N + n, N);
      for (; n < b1; ++n) tile<1, 8, false>(x + (long)m * K, K, w + (long)n * K, y + (long)m * N + n, N);
    }
  }
}

// 8-15 rows in 3 x 8 tiles (24 accumulators; 11 loads per 24 FMAs against 4 x 4's 8 per 16;
// one core, interleaved: 30-40% faster at 8 rows), fewer in 4 x 4 ones, the rest blocked.
template <typename W>
void tiles(const float* x, int M, int K, const W* w, int n0, int n1, float* y, int N) {
  if (M > 32 || (M >= 16 && M % 8 == 0)) return blocked(x, M, K, w, n0, n1, y, N);
  if (M >= 8) return columns<3, 8>(x, M, K, w, n0, n1, y, N);
  columns<4, 4>(x, M, K, w, n0, n1, y, N);
}

// 3, 5-7 and 12 rows are padded with zero rows to 4, 8 and 16, prefill's to a multiple of 8:
// the weights stream once either way, and whole tiles ran faster (one core, cold weights, time
// over 1 row: 3 rows 1.6 against 4 rows 1.25, 5-7 rows 1.7-2.3 against 8 rows 1.36). A row's
// sums are the same.
template <typename W>
void gemv(const float* x, int M, int K, const W* w, int n0, int n1, float* y, int N) {
  const int padded = M == 3 ? 4 : (M > 4 && M < 8) ? 8 : M == 12 ? 16 : M > 32 ? (M + 7) / 8 * 8 : M;
  if (padded == M || n1 <= n0) return tiles(x, M, K, w, n0, n1, y, N);
  static thread_local std::vector<float> xs, ys;
  const int cols = n1 - n0;
  xs.assign(static_cast<size_t>(padded) * K, 0.0f);
  std::copy(x, x + static_cast<size_t>(M) * K, xs.begin());
  ys.resize(static_cast<size_t>(padded) * cols);
  tiles(xs.data(), padded, K, w, n0, n1, ys.data() - n0, cols);  // row m, column n at ys[m * cols + n - n0]
  for (int m = 0; m < M; ++m)
    std::copy(ys.begin() + static_cast<size_t>(m) * cols, ys.begin() + static_cast<size_t>(m + 1) * cols,
              y + static_cast<size_t>(m) * N + n0);
}

}  // namespace

void gemv_avx512(const float* x, int M, int K, const float* w, int n0, int n1, float* y, int N) {
  gemv(x, M, K, w, n0, n1, y, N);
}
void gemv_avx512(const float* x, int M, int K, const uint16_t* w, int n0, int n1, float* y, int N) {
  gemv(x, M, K, w, n0, n1, y, N);
}

}  // namespace specbatch
