// The 8-bit blocks' walk, shared by the tiles of each ISA (q8_avx512.cpp, q8_avx2.cpp, each file
// compiled for its own; they differ only in how a block's weights come out of its bytes, `Ops`;
// the 4-bit blocks have their own walk and layout, q4_impl.h).
// Each (token row, weight row) pair sums k in order per vector lane, the float32 kernel's order on
// that ISA, and reduces the lanes the same way, so a row's bits never depend on the others.
//
// Ops: `Vec` (a vector of floats), `zero()`, `sum(Vec)`, `block<NB, MB, CHUNKS>(x, K, k0, p, sb,
// acc)` (one 64-weight block, or its first half with CHUNKS = 2, met by MB token rows),
// `kBlockBytes` (a packed block's size), `kOnePass` (token rows read by 4-row weight tiles in one
// pass) and `kPassRows` (token rows a pass beyond that).
//
// The target's 210 layer matrices against the float16 matrix the blocks replaced (AVX-512,
// alternating processes, best of 40): 1 / 2 / 4 / 5 / 8 token rows 0.78 / 0.74 / 0.71 / 0.62 /
// 0.96x the time, 16 / 32 rows 1.05-1.12x / 1.13-1.18x (streaming the float32 matrix itself,
// 4 bytes a weight: 1.5x at 16-32 rows; 48-row weight blocks dequantized into L2 for the float32
// tile: 1.45x at 8 rows).
#pragma once

// (No standard-library templates here: their out-of-line copies would carry this file's ISA flags
// to every caller the linker gives them to.)

#include <immintrin.h>

#include <cstdint>

#include "gemv.h"

namespace specbatch {
namespace blocks_impl {

// Blocks read ahead of the one in hand, in the weights' and the scales' streams (rows ahead at
// the target's widths; a prefetch never faults), into L2 (kWeightPrefetch, gemv.h). AMD EPYC
// Zen 4, whole forwards of the embedded target, alternating processes, medians of 7-8: T0 at 64 blocks 8.67 ms (1 row) / 10.30 (2) / 13.76 (4 positions), T1 at 64
// 8.02 / 9.46 / 12.88, at 256 7.35 / 8.97 / 13.27 (128 7.5, 512 7.3, 1,024 7.5 at 1 row); the
// 8-bit head alone, 2 threads, 1.9-2.1 -> 1.2-1.6 ms. The AVX2 tiles on the same CPU: 0.96x.
constexpr int kAhead = 256;

// Weight rows a block beyond one pass: the block's nibbles stay in L2 while 8-row slabs of x,
// in L1, meet its tiles in turn (x re-read from L2 for every tile made 32 rows 1.5x the time;
// 24- and 96-row blocks measured no better).
constexpr int kBlockRows = 48;

// Blocks whose float16 scale-bias pairs are widened at once into a stack buffer the tiles read
// (4 converts of 8 halves). Streamed as float16, a 4-bit weight is 0.625 bytes instead of 0.75:
// AMD EPYC Zen 4, alternating processes, the width-1 forward 7.7-7.9 -> 7.3-7.5 ms, 2 positions
// 9.2-9.5 -> 8.6-9.5; the engine's plain width 1 +11%.
constexpr int kSpan = 8;

// The float32 values of 4 * kSpan halves at h (exact: float16 widens without rounding). Static:
// each ISA's file keeps its own copy (one shared symbol could carry AVX-512 code to AVX2 callers).
static inline const float* widen(const uint16_t* h, float* out) {
  for (int j = 0; j < 4 * kSpan; j += 8)
    _mm256_store_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
  return out;
}

// NB weight rows at once: NB independent accumulator chains per token row (one chain alone
// waits on each FMA's latency), each still summing its k in order. Whole blocks in the loop,
// with their chunk count known to the compiler (a runtime count left the weights on the stack:
// one core, 1 / 4 token rows 0.90 / 0.80x the time).
template <class Ops, int NB, int MB>
void tile(const float* x, int K, const BlockView& w, int n, float* y, int N) {
  using Vec = typename Ops::Vec;
  constexpr int B = Ops::kBlockBytes;
  const int G = K / 32, blocks = (K + 63) / 64, whole = G / 2;
  Vec acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = Ops::zero();
  const uint8_t* p[NB];
  const uint16_t* half[NB];  // each row's float16 scale-bias pairs, 4 halves a block
  alignas(64) float wide[NB][4 * kSpan];
  const float* sb[NB];
  for (int i = 0; i < NB; ++i) p[i] = w.packed + (long)(n + i) * blocks * B, half[i] = w.sb + (long)(n + i) * G * 2;
  for (int b = 0; b < blocks; ++b) {
    if (b % kSpan == 0)
      for (int i = 0; i < NB; ++i) sb[i] = widen(half[i] + 4 * b, wide[i]);
    for (int i = 0; i < NB; ++i) {  // both streams, a cache line of scales every 8 blocks
      _mm_prefetch(reinterpret_cast<const char*>(p[i] + kAhead * B), kWeightPrefetch);
      if (b % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(half[i] + 4 * (b + kAhead)), kWeightPrefetch);
    }
    if (b < whole) {
      Ops::template block<NB, MB, 4>(x, K, 64 * b, p, sb, acc);
    } else {
      Ops::template block<NB, MB, 2>(x, K, 64 * b, p, sb, acc);  // K / 32 odd: the last half block
    }
    for (int i = 0; i < NB; ++i) p[i] += B, sb[i] += 4;
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(long)j * N + n + i] = Ops::sum(acc[i][j]);
}

// `rows` (1..MB) token rows against the 2-row weight tile at n.
template <class Ops, int MB = Ops::kPassRows>
void slab(const float* x, int rows, int K, const BlockView& w, int n, float* y, int N) {
  if constexpr (MB > 1) {
    if (rows < MB) return slab<Ops, MB - 1>(x, rows, K, w, n, y, N);
  }
  tile<Ops, 2, MB>(x, K, w, n, y, N);
}

// Weight rows [n0, n1) for M token rows: 4-row weight tiles in one pass where M is that small
// (more accumulator chains a token row), else 2-row tiles met by up to kPassRows token rows a
// pass, blocked as above; an odd last weight row alone.
template <class Ops, int MB = Ops::kOnePass>
void gemv(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N) {
  if constexpr (MB > 1) {
    if (M < MB) return gemv<Ops, MB - 1>(x, M, K, w, n0, n1, y, N);
  }
  if (M == MB)
    for (; n0 + 4 <= n1; n0 += 4) tile<Ops, 4, MB>(x, K, w, n0, y, N);
  const int even = n0 + (n1 - n0) / 2 * 2;
  for (int b0 = n0; b0 < even; b0 += kBlockRows) {
    const int b1 = b0 + kBlockRows < even ? b0 + kBlockRows : even;
    for (int m = 0; m < M; m += Ops::kPassRows)
      for (int n = b0; n < b1; n += 2)
        slab<Ops>(x + (long)m * K, M - m < Ops::kPassRows ? M - m : Ops::kPassRows, K, w, n, y + (long)m * N, N);
  }
  if (even < n1)
    for (int m = 0; m < M; ++m) tile<Ops, 1, 1>(x + (long)m * K, K, w, even, y + (long)m * N, N);
}

}  // namespace blocks_impl
}  // namespace specbatch
