// Gumbel noise's body, compiled once per ISA (noise_avx2.cpp, noise_avx512.cpp) with W lanes.
// The same integer hash and float steps in every lane and on both ISAs (no contraction).
#include "noise.h"

namespace specbatch {
namespace {

#include "vmath_impl.h"

typedef unsigned vu __attribute__((vector_size(W * 4)));

// murmur3's finaliser: a bijection of 32 bits with full avalanche
inline vu fmix(vu h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

// log(x) for normal x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), a degree-9 polynomial in
// m - 1 (cephes' logf), within about one ulp.
inline vf vlog(vf x) {
  vi bits;
  __builtin_memcpy(&bits, &x, sizeof(bits));
  vi e = ((bits >> 23) & 0xff) - 126;
  vi mbits = (bits & 0x007fffff) | 0x3f000000;  // m in [0.5, 1)
  vf m;
  __builtin_memcpy(&m, &mbits, sizeof(m));
  const vi small = m < 0.707106781186547524f;  // all ones where true
  e = e + small;  // -1 where m < sqrt(1/2): take 2m instead
  vf twice;
  const vi mb2 = mbits & small;
  __builtin_memcpy(&twice, &mb2, sizeof(twice));
  m = m - 1.0f + twice;
  const vf z = m * m;
  vf y = splat(7.0376836292e-2f);
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const vf fe = __builtin_convertvector(e, vf);
  y = y + fe * -2.12194440e-4f;
  y = y - z * 0.5f;
  return m + y + fe * 0.693359375f;
}

// -log(-log(u)), u = (top 24 bits of fmix(key + fmix(v * golden ^ c)) + 1/2) / 2^24 in (0, 1)
inline vf noise(uint32_t key, vu v) {
  const vu h = fmix(fmix(v * 0x9e3779b9u ^ 0x85ebca77u) + key);
  const vf u = (__builtin_convertvector(h >> 8, vf) + 0.5f) * 5.9604644775390625e-8f;
  return -vlog(-vlog(u));
}

// Keeps each lane's best score and its index: strictly better, or the first NaN (a lane's
// indices only grow, so a tie keeps the first).
inline void take(vf s, vi where, vf& best, vi& at) {
  const vi better = (s > best) | ((s != s) & (best == best));
  best = better ? s : best;
  at = better ? where : at;
}

}  // namespace

void GUMBEL_ROW(uint32_t key, float* out, int V) {
  vu lane;
  for (int i = 0; i < W; ++i) lane[i] = static_cast<unsigned>(i);
  int v = 0;
  for (; v + W <= V; v += W) store(out + v, noise(key, lane + static_cast<unsigned>(v)));
  if (v == V) return;
  float tail[W];
  store(tail, noise(key, lane + static_cast<unsigned>(v)));
  for (int j = v; j < V; ++j) out[j] = tail[j - v];
}

ArgBest SAMPLE_SPAN(uint32_t key, const float* logits, float denom, int v0, int v1) {
  vu lane;
  vi index;
  for (int i = 0; i < W; ++i) lane[i] = static_cast<unsigned>(i), index[i] = i;
  vf best = splat(-__builtin_inff());
  vi at = index + v0;  // a lane never taken holds -inf at its first index
  int v = v0;
  if (denom > 0.0f) {
    for (; v + W <= v1; v += W)
      take(load(logits + v) / denom + noise(key, lane + static_cast<unsigned>(v)), index + v, best, at);
  } else {
    for (; v + W <= v1; v += W) take(load(logits + v), index + v, best, at);
  }
  if (v < v1) {
    float tail[W];
    for (int j = 0; j < W; ++j) tail[j] = v + j < v1 ? logits[v + j] : 0.0f;
    vf s = load(tail);
    if (denom > 0.0f) s = s / denom + noise(key, lane + static_cast<unsigned>(v));
    store(tail, s);
    for (int j = v1 - v; j < W; ++j) tail[j] = -__builtin_inff();  // past the span: never taken
    take(load(tail), index + v, best, at);
  }
  ArgBest out{best[0], at[0]};
  for (int i = 1; i < W; ++i)
    if (arg_beats(best[i], at[i], out.value, out.index)) out = {best[i], at[i]};
  return out;
}

}  // namespace specbatch
