// Fused projections for decode and verify rows (at most kMaxRows): a layer's q, k and v (with
// RoPE, written in the head layout attention reads) or its gate and up, in one op and one
// pass of the thread pool over all their weight rows. Per element the same sums as
// SmallLinear and RoPE alone, so the same bits; a decode step has ~300 fewer graph nodes.
#pragma once

#include <vector>

#include "linear.h"
#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

struct QkvShape {
  int heads, kv_heads, dims;  // dims: the rotated features of each head
  bool traditional;
  float scale;
  float eps = 0.0f;  // the layer's input RMSNorm, where qkv_rope is handed its weight
};

// x [B, L, K]; wq [Hq * D, K], wk and wv [Hkv * D, K]; biases: none or one per weight;
// positions and inv_freq as for `rope` -> q [B, Hq, L, D], k and v [B, Hkv, L, D]. norms: none,
// or the layer's input RMSNorm weight [K] (with shape.eps), applied to x first: the norm's
// own op's bits, one graph node fewer a layer.
std::vector<mx::array> qkv_rope(const mx::array& x, const mx::array& wq, const mx::array& wk, const mx::array& wv,
                                const std::vector<mx::array>& biases, const mx::array& positions,
                                const mx::array& inv_freq, const QkvShape& shape,
                                const std::vector<mx::array>& norms = {});

// The RoPE a fused op applies to heads of size D: even dims, at most D, inv_freq float32 [dims / 2].
inline bool rope_fits(const QkvShape& s, int D, const mx::array& inv_freq) {
  return s.dims > 0 && s.dims % 2 == 0 && s.dims <= D && vector_of(inv_freq, s.dims / 2);
}

// A llama block's arrays, norm_in, wq, wk, wv, [bq, bk, bv], norm_post, wg, wu, wd, wo (the
// decoder stack's layers, the MTP head's block), against K (the model width) and D (a head's
// size): null where they fit, else what does not (the caller's error names its op).
const char* block_mismatch(const mx::array* w, const QkvShape& s, bool bias, int K, int D);

// One qkv_rope on rows in memory (the op's task; each layer of the decoder stack): x [B * L, K]
// row-major, normed by `norm` first where given; biases: all three or none (bias[0] null);
// positions and inv_freq as `rope` reads them -> out: q [B, Hq, L, D], k and v [B, Hkv, L, D].
struct QkvRows {
  const float* x;
  int B, L, K;
  Weights w[3];  // wq, wk, wv
  int nq, nk;  // their rows: Hq * D, Hkv * D
  const float* norm;
  const float* bias[3];
  const int* pos;
  bool per_row, explicit_positions;  // positions [B] (one a row) / [B, L]; else [1]
  const float* inv;
  QkvShape shape;
  float* out[3];
};
void qkv_rows(const QkvRows& r);

// x [..., K]; wg and wu [I, K] -> x @ wg.T and x @ wu.T.
std::vector<mx::array> gate_up(const mx::array& x, const mx::array& wg, const mx::array& wu);

class Projections : public mx::Primitive {
 public:
  Projections(mx::Stream stream, bool qkv, bool bias, QkvShape shape, bool norm = false)
      : mx::Primitive(stream), qkv_(qkv), bias_(bias), norm_(norm), shape_(shape) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return qkv_ ? "SpecbatchQkvRope" : "SpecbatchGateUp"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::vector<mx::array> unfused(const std::vector<mx::array>& inputs);  // the same with MLX ops
  bool qkv_, bias_, norm_;  // norm_: the last input is an RMSNorm weight applied to x first
  QkvShape shape_;
};

}  // namespace specbatch
