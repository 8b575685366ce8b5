// The sampler's last steps as one op: scores = logits / max(T, 1e-6) + Gumbel noise (or the
// logits where T = 0), then their argmax. MLX's ops made a [B, N, V] noise array, two more of
// scores and a scalar argmax pass: ~0.3 ms for a width-1 verify over a 49,152-token vocabulary.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// logits float32 [B, N, V], temperatures float32 [B], seeds uint32 [B], positions int32 [B, N]
// -> int32 [B, N]: bit for bit the argmax of `sampling.perturbed`'s scores on the kernels.
mx::array sample_tokens(const mx::array& logits, const mx::array& temperatures, const mx::array& seeds,
                        const mx::array& positions);

class SampleTokens : public mx::UnaryPrimitive {
 public:
  explicit SampleTokens(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "SpecbatchSampleTokens"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace specbatch
