#include "rope.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "pool.h"
#include "strided.h"

namespace specbatch {

mx::array rope(const mx::array& x, const mx::array& positions, const mx::array& inv_freq, int dims,
               bool traditional, float scale, bool inverse) {
  if (x.dtype() != mx::float32 || x.ndim() != 4) throw std::invalid_argument("rope: x float32 [B, H, L, D]");
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(3)) throw std::invalid_argument("rope: dims even, at most D");
  if (inv_freq.dtype() != mx::float32 || inv_freq.ndim() != 1 || inv_freq.shape(0) != dims / 2)
    throw std::invalid_argument("rope: inv_freq float32 [dims / 2]");
  const int B = x.shape(0), L = x.shape(2);
  const bool offsets = positions.ndim() == 1 && (positions.shape(0) == 1 || positions.shape(0) == B);
  const bool explicit_ = positions.ndim() == 2 && positions.shape(0) == B && positions.shape(1) == L;
  if (positions.dtype() != mx::int32 || !(offsets || explicit_))
    throw std::invalid_argument("rope: positions int32 [1], [B] or [B, L]");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RoPE>(s, dims, traditional, scale, inverse),
                   {x, positions, inv_freq});
}

namespace {
using Args = RopeArgs;

// Token (b, l) of every head: its cosines and sines computed once, as MLX computes them
// (position = float(l) + float(offset), times scale, times inv_freq[i], in float32).
void rope_token(const Args& a, int b, int l, float* cs) {
  float position;
  if (a.explicit_) {
    position = static_cast<float>(a.pos[static_cast<int64_t>(b) * a.L + l]);
  } else {
    position = static_cast<float>(l) + static_cast<float>(a.pos[a.per_row ? b : 0]);
  }
  position *= a.scale;
  for (int i = 0; i < a.half; ++i) {
    const float theta = position * a.inv[i];
    cs[i] = std::cos(theta);
    cs[a.half + i] = a.inverse ? -std::sin(theta) : std::sin(theta);
  }
  for (int h = 0; h < a.H; ++h) {
    const float* x = a.x + b * a.xs[0] + h * a.xs[1] + l * a.xs[2];
    float* y = a.out + ((static_cast<int64_t>(b) * a.H + h) * a.L + l) * a.D;
    const int64_t ds = a.xs[3];
    for (int i = 0; i < a.half; ++i) {
      const int i1 = a.traditional ? 2 * i : i, i2 = a.traditional ? 2 * i + 1 : i + a.half;
      const float x1 = x[i1 * ds], x2 = x[i2 * ds], c = cs[i], s = cs[a.half + i];
      y[i1] = x1 * c - x2 * s;
      y[i2] = x1 * s + x2 * c;
    }
    for (int d = 2 * a.half; d < a.D; ++d) y[d] = x[d * ds];
  }
}
}  // namespace

void rope_tokens(const RopeArgs& a, int64_t t0, int64_t t1) {
  std::vector<float> cs(2 * a.half);
  for (int64_t t = t0; t < t1; ++t) rope_token(a, static_cast<int>(t / a.L), static_cast<int>(t % a.L), cs.data());
}

void RoPE::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& pos = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  Args a{x.data<float>(), nullptr, nullptr, out.data<float>(),
         x.shape(0), x.shape(1), x.shape(2), x.shape(3), dims_ / 2, {}, pos.ndim() == 1 && pos.shape(0) > 1,
         pos.ndim() == 2, traditional_, inverse_, scale_};
  for (int i = 0; i < 4; ++i) a.xs[i] = x.strides(i);
  encoder.dispatch([a, pos, inv = inputs[2]]() mutable {
    std::vector<int> pc;
    std::vector<float> ic;
    a.pos = row_major(pos, pc), a.inv = row_major(inv, ic);
    const int64_t tokens = static_cast<int64_t>(a.B) * a.L;
    auto body = [&](int64_t t0, int64_t t1) { rope_tokens(a, t0, t1); };
    pool().split(tokens, static_cast<int64_t>(a.H) * a.D, 1 << 15, body);
  });
}

// The rotation is orthogonal: its vjp rotates the cotangent back by the same angles.
std::vector<mx::array> RoPE::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                 const std::vector<int>& argnums, const std::vector<mx::array>&) {
  for (int arg : argnums)
    if (arg != 0) throw std::invalid_argument("rope: no gradient for positions or frequencies");
  return {rope(cotangents[0], primals[1], primals[2], dims_, traditional_, scale_, !inverse_)};
}

void RoPE::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchRoPE runs on the CPU only");
}

}  // namespace specbatch
