// The attention body's softmax over chunks of keys (attention.h's kChunkKeys): each chunk's
// own most and sum, and the fold of chunks in key order. Included by attention_impl.h inside its
// anonymous namespace, with W float lanes and vmath_impl.h's exp_neg.

const float kNegInf = -std::numeric_limits<float>::infinity();

// Lanes halved in a fixed tree (a sequential sum's chain of adds held each chunk's exps back).
inline float tree_sum(vf v) {
  float t[W];
  store(t, v);
  for (int h = W / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) t[i] += t[i + h];
  return t[0];
}

inline float tree_max(vf v) {
  float t[W];
  store(t, v);
  for (int h = W / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) t[i] = t[i + h] > t[i] ? t[i + h] : t[i];
  return t[0];
}

// A row's chunk scaled in place, masked keys (j >= limit, or the mask's false) -inf; returns the
// chunk's most (-inf where every key is masked).
float chunk_scale(float* sr, int j0, int j1, int limit, const bool* m, int64_t mstride, float scale) {
  const int width = (j1 - j0 + W - 1) / W * W, end = std::min(limit, j1) - j0;  // keys [j0, j0 + end) seen
  vi lane;
  for (int l = 0; l < W; ++l) lane[l] = l;
  vf tops = splat(kNegInf);
  for (int j = 0; j < width; j += W) {
    vf x = (lane + j) < end ? load(sr + j) * scale : splat(kNegInf);
    if (m)
      for (int l = 0; l < W && j + l < end; ++l) x[l] = m[(j0 + j + l) * mstride] ? x[l] : kNegInf;
    store(sr + j, x);
    tops = x > tops ? x : tops;
  }
  return tree_max(tops);
}

// p = exp(x - top) in place over a scaled chunk (masked keys exact zeros); returns the p's sum.
float chunk_exp(float* sr, int width, float top) {
  if (top == kNegInf) {
    for (int j = 0; j < width; ++j) sr[j] = 0.0f;
    return 0.0f;
  }
  vf sum = vf{};
  for (int j = 0; j < width; j += W) {
    const vf x = load(sr + j);
    vf p = exp_neg(x - top);
    p = x == splat(kNegInf) ? vf{} : p;  // exactly zero: masked keys change no sum
    store(sr + j, p);
    sum += p;
  }
  return tree_sum(sum);
}

// Rows' running sums (most rm, sum rl, weighed values tot [rows][D]) with their next chunk's
// (cm, cl, a [rows][D]) folded in, chunk by chunk in key order whichever thread computed which:
// the online softmax at fixed chunks. Rows that saw nothing yet or in the chunk weigh zero; the
// rescales take one vector exp for W rows (a prefill block folds ~100 rows a chunk).
void fold(int rows, int D, float* rm, float* rl, float* tot, const float* cm, const float* cl, const float* a) {
  for (int r0 = 0; r0 < rows; r0 += W) {
    const int n = std::min(W, rows - r0);
    vf m0 = splat(kNegInf), m1 = splat(kNegInf);
    for (int l = 0; l < n; ++l) m0[l] = rm[r0 + l], m1[l] = cm[r0 + l];
    const vf top = m0 > m1 ? m0 : m1;
    const vf x = m0 == splat(kNegInf) ? vf{} : exp_neg(m0 - top), y = m1 == splat(kNegInf) ? vf{} : exp_neg(m1 - top);
    for (int l = 0; l < n; ++l) {
      const int r = r0 + l;
      rm[r] = top[l], rl[r] = rl[r] * x[l] + cl[r] * y[l];
      float* t = tot + static_cast<size_t>(r) * D;
      const float* c = a + static_cast<size_t>(r) * D;
      int d = 0;
      for (; d + W <= D; d += W) store(t + d, load(t + d) * x[l] + load(c + d) * y[l]);
      for (; d < D; ++d) t[d] = t[d] * x[l] + c[d] * y[l];
    }
  }
}
