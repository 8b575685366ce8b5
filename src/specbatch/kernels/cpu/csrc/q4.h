// 4-bit weights for decode and verify rows: a matrix that came from affine 4-bit blocks (the
// GGUF's Q4_0 / Q4_1 as MLX quantizes them: 32 weights a group, float16 scale and bias) and holds
// their float32 values, q * scale + bias with one rounding (what MLX's quantized_matmul computes
// with float32 activations), is read as those blocks by up to kMaxRows token rows: 0.75 bytes a
// weight instead of 4 (the nibbles repacked, each group's scale and bias widened at registration).
// Registration checks every value against the matrix first, so every sum is the float32 path's,
// bit for bit.
#pragma once

#include <cstdint>

#include "mlx/array.h"

namespace specbatch {

namespace mx = mlx::core;

// A matrix's 4-bit blocks as the kernel reads them (q4.cpp): nibbles packed a 64-weight block
// at a time, and each group's scale and bias widened, side by side.
struct Q4View {
  const uint16_t* packed = nullptr;
  const float* sb = nullptr;
};

// Token rows read in one pass of 4 weight rows (1-3) or 2 (4); 5-32 rows take passes of up to 8
// over 2-row weight tiles (q4.cpp). The target's 210 layer matrices against the float16 matrix
// they replaced, alternating processes, best of 40: 1 / 2 / 4 / 5 / 8 token rows 0.78 / 0.74 /
// 0.71 / 0.62 / 0.96x the time, 16 / 32 rows 1.05-1.12x / 1.13-1.18x (the float32 matrix
// itself, 4 bytes a weight, 1.5x at 16-32 rows).
constexpr int kQ4MaxRows = 4;

// Register `weight` [N, K] (float32, or float16 holding the same values)'s blocks (q uint32
// [N, K / 8], scales and biases float16 [N, K / 32]) where they rebuild it exactly, returning the
// bytes a decode row then reads; 0 (and nothing kept) where they do not, or where the CPU lacks
// AVX2 and FMA. The registry keeps its own copy of the blocks and holds `weight`, so the key's buffer
// stays put.
int64_t q4_register(const mx::array& weight, const mx::array& q, const mx::array& scales, const mx::array& biases);
// The blocks registered for the matrix whose buffer is at `data`, or a view with packed == nullptr.
Q4View q4_lookup(const void* data);
// Forget `weight`'s registration (its module is gone), or every one (tests); how many are held.
void q4_forget(const mx::array& weight);
void q4_clear();
int q4_count();

// y[m, n] for rows [n0, n1) of the blocks and M <= kMaxRows token rows: the same sums, in the
// same order, as gemv_avx512 (gemv_avx2) over the float32 matrix.
void gemv_q4_avx512(const float* x, int M, int K, const Q4View& w, int n0, int n1, float* y, int N);
void gemv_q4_avx2(const float* x, int M, int K, const Q4View& w, int n0, int n1, float* y, int N);

}  // namespace specbatch
