#include "projections.h"

#include <algorithm>
#include <stdexcept>

#include "gemv.h"
#include "linear.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/fast.h"
#include "mlx/transforms.h"
#include "norm.h"
#include "pool.h"
#include "rope.h"
#include "strided.h"

namespace specbatch {

namespace {
void check(const mx::array& x, const std::vector<const mx::array*>& ws) {
  if (x.dtype() != mx::float32 || x.ndim() < 1) throw std::invalid_argument("projections: float32 x [..., K]");
  for (const auto* w : ws)
    if (!weight_dtype_ok(*w) || w->ndim() != 2 || w->shape(1) != x.shape(-1))
      throw std::invalid_argument("projections: float32 or float16 weights [N, K]");
  if (x.size() / std::max(1, x.shape(-1)) > static_cast<size_t>(kMaxRows))
    throw std::invalid_argument("projections: at most 32 rows");
  if (detect_isa() == Isa::none) throw std::runtime_error("projections: the CPU lacks AVX2/FMA");
}
}  // namespace

std::vector<mx::array> qkv_rope(const mx::array& x, const mx::array& wq, const mx::array& wk, const mx::array& wv,
                                const std::vector<mx::array>& biases, const mx::array& positions,
                                const mx::array& inv_freq, const QkvShape& shape, const std::vector<mx::array>& norms) {
  check(x, {&wq, &wk, &wv});
  if (x.ndim() != 3) throw std::invalid_argument("qkv_rope: x [B, L, K]");
  const int B = x.shape(0), L = x.shape(1);
  const int D = shape.heads > 0 ? wq.shape(0) / shape.heads : 0;
  if (D == 0 || wq.shape(0) != shape.heads * D || wk.shape(0) != shape.kv_heads * D || wv.shape() != wk.shape())
    throw std::invalid_argument("qkv_rope: wq [Hq * D, K], wk and wv [Hkv * D, K]");
  if (shape.dims <= 0 || shape.dims % 2 || shape.dims > D || inv_freq.dtype() != mx::float32 ||
      inv_freq.ndim() != 1 || inv_freq.shape(0) != shape.dims / 2)
    throw std::invalid_argument("qkv_rope: dims even, at most D; inv_freq [dims / 2]");
  const bool offsets = positions.ndim() == 1 && (positions.shape(0) == 1 || positions.shape(0) == B);
  if (positions.dtype() != mx::int32 || !(offsets || (positions.ndim() == 2 && positions.shape(0) == B &&
                                                      positions.shape(1) == L)))
    throw std::invalid_argument("qkv_rope: positions int32 [1], [B] or [B, L]");
  if (!biases.empty() && (biases.size() != 3 || biases[0].size() != static_cast<size_t>(wq.shape(0)) ||
                          biases[1].size() != static_cast<size_t>(wk.shape(0)) ||
                          biases[2].size() != static_cast<size_t>(wv.shape(0))))
    throw std::invalid_argument("qkv_rope: no biases or one [N] per weight");
  if (norms.size() > 1 || (norms.size() == 1 && (norms[0].dtype() != mx::float32 || norms[0].ndim() != 1 ||
                                                  norms[0].shape(0) != x.shape(-1))))
    throw std::invalid_argument("qkv_rope: no norm or one float32 weight [K]");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {x, wq, wk, wv, positions, inv_freq};
  for (const auto& b : biases) inputs.push_back(mx::astype(b, mx::float32, s));
  for (const auto& n : norms) inputs.push_back(n);
  return mx::array::make_arrays({{B, shape.heads, L, D}, {B, shape.kv_heads, L, D}, {B, shape.kv_heads, L, D}},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<Projections>(s, true, !biases.empty(), shape, !norms.empty()), inputs);
}

const char* block_mismatch(const mx::array* w, const QkvShape& s, bool bias, int K, int D) {
  const int nq = s.heads * D, nk = s.kv_heads * D, b = bias ? 3 : 0;
  const int I = w[5 + b].ndim() == 2 ? w[5 + b].shape(0) : -1;
  if (!vector_of(w[0], K) || !matrix_of(w[1], nq, K) || !matrix_of(w[2], nk, K) || !matrix_of(w[3], nk, K))
    return "norm_in [K], wq [Hq * D, K], wk and wv [Hkv * D, K]";
  if (bias && (!vector_of(w[4], nq) || !vector_of(w[5], nk) || !vector_of(w[6], nk)))
    return "float32 biases [Hq * D], [Hkv * D], [Hkv * D]";
  if (!vector_of(w[4 + b], K) || !matrix_of(w[5 + b], I, K) || !matrix_of(w[6 + b], I, K) ||
      !matrix_of(w[7 + b], K, I) || !matrix_of(w[8 + b], K, nq))
    return "norm_post [K], wg and wu [I, K], wd [K, I], wo [K, Hq * D]";
  return nullptr;
}

void qkv_rows(const QkvRows& r) {
  const int M = r.B * r.L, K = r.K, nq = r.nq, nk = r.nk, N = nq + 2 * nk;
  const float* x = r.x;
  std::vector<float> normed;
  if (r.norm) {  // the layer's input norm, row by row as the RMSNorm op computes it
    normed.resize(static_cast<size_t>(M) * K);
    norm_rows(x, r.norm, normed.data(), M, K, r.shape.eps);
    x = normed.data();
  }
  std::vector<float> y(static_cast<size_t>(M) * N);  // [M, q | k | v]
  gemv_all(x, M, K, {{r.w[0], nq, y.data(), N}, {r.w[1], nk, y.data() + nq, N}, {r.w[2], nk, y.data() + nq + nk, N}});
  if (r.bias[0]) {
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n)
        y[m * N + n] += n < nq ? r.bias[0][n] : n < nq + nk ? r.bias[1][n - nq] : r.bias[2][n - nq - nk];
  }
  const int D = nq / r.shape.heads;
  for (int part = 0; part < 3; ++part) {  // q and k rotated, v copied: [B, H, L, D] each
    const int H = part == 0 ? r.shape.heads : r.shape.kv_heads, offset = part == 0 ? 0 : part == 1 ? nq : nq + nk;
    RopeArgs a{y.data() + offset, r.pos, r.inv, r.out[part], r.B, H, r.L, D, part == 2 ? 0 : r.shape.dims / 2,
               {static_cast<int64_t>(r.L) * N, D, N, 1}, r.per_row, r.explicit_positions, r.shape.traditional, false,
               r.shape.scale};
    rope_tokens(a, 0, static_cast<int64_t>(r.B) * r.L);  // half 0: a plain copy into the head layout
  }
}

std::vector<mx::array> gate_up(const mx::array& x, const mx::array& wg, const mx::array& wu) {
  check(x, {&wg, &wu});
  if (wg.shape() != wu.shape()) throw std::invalid_argument("gate_up: wg and wu [I, K] alike");
  auto shape = x.shape();
  shape.back() = wg.shape(0);
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({shape, shape}, {mx::float32, mx::float32},
                                std::make_shared<Projections>(s, false, false, QkvShape{}), {x, wg, wu});
}

void Projections::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
  const int K = inputs[0].shape(-1), M = static_cast<int>(inputs[0].size() / std::max(1, K));
  std::vector<float*> ys;
  for (auto& out : outputs) ys.push_back(out.data<float>());
  encoder.dispatch([inputs, ys, M, K, qkv = qkv_, bias = bias_, norm = norm_, shape = shape_]() {
    if (M == 0) return;
    std::vector<float> xc, wn, bc[3], ic;
    std::vector<int> pc;
    WeightCopy copies[3];
    std::vector<Weights> w;
    for (size_t i = 1; i < (qkv ? 4u : 3u); ++i) w.push_back(weights_of(inputs[i], copies[i - 1]));
    const float* x = row_major(inputs[0], xc);
    if (!qkv) return gemv_all(x, M, K, {{w[0], inputs[1].shape(0), ys[0], inputs[1].shape(0)},
                                        {w[1], inputs[2].shape(0), ys[1], inputs[2].shape(0)}});
    QkvRows r{x, inputs[0].shape(0), inputs[0].shape(1), K, {w[0], w[1], w[2]}, inputs[1].shape(0),
              inputs[2].shape(0), norm ? row_major(inputs.back(), wn) : nullptr, {nullptr, nullptr, nullptr},
              row_major(inputs[4], pc), inputs[4].ndim() == 1 && inputs[4].shape(0) > 1, inputs[4].ndim() == 2,
              row_major(inputs[5], ic), shape, {ys[0], ys[1], ys[2]}};
    if (bias)
      for (int i = 0; i < 3; ++i) r.bias[i] = row_major(inputs[6 + i], bc[i]);
    qkv_rows(r);
  });
}

std::vector<mx::array> Projections::unfused(const std::vector<mx::array>& in) {
  auto s = stream();
  if (!qkv_) return {mx::matmul(in[0], mx::transpose(in[1], s), s), mx::matmul(in[0], mx::transpose(in[2], s), s)};
  const int B = in[0].shape(0), L = in[0].shape(1);
  const mx::array x = norm_ ? mx::fast::rms_norm(in[0], in.back(), shape_.eps, s) : in[0];
  std::vector<mx::array> out;
  for (int i = 0; i < 3; ++i) {
    auto y = mx::matmul(x, mx::transpose(in[1 + i], s), s);  // [B, L, H * D]
    if (bias_) y = mx::add(y, in[6 + i], s);
    const int H = i == 0 ? shape_.heads : shape_.kv_heads;
    y = mx::transpose(mx::reshape(y, {B, L, H, -1}, s), {0, 2, 1, 3}, s);
    out.push_back(i == 2 ? y : rope(y, in[4], in[5], shape_.dims, shape_.traditional, shape_.scale, false));
  }
  return out;
}

// Gradients through the same computation in MLX ops (and RoPE's own vjp); positions and
// frequencies (inputs 4 and 5 of qkv_rope) are constants.
std::vector<mx::array> Projections::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                        const std::vector<int>& argnums, const std::vector<mx::array>&) {
  for (int arg : argnums)
    if (qkv_ && (arg == 4 || arg == 5)) throw std::invalid_argument("qkv_rope: no gradient for positions or frequencies");
  std::vector<int> free;  // the inputs differentiated
  for (int i = 0; i < static_cast<int>(primals.size()); ++i)
    if (!qkv_ || (i != 4 && i != 5)) free.push_back(i);
  std::vector<mx::array> args;
  for (int i : free) args.push_back(primals[i]);
  auto f = [this, &primals, &free](const std::vector<mx::array>& in) {
    std::vector<mx::array> all = primals;
    for (size_t j = 0; j < free.size(); ++j) all[free[j]] = in[j];
    return unfused(all);
  };
  auto grads = mx::vjp(f, args, cotangents).second;
  std::vector<mx::array> picked;
  for (int arg : argnums) picked.push_back(grads[std::find(free.begin(), free.end(), arg) - free.begin()]);
  return picked;
}

bool Projections::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Projections&>(other);
  return qkv_ == o.qkv_ && bias_ == o.bias_ && norm_ == o.norm_ && shape_.heads == o.shape_.heads &&
         shape_.kv_heads == o.shape_.kv_heads && shape_.dims == o.shape_.dims && shape_.traditional == o.shape_.traditional &&
         shape_.scale == o.shape_.scale && shape_.eps == o.shape_.eps;
}

void Projections::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("specbatch projections run on the CPU only");
}

}  // namespace specbatch
