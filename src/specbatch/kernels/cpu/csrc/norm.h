// RMSNorm as one primitive: MLX's CPU backend runs mx.fast.rms_norm as ~8 separate ops
// (about 40 us a call at decode shapes, 60 calls a step).
#pragma once

#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// One row of D: y = x * rsqrt(mean(x^2) + eps) * w, the squares summed in 8 fixed lanes
// (a row's result never depends on its batch).
void norm_row(const float* x, const float* w, float* y, int D, float eps);
// norm_row over `rows` consecutive rows of D (on this thread).
void norm_rows(const float* x, const float* w, float* y, int64_t rows, int D, float eps);

// x [..., D] float32, w [D] float32 -> x * rsqrt(mean(x^2) + eps) * w, per row of D.
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps);

// x, r [..., D] float32, w [D] -> (h = x + r, rms_norm(h, w, eps)): a decoder layer's residual
// add and the norm after it as one op, each output bitwise what the two ops give apart.
std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& r, const mx::array& w, float eps);

class AddRMSNorm : public mx::Primitive {
 public:
  AddRMSNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SpecbatchAddRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const AddRMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SpecbatchRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

}  // namespace specbatch
