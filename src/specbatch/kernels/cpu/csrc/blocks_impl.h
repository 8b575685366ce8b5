// The quantized blocks' walk (4 and 8 bits), shared by the AVX-512 and AVX2 tiles
// (blocks_avx512.cpp, blocks_avx2.cpp, each compiled for its own ISA; they differ only in the
// vector width, `Ops`).
//
// Vector lanes hold weight rows, not k: a lane sums its own row's dot product, so no lane ever
// needs a horizontal sum, and a group's scale multiplies a whole 32-k partial sum once:
//   y[n] = sum_g ( scale[n, g] * sum_{k in g} q[n, k] * x[k]  +  bias[n, g] * sum_{k in g} x[k] ).
// A chunk of 16 weights is one mask and one convert, then one FMA per token row, where the
// blocks' own value q * scale + bias cost a table (4 bits) or a widen and an FMA (8 bits) before
// every row's FMA (one core, in cache, the target's 576 x 576 4-bit blocks: 1 / 2 / 4 token rows
// 0.73 / 1.10 / 1.59 -> 0.48 / 0.73 / 1.34 ns a 16-weight chunk). The sums are not the float32
// matrix's bit for bit: against the exact product they err ~5e-8 of sum |x w| (MLX's
// quantized_matmul ~1.5e-7).
// Values are masked in place, q * 2^(bits j) in lane bits [bits j, bits (j + 1)), and x comes
// pre-scaled by 2^-(bits j), so the product is q * x exactly (powers of two; x under ~2^-100
// would lose bits): no shift per weight. Every row runs the same FMAs in the same order whatever
// the rows, the lanes, the thread split or the ISA beside it, so a row's bits never depend on them.
//
// Layout (blocks.cpp packs it): tile groups of 64 weight rows, 4 slabs of 16; each 32-k group of
// a tile group is one record, read as one stream: BITS words x 4 slabs x 16 uint32 lanes (lane
// l's word w holds, as its value j, the weight (row 16 slab + l, k = (32 / BITS) w + j)), then per
// slab 16 float16 scales and 16 float16 biases: 1,280 bytes at 4 bits, 2,304 at 8. One stream a
// thread instead of a stream per weight row and its scales (a standalone copy over the target's
// 210 layer matrices, two threads, 1 token row: the table tile 2.8-3.1 ms, this tile a stream per
// slab 2.7-3.2, one stream 2.4-2.6; a plain read of the same bytes 1.6). The engine's width-1
// plain decode, the old and new 4-bit tiles toggled prompt by prompt in one process: 0.946x the
// time (24 pairs; forwards alone ~0.9x).
//
// Ops: `Vec`, `Words`, `kLanes` (16 or 8), `zero()`, `load(p)` (kLanes uint32 words),
// `values<BITS, J>(words)` (value J's q * 2^(BITS J) as floats, the top one shifted down by
// BITS first), `halves(p)` (kLanes float16 widened), `fma`, `broadcast(float)`, `store(p, v)`,
// `kPassRows` (token rows a tile at most) and `units(rows)` (vectors of weight rows a tile of that
// many token rows reads).
#pragma once

// (No standard-library templates here: their out-of-line copies would carry this file's ISA flags
// to every caller the linker gives them to.)

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>

#include "gemv.h"
#include "reduce_avx2.h"

namespace specbatch {
namespace blocks_impl {

constexpr int kSlab = 16, kSlabs = 4, kTileRows = kSlab * kSlabs;
constexpr int kLineBytes = kSlabs * kSlab * 4;  // one word of every lane of a tile group: 256
constexpr int words_bytes(int bits) { return bits * kLineBytes; }
constexpr int record_bytes(int bits) { return words_bytes(bits) + kSlabs * kSlab * 2 * 2; }
// Records prefetched ahead into L2. A standalone walk over the layers read 0-32 within noise, but
// in the engine the nearer read-ahead wins: 4 against 16, toggled in one process, whole forwards
// at 1 / 2 / 4 positions 0.93 / 0.89 / 0.95x the time (widths 4-16 even), the engine's width-1
// decode 0.92x plain (36 prompt pairs) and 0.96x at k = 1; 8 even with 4, 48 slower than 16.
constexpr int kAhead = 4;

// x's pre-scaling by k % 8: the value's place in its word (the top one shifted down first).
constexpr float kPlace4[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-24f};
constexpr float kPlace8[8] = {1.0f, 0x1p-8f, 0x1p-16f, 0x1p-16f, 1.0f, 0x1p-8f, 0x1p-16f, 0x1p-16f};

// Each row's x pre-scaled (xs [M, K]) and its groups' sums (sums [M, K / 32]), in a fixed order
// (8-lane adds, then reduce_avx2's hsum) on both ISAs. Per thread: the buffer it grows. `again`:
// this thread's previous call was for the same x (a pass's next matrix, as q, k and v are), so
// what it prepared stands where the width and shape match.
static inline void prepare(const float* x, int M, int K, int bits, bool again, float*& xs, float*& sums) {
  static thread_local float* buffer = nullptr;
  static thread_local long capacity = 0;
  static thread_local int held[3] = {0, 0, 0};  // the bits, M and K the buffer holds
  const long need = (long)M * K + (long)M * (K / 32);
  xs = buffer, sums = buffer + (long)M * K;
  if (again && held[0] == bits && held[1] == M && held[2] == K) return;
  if (need > capacity) {  // kept for the thread's life: the pool's threads reuse it every pass
    std::free(buffer);
    buffer = static_cast<float*>(std::malloc(need * sizeof(float)));
    if (buffer == nullptr) std::abort();
    capacity = need;
  }
  xs = buffer, sums = buffer + (long)M * K;
  held[0] = bits, held[1] = M, held[2] = K;
  const __m256 place = _mm256_loadu_ps(bits == 4 ? kPlace4 : kPlace8);
  for (long r = 0; r < M; ++r)
    for (int g = 0; g < K / 32; ++g) {
      const float* in = x + r * K + 32 * g;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(in + 8 * i);
        _mm256_storeu_ps(xs + r * K + 32 * g + 8 * i, _mm256_mul_ps(v[i], place));
      }
      sums[r * (K / 32) + g] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    }
}

// Value J of T units' words against MB token rows (xk: x's pre-scaled word).
template <class Ops, int BITS, int J, int MB, int T>
__attribute__((always_inline)) inline void step(const typename Ops::Words (&w)[T], const float* xk, int K,
                                                typename Ops::Vec (&acc)[MB][T]) {
  typename Ops::Vec q[T];
  for (int t = 0; t < T; ++t) q[t] = Ops::template values<BITS, J>(w[t]);
  for (int r = 0; r < MB; ++r) {
    const typename Ops::Vec xb = Ops::broadcast(xk[(long)r * K + J]);
    for (int t = 0; t < T; ++t) acc[r][t] = Ops::fma(q[t], xb, acc[r][t]);
  }
  if constexpr (J + 1 < 32 / BITS) step<Ops, BITS, J + 1>(w, xk, K, acc);
}

// T vectors of weight rows (units u0.. of the tile group at `base`) for MB token rows, every group.
template <class Ops, int BITS, int MB, int T>
__attribute__((noinline)) void tile(const float* xs, const float* sums, int K, const uint8_t* base, int u0,
                                    float* y, int ldy, long n_base, long n0, long n1) {
  using Vec = typename Ops::Vec;
  constexpr int L = Ops::kLanes, kUnitsPerSlab = kSlab / L, kRecord = record_bytes(BITS), kPerWord = 32 / BITS;
  const int G = K / 32;
  Vec tot[MB][T], acc[MB][T];
  for (int r = 0; r < MB; ++r)
    for (int t = 0; t < T; ++t) tot[r][t] = Ops::zero();
  const uint8_t* p = base;
  for (int g = 0; g < G; ++g, p += kRecord) {
    for (int i = 0; i < kRecord; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * kRecord + i), kWeightPrefetch);
    for (int r = 0; r < MB; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = Ops::zero();
    for (int o = 0; o < BITS; ++o) {
      typename Ops::Words w[T];
      for (int t = 0; t < T; ++t) w[t] = Ops::load(p + o * kLineBytes + (u0 + t) * 4 * L);
      step<Ops, BITS, 0>(w, xs + 32 * g + kPerWord * o, K, acc);
    }
    for (int t = 0; t < T; ++t) {
      const int u = u0 + t;
      const uint8_t* sb = p + words_bytes(BITS) + (u / kUnitsPerSlab) * 64 + (u % kUnitsPerSlab) * 2 * L;
      const Vec scale = Ops::halves(sb), bias = Ops::halves(sb + 32);
      for (int r = 0; r < MB; ++r) {
        tot[r][t] = Ops::fma(acc[r][t], scale, tot[r][t]);
        tot[r][t] = Ops::fma(bias, Ops::broadcast(sums[(long)r * G + g]), tot[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const long first = n_base + (long)(u0 + t) * L;
    for (int r = 0; r < MB; ++r) {
      if (first >= n0 && first + L <= n1) {
        Ops::store(y + r * (long)ldy + first, tot[r][t]);
        continue;
      }
      alignas(64) float lanes[L];  // a unit at the range's edge: only its rows in [n0, n1)
      Ops::store(lanes, tot[r][t]);
      for (int l = 0; l < L; ++l)
        if (first + l >= n0 && first + l < n1) y[r * (long)ldy + first + l] = lanes[l];
    }
  }
}

// MB token rows (1..Ops::kPassRows) against T units (1..Ops::units(MB)), both known at compile time.
template <class Ops, int BITS, int MB = Ops::kPassRows, int T = Ops::units(1)>
void dispatch(int rows, int units, const float* xs, const float* sums, int K, const uint8_t* base, int u0, float* y,
              int ldy, long n_base, long n0, long n1) {
  if constexpr (MB > 1) {
    if (rows < MB) return dispatch<Ops, BITS, MB - 1, T>(rows, units, xs, sums, K, base, u0, y, ldy, n_base, n0, n1);
  }
  if constexpr (T > Ops::units(MB)) {
    return dispatch<Ops, BITS, MB, T - 1>(rows, units, xs, sums, K, base, u0, y, ldy, n_base, n0, n1);
  } else if constexpr (T > 1) {
    if (units < T) return dispatch<Ops, BITS, MB, T - 1>(rows, units, xs, sums, K, base, u0, y, ldy, n_base, n0, n1);
  }
  tile<Ops, BITS, MB, T>(xs, sums, K, base, u0, y, ldy, n_base, n0, n1);
}

// Weight rows [n0, n1) for M token rows (any M: passes of kPassRows rows over a tile group, which
// stays in L2 between them).
template <class Ops, int BITS>
void gemv(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N, bool again) {
  if (M <= 0 || n0 >= n1) return;
  float *xs, *sums;
  prepare(x, M, K, BITS, again, xs, sums);
  constexpr int kUnitsPerSlab = kSlab / Ops::kLanes;
  const long record_stride = (long)(K / 32) * record_bytes(BITS);
  for (int tg = n0 / kTileRows; tg * kTileRows < n1; ++tg) {
    const long n_base = (long)tg * kTileRows;
    const int first = n0 > n_base ? (n0 - n_base) / Ops::kLanes : 0;
    const int last = n1 < n_base + kTileRows ? (n1 - n_base + Ops::kLanes - 1) / Ops::kLanes : kSlabs * kUnitsPerSlab;
    for (int m = 0; m < M; m += Ops::kPassRows) {
      const int rows = M - m < Ops::kPassRows ? M - m : Ops::kPassRows, most = Ops::units(rows);
      for (int u = first; u < last; u += most)
        dispatch<Ops, BITS>(rows, last - u < most ? last - u : most, xs + (long)m * K, sums + (long)m * (K / 32), K,
                            w.packed + tg * record_stride, u, y + (long)m * N, N, n_base, n0, n1);
    }
  }
}

// Both widths, chosen by the view's.
template <class Ops>
void gemv_blocks(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N, bool again) {
  if (w.bits == 8) return gemv<Ops, 8>(x, M, K, w, n0, n1, y, N, again);
  gemv<Ops, 4>(x, M, K, w, n0, n1, y, N, again);
}

}  // namespace blocks_impl
}  // namespace specbatch
