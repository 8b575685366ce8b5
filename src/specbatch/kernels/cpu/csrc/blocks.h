// Quantized weights for decode and verify rows: a matrix that came from affine blocks (32 weights
// a group, a float16 scale and bias each, as MLX quantizes the GGUF's Q4_0 / Q4_1 at 4 bits and
// Q8_0 at 8) and holds their float32 values, q * scale + bias with one rounding (what MLX's
// quantized_matmul computes with float32 activations), is read as those blocks: 0.625 (4 bits) or
// 1.125 (8 bits) bytes a weight instead of 4, each group's scale and bias kept as its float16 bits
// and widened as the walk streams them, for any number of token rows: weight rows in vector lanes
// and each group's partial sum scaled once, within rounding of the float32 path (blocks_impl.h,
// blocks_*.cpp). Registration checks every value against the matrix first.
#pragma once

#include <cstdint>

#include "gemv.h"
#include "mlx/array.h"

namespace specbatch {

namespace mx = mlx::core;

// Register `weight` [N, K] (float32, or float16 holding the same values)'s `bits`-bit blocks (q
// uint32 [N, K * bits / 32], scales and biases float16 [N, K / 32]) where they rebuild it exactly,
// returning the bytes a decode row then reads; 0 (and nothing kept) where they do not, for other
// widths than 4 and 8, or where the CPU lacks AVX2 and FMA. The registry keeps its own copy of
// the blocks and holds `weight`, so the key's buffer stays put.
int64_t blocks_register(const mx::array& weight, const mx::array& q, const mx::array& scales,
                        const mx::array& biases, int bits);
// Register `rows` [R, K], the rows `ids` [R] (int32) of the registered `weight`, with those rows of
// its blocks (a reduced-vocabulary head's); the bytes a decode row reads, 0 where `weight` has no
// blocks or `rows` are not its rows.
int64_t blocks_register_rows(const mx::array& rows, const mx::array& weight, const mx::array& ids);
// The blocks registered for the matrix whose buffer is at `data`, or a view with packed == nullptr.
BlockView blocks_lookup(const void* data);
// Forget `weight`'s registration (its module is gone), or every one (tests); how many are held.
void blocks_forget(const mx::array& weight);
void blocks_clear();
int blocks_count();
// Changes at every registration and every forget: a view looked up before a change may dangle.
uint64_t blocks_generation();

}  // namespace specbatch
