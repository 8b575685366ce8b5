// SwiGLU's body, compiled once per ISA (swiglu_avx2.cpp, swiglu_avx512.cpp) with W lanes.
#include "swiglu.h"

namespace specbatch {
namespace {

#include "vmath_impl.h"

// silu(g) * u with sigmoid(g) from e = exp(-|g|) <= 1, which never overflows:
// 1 / (1 + e) for g >= 0, e / (1 + e) below. Relative error a few 1e-7.
inline vf swiglu_vec(vf g, vf u) {
  const vf one = splat(1.0f);
  const vf e = exp_neg(g < 0.0f ? g : -g);
  const vf s = (g >= 0.0f ? one : e) / (one + e);
  return g * s * u;
}

}  // namespace

void SWIGLU(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(y + i, swiglu_vec(load(g + i), load(u + i)));
  if (i == n) return;
  float gt[W] = {}, ut[W] = {}, yt[W];
  for (int64_t j = i; j < n; ++j) gt[j - i] = g[j], ut[j - i] = u[j];
  store(yt, swiglu_vec(load(gt), load(ut)));
  for (int64_t j = i; j < n; ++j) y[j] = yt[j - i];
}

}  // namespace specbatch
