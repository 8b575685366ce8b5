// A llama-family decoder stack's decode or verify forward over a paged KV cache as one MLX op:
// per layer the input norm with q, k and v and RoPE, the two paged writes, paged attention and
// the block's second half (mlp_block with the output projection), the functions the separate
// ops run in the order the Python stack builds them, so every bit is the same. A width-1 step
// was ~150 ops: their graph built in Python (~25 us a layer, 0.75-0.85 ms), then scheduled one
// by one on the caller's thread (~4 us each), while the step's compute ran on both cores.
#pragma once

#include <memory>
#include <optional>
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

// Where a forward's keys and values go, per layer its keys then its values: a paged cache's
// pools [Hkv, P, D] through slots, or dense buffers [B, Hkv, C, D] (mlx-lm's KVCache) from column
// `start` on, every row's.
struct StackKV {
  std::vector<mx::array> buffers;
  std::optional<mx::array> write_slots, read_slots;  // paged: int32 [B * L] (the new tokens'), [B, T] (all)
  int start = 0;  // dense: the new tokens' first column
  bool paged() const { return write_slots.has_value(); }
};

// A stack's constants, checked and evaluated once (the Python stack makes one each time it reads
// its weights): a forward then hands over this, not ~270 arrays that each call would convert,
// check and copy, cold after the step's weight stream (~0.1-0.2 ms a width-1 step).
// weights: each layer's layer_inputs() arrays in that order; eps: each layer's (input,
// post-attention) norm eps.
struct StackWeights {
  StackShape shape;
  std::vector<mx::array> weights;
  std::vector<float> eps;
  int layers, K, D;  // layers, the hidden size, a head's size
};
std::shared_ptr<const StackWeights> stack_weights(std::vector<mx::array> weights, std::vector<float> eps,
                                                  const StackShape& shape);

// h [B, L, K] (the embeddings, at most kMaxRows rows); positions int32 [1] / [B] (each row's first
// new position); mask_kind '', 'causal' or 'array' (a bool mask [B or 1, 1, L, T]); keep: layers
// whose outputs come back. -> {the last layer's output, the kept layers', the KV buffers written
// (2 a layer)}: one op. A buffer the op alone holds is written in place (donated), else copied first.
std::vector<mx::array> decoder_stack(const mx::array& h, const std::shared_ptr<const StackWeights>& w,
                                     const mx::array& positions, const mx::array& inv_freq, const StackKV& kv,
                                     const std::string& mask_kind, const mx::array& mask,
                                     const std::vector<int>& keep);

class DecoderStack : public mx::Primitive {
 public:
  DecoderStack(mx::Stream stream, std::shared_ptr<const StackWeights> w, std::vector<int> keep, bool causal,
               bool masked, bool paged, int start)
      : mx::Primitive(stream), w_(std::move(w)), keep_(std::move(keep)), causal_(causal), masked_(masked),
        paged_(paged), start_(start) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SpecbatchDecoderStack"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  void run(const std::vector<mx::array>& inputs, const std::vector<float*>& ys) const;
  std::shared_ptr<const StackWeights> w_;  // evaluated constants, held here rather than as inputs
  std::vector<int> keep_;
  bool causal_, masked_, paged_;  // inputs: h, positions, inv_freq, [the slots], [the mask], the buffers
  int start_;  // dense: the new tokens' first column
};

}  // namespace specbatch
