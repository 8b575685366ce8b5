#include "swiglu.h"

#include <algorithm>
#include <stdexcept>

#include "gemv.h"
#include "grad.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "pool.h"
#include "strided.h"

namespace specbatch {

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32)
    throw std::invalid_argument("swiglu: float32 inputs only");
  if (gate.shape() != up.shape()) throw std::invalid_argument("swiglu: gate and up must have one shape");
  if (detect_isa() == Isa::none) throw std::runtime_error("swiglu: the CPU lacks AVX2/FMA");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(gate.shape(), mx::float32, std::make_shared<Swiglu>(s), {gate, up});
}

void swiglu_rows(const float* g, const float* u, float* y, int64_t n) {
  (detect_isa() == Isa::avx512 ? swiglu_avx512 : swiglu_avx2)(g, u, y, n);
}

void Swiglu::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& g = inputs[0];
  const auto& u = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(g);
  encoder.set_input_array(u);
  encoder.set_output_array(out);
  encoder.dispatch([g, u, yp = out.data<float>(), n = static_cast<int64_t>(out.size())]() {
    std::vector<float> gc, uc;
    const float* gp = row_major(g, gc);
    const float* up = row_major(u, uc);
    pool().split(n, 1, 1 << 15, [&](int64_t a, int64_t b) { swiglu_rows(gp + a, up + a, yp + a, b - a); }, 64);
  });
}

// Gradients through MLX's own ops (training a head whose MLP was swapped).
std::vector<mx::array> Swiglu::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                   const std::vector<int>& argnums, const std::vector<mx::array>&) {
  auto f = [](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{mx::multiply(mx::multiply(in[0], mx::sigmoid(in[0])), in[1])};
  };
  return vjp_through(f, primals, cotangents, argnums);
}

void Swiglu::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchSwiglu runs on the CPU only");
}

}  // namespace specbatch
