// Gumbel noise keyed by (seed, position, token) as one op: MLX's keyed gumbel (threefry bits,
// then two scalar logs) took 0.76 ms per position over a 49,152-token vocabulary, paid for
// every sampled position of every round (draft, verify and plain) at temperature > 0.
#pragma once

#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// One row of noise: out[v] = -log(-log(u(key, v))) for v < V; `key` mixes (seed, position).
void gumbel_row_avx2(uint32_t key, float* out, int V);
void gumbel_row_avx512(uint32_t key, float* out, int V);
uint32_t gumbel_key(uint32_t seed, uint32_t position);
// The best score over tokens [v0, v1) of one row and its first index, in MLX's argmax order
// (any NaN beats every number; the first index wins a tie): scores logits[v] / denom + the
// row's noise (denom > 0), or logits[v] (denom 0: greedy). v1 > v0.
struct ArgBest {
  float value;
  int index;
};
ArgBest sample_span_avx2(uint32_t key, const float* logits, float denom, int v0, int v1);
ArgBest sample_span_avx512(uint32_t key, const float* logits, float denom, int v0, int v1);
// Whether (a, ia) comes before (b, ib) in that order.
bool arg_beats(float a, int ia, float b, int ib);

// seeds uint32 [B], positions int32 [B, N] -> float32 [B, N, vocab]; an element depends only
// on (seed, position, token), never on the shape of the call.
mx::array gumbel(const mx::array& seeds, const mx::array& positions, int vocab);

class Gumbel : public mx::UnaryPrimitive {
 public:
  Gumbel(mx::Stream stream, int vocab) : mx::UnaryPrimitive(stream), vocab_(vocab) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "SpecbatchGumbel"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return vocab_ == static_cast<const Gumbel&>(other).vocab_;
  }

 private:
  int vocab_;
};

}  // namespace specbatch
