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
// bandwidth with L1 prefetches; whole forwards of the target on the float tiles, float16 weights
// 17.1-17.8 -> 10.7-11.4 ms a step (AVX2 tiles 17.1-17.7 -> 11.2-12.5), float32 25.4-27.3 ->
// 18.8-21.0, 16 rows 0.88-0.92x. (Non-temporal prefetches of the blocks: 1.09x the time.)
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

// A matrix's registered blocks as the tiles read them (blocks.h): blocks_impl.h's records, each
// group's scale and bias inside them as the checkpoint's float16 bits.
struct BlockView {
  const uint8_t* packed = nullptr;
  int bits = 0;  // 4 or 8
};

// The same y read from 4- or 8-bit blocks (blocks_*.cpp, any M): sums of their own, each group's
// partial sum scaled once, the same bits on both ISAs. `again`: this thread's previous call in
// the same pass read the same x (its prepared copy then stands).
void gemv_blocks_avx512(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N, bool again);
void gemv_blocks_avx2(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N, bool again);

}  // namespace specbatch
