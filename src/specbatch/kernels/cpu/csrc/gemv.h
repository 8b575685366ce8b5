// y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m: every weight row is read once for
// all rows of x. Each (m, n) sums k in one fixed order whatever M, the tile or the thread
// split, so a row's result is bitwise the same however many rows share the call.
#pragma once

#include <xmmintrin.h>

#include <cstdint>

namespace specbatch {

// Where every tile's weight prefetches land: L2, not L1. A line prefetched into L1 holds one of
// the core's few miss buffers for its whole trip from memory, and the tile's own loads wait
// behind it. Zen 4 EPYC, alternating processes: the 8-bit head streamed at half the read
// bandwidth (the blocks' numbers: blocks_impl.h); whole forwards of the target on the float
// tiles, float16 weights 17.1-17.8 -> 10.7-11.4 ms a step (AVX2 tiles 17.1-17.7 -> 11.2-12.5),
// float32 25.4-27.3 -> 18.8-21.0, 16 rows 0.88-0.92x.
constexpr _mm_hint kWeightPrefetch = _MM_HINT_T1;

enum class Isa { none, avx2, avx512 };

Isa detect_isa();
const char* isa_name(Isa isa);

// Whether the CPU widens float16 weights (F16C; every AVX-512 CPU has it).
bool half_weights_supported();

// Rows [n0, n1) of the output columns; x is [M, K], w is [N, K], y is [M, N] (row-major).
// Weights float32, or float16 (IEEE half bits) widened exactly as they are read.
void gemv_avx2(const float* x, int M, int K, const float* w, int n0, int n1, float* y, int N);
void gemv_avx2(const float* x, int M, int K, const uint16_t* w, int n0, int n1, float* y, int N);
void gemv_avx512(const float* x, int M, int K, const float* w, int n0, int n1, float* y, int N);
void gemv_avx512(const float* x, int M, int K, const uint16_t* w, int n0, int n1, float* y, int N);

// A matrix's registered blocks as the tiles read them (blocks.h). 8 bits: 64 weights a block, its
// 64 bytes in order, each group of 32 with its scale and bias side by side as float16 bits in sb
// (the checkpoint's own: widened exactly by the walk, blocks_impl.h). 4 bits: q4_impl.h's
// records, scales and biases inside them (sb unused).
struct BlockView {
  const uint8_t* packed = nullptr;
  const uint16_t* sb = nullptr;  // 8 bits: [N, K / 32, 2], then kScalePad halves of padding
  int bits = 0;
};

// Halves past the last row's scales, so the walk widens whole spans without a bounds check.
constexpr int kScalePad = 32;

// The same y read from blocks. 8 bits (q8_*.cpp, M <= 32 token rows): the same sums, in the same
// order, as gemv_avx512 (gemv_avx2) over the blocks' float32 values. 4 bits (q4_*.cpp, any M):
// sums of their own, each group's partial sum scaled once, the same bits on both ISAs.
void gemv_q4_avx512(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N);
void gemv_q4_avx2(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N);
void gemv_q8_avx512(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N);
void gemv_q8_avx2(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N);

}  // namespace specbatch
