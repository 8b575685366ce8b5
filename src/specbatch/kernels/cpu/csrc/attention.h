// Attention for decode, verify and prefill queries over a strided KV (flash-style blocks
// of queries, vectorised exp, keys past a block's causal limit never read).
#pragma once

#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// What one call sees; strides in floats (the head dimension D is contiguous). Paged: key
// j of batch row b is slot slots[b * slot_stride + j] of its head's pool (ks[1], vs[1]: a head's
// pool, P * D; ks[2], vs[2]: D).
struct AttentionArgs {
  const float* q; const float* k; const float* v; const bool* mask; float* out;
  const int32_t* slots; int64_t slot_stride;
  int B, Hq, Hkv, L, T, D;
  int64_t qs[3], ks[3], vs[3], ms[3];  // [batch, head, row] strides; ms: [batch, query, key]
  int64_t os[3];  // the output's [batch, head, row] strides: [B, Hq, L, D] or merged [B, L, Hq * D]
  float scale;
  bool causal;  // query i sees keys j <= T - L + i
  // keys j >= split come from a second place, dense (the MTP head's own keys after the
  // target's): tk, tv + batch * ts[0] + head * ts[1] + (j - split) * D
  const float* tk = nullptr; const float* tv = nullptr;
  int64_t ts[2] = {0, 0};
  int split = 1 << 30;
  bool blocked = false;  // paged keys in 16-slot blocks, [D][16] each (paged_write.h): no transposes
};

// Query positions per block: each block reads (and transposes) the keys it sees once for
// all of them; prefill chunks take larger blocks. A row's result never depends on it.
inline int query_block(int L) { return L > 64 ? 32 : 8; }

// Keys a chunk: the softmax's unit. Each chunk has its own most, sum and weighed values, folded
// in key order: chunks at fixed key positions give every path the same bits, and a row's chunks
// can go to different threads. 128 against 64, paired in one process against the old whole-row
// softmax: prefill blocks over 512-1,408 keys 0.89-1.03x against 0.99-1.04x, dense decode over
// 512 / 1,440 keys 0.82-0.86x / 0.76-0.93x against 0.83-0.88x / 0.89-0.92x (128 keys: even).
constexpr int kChunkKeys = 128;

// One head's keys (or values): key j at base + j * stride, or at pool row slots[j]; from
// `split` on, at tail + (j - split) * tail_stride. Blocked (keys before `split`): slot s's
// element d at base + (s / 16) * 16 * D + d * 16 + s % 16, which at() does not give.
struct KeyRows {
  const float* base; int64_t stride; const int32_t* slots;
  const float* tail = nullptr; int64_t tail_stride = 0; int split = 1 << 30;
  bool blocked = false;
  const float* at(int j) const {
    return j >= split ? tail + (j - split) * tail_stride : base + (slots ? slots[j] : j) * stride;
  }
};

// Every task of a call on the pool (the op's task; each layer of the decoder stack).
void attention_run(const AttentionArgs& a);
// Whether every one of n slots names one of a pool's rows (else the caller writes NaN).
bool slots_valid(const int32_t* slots, int64_t n, int64_t rows);

// A task (one block of query positions of one batch row and KV head): its key chunks [c0, c1),
// folded and written out, or where the pass split its chunks over threads, each chunk's sums
// kept in `partials` ([chunk][row][D + 2]) for the fold of all of them after it.
void attention_avx2(const AttentionArgs& a, int64_t task, int c0, int c1, float* partials);
void attention_avx512(const AttentionArgs& a, int64_t task, int c0, int c1, float* partials);
void attention_fold_avx2(const AttentionArgs& a, int64_t task, int chunks, const float* partials);
void attention_fold_avx512(const AttentionArgs& a, int64_t task, int chunks, const float* partials);

// q [B, Hq, L, D], k and v [B, Hkv, T, D] (any strides but D's), mask: "" / "causal" /
// "array" (bool [B or 1, 1, L, T] as the fourth input) -> [B, Hq, L, D], or with merge_heads
// [B, L, Hq * D] (what the output projection takes: no transpose and copy after it). length > 0:
// only the first `length` keys of k and v are attended (a cache's buffer read in place, no
// slice node before it), and T above means `length`.
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::string& mask_kind, const mx::array& mask, bool merge_heads = false, int length = 0);

// The same over a paged cache: k_pool and v_pool [Hkv, P, D] (each head's token slots in a row),
// slots int32 [B, T]: row b's key j is slot slots[b, j] (columns past a row's length
// point at any valid slot and are masked).
mx::array paged_attention(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                          const mx::array& slots, float scale, const std::string& mask_kind, const mx::array& mask,
                          bool merge_heads = false);

class Attention : public mx::UnaryPrimitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal, bool paged, bool merged, int length = 0)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal), paged_(paged), merged_(merged), length_(length) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "SpecbatchAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && paged_ == o.paged_ && merged_ == o.merged_ &&
           length_ == o.length_;
  }

 private:
  float scale_;
  bool causal_;
  bool paged_;  // inputs q, k_pool, v_pool, slots[, mask]
  bool merged_;  // output [B, L, Hq * D]
  int length_;  // keys attended (the first of k's), 0: all
};

}  // namespace specbatch
