#include "mlp_block.h"

#include <algorithm>
#include <optional>
#include <stdexcept>

#include "gemv.h"
#include "grad.h"
#include "linear.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/ops.h"
#include "norm.h"
#include "strided.h"
#include "task.h"
#include "swiglu.h"

namespace specbatch {

mx::array mlp_block(const mx::array& x, const mx::array& r, const mx::array& norm, float eps, const mx::array& wg,
                    const mx::array& wu, const mx::array& wd, const std::optional<mx::array>& wo) {
  for (const auto* a : {&x, &r, &norm})
    if (a->dtype() != mx::float32) throw std::invalid_argument("mlp_block: float32 x, r and norm");
  for (const auto* w : {&wg, &wu, &wd})
    if (!weight_dtype_ok(*w)) throw std::invalid_argument("mlp_block: float32 or float16 weights");
  if (wo && !weight_dtype_ok(*wo)) throw std::invalid_argument("mlp_block: float32 or float16 weights");
  const int K = x.ndim() < 1 ? -1 : x.shape(-1);
  if (wo && (wo->ndim() != 2 || wo->shape(0) != K || r.ndim() != x.ndim() || r.shape(-1) != wo->shape(1) ||
             r.size() / std::max(1, wo->shape(1)) != x.size() / std::max(1, K)))
    throw std::invalid_argument("mlp_block: wo [K, J] and r [..., J] with x's rows");
  if (x.ndim() < 1 || (!wo && x.shape() != r.shape())) throw std::invalid_argument("mlp_block: x and r [..., K] alike");
  if (norm.ndim() != 1 || norm.shape(0) != K || wg.ndim() != 2 || wg.shape() != wu.shape() || wg.shape(1) != K ||
      wd.ndim() != 2 || wd.shape(0) != K || wd.shape(1) != wg.shape(0))
    throw std::invalid_argument("mlp_block: norm [K], wg and wu [I, K], wd [K, I]");
  if (x.size() / std::max(1, K) > static_cast<size_t>(kMaxRows))
    throw std::invalid_argument("mlp_block: at most 32 rows");
  if (detect_isa() == Isa::none) throw std::runtime_error("mlp_block: the CPU lacks AVX2/FMA");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x, r, norm, wg, wu, wd};
  if (wo) inputs.push_back(*wo);
  return mx::array(x.shape(), mx::float32, std::make_shared<MlpBlock>(s, eps), std::move(inputs));
}

void mlp_rows(const float* x, const float* r, int M, int K, int I, int J, const float* norm, float eps,
              const Weights& wg, const Weights& wu, const Weights& wd, const Weights* wo, float* y) {
  std::vector<float> h(static_cast<size_t>(M) * K), n(h.size()), gu(static_cast<size_t>(M) * I * 2);
  if (wo) {  // r = attention's heads through the output projection, as o_proj's own op sums it
    gemv_all(r, M, J, {{*wo, K, n.data(), K}});
    r = n.data();  // n is free until the norm below writes it
  }
  for (size_t i = 0; i < h.size(); ++i) h[i] = x[i] + r[i];
  norm_rows(h.data(), norm, n.data(), M, K, eps);
  float* g = gu.data();
  float* u = g + static_cast<size_t>(M) * I;
  gemv_all(n.data(), M, K, {{wg, I, g, I}, {wu, I, u, I}});
  swiglu_rows(g, u, g, static_cast<int64_t>(M) * I);  // in place
  gemv_all(g, M, I, {{wd, K, y, K}});
  for (size_t i = 0; i < h.size(); ++i) y[i] = h[i] + y[i];
}

void MlpBlock::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const int K = inputs[0].shape(-1), I = inputs[3].shape(0), J = inputs[1].shape(-1);
  const int M = K == 0 ? 0 : static_cast<int>(inputs[0].size() / K);
  auto weak = task_inputs(encoder, inputs, out);  // before out.data(): it allocates out
  encoder.dispatch([in = std::move(weak), yp = out.data<float>(), M, K, I, J, eps = eps_]() {
    if (M == 0 || K == 0) return;
    std::vector<float> copies[3];
    const float* p[3];
    for (int i = 0; i < 3; ++i) p[i] = row_major(in[i], copies[i]);
    WeightCopy wc[3];
    const Weights wg = weights_of(in[3], wc[0]), wu = weights_of(in[4], wc[1]), wd = weights_of(in[5], wc[2]);
    WeightCopy wo_copy;
    const Weights wo = in.size() == 7 ? weights_of(in[6], wo_copy) : Weights{};
    mlp_rows(p[0], p[1], M, K, I, J, p[2], eps, wg, wu, wd, in.size() == 7 ? &wo : nullptr, yp);
  });
}

// Gradients through the same computation in MLX's own ops (training a head through a
// swapped target).
std::vector<mx::array> MlpBlock::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                     const std::vector<int>& argnums, const std::vector<mx::array>&) {
  const float eps = eps_;
  auto f = [eps](const std::vector<mx::array>& in) {
    auto h = mx::add(in[0], in.size() == 7 ? mx::matmul(in[1], mx::transpose(in[6])) : in[1]);
    auto n = mx::fast::rms_norm(h, in[2], eps);
    auto g = mx::matmul(n, mx::transpose(in[3]));
    auto u = mx::matmul(n, mx::transpose(in[4]));
    auto a = mx::multiply(mx::multiply(g, mx::sigmoid(g)), u);
    return std::vector<mx::array>{mx::add(h, mx::matmul(a, mx::transpose(in[5])))};
  };
  return vjp_through(f, primals, cotangents, argnums);
}

void MlpBlock::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchMlpBlock runs on the CPU only");
}

}  // namespace specbatch
