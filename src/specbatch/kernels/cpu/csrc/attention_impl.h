// The attention kernel body, compiled once per ISA (attention_avx2.cpp, attention_avx512.cpp)
// with W float lanes. A query row's result is summed in one fixed order over keys 0..T-1
// whatever block, batch or thread it falls in: masked keys add exact zeros.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention.h"
#include "paged_write.h"

namespace specbatch {
namespace {

#include "vmath_impl.h"

inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// Keys [j0, j1) pulled in ahead of use. A paged row's keys jump to another place in the pool
// every block, where the hardware prefetcher restarts its stream; dense keys gained ~8% too.
constexpr int kAheadKeys = 32;
inline void prefetch_rows(const KeyRows& k, int j0, int j1, int D, int from = 0) {
  for (int j = j0; j < j1; ++j) {
    const char* row = reinterpret_cast<const char*>(k.at(j) + from);
    for (int b = 0; b < D * 4; b += 64) __builtin_prefetch(row + b);
  }
}

// A blocked pool's slot s: its element d at the result + d * kBlockSlots.
inline const float* block_key(const KeyRows& k, int32_t s, int D) {
  return k.base + static_cast<int64_t>(s / kBlockSlots) * kBlockSlots * D + s % kBlockSlots;
}

// Keys [j0, j1) pulled in ahead of use; a blocked key's D lines (its block's, one a d).
inline void prefetch_keys(const KeyRows& k, int j0, int j1, int D) {
  if (!k.blocked) return prefetch_rows(k, j0, j1, D);
  for (int j = j0; j < j1 && j < k.split; j += W) {
    const float* at = block_key(k, k.slots[j], D);
    for (int d = 0; d < D; ++d) __builtin_prefetch(at + d * kBlockSlots);
  }
}

// acc[r] = sum_j p[r][j] v[j] over the head's vectors [n0, n0 + NV) for RN rows kept in
// registers over every key (acc rows NA vectors apart); one multiply and one add per term, in
// key order (no contraction: -ffp-contract=off).
template <int NV, int RN, int NA = NV>
void weigh_rows(const float* p, int stride, const KeyRows& v, int seen, float* acc, int n0 = 0) {
  vf sum[RN][NV] = {};
  prefetch_rows(v, 0, std::min(seen, kAheadKeys), NV * W, n0 * W);  // this pass's vectors only
  for (int j = 0; j < seen; ++j) {
    if (j + kAheadKeys < seen) prefetch_rows(v, j + kAheadKeys, j + kAheadKeys + 1, NV * W, n0 * W);
    vf vj[NV];
    const float* vrow = v.at(j) + n0 * W;
    for (int n = 0; n < NV; ++n) vj[n] = load(vrow + n * W);
    for (int r = 0; r < RN; ++r) {
      const vf pr = splat(p[static_cast<size_t>(r) * stride + j]);
      for (int n = 0; n < NV; ++n) sum[r][n] += pr * vj[n];
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int n = 0; n < NV; ++n) store(acc + r * NA * W + (n0 + n) * W, sum[r][n]);
}

// A head too wide for several rows' sums in the registers (AVX2, D = 64: 8 vectors) in slices
// of 2 vectors against up to 6 rows: each value read once per 6 rows, not once per row, and
// each element summed in the same order as whole rows sum it (the same bits).
template <int NV>
void weigh_sliced(const float* p, int stride, int rows, const KeyRows& v, int seen, float* acc) {
  constexpr int S = 2;
  int r = 0;
  for (; r + 6 <= rows; r += 6)
    for (int n0 = 0; n0 < NV; n0 += S) weigh_rows<S, 6, NV>(p + r * stride, stride, v, seen, acc + r * NV * W, n0);
  const int left = rows - r;
  for (int n0 = 0; left > 0 && n0 < NV; n0 += S) {
    const float* pr = p + r * stride;
    float* ar = acc + r * NV * W;
    switch (left) {
      case 5: weigh_rows<S, 5, NV>(pr, stride, v, seen, ar, n0); break;
      case 4: weigh_rows<S, 4, NV>(pr, stride, v, seen, ar, n0); break;
      case 3: weigh_rows<S, 3, NV>(pr, stride, v, seen, ar, n0); break;
      case 2: weigh_rows<S, 2, NV>(pr, stride, v, seen, ar, n0); break;
      default: weigh_rows<S, 1, NV>(pr, stride, v, seen, ar, n0);
    }
  }
}

template <int NV>
void weigh_fixed(const float* p, int stride, int rows, const KeyRows& v, int seen, float* acc) {
  constexpr int regs = W == 16 ? 32 : 16;  // rows per pass that fit the registers with the values
  constexpr int R = (regs - NV) / NV >= 4 ? 4 : (regs - NV) / NV >= 2 ? 2 : 1;
  if constexpr (R == 1 && NV % 2 == 0) return weigh_sliced<NV>(p, stride, rows, v, seen, acc);
  int r = 0;
  for (; r + R <= rows; r += R) weigh_rows<NV, R>(p + r * stride, stride, v, seen, acc + r * NV * W);
  // the rest in one pass where it fits (a decode query group is 3 rows): each pass reads every value
  if (R >= 4 && rows - r == 3) return weigh_rows<NV, 3>(p + r * stride, stride, v, seen, acc + r * NV * W);
  if (R >= 2 && rows - r >= 2) weigh_rows<NV, 2>(p + r * stride, stride, v, seen, acc + r * NV * W), r += 2;
  for (; r < rows; ++r) weigh_rows<NV, 1>(p + r * stride, stride, v, seen, acc + r * NV * W);
}

// Any head size: the same terms in the same order, through memory.
void weigh_any(const float* p, int stride, int rows, const KeyRows& v, int seen, int D, float* acc) {
  for (int i = 0; i < rows * D; ++i) acc[i] = 0.0f;
  for (int j = 0; j < seen; ++j)
    for (int r = 0; r < rows; ++r) {
      const float pr = p[static_cast<size_t>(r) * stride + j];
      for (int d = 0; d < D; ++d) acc[r * D + d] += pr * v.at(j)[d];
    }
}

void weigh_values(const float* p, int stride, int rows, const KeyRows& v, int seen, int D, float* acc) {
  if (D == 4 * W) return weigh_fixed<4>(p, stride, rows, v, seen, acc);
  if (D == 8 * W) return weigh_fixed<8>(p, stride, rows, v, seen, acc);
  if (D == 2 * W) return weigh_fixed<2>(p, stride, rows, v, seen, acc);
  if (D == W) return weigh_fixed<1>(p, stride, rows, v, seen, acc);
  weigh_any(p, stride, rows, v, seen, D, acc);
}

// Lane p of the result: a[p] where bit h of p is clear, else b[p - h] (lo); a[p + h] or
// b[p] (hi). log2(W) such steps swap the off-diagonal blocks of a W x W tile: a transpose.
template <int H>
inline void swap_blocks(vf& a, vf& b) {
  vi lo, hi;
  for (int p = 0; p < W; ++p) {
    lo[p] = (p & H) ? W + p - H : p;
    hi[p] = (p & H) ? W + p : p + H;
  }
  const vf x = __builtin_shuffle(a, b, lo), y = __builtin_shuffle(a, b, hi);
  a = x, b = y;
}

template <int H>
inline void transpose_step(vf* r) {
  for (int i = 0; i < W; ++i)
    if (!(i & H)) swap_blocks<H>(r[i], r[i + H]);
}

// Keys j0 .. j0+n-1 as [D][W] (key j in lane j - j0; lanes past n zero): each score is
// then one lane summed over d in order, the same order for every query block size.
void transpose_keys(const KeyRows& k, int j0, int n, int D, float* kt) {
  if (n == W && D % W == 0) {  // whole W x W tiles, transposed in registers
    for (int d0 = 0; d0 < D; d0 += W) {
      vf r[W];
      for (int j = 0; j < W; ++j) r[j] = load(k.at(j0 + j) + d0);
      if (W >= 16) transpose_step<(W >= 16 ? 8 : 1)>(r);
      transpose_step<4>(r);
      transpose_step<2>(r);
      transpose_step<1>(r);
      for (int d = 0; d < W; ++d) store(kt + (d0 + d) * W, r[d]);
    }
    return;
  }
  for (int j = 0; j < n; ++j) {
    const float* row = k.at(j0 + j);
    for (int d = 0; d < D; ++d) kt[d * W + j] = row[d];
  }
  for (int j = n; j < W; ++j)
    for (int d = 0; d < D; ++d) kt[d * W + j] = 0.0f;
}

// Query rows a scores pass keeps in registers beside a key vector: 8 accumulators hide the
// adds' latency (4 left a Zen 3 core waiting on them; 8 need 10 of AVX2's 16 registers).
constexpr int kScoreRows = 8;

// Where query row r's element d sits in the pass layout (rows in passes of kScoreRows, the
// last pass the rest; a pass of n rows from r0 stored [D][n]): every broadcast of a pass at a
// fixed offset from one pointer.
inline size_t pass_at(int r, int d, int rows, int D) {
  const int r0 = r / kScoreRows * kScoreRows, n = std::min(kScoreRows, rows - r0);
  return static_cast<size_t>(r0) * D + static_cast<size_t>(d) * n + (r - r0);
}

// s[r][0..W) = q_r . k_(j0 ..): R query rows (q: their pass, [D][R]) in registers, one multiply
// and one add per d.
template <int R>
void dot_rows(const float* q, int D, const float* kt, int ks, float* s, int stride) {
  vf acc[R] = {};
  for (int d = 0; d < D; ++d) {
    const vf kd = load(kt + d * ks);
    for (int r = 0; r < R; ++r) acc[r] += splat(q[d * R + r]) * kd;
  }
  for (int r = 0; r < R; ++r) store(s + static_cast<size_t>(r) * stride, acc[r]);
}

template <int R = kScoreRows>
void dot_pass(int n, const float* q, int D, const float* kt, int ks, float* s, int stride) {
  if constexpr (R > 1) {
    if (n < R) return dot_pass<R - 1>(n, q, D, kt, ks, s, stride);
  }
  dot_rows<R>(q, D, kt, ks, s, stride);
}

// Keys j0 .. j0+n-1 as [D][ks]: a blocked pool's block itself where they are its consecutive
// slots (ks = 16, no copy: a key block of a row's table always is), else transposed or
// gathered into kt (ks = W). The lanes past n hold other slots' keys there: their scores
// are past `seen`, which the softmax sets to -inf.
const float* key_block(const KeyRows& k, int j0, int n, int D, float* kt, int& ks) {
  ks = W;
  if (!k.blocked) {
    transpose_keys(k, j0, n, D, kt);
    return kt;
  }
  if (j0 + n <= k.split) {
    const int32_t s0 = k.slots[j0];
    bool run = s0 % kBlockSlots + n <= kBlockSlots;
    for (int j = 1; run && j < n; ++j) run = k.slots[j0 + j] == s0 + j;
    if (run) {
      ks = kBlockSlots;
      return block_key(k, s0, D);
    }
  }
  for (int j = 0; j < W; ++j) {
    const bool tail = j0 + j >= k.split;
    const float* at = j >= n ? nullptr : tail ? k.at(j0 + j) : block_key(k, k.slots[j0 + j], D);
    const int step = tail ? 1 : kBlockSlots;
    for (int d = 0; d < D; ++d) kt[d * W + j] = at ? at[d * step] : 0.0f;
  }
  return kt;
}

// Raw scores of `rows` query rows (q in their passes' layout, `pass_at`) against keys [0, seen):
// s [rows][stride].
void scores(const float* q, int rows, const KeyRows& k, int seen, int D, float* s, int stride, float* kt) {
  prefetch_keys(k, 0, std::min(seen, kAheadKeys), D);
  for (int j0 = 0; j0 < seen; j0 += W) {
    prefetch_keys(k, std::min(seen, j0 + kAheadKeys), std::min(seen, j0 + kAheadKeys + W), D);
    int ks;
    const float* kb = key_block(k, j0, std::min(W, seen - j0), D, kt, ks);
    for (int r = 0; r < rows; r += kScoreRows)
      dot_pass(std::min(kScoreRows, rows - r), q + static_cast<size_t>(r) * D, D, kb, ks,
               s + static_cast<size_t>(r) * stride + j0, stride);
  }
}

// softmax in place over one row's keys [0, stride): masked and padding keys exactly zero;
// returns 1 / the row's sum (0 for a fully masked row).
float softmax_row(float* sr, int seen, int stride, int limit, const bool* m, int64_t mstride, float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  if (m) {
    for (int j = 0; j < seen; ++j) {
      const bool keep = j < limit && m[j * mstride];
      sr[j] = keep ? sr[j] * scale : neg_inf;
      top = sr[j] > top ? sr[j] : top;
    }
    for (int j = seen; j < stride; ++j) sr[j] = neg_inf;
  } else {  // no mask array (decode, causal verify and prefill): the same values a vector at a time
    const int end = limit < seen ? limit : seen;
    vi lane;
    for (int l = 0; l < W; ++l) lane[l] = l;
    vf tops = splat(neg_inf);
    for (int j = 0; j < stride; j += W) {
      const vf x = (lane + j) < end ? load(sr + j) * scale : splat(neg_inf);
      store(sr + j, x);
      tops = x > tops ? x : tops;
    }
    for (int l = 0; l < W; ++l) top = tops[l] > top ? tops[l] : top;  // a max: any order, the same value
  }
  vf sum = vf{};
  for (int j = 0; j < stride; j += W) {
    vf x = load(sr + j);
    vf p = exp_neg(x - top);
    p = x == splat(neg_inf) ? vf{} : p;  // exactly zero: masked keys change no sum
    store(sr + j, p);
    sum += p;
  }
  const float total = hsum(sum);
  return top == neg_inf || total == 0.0f ? 0.0f : 1.0f / total;
}

struct Scratch {
  std::vector<float> s, q, acc, kt, inv;
};

// One block of query positions [i0, i0 + n) of one (batch, KV head), for every query head
// of its group at once (row g * n + i: head hk * G + g, position i0 + i), so each key
// block is transposed once for all of them.
void block(const AttentionArgs& a, int b, int hk, int i0, int n, Scratch& w) {
  const int G = a.Hq / a.Hkv, D = a.D, rows = G * n;
  const int32_t* slots = a.slots ? a.slots + b * a.slot_stride : nullptr;
  const int64_t tail = b * a.ts[0] + hk * a.ts[1];
  const KeyRows k{a.k + b * a.ks[0] + hk * a.ks[1], a.ks[2], slots, a.tk + tail, D, a.split, a.blocked && slots};
  const KeyRows v{a.v + b * a.vs[0] + hk * a.vs[1], a.vs[2], slots, a.tv + tail, D, a.split};
  const int shift = a.T - a.L;  // causal: query i sees keys j <= shift + i
  const int seen = a.causal ? shift + i0 + n : a.T;  // keys any row of the block sees
  const int stride = (seen + W - 1) / W * W;
  w.s.resize(static_cast<size_t>(rows) * stride);
  w.q.resize(static_cast<size_t>(rows) * D);
  w.acc.resize(static_cast<size_t>(rows) * D);
  w.kt.resize(static_cast<size_t>(D) * W);
  w.inv.resize(rows);
  for (int g = 0; g < G; ++g) {
    const float* q = a.q + b * a.qs[0] + (hk * G + g) * a.qs[1] + i0 * a.qs[2];
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < D; ++d) w.q[pass_at(g * n + i, d, rows, D)] = q[i * a.qs[2] + d];
  }
  scores(w.q.data(), rows, k, seen, D, w.s.data(), stride, w.kt.data());
  for (int r = 0; r < rows; ++r) {
    const int i = r % n;
    const int limit = a.causal ? shift + i0 + i + 1 : a.T;
    const bool* m = a.mask ? a.mask + b * a.ms[0] + (i0 + i) * a.ms[1] : nullptr;
    w.inv[r] = softmax_row(w.s.data() + static_cast<size_t>(r) * stride, seen, stride, limit, m, a.ms[2], a.scale);
  }
  weigh_values(w.s.data(), stride, rows, v, seen, D, w.acc.data());
  for (int r = 0; r < rows; ++r) {
    const int g = r / n, i = r % n;
    float* out = a.out + b * a.os[0] + (hk * G + g) * a.os[1] + (i0 + i) * a.os[2];
    for (int d = 0; d < D; ++d) out[d] = w.acc[r * D + d] * w.inv[r];
  }
}

}  // namespace

void ATTENTION(const AttentionArgs& a, int64_t task) {
  static thread_local Scratch scratch;
  const int qb = query_block(a.L), blocks = (a.L + qb - 1) / qb;
  const int bh = static_cast<int>(task / blocks), blk = static_cast<int>(task % blocks);
  const int i0 = blk * qb;
  block(a, bh / a.Hkv, bh % a.Hkv, i0, std::min(qb, a.L - i0), scratch);
}

}  // namespace specbatch
