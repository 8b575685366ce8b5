// 4-bit weights for decode and verify rows: a matrix that came from affine 4-bit blocks (the
// GGUF's Q4_0 / Q4_1 as MLX quantizes them: 32 weights a group, float16 scale and bias) and holds
// their float32 values, q * scale + bias with one rounding (what MLX's quantized_matmul computes
// with float32 activations), is read as those blocks by up to kMaxRows token rows: 0.75 bytes a
// weight instead of 4 (the nibbles repacked, each group's scale and bias widened at registration;
// the tiles: q4_impl.h, one per ISA in q4_avx512.cpp and q4_avx2.cpp).
// Registration checks every value against the matrix first, so every sum is the float32 path's,
// bit for bit.
#pragma once

#include <cstdint>

#include "gemv.h"
#include "mlx/array.h"

namespace specbatch {

namespace mx = mlx::core;

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

}  // namespace specbatch
