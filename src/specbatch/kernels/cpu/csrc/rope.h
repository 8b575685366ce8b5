// RoPE as one primitive: MLX's CPU backend runs mx.fast.rope as ~20 ops (sines and cosines
// recomputed per call and head); this computes them once per position for every head.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// x [B, H, L, D] float32 (any strides); positions int32: [1] or [B] (an offset: token l
// of row b sits at positions[b] + l) or [B, L] (explicit); inv_freq [dims / 2] float32.
// Rotates the first `dims` features by angle (position * scale) * inv_freq[i]: halves
// (x[i], x[i + dims/2]) or, `traditional`, pairs (x[2i], x[2i + 1]); the rest is copied.
// `inverse` rotates back (the vjp). -> contiguous [B, H, L, D].
mx::array rope(const mx::array& x, const mx::array& positions, const mx::array& inv_freq, int dims,
               bool traditional, float scale, bool inverse);

// What rotating one call's tokens needs: x strided [B, H, L, D], out contiguous.
struct RopeArgs {
  const float* x; const int* pos; const float* inv; float* out;
  int B, H, L, D, half;
  int64_t xs[4];
  bool per_row, explicit_, traditional, inverse;
  float scale;
};

// Tokens t0 .. t1 - 1 (t = b * L + l) of every head; one float order for every caller.
void rope_tokens(const RopeArgs& a, int64_t t0, int64_t t1);

class RoPE : public mx::UnaryPrimitive {
 public:
  RoPE(mx::Stream stream, int dims, bool traditional, float scale, bool inverse)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), scale_(scale), inverse_(inverse) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SpecbatchRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RoPE&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_ && inverse_ == o.inverse_;
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
  bool inverse_;
};

}  // namespace specbatch
