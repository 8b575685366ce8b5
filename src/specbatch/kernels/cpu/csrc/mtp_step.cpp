#include "mtp_step.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "attention.h"
#include "linear.h"
#include "mlp_block.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "norm.h"
#include "paged_write.h"
#include "strided.h"

namespace specbatch {

namespace {

constexpr int kFixed = 6;  // h, emb, positions, inv_freq, ctx_k, ctx_v (then the slots, the mask where given)

void fail(const char* what) { throw std::invalid_argument(std::string("mtp_step: ") + what); }


void check_weights(const std::vector<mx::array>& w, const MtpShape& s, int K) {
  if (w.size() != kMtpWeights) fail("13 weights: enorm, hnorm, eh_proj, the block's, the final norm");
  const int D = s.qkv.heads > 0 && w[kWq].ndim() == 2 ? w[kWq].shape(0) / s.qkv.heads : 0;
  if (D == 0 || D > 256 || s.qkv.kv_heads <= 0 || s.qkv.heads % s.qkv.kv_heads) fail("Hq a multiple of Hkv, D <= 256");
  for (int i : {kEnorm, kHnorm, kNormOut})
    if (!vector_of(w[i], K)) fail("enorm, hnorm and the final norm float32 [K]");
  if (!matrix_of(w[kEhProj], K, 2 * K)) fail("eh_proj [K, 2K]");
  // kNormIn .. kWo are a block's arrays in the decoder stack's order (no biases)
  if (const char* what = block_mismatch(w.data() + kNormIn, s.qkv, false, K, D)) fail(what);
}

// The context's keys or values, read in place: [B or 1, Hkv, >= length, D], D contiguous.
void check_context(const mx::array& c, int B, int Hkv, int D, int length) {
  if (c.dtype() != mx::float32 || c.ndim() != 4 || (c.shape(0) != 1 && c.shape(0) != B) || c.shape(1) != Hkv ||
      c.shape(3) != D || length < 0 || length > c.shape(2))
    fail("ctx_k, ctx_v float32 [B or 1, Hkv, >= length, D]");
}

// A paged context: pools [Hkv, P, D] (P a multiple of the key blocks' 16), slots [B or 1, length].
void check_pools(const mx::array& k, const mx::array& v, const mx::array& slots, int B, int Hkv, int D, int length) {
  if (k.dtype() != mx::float32 || k.ndim() != 3 || k.shape(0) != Hkv || k.shape(2) != D || k.shape() != v.shape() ||
      v.dtype() != mx::float32 || k.shape(1) % kBlockSlots)
    fail("paged ctx_k, ctx_v float32 pools [Hkv, P, D], P a multiple of 16");
  if (slots.dtype() != mx::int32 || slots.ndim() != 2 || (slots.shape(0) != 1 && slots.shape(0) != B) ||
      slots.shape(1) != length)
    fail("ctx_slots int32 [B or 1, length]");
}

// A context's keys or values as the attention reads them: [batch, head, key] strides in floats.
struct Context {
  const float* data;
  int64_t strides[3];
};

Context context_of(const mx::array& c, std::vector<float>& copy) {
  const bool whole = c.shape(0) == 1;  // one row's context for every draft row (a tree's frontier)
  if (c.strides(3) == 1)
    return {c.data<float>(), {whole ? 0 : c.strides(0), c.strides(1), c.strides(2)}};
  const int64_t T = c.shape(2), D = c.shape(3);
  return {row_major(c, copy), {whole ? 0 : c.shape(1) * T * D, T * D, D}};
}

}  // namespace

std::vector<mx::array> mtp_step(const mx::array& h, const mx::array& emb, const mx::array& positions,
                                const mx::array& inv_freq, const mx::array& ctx_k, const mx::array& ctx_v, int length,
                                const std::optional<mx::array>& ctx_mask, const std::optional<mx::array>& ctx_slots,
                                const std::vector<mx::array>& own_k, const std::vector<mx::array>& own_v,
                                const std::vector<mx::array>& weights, const MtpShape& shape) {
  if (h.dtype() != mx::float32 || h.ndim() != 2 || h.shape(0) == 0 || h.shape(0) > kMaxRows || emb.shape() != h.shape() ||
      emb.dtype() != mx::float32)
    fail("h and emb float32 [B, K], at most 32 rows");
  if (detect_isa() == Isa::none) throw std::runtime_error("mtp_step: the CPU lacks AVX2/FMA");
  const int B = h.shape(0), K = h.shape(1), Hkv = shape.qkv.kv_heads;
  check_weights(weights, shape, K);
  const int D = weights[kWq].shape(0) / shape.qkv.heads;
  if (positions.dtype() != mx::int32 || positions.ndim() != 1 || (positions.shape(0) != 1 && positions.shape(0) != B))
    fail("positions int32 [1] or [B]");
  if (!rope_fits(shape.qkv, D, inv_freq))
    fail("RoPE dims even, at most D; inv_freq [dims / 2]");
  if (ctx_slots) {
    check_pools(ctx_k, ctx_v, *ctx_slots, B, Hkv, D, length);
  } else {
    check_context(ctx_k, B, Hkv, D, length);
    check_context(ctx_v, B, Hkv, D, length);
  }
  if (ctx_mask && (ctx_mask->dtype() != mx::bool_ || ctx_mask->ndim() != 2 || ctx_mask->shape(1) != length ||
                   (ctx_mask->shape(0) != 1 && ctx_mask->shape(0) != B)))
    fail("ctx_mask bool [B or 1, length]");
  if (own_k.size() != own_v.size()) fail("as many own values as own keys");
  for (const auto* own : {&own_k, &own_v})
    for (const auto& a : *own)
      if (a.dtype() != mx::float32 || a.shape() != mx::Shape{B, Hkv, 1, D}) fail("own keys and values [B, Hkv, 1, D]");
  evaluate_constants(weights);
  std::vector<mx::array> inputs{h, emb, positions, inv_freq, ctx_k, ctx_v};
  if (ctx_slots) inputs.push_back(*ctx_slots);
  if (ctx_mask) inputs.push_back(*ctx_mask);
  inputs.insert(inputs.end(), own_k.begin(), own_k.end());
  inputs.insert(inputs.end(), own_v.begin(), own_v.end());
  auto s = mx::default_stream(mx::Device::cpu);
  auto op = std::make_shared<MtpStep>(s, shape, weights, length, static_cast<int>(own_k.size()), ctx_mask.has_value(),
                                     ctx_slots.has_value());
  const mx::Shape kv{B, Hkv, 1, D};
  return mx::array::make_arrays({h.shape(), kv, kv}, {mx::float32, mx::float32, mx::float32}, op, inputs);
}

namespace {

// The tail [B, Hkv, own + 1, D]: the head's earlier keys (or values) of the round, then this step's.
void gather_tail(const std::vector<mx::array>& in, size_t first, int own, const float* now, int rows, int D,
                 std::vector<float>& tail) {
  const int n = own + 1;
  std::vector<float> copy;
  tail.resize(static_cast<size_t>(rows) * n * D);
  for (int i = 0; i < n; ++i) {
    const float* src = i < own ? row_major(in[first + i], copy) : now;
    for (int r = 0; r < rows; ++r)
      std::memcpy(tail.data() + (static_cast<size_t>(r) * n + i) * D, src + static_cast<size_t>(r) * D, sizeof(float) * D);
  }
}

}  // namespace

// The block's attention for B query rows: q [B, Hq, 1, D] over the context's first `length`
// keys (in place, or a paged layer's blocks through its slots; masked where a mask came), then
// the tail: the head's earlier keys of the round and this step's (k, v [B, Hkv, 1, D]) ->
// merged heads [B, 1, Hq * D].
void MtpStep::attend(const std::vector<mx::array>& in, int D, const float* q, const float* k, const float* v,
                     float* heads) const {
  const int B = in[0].shape(0), Hq = shape_.qkv.heads, Hkv = shape_.qkv.kv_heads, n = own_ + 1;
  const size_t mask_at = kFixed + (paged_ ? 1 : 0), first_own = mask_at + (masked_ ? 1 : 0);
  std::vector<float> tk, tv, kc, vc;  // kc, vc: a context whose D is strided (never a cache buffer) copied
  gather_tail(in, first_own, own_, k, B * Hkv, D, tk);
  gather_tail(in, first_own + own_, own_, v, B * Hkv, D, tv);
  AttentionArgs at{};
  std::vector<int32_t> sc;
  Context ck, cv;
  if (paged_) {  // [Hkv, P, D] pools, keys in blocks; row b's key j at slot slots[b, j]
    const auto& slots = in[kFixed];
    const int64_t pool = static_cast<int64_t>(in[4].shape(1)) * D;
    at.slots = row_major(slots, sc), at.slot_stride = slots.shape(0) == 1 ? 0 : length_, at.blocked = true;
    if (!slots_valid(at.slots, static_cast<int64_t>(slots.shape(0)) * length_, in[4].shape(1))) {
      std::fill(heads, heads + static_cast<size_t>(B) * Hq * D, std::nanf(""));  // a table bug: NaN, never a stray read
      return;
    }
    ck = {row_major(in[4], kc), {0, pool, D}}, cv = {row_major(in[5], vc), {0, pool, D}};
  } else {
    ck = context_of(in[4], kc), cv = context_of(in[5], vc);
  }
  at.B = B, at.Hq = Hq, at.Hkv = Hkv, at.L = 1, at.D = D, at.T = length_ + n, at.scale = shape_.attn_scale;
  at.q = q, at.qs[0] = static_cast<int64_t>(Hq) * D, at.qs[1] = D, at.qs[2] = D;
  at.out = heads, at.os[0] = static_cast<int64_t>(Hq) * D, at.os[1] = D, at.os[2] = static_cast<int64_t>(Hq) * D;
  at.k = ck.data, at.v = cv.data;
  std::copy(ck.strides, ck.strides + 3, at.ks), std::copy(cv.strides, cv.strides + 3, at.vs);
  at.tk = tk.data(), at.tv = tv.data(), at.ts[0] = static_cast<int64_t>(Hkv) * n * D, at.ts[1] = n * D;
  at.split = length_;
  std::vector<char> mask;  // the context's mask, then the head's own keys (always seen)
  if (masked_) {
    const auto& m = in[mask_at];
    mask.assign(static_cast<size_t>(B) * at.T, 1);
    const bool* mp = m.data<bool>();
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < length_; ++j)
        mask[static_cast<size_t>(b) * at.T + j] = mp[(m.shape(0) == 1 ? 0 : b * m.strides(0)) + j * m.strides(1)];
    at.mask = reinterpret_cast<const bool*>(mask.data()), at.ms[0] = at.T, at.ms[1] = 0, at.ms[2] = 1;
  }
  attention_run(at);
}

// norm, project, one block over [the context's keys; the head's own], norm (the op's task).
void MtpStep::run(const std::vector<mx::array>& in, float* hidden, float* kout, float* vout) const {
  const HeldConstants w(weights_);
  const auto vec = [&](int i) { return static_cast<const float*>(w[i].w.data); };
  const int B = in[0].shape(0), K = in[0].shape(1), Hq = shape_.qkv.heads, Hkv = shape_.qkv.kv_heads;
  const int D = w[kWq].rows / Hq, nq = Hq * D, nk = Hkv * D;
  std::vector<float> copies[3], a(static_cast<size_t>(B) * 2 * K), x(static_cast<size_t>(B) * K), y(x.size());
  std::vector<int> pc;
  const float* hp = row_major(in[0], copies[0]);
  const float* ep = row_major(in[1], copies[1]);
  for (int b = 0; b < B; ++b) {  // a row = [enorm(emb); hnorm(h)]: the concatenation eh_proj reads
    norm_rows(ep + b * K, vec(kEnorm), a.data() + b * 2 * K, 1, K, shape_.eps_emb);
    norm_rows(hp + b * K, vec(kHnorm), a.data() + b * 2 * K + K, 1, K, shape_.eps_hidden);
  }
  gemv_all(a.data(), B, 2 * K, {{w[kEhProj].w, K, x.data(), K}});
  std::vector<float> q(static_cast<size_t>(B) * nq), heads(q.size());
  QkvRows r{x.data(), B, 1, K, {w[kWq].w, w[kWk].w, w[kWv].w}, nq, nk, vec(kNormIn), {nullptr, nullptr, nullptr},
            row_major(in[2], pc), in[2].shape(0) > 1, false, row_major(in[3], copies[2]), shape_.qkv,
            {q.data(), kout, vout}};
  qkv_rows(r);
  attend(in, D, q.data(), kout, vout, heads.data());
  mlp_rows(x.data(), heads.data(), B, K, w[kWg].rows, nq, vec(kNormPost), shape_.eps_post, w[kWg].w, w[kWu].w,
           w[kWd].w, &w[kWo].w, y.data());
  norm_rows(y.data(), vec(kNormOut), hidden, B, K, shape_.eps_out);
}

void MtpStep::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  std::vector<float*> ys;
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    ys.push_back(out.data<float>());
  }
  std::vector<mx::array> weak;  // as MLX's own ops capture: MLX keeps the buffers until the task ran
  for (const auto& in : inputs) weak.push_back(mx::array::unsafe_weak_copy(in));
  auto op = std::static_pointer_cast<MtpStep>(outputs[0].primitive_ptr());
  encoder.dispatch([op, in = std::move(weak), ys]() { op->run(in, ys[0], ys[1], ys[2]); });
}

bool MtpStep::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const MtpStep&>(other);
  const auto& a = shape_.qkv;
  const auto& b = o.shape_.qkv;
  return a.heads == b.heads && a.kv_heads == b.kv_heads && a.dims == b.dims && a.traditional == b.traditional &&
         a.scale == b.scale && a.eps == b.eps && shape_.attn_scale == o.shape_.attn_scale &&
         shape_.eps_emb == o.shape_.eps_emb && shape_.eps_hidden == o.shape_.eps_hidden &&
         shape_.eps_post == o.shape_.eps_post && shape_.eps_out == o.shape_.eps_out && length_ == o.length_ &&
         own_ == o.own_ && masked_ == o.masked_ && paged_ == o.paged_ &&
         std::equal(weights_.begin(), weights_.end(), o.weights_.begin(), o.weights_.end(),
                    [](const mx::array& x, const mx::array& y) { return x.id() == y.id(); });
}

void MtpStep::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("SpecbatchMtpStep runs on the CPU only");
}

}  // namespace specbatch
