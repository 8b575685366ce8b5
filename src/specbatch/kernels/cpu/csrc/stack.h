// A llama-family decoder stack's decode or verify forward over a paged KV cache, its graph
// built in one call: the ops and order the Python stack takes layer by layer (qkv_rope with
// the input norm, the two paged writes, paged attention, mlp_block with the output
// projection), so every bit is the same, without ~25 us of Python a layer (0.75-0.85 ms of a
// ~8 ms width-1 step, serial with compute).
#pragma once

#include <string>
#include <vector>

#include "mlx/array.h"
#include "projections.h"

namespace specbatch {

namespace mx = mlx::core;

// What every layer shares: the attention's shape and scale, whether q, k and v carry biases.
struct StackShape {
  QkvShape qkv;  // heads, kv_heads, RoPE dims, traditional, RoPE scale (eps: per layer below)
  float attn_scale;
  bool bias;
};

// The weights a layer hands over, in this order (biases only where StackShape::bias).
constexpr int kLayerWeights = 8;  // norm_in, wq, wk, wv, norm_post, wg, wu, wd (+ wo below)
int layer_inputs(bool bias);  // arrays a layer takes: the 8, wo, and 3 biases with bias

// h [B, L, K] (the embeddings); weights: each layer's layer_inputs() arrays in the order
// norm_in, wq, wk, wv, [bq, bk, bv], norm_post, wg, wu, wd, wo; eps: each layer's (input,
// post-attention) norm eps, 2 a layer; pools: each layer's key then value pool [P, Hkv * D];
// write_slots int32 [B * L] (the new tokens' slots), read_slots int32 [B, T] (every token's
// after them); mask as `paged_attention` takes it; keep: layers whose outputs come back.
// -> {the last layer's output, the kept layers' outputs, the pools written (2 a layer)}.
std::vector<mx::array> decoder_stack(const mx::array& h, const std::vector<mx::array>& weights,
                                     const std::vector<float>& eps, const mx::array& positions,
                                     const mx::array& inv_freq, const StackShape& shape,
                                     std::vector<mx::array> pools, const mx::array& write_slots,
                                     const mx::array& read_slots, const std::string& mask_kind,
                                     const mx::array& mask, const std::vector<int>& keep);

}  // namespace specbatch
