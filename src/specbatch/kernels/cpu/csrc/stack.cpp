#include "stack.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "attention.h"
#include "gemv.h"
#include "linear.h"
#include "mlp_block.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "paged_write.h"
#include "strided.h"

namespace specbatch {

int layer_inputs(bool bias) { return 9 + (bias ? 3 : 0); }

namespace {

constexpr int kFixed = 3;  // h, positions, inv_freq (then the slots where paged, the mask where given)

void fail(const char* what) { throw std::invalid_argument(std::string("decoder_stack: ") + what); }


// The KV buffers against the forward (B rows of L tokens, D a head's size); T: the keys attended.
int check_kv(const StackKV& kv, int B, int L, int Hkv, int D) {
  for (const auto& p : kv.buffers) {
    const bool fits = kv.paged() ? p.ndim() == 3 && p.shape(0) == Hkv && p.shape(2) == D && p.shape(1) % kBlockSlots == 0
                                 : p.ndim() == 4 && p.shape(0) == B && p.shape(1) == Hkv && p.shape(3) == D &&
                                       kv.start >= 0 && kv.start + L <= p.shape(2);
    if (p.dtype() != mx::float32 || !fits)
      fail("KV buffers float32: pools [Hkv, P, D] (P a multiple of 16), or dense [B, Hkv, C, D] with room for the tokens");
  }
  if (!kv.paged()) return kv.start + L;
  const auto& ws = *kv.write_slots;
  if (!kv.read_slots || ws.dtype() != mx::int32 || ws.ndim() != 1 || ws.shape(0) != B * L ||
      kv.read_slots->dtype() != mx::int32 || kv.read_slots->ndim() != 2 || kv.read_slots->shape(0) != B)
    fail("write_slots int32 [B * L], read_slots int32 [B, T]");
  return kv.read_slots->shape(1);
}

// What a forward brings against its stack's checked constants.
void check(const mx::array& h, const StackWeights& w, const mx::array& positions, const mx::array& inv_freq,
           const StackKV& kv, const std::string& kind, const mx::array& mask, const std::vector<int>& keep) {
  if (kv.buffers.size() != 2 * static_cast<size_t>(w.layers)) fail("per layer two KV buffers");
  if (h.dtype() != mx::float32 || h.ndim() != 3 || h.shape(0) * h.shape(1) > kMaxRows || h.size() == 0 ||
      h.shape(2) != w.K)
    fail("h float32 [B, L, K] (K the stack's), at most 32 rows");
  const int B = h.shape(0), L = h.shape(1);
  if (positions.dtype() != mx::int32 || positions.ndim() != 1 || (positions.shape(0) != 1 && positions.shape(0) != B))
    fail("positions int32 [1] or [B]");
  if (!rope_fits(w.shape.qkv, w.D, inv_freq))
    fail("RoPE dims even, at most D; inv_freq [dims / 2]");
  const int T = check_kv(kv, B, L, w.shape.qkv.kv_heads, w.D);
  if (kind == "causal" ? L > T : kind == "array" ? (mask.dtype() != mx::bool_ || mask.ndim() != 4 ||
                                                    mask.shape(1) != 1 || mask.shape(2) != L || mask.shape(3) != T ||
                                                    (mask.shape(0) != 1 && mask.shape(0) != B))
                                                 : !kind.empty())
    fail("mask '', 'causal' (L <= T) or 'array' (bool [B or 1, 1, L, T])");
  for (int i : keep)
    if (i < 0 || i >= w.layers) fail("keep names a layer");
}

}  // namespace

std::shared_ptr<const StackWeights> stack_weights(std::vector<mx::array> weights, std::vector<float> eps,
                                                  const StackShape& s) {
  const size_t per = layer_inputs(s.bias), layers = weights.size() / per;
  if (layers == 0 || weights.size() != layers * per || eps.size() != 2 * layers)
    fail("per layer two eps and its weights");
  if (detect_isa() == Isa::none) throw std::runtime_error("decoder_stack: the CPU lacks AVX2/FMA");
  const int K = weights[0].ndim() == 1 ? weights[0].shape(0) : 0;
  const int D = s.qkv.heads > 0 && weights[1].ndim() == 2 ? weights[1].shape(0) / s.qkv.heads : 0;
  if (D == 0 || D > 256 || s.qkv.kv_heads <= 0 || s.qkv.heads % s.qkv.kv_heads)
    fail("Hq a multiple of Hkv, D <= 256");
  for (size_t i = 0; i < layers; ++i)
    if (const char* what = block_mismatch(weights.data() + i * per, s.qkv, s.bias, K, D)) fail(what);
  // The weights are constants the op holds, not inputs: each of a many-output op's outputs copies
  // its inputs (~430 a step, 63 outputs), and the graph would walk them every step.
  evaluate_constants(weights);
  return std::make_shared<const StackWeights>(StackWeights{s, std::move(weights), std::move(eps),
                                                           static_cast<int>(layers), K, D});
}

std::vector<mx::array> decoder_stack(const mx::array& h, const std::shared_ptr<const StackWeights>& w,
                                     const mx::array& positions, const mx::array& inv_freq, const StackKV& kv,
                                     const std::string& mask_kind, const mx::array& mask,
                                     const std::vector<int>& keep) {
  if (!w) fail("no weights");
  check(h, *w, positions, inv_freq, kv, mask_kind, mask, keep);
  auto s = mx::default_stream(mx::Device::cpu);
  const bool masked = mask_kind == "array";
  std::vector<mx::array> inputs{h, positions, inv_freq};
  if (kv.paged()) inputs.push_back(*kv.write_slots), inputs.push_back(*kv.read_slots);
  if (masked) inputs.push_back(mask);
  inputs.insert(inputs.end(), kv.buffers.begin(), kv.buffers.end());
  std::vector<mx::Shape> shapes(1 + keep.size(), h.shape());
  for (const auto& p : kv.buffers) shapes.push_back(p.shape());
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  auto op = std::make_shared<DecoderStack>(s, w, keep, mask_kind == "causal", masked, kv.paged(),
                                           kv.paged() ? 0 : kv.start);
  return mx::array::make_arrays(std::move(shapes), dtypes, op, inputs);
}

namespace {

// One call's layout: where each input sits, the shapes every layer shares.
struct Layout {
  int B, L, K, D, Hq, Hkv, T, layers, per;
  size_t mask, kv;  // the mask's input, the first KV buffer's
};

Layout layout_of(const std::vector<mx::array>& in, const StackWeights& w, bool masked, bool paged, int start) {
  const StackShape& s = w.shape;
  Layout l{};
  l.B = in[0].shape(0), l.L = in[0].shape(1), l.K = in[0].shape(2);
  l.Hq = s.qkv.heads, l.Hkv = s.qkv.kv_heads, l.per = layer_inputs(s.bias);
  l.T = paged ? in[kFixed + 1].shape(1) : start + l.L;
  l.mask = kFixed + (paged ? 2 : 0);
  l.kv = l.mask + (masked ? 1 : 0);
  l.layers = w.layers;
  l.D = w.D;
  return l;
}

// A forward's keys (or values) [B, H, L, D] into a dense buffer [B, H, C, D] from column start.
void dense_rows(const float* x, int B, int H, int L, int D, int C, int start, float* buf) {
  for (int64_t bh = 0; bh < static_cast<int64_t>(B) * H; ++bh)
    std::memcpy(buf + (bh * C + start) * D, x + bh * L * D, sizeof(float) * L * D);
}

// One layer's attention, merged heads out, as the Attention op sets up its call: over a paged
// pool through slots (C = 0), or a dense buffer's first T keys (C its columns).
void attend(const Layout& l, const float* q, const float* kp, const float* vp, int64_t rows, int C,
            const int32_t* slots, const mx::array* mask, const StackShape& s, bool causal, float* out) {
  AttentionArgs a{};
  a.B = l.B, a.Hq = l.Hq, a.L = l.L, a.D = l.D, a.Hkv = l.Hkv, a.T = l.T;
  a.scale = s.attn_scale, a.causal = causal, a.out = out;
  a.os[0] = static_cast<int64_t>(l.Hq) * l.L * l.D, a.os[1] = l.D, a.os[2] = static_cast<int64_t>(l.Hq) * l.D;
  a.q = q, a.qs[0] = static_cast<int64_t>(l.Hq) * l.L * l.D, a.qs[1] = static_cast<int64_t>(l.L) * l.D, a.qs[2] = l.D;
  a.k = kp, a.v = vp;
  if (slots) {
    a.slots = slots, a.slot_stride = l.T, a.blocked = true;
    a.ks[0] = a.vs[0] = 0, a.ks[1] = a.vs[1] = rows * l.D, a.ks[2] = a.vs[2] = l.D;
  } else {
    a.ks[0] = a.vs[0] = static_cast<int64_t>(l.Hkv) * C * l.D, a.ks[1] = a.vs[1] = static_cast<int64_t>(C) * l.D;
    a.ks[2] = a.vs[2] = l.D;
  }
  if (mask) {
    a.mask = mask->data<bool>();
    a.ms[0] = mask->shape(0) == 1 ? 0 : mask->strides(0), a.ms[1] = mask->strides(2), a.ms[2] = mask->strides(3);
  }
  if (slots && !slots_valid(slots, static_cast<int64_t>(l.B) * l.T, rows)) {  // a table bug: NaN, never a stray read
    std::fill(out, out + static_cast<int64_t>(l.B) * l.Hq * l.L * l.D, std::nanf(""));
    return;
  }
  attention_run(a);
}

// A layer's arrays as the walk reads them: its 7 matrices (wq, wk, wv, wg, wu, wd, wo), its
// norms and biases, and I (wg's rows), from its resolved constants.
struct LayerView {
  Weights m[7];
  const float *norm_in, *norm_post, *bias[3] = {nullptr, nullptr, nullptr};
  int I;
};

LayerView layer_view(const Constant* t, bool bias) {
  const int b = bias ? 3 : 0;
  const int at[7] = {1, 2, 3, 5 + b, 6 + b, 7 + b, 8 + b};
  LayerView view;
  for (int j = 0; j < 7; ++j) view.m[j] = t[at[j]].w;
  view.norm_in = static_cast<const float*>(t[0].w.data);
  view.norm_post = static_cast<const float*>(t[4 + b].w.data);
  for (int j = 0; j < b; ++j) view.bias[j] = static_cast<const float*>(t[4 + j].w.data);
  view.I = t[5 + b].rows;
  return view;
}

}  // namespace

// The layers in turn on the pool (the op's task): ys = {the output, the kept outputs, the pools}.
void DecoderStack::run(const std::vector<mx::array>& in, const std::vector<float*>& ys) const {
  const StackShape& shape = w_->shape;
  const Layout l = layout_of(in, *w_, masked_, paged_, start_);
  const int M = l.B * l.L, nq = l.Hq * l.D, nk = l.Hkv * l.D;
  std::vector<float> hc, ic;
  std::vector<int> pc, wc, rc;
  const int* pos = row_major(in[1], pc);
  const float* inv = row_major(in[2], ic);
  const int32_t* ws = paged_ ? row_major(in[kFixed], wc) : nullptr;
  const int32_t* rs = paged_ ? row_major(in[kFixed + 1], rc) : nullptr;
  std::vector<float> q(static_cast<size_t>(M) * nq), k(static_cast<size_t>(M) * nk), v(k.size()), heads(q.size());
  std::vector<float> buf[2] = {std::vector<float>(static_cast<size_t>(M) * l.K), std::vector<float>(M * l.K)};
  const float* x = row_major(in[0], hc);
  const size_t out_pools = 1 + keep_.size();
  const HeldConstants t(w_->weights);
  for (int i = 0; i < l.layers; ++i) {
    const LayerView lv = layer_view(t.data() + static_cast<size_t>(i) * l.per, shape.bias);
    QkvShape qs = shape.qkv;
    qs.eps = w_->eps[2 * i];
    QkvRows r{x, l.B, l.L, l.K, {lv.m[0], lv.m[1], lv.m[2]}, nq, nk, lv.norm_in, {lv.bias[0], lv.bias[1], lv.bias[2]},
              pos, in[1].shape(0) > 1, false, inv, qs, {q.data(), k.data(), v.data()}};
    qkv_rows(r);
    float* kp = ys[out_pools + 2 * i];
    float* vp = ys[out_pools + 2 * i + 1];
    const mx::array& buffer = in[l.kv + 2 * i];
    const int64_t P = paged_ ? buffer.shape(1) : 0;  // paged: a head's pool slots
    const int C = paged_ ? 0 : buffer.shape(2);  // dense: the buffer's columns
    if (paged_) {
      const int64_t xs[3] = {static_cast<int64_t>(l.Hkv) * l.L * l.D, static_cast<int64_t>(l.L) * l.D, l.D};
      paged_rows(k.data(), xs, ws, l.B, l.Hkv, l.L, l.D, P, kp, true);
      paged_rows(v.data(), xs, ws, l.B, l.Hkv, l.L, l.D, P, vp, false);
    } else {
      dense_rows(k.data(), l.B, l.Hkv, l.L, l.D, C, start_, kp);
      dense_rows(v.data(), l.B, l.Hkv, l.L, l.D, C, start_, vp);
    }
    attend(l, q.data(), kp, vp, P, C, rs, masked_ ? &in[l.mask] : nullptr, shape, causal_, heads.data());
    float* y = i + 1 == l.layers ? ys[0] : buf[i % 2].data();
    mlp_rows(x, heads.data(), M, l.K, lv.I, nq, lv.norm_post, w_->eps[2 * i + 1], lv.m[3], lv.m[4], lv.m[5], &lv.m[6], y);
    for (size_t j = 0; j < keep_.size(); ++j)
      if (keep_[j] == i) std::memcpy(ys[1 + j], y, sizeof(float) * M * l.K);
    x = y;
  }
}

void DecoderStack::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  // Each output holds its own copy of the inputs, so no input of a many-output op is ever
  // donatable; MLX drops the copies once the op has run, so the siblings' go now, and a pool
  // this op alone holds is written in place (the caller dropped it: StackWrite.commit).
  if (!outputs[0].is_tracer())
    for (auto& o : outputs)
      if (&o.inputs() != &inputs) o.inputs().clear();
  const Layout l = layout_of(inputs, *w_, masked_, paged_, start_);
  const size_t out_pools = 1 + keep_.size();
  std::vector<mx::array> copied;  // pools another reference holds: copied first, then written
  std::vector<float*> copy_to;
  for (size_t j = 0; j < outputs.size(); ++j) {
    auto& out = outputs[j];
    const mx::array* pool = j >= out_pools ? &inputs[l.kv + j - out_pools] : nullptr;
    if (pool && pool->is_donatable() && pool->flags().row_contiguous) {
      out.copy_shared_buffer(*pool);
      continue;
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    if (pool) copied.push_back(mx::array::unsafe_weak_copy(*pool)), copy_to.push_back(out.data<float>()), paged_write_copied();
  }
  std::vector<float*> ys;
  for (auto& out : outputs) ys.push_back(out.data<float>());
  std::vector<mx::array> weak;  // as MLX's own ops capture: MLX keeps the buffers until the task ran
  for (const auto& in : inputs) weak.push_back(mx::array::unsafe_weak_copy(in));
  auto op = std::static_pointer_cast<DecoderStack>(outputs[0].primitive_ptr());
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.dispatch([op, in = std::move(weak), copied = std::move(copied), copy_to = std::move(copy_to), ys]() {
    for (size_t j = 0; j < copied.size(); ++j) {  // inputs are ready only inside the task
      std::vector<float> c;
      std::memcpy(copy_to[j], row_major(copied[j], c), copied[j].nbytes());
    }
    op->run(in, ys);
  });
}

bool DecoderStack::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const DecoderStack&>(other);
  if (keep_ != o.keep_ || causal_ != o.causal_ || masked_ != o.masked_ || paged_ != o.paged_ || start_ != o.start_)
    return false;
  if (w_ == o.w_) return true;
  const auto& a = w_->shape.qkv;
  const auto& b = o.w_->shape.qkv;
  return a.heads == b.heads && a.kv_heads == b.kv_heads && a.dims == b.dims && a.traditional == b.traditional &&
         a.scale == b.scale && w_->shape.attn_scale == o.w_->shape.attn_scale && w_->shape.bias == o.w_->shape.bias &&
         w_->eps == o.w_->eps &&
         std::equal(w_->weights.begin(), w_->weights.end(), o.w_->weights.begin(), o.w_->weights.end(),
                    [](const mx::array& x, const mx::array& y) { return x.id() == y.id(); });
}

void DecoderStack::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("SpecbatchDecoderStack runs on the CPU only");
}

}  // namespace specbatch
