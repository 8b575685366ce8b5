// A llama-family decoder stack's decode or verify forward over a paged KV cache as one MLX op:
// per layer the input norm with q, k and v and RoPE, the two paged writes, paged attention and
// the block's second half (mlp_block with the output projection), the functions the separate
// ops run in the order the Python stack builds them, so every bit is the same. A width-1 step
// was ~150 ops: their graph built in Python (~25 us a layer, 0.75-0.85 ms), then scheduled one
// by one on the caller's thread (~4 us each), while the step's compute ran on both cores.
#pragma once

#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "projections.h"

namespace specbatch {

namespace mx = mlx::core;

// What every layer shares: the attention's shape and scale, whether q, k and v carry biases.
struct StackShape {
  QkvShape qkv;  // heads, kv_heads, RoPE dims, traditional, RoPE scale (eps: per layer below)
  float attn_scale;
  bool bias;
};

// Arrays a layer hands over: norm_in, wq, wk, wv, [bq, bk, bv], norm_post, wg, wu, wd, wo.
int layer_inputs(bool bias);

// h [B, L, K] (the embeddings, at most kMaxRows rows); weights: each layer's layer_inputs()
// arrays in that order; eps: each layer's (input, post-attention) norm eps; positions int32
// [1] / [B] (each row's first new position); pools: each layer's key then value pool [P, Hkv * D]
// float32; write_slots int32 [B * L] (the new tokens' slots), read_slots int32 [B, T] (every
// token's after them); mask_kind '', 'causal' or 'array' (a bool mask [B or 1, 1, L, T]); keep:
// layers whose outputs come back. -> {the last layer's output, the kept layers', the pools
// written (2 a layer)}: one op. A pool the op alone holds is written in place (donated).
std::vector<mx::array> decoder_stack(const mx::array& h, const std::vector<mx::array>& weights,
                                     const std::vector<float>& eps, const mx::array& positions,
                                     const mx::array& inv_freq, const StackShape& shape,
                                     const std::vector<mx::array>& pools, const mx::array& write_slots,
                                     const mx::array& read_slots, const std::string& mask_kind,
                                     const mx::array& mask, const std::vector<int>& keep);

class DecoderStack : public mx::Primitive {
 public:
  DecoderStack(mx::Stream stream, StackShape shape, std::vector<mx::array> weights, std::vector<float> eps,
               std::vector<int> keep, bool causal, bool masked)
      : mx::Primitive(stream), shape_(shape), weights_(std::move(weights)), eps_(std::move(eps)),
        keep_(std::move(keep)), causal_(causal), masked_(masked) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SpecbatchDecoderStack"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  void run(const std::vector<mx::array>& inputs, const std::vector<float*>& ys) const;
  StackShape shape_;
  std::vector<mx::array> weights_;  // evaluated constants, held here rather than as inputs
  std::vector<float> eps_;
  std::vector<int> keep_;
  bool causal_, masked_;  // masked_: inputs[5] is the bool mask
};

}  // namespace specbatch
