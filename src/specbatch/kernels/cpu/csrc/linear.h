// SmallLinear: y = x @ w.T as an MLX primitive (CPU only), written for decode and verify rows
// (up to kMaxRows, the fused ops' limit) and blocked for prefill's wider inputs.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "blocks.h"

namespace specbatch {

namespace mx = mlx::core;

constexpr int kMaxRows = 32;

// A weight matrix's row-major elements as stored: float32, or float16 (`half`), which the
// kernels widen exactly as they read it (half the bytes streamed, the same sums).
struct Weights {
  const void* data = nullptr;
  bool half = false;
  BlockView blocks;  // the matrix's registered 4- or 8-bit blocks, read by up to kMaxRows token rows
};

// Where a strided weight's row-major copy lives while a kernel runs.
struct WeightCopy {
  std::vector<float> f;
  std::vector<uint16_t> h;
};

// float32, or float16 where the CPU widens it (F16C): the weight dtypes the kernels take.
bool weight_dtype_ok(const mx::array& w);
// A float32 vector [n]; a weight matrix [rows, cols] the kernels take (the fused ops' checks).
inline bool vector_of(const mx::array& a, int n) { return a.dtype() == mx::float32 && a.ndim() == 1 && a.shape(0) == n; }
inline bool matrix_of(const mx::array& w, int rows, int cols) {
  return weight_dtype_ok(w) && w.ndim() == 2 && w.shape(0) == rows && w.shape(1) == cols;
}
// Weights an op holds as constants, evaluated once where they are not yet (its first build).
void evaluate_constants(const std::vector<mx::array>& weights);
// A constant an op holds as the kernels read it (a matrix's registered blocks too), its rows.
struct Constant {
  Weights w;
  int rows;
};
// Every constant of `held` resolved once and kept while the same arrays are held and no block set
// changed: resolving per call read each array's header and the block registry cold (after a
// step's weight stream) on the computing thread, ~0.1 ms a width-1 step for the decoder stack.
// Null where one would need a copy (a strided array: the caller resolves per call).
std::shared_ptr<const std::vector<Constant>> resolved(const std::vector<mx::array>& held);
// Drops every kept table and the arrays it holds (a block set was forgotten: its model is going).
void forget_resolved();
// An op's constants for one call: `resolved`'s table, or this call's own where one needs a copy.
class HeldConstants {
 public:
  explicit HeldConstants(const std::vector<mx::array>& held);
  const Constant* data() const { return data_; }
  const Constant& operator[](size_t i) const { return data_[i]; }

 private:
  std::shared_ptr<const std::vector<Constant>> kept_;
  std::vector<Constant> local_;
  std::vector<WeightCopy> copies_;
  const Constant* data_;
};
// w's elements: its own buffer where row-contiguous, else a copy in `copy`.
Weights weights_of(const mx::array& w, WeightCopy& copy);

// One weight matrix of a pool pass: y[m * ldy + n] = x[m] . w[n] for n < rows.
struct Target {
  Weights w;  // [rows, K]
  int rows;
  float* y;  // [M, ldy]
  int ldy;
};

// y_i = x @ w_i.T for every target, the pool splitting their rows (as one matrix) in column
// blocks of whole cache lines; per element the same sums whatever the split.
void gemv_all(const float* x, int M, int K, const std::vector<Target>& targets);

// x: [..., K] float32 (any number of rows; each row's bits the same whatever the others);
// w: [N, K] float32 or float16 -> [..., N] float32.
mx::array small_linear(const mx::array& x, const mx::array& w);

class SmallLinear : public mx::UnaryPrimitive {
 public:
  explicit SmallLinear(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SmallLinear"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace specbatch
