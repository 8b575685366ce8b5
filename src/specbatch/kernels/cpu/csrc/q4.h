// 4-bit weights for decode rows: a half-stored matrix that came from affine 4-bit blocks (the
// GGUF's Q4_0 / Q4_1 as MLX quantizes them: 32 weights a group, float16 scale and bias) can
// also be read as those blocks: 0.75 bytes a weight instead of 2 (the nibbles repacked, each
// group's scale and bias widened to float32 at registration). Each group's 16 values are
// rebuilt as MLX's dequantize rounds them (q * scale to float16, + bias to float16) into a
// lookup table, so every weight read is the float16 matrix's value and every sum the float16
// path's, bit for bit; registration checks that for the whole matrix before it is used.
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

// Token rows up to which decode reads the blocks (each group's table is built once for all).
// The target's 210 layer matrices, alternating processes, time over the float16 path's: 4 rows
// 0.82x; 5 rows 1.0-1.1x and 6 rows 1.2x (the tables' float16 roundings no longer pay there).
constexpr int kQ4MaxRows = 4;

// Register `half` [N, K] float16's blocks (q uint32 [N, K / 8], scales and biases float16
// [N, K / 32]) where they rebuild it exactly, returning the bytes a decode row then reads; 0
// (and nothing kept) where they do not, or where the CPU lacks AVX-512. The registry keeps its
// own copy of the blocks and holds `half`, so the key's buffer stays put.
int64_t q4_register(const mx::array& half, const mx::array& q, const mx::array& scales, const mx::array& biases);
// The blocks registered for the float16 buffer at `data`, or a view with packed == nullptr.
Q4View q4_lookup(const void* data);
// Forget `half`'s registration (its module is gone), or every one (tests); how many are held.
void q4_forget(const mx::array& half);
void q4_clear();
int q4_count();

// y[m, n] for rows [n0, n1) of the blocks and M <= kQ4MaxRows token rows: the same sums, in
// the same order, as gemv_avx512 over the float16 matrix.
void gemv_q4_avx512(const float* x, int M, int K, const Q4View& w, int n0, int n1, float* y, int N);

}  // namespace specbatch
