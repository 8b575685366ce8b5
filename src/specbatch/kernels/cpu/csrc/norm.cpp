#include "norm.h"

#include <cmath>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "grad.h"
#include "pool.h"
#include "strided.h"

namespace specbatch {

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32)
    throw std::invalid_argument("rms_norm: float32 inputs only");
  if (x.ndim() < 1 || w.ndim() != 1 || x.shape(-1) != w.shape(0))
    throw std::invalid_argument("rms_norm: x [..., D] and w [D] expected");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(s, eps),
                   {x, w});
}

void norm_row(const float* x, const float* w, float* y, int D, float eps) {
  float lanes[8] = {};
  int d = 0;
  for (; d + 8 <= D; d += 8)
    for (int i = 0; i < 8; ++i) lanes[i] += x[d + i] * x[d + i];
  float ss = 0.0f;
  for (int i = 0; i < 8; ++i) ss += lanes[i];
  for (; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (d = 0; d < D; ++d) y[d] = (x[d] * r) * w[d];
}

void norm_rows(const float* x, const float* w, float* y, int64_t rows, int D, float eps) {
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * D, w, y + r * D, D, eps);
}

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_output_array(out);
  const int D = w.shape(0);
  const int64_t rows = D == 0 ? 0 : static_cast<int64_t>(x.size() / D);
  encoder.dispatch([x, w, yp = out.data<float>(), rows, D, eps = eps_]() {
    std::vector<float> xc, wc;
    const float* xp = row_major(x, xc);
    const float* wp = row_major(w, wc);
    auto body = [&](int64_t r0, int64_t r1) {
      norm_rows(xp + r0 * D, wp, yp + r0 * D, r1 - r0, D, eps);
    };
    pool().split(rows, D, 1 << 16, body);
  });
}

// Gradients through MLX's own rms_norm (training a head whose norms were swapped).
std::vector<mx::array> RMSNorm::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                    const std::vector<int>& argnums, const std::vector<mx::array>&) {
  const float eps = eps_;
  auto f = [eps](const std::vector<mx::array>& in) {
    return std::vector<mx::array>{mx::fast::rms_norm(in[0], in[1], eps)};
  };
  return vjp_through(f, primals, cotangents, argnums);
}

std::vector<mx::array> add_rms_norm(const mx::array& x, const mx::array& r, const mx::array& w, float eps) {
  if (x.dtype() != mx::float32 || r.dtype() != mx::float32 || w.dtype() != mx::float32)
    throw std::invalid_argument("add_rms_norm: float32 inputs only");
  if (x.shape() != r.shape() || x.ndim() < 1 || w.ndim() != 1 || x.shape(-1) != w.shape(0))
    throw std::invalid_argument("add_rms_norm: x and r [..., D] alike, w [D]");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({x.shape(), x.shape()}, {mx::float32, mx::float32},
                                std::make_shared<AddRMSNorm>(s, eps), {x, r, w});
}

void AddRMSNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
  const int D = inputs[2].shape(0);
  const int64_t rows = D == 0 ? 0 : static_cast<int64_t>(inputs[0].size() / D);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), r = mx::array::unsafe_weak_copy(inputs[1]),
                    w = mx::array::unsafe_weak_copy(inputs[2]), hp = outputs[0].data<float>(),
                    yp = outputs[1].data<float>(), rows, D, eps = eps_]() {
    std::vector<float> xc, rc, wc;
    const float* xp = row_major(x, xc);
    const float* rp = row_major(r, rc);
    const float* wp = row_major(w, wc);
    auto body = [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * D; i < r1 * D; ++i) hp[i] = xp[i] + rp[i];
      norm_rows(hp + r0 * D, wp, yp + r0 * D, r1 - r0, D, eps);
    };
    pool().split(rows, D, 1 << 16, body);
  });
}

std::vector<mx::array> AddRMSNorm::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                       const std::vector<int>& argnums, const std::vector<mx::array>&) {
  const float eps = eps_;
  auto f = [eps](const std::vector<mx::array>& in) {
    auto h = mx::add(in[0], in[1]);
    return std::vector<mx::array>{h, mx::fast::rms_norm(h, in[2], eps)};
  };
  return vjp_through(f, primals, cotangents, argnums);
}

void AddRMSNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("SpecbatchAddRMSNorm runs on the CPU only");
}

void RMSNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchRMSNorm runs on the CPU only");
}

}  // namespace specbatch
