// A llama decoder block's second half as one op for decode and verify rows (at most
// kMaxRows): h = x + r, then h + down(swiglu(gate(n), up(n))) with n = rms_norm(h); with
// `wo`, r is attention's merged heads and the op projects them first (r @ wo.T). Six graph
// nodes a layer become one, and the pool runs its passes (the projection, gate and up,
// down) inside it. Per element the same sums as the separate kernels, so the same bits.
#pragma once

#include <optional>
#include <vector>

#include "linear.h"
#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// x, r [..., K] (with wo [K, J]: r [..., J]); norm [K]; wg, wu [I, K]; wd [K, I] -> [..., K].
mx::array mlp_block(const mx::array& x, const mx::array& r, const mx::array& norm, float eps, const mx::array& wg,
                    const mx::array& wu, const mx::array& wd, const std::optional<mx::array>& wo = std::nullopt);

// The op on rows in memory (its task; each layer of the decoder stack): x [M, K]; r [M, K], or
// [M, J] with wo; y [M, K].
void mlp_rows(const float* x, const float* r, int M, int K, int I, int J, const float* norm, float eps,
              const Weights& wg, const Weights& wu, const Weights& wd, const Weights* wo, float* y);

class MlpBlock : public mx::UnaryPrimitive {
 public:
  MlpBlock(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SpecbatchMlpBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const MlpBlock&>(other).eps_;
  }

 private:
  float eps_;
};

}  // namespace specbatch
