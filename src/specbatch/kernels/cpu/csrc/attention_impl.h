// The attention kernel body, compiled once per ISA (attention_avx2.cpp, attention_avx512.cpp)
// with W float lanes. A query row's result is summed in one fixed order over keys 0..T-1
// whatever block, batch or thread it falls in: chunks of kChunkKeys keys at fixed positions,
// each with its own softmax, folded in key order; masked keys add exact zeros.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention.h"
#include "paged_write.h"

namespace specbatch {
namespace {

#include "vmath_impl.h"
#include "weigh_impl.h"

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

// s[r][i * W .. (i + 1) * W) = q_r . k_(key vector i's): R query rows (q: their pass, [D][R])
// against K key vectors (kb[i]: [D][ks[i]]) in registers, one multiply and one add per d.
template <int R, int K>
void dot_rows(const float* q, int D, const float* const* kb, const int* ks, float* s, int stride) {
  vf acc[R][K] = {};
  for (int d = 0; d < D; ++d) {
    vf kd[K];
    for (int i = 0; i < K; ++i) kd[i] = load(kb[i] + d * ks[i]);
    for (int r = 0; r < R; ++r) {
      const vf qr = splat(q[d * R + r]);
      for (int i = 0; i < K; ++i) acc[r][i] += qr * kd[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < K; ++i) store(s + static_cast<size_t>(r) * stride + i * W, acc[r][i]);
}

// Rows a pass takes against two key vectors at once: a decode group's 3 rows against one
// left each add waiting on the last (3 chains of a 3-cycle add); 2 x 6 sums fit the registers.
constexpr int kTwoKeyRows = 6;

// n rows of a pass against `keys` (1 or 2) key vectors: every score the same sum either way.
template <int R = kScoreRows>
void dot_pass(int n, int keys, const float* q, int D, const float* const* kb, const int* ks, float* s, int stride) {
  if constexpr (R > 1) {
    if (n < R) return dot_pass<R - 1>(n, keys, q, D, kb, ks, s, stride);
  }
  if constexpr (R <= kTwoKeyRows) {
    if (keys == 2) return dot_rows<R, 2>(q, D, kb, ks, s, stride);
  }
  for (int i = 0; i < keys; ++i) dot_rows<R, 1>(q, D, kb + i, ks + i, s + i * W, stride);
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

// Raw scores of `rows` query rows (q in their passes' layout, `pass_at`) against keys [j0, j1):
// s [rows][stride] from j0 (kt: room for two key blocks, [2][D][W]).
void scores(const float* q, int rows, const KeyRows& k, int j0, int j1, int D, float* s, int stride, float* kt) {
  prefetch_keys(k, j0, std::min(j1, j0 + kAheadKeys), D);
  for (int j = j0; j < j1; j += 2 * W) {
    prefetch_keys(k, std::min(j1, j + kAheadKeys), std::min(j1, j + kAheadKeys + 2 * W), D);
    const int keys = j + W < j1 ? 2 : 1;  // key vectors this step
    int ks[2];
    const float* kb[2];
    for (int i = 0; i < keys; ++i)
      kb[i] = key_block(k, j + i * W, std::min(W, j1 - j - i * W), D, kt + i * D * W, ks[i]);
    for (int r = 0; r < rows; r += kScoreRows)
      dot_pass(std::min(kScoreRows, rows - r), keys, q + static_cast<size_t>(r) * D, D, kb, ks,
               s + static_cast<size_t>(r) * stride + j - j0, stride);
  }
}

#include "softmax_impl.h"

// A split task's chunk c (of `rows` query rows): its rows' most [rows], sum [rows] and weighed
// values [rows][D], kept for the fold after the pass.
inline size_t partial_at(int c, int rows, int D) { return static_cast<size_t>(c) * rows * (D + 2); }

struct Scratch {
  std::vector<float> s, q, acc, tot, kt, rm, rl, cm, cl;
  void start(int rows, int D) {  // a task's running sums: nothing seen
    rm.assign(rows, kNegInf), rl.assign(rows, 0.0f), tot.assign(static_cast<size_t>(rows) * D, 0.0f);
    cm.resize(rows), cl.resize(rows), acc.resize(static_cast<size_t>(rows) * D);
  }
};

// What one block of a task sees: its rows, their keys and values, where its causal limit lies.
struct Block {
  int rows, n, shift, seen;
  KeyRows k, v;
};

Block block_of(const AttentionArgs& a, int b, int hk, int i0, int n) {
  const int32_t* slots = a.slots ? a.slots + b * a.slot_stride : nullptr;
  const int64_t tail = b * a.ts[0] + hk * a.ts[1];
  const KeyRows k{a.k + b * a.ks[0] + hk * a.ks[1], a.ks[2], slots, a.tk + tail, a.D, a.split, a.blocked && slots};
  const KeyRows v{a.v + b * a.vs[0] + hk * a.vs[1], a.vs[2], slots, a.tv + tail, a.D, a.split};
  const int shift = a.T - a.L;  // causal: query i sees keys j <= shift + i
  return {a.Hq / a.Hkv * n, n, shift, a.causal ? shift + i0 + n : a.T, k, v};  // seen: keys any row sees
}

// Row r's output (head hk * G + r / n, position i0 + r % n): acc / sum, zero where nothing was seen.
void write_row(const AttentionArgs& a, int b, int hk, int i0, int n, int r, float m, float l, const float* acc) {
  const int g = r / n, i = r % n;
  float* out = a.out + b * a.os[0] + (hk * (a.Hq / a.Hkv) + g) * a.os[1] + (i0 + i) * a.os[2];
  const float inv = m == kNegInf || l == 0.0f ? 0.0f : 1.0f / l;
  for (int d = 0; d < a.D; ++d) out[d] = acc[d] * inv;
}

// Chunks [c0, c1) of one block of query positions [i0, i0 + n) of one (batch, KV head), for every
// query head of its group at once (row g * n + i: head hk * G + g, position i0 + i), so each key
// block is transposed once for all of them. Folded and written out (partials null), or each
// chunk's sums kept in `partials` for the fold after the pass (a task split over threads).
void block(const AttentionArgs& a, int b, int hk, int i0, int n, int c0, int c1, float* partials, Scratch& w) {
  const Block blk = block_of(a, b, hk, i0, n);
  const int G = a.Hq / a.Hkv, D = a.D, rows = blk.rows;
  // every chunk's scores first, then each chunk's softmax and values: the keys, then the values,
  // each read in one stream as before the chunks
  const int first = c0 * kChunkKeys, last = std::min(blk.seen, c1 * kChunkKeys);
  const int stride = (last - first + W - 1) / W * W;
  w.s.resize(static_cast<size_t>(rows) * stride);
  w.q.resize(static_cast<size_t>(rows) * D);
  w.kt.resize(static_cast<size_t>(2) * D * W);  // two key blocks
  w.start(rows, D);
  for (int g = 0; g < G; ++g) {
    const float* q = a.q + b * a.qs[0] + (hk * G + g) * a.qs[1] + i0 * a.qs[2];
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < D; ++d) w.q[pass_at(g * n + i, d, rows, D)] = q[i * a.qs[2] + d];
  }
  scores(w.q.data(), rows, blk.k, first, last, D, w.s.data(), stride, w.kt.data());
  prefetch_rows(blk.v, first, std::min(last, first + kAheadKeys), D);
  for (int c = c0; c < c1; ++c) {
    const int j0 = c * kChunkKeys, j1 = std::min(last, j0 + kChunkKeys);
    float* s = w.s.data() + (j0 - first);
    for (int r = 0; r < rows; ++r) {  // every row's most, then every row's exps: rows overlap
      const int i = r % n;
      const int limit = a.causal ? blk.shift + i0 + i + 1 : a.T;
      const bool* m = a.mask ? a.mask + b * a.ms[0] + (i0 + i) * a.ms[1] : nullptr;
      w.cm[r] = chunk_scale(s + static_cast<size_t>(r) * stride, j0, j1, limit, m, a.ms[2], a.scale);
    }
    for (int r = 0; r < rows; ++r)
      w.cl[r] = chunk_exp(s + static_cast<size_t>(r) * stride, (j1 - j0 + W - 1) / W * W, w.cm[r]);
    if (!partials) {
      weigh_values(s, stride, rows, blk.v, j0, j1, last, D, w.acc.data());
      fold(rows, D, w.rm.data(), w.rl.data(), w.tot.data(), w.cm.data(), w.cl.data(), w.acc.data());
      continue;
    }
    float* at = partials + partial_at(c, rows, D);
    std::copy(w.cm.begin(), w.cm.end(), at);
    std::copy(w.cl.begin(), w.cl.end(), at + rows);
    weigh_values(s, stride, rows, blk.v, j0, j1, last, D, at + 2 * rows);
  }
  if (!partials)
    for (int r = 0; r < rows; ++r) write_row(a, b, hk, i0, n, r, w.rm[r], w.rl[r], w.tot.data() + static_cast<size_t>(r) * D);
}

// Task `task`'s (batch, KV head) and first query position.
void task_at(const AttentionArgs& a, int64_t task, int& b, int& hk, int& i0, int& n) {
  const int qb = query_block(a.L), blocks = (a.L + qb - 1) / qb;
  const int bh = static_cast<int>(task / blocks);
  b = bh / a.Hkv, hk = bh % a.Hkv, i0 = static_cast<int>(task % blocks) * qb, n = std::min(qb, a.L - i0);
}

}  // namespace

void ATTENTION(const AttentionArgs& a, int64_t task, int c0, int c1, float* partials) {
  static thread_local Scratch scratch;
  int b, hk, i0, n;
  task_at(a, task, b, hk, i0, n);
  block(a, b, hk, i0, n, c0, c1, partials, scratch);
}

void FOLD(const AttentionArgs& a, int64_t task, int chunks, const float* partials) {
  static thread_local Scratch w;
  int b, hk, i0, n;
  task_at(a, task, b, hk, i0, n);
  const int rows = a.Hq / a.Hkv * n, D = a.D;
  w.start(rows, D);
  for (int c = 0; c < chunks; ++c) {
    const float* at = partials + partial_at(c, rows, D);
    fold(rows, D, w.rm.data(), w.rl.data(), w.tot.data(), at, at + rows, at + 2 * rows);
  }
  for (int r = 0; r < rows; ++r) write_row(a, b, hk, i0, n, r, w.rm[r], w.rl[r], w.tot.data() + static_cast<size_t>(r) * D);
}

}  // namespace specbatch
