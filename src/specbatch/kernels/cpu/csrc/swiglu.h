// SwiGLU, silu(gate) * up, as one op with a vectorised exp: MLX's CPU backend computes exp
// one float at a time (~40M a second), 12 ms of a 16-row verify and ~1.2 s of a 1,400-token
// prefill on the embedded target.
#pragma once

#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// y[i] = silu(g[i]) * u[i] over n floats, W lanes at a time (the tail padded to a full
// vector, so every element takes the same path: its result never depends on n or its index).
void swiglu_avx2(const float* g, const float* u, float* y, int64_t n);
void swiglu_avx512(const float* g, const float* u, float* y, int64_t n);
// The same on this CPU's widest kernel (y may be g or u: each element reads both first).
void swiglu_rows(const float* g, const float* u, float* y, int64_t n);

// gate and up: float32 arrays of one shape (any strides) -> silu(gate) * up.
mx::array swiglu(const mx::array& gate, const mx::array& up);

class Swiglu : public mx::UnaryPrimitive {
 public:
  explicit Swiglu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SpecbatchSwiglu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace specbatch
