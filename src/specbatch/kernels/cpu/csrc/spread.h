// A reduced vocabulary's logits spread over the whole vocabulary: out[b, ids[j]] = values[b, j],
// -inf everywhere else (an FR-Spec head's draft logits, which the samplers read over the full
// vocabulary). MLX's scatter took 0.12-0.21 ms for 4,096 of 49,152 tokens at width 1, more than the
// linear that made them (0.09-0.10 ms); this op 0.017 ms.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// values float32 [B, n], ids int32 [n] -> float32 [B, vocab]. An id outside [0, vocab) makes
// every value NaN (never a stray write); ids are distinct (a repeated one keeps its last column).
mx::array spread(const mx::array& values, const mx::array& ids, int vocab);

class Spread : public mx::UnaryPrimitive {
 public:
  Spread(mx::Stream stream, int vocab) : mx::UnaryPrimitive(stream), vocab_(vocab) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "SpecbatchSpread"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return vocab_ == static_cast<const Spread&>(other).vocab_;
  }

 private:
  int vocab_;
};

}  // namespace specbatch
