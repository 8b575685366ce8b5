#include "attention.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "gemv.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "paged_write.h"
#include "pool.h"
#include "strided.h"

namespace specbatch {

namespace {
mx::Shape out_shape(const mx::array& q, bool merge_heads) {
  if (!merge_heads) return q.shape();
  return {q.shape(0), q.shape(2), q.shape(1) * q.shape(3)};
}
}  // namespace

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::string& mask_kind, const mx::array& mask, bool merge_heads, int length) {
  for (const auto* a : {&q, &k, &v})
    if (a->dtype() != mx::float32 || a->ndim() != 4) throw std::invalid_argument("attention: float32 [B, H, N, D] inputs");
  const int Hq = q.shape(1), Hkv = k.shape(1), D = q.shape(3);
  if (k.shape() != v.shape() || k.shape(3) != D || Hkv == 0 || Hq % Hkv != 0 || q.shape(0) != k.shape(0))
    throw std::invalid_argument("attention: q [B, Hq, L, D] and k, v [B, Hkv, T, D] with Hq a multiple of Hkv");
  if (D > 256) throw std::invalid_argument("attention: head dimension above 256");
  if (detect_isa() == Isa::none) throw std::runtime_error("attention: the CPU lacks AVX2/FMA");
  if (length < 0 || length > k.shape(2)) throw std::invalid_argument("attention: length outside [0, T]");
  const int T = length > 0 ? length : k.shape(2);
  if (mask_kind == "causal" && q.shape(2) > T) throw std::invalid_argument("attention: more queries than keys");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {q, k, v};
  if (mask_kind == "array") {
    if (mask.dtype() != mx::bool_ || mask.ndim() != 4 || mask.shape(1) != 1 || mask.shape(2) != q.shape(2) ||
        mask.shape(3) != T || (mask.shape(0) != 1 && mask.shape(0) != q.shape(0)))
      throw std::invalid_argument("attention: a bool mask [B or 1, 1, L, T]");
    inputs.push_back(mask);
  } else if (!mask_kind.empty() && mask_kind != "causal") {
    throw std::invalid_argument("attention: mask is '', 'causal' or 'array'");
  }
  return mx::array(out_shape(q, merge_heads), mx::float32,
                   std::make_shared<Attention>(s, scale, mask_kind == "causal", false, merge_heads, length), inputs);
}

mx::array paged_attention(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                          const mx::array& slots, float scale, const std::string& mask_kind, const mx::array& mask,
                          bool merge_heads) {
  if (q.dtype() != mx::float32 || q.ndim() != 4 || k_pool.dtype() != mx::float32 || v_pool.dtype() != mx::float32)
    throw std::invalid_argument("paged_attention: float32 q [B, Hq, L, D] and pools");
  const int Hq = q.shape(1), D = q.shape(3);
  if (k_pool.ndim() != 3 || k_pool.shape() != v_pool.shape() || D == 0 || k_pool.shape(2) != D)
    throw std::invalid_argument("paged_attention: pools [Hkv, P, D], the same for keys and values");
  const int Hkv = k_pool.shape(0);
  if (Hkv == 0 || Hq % Hkv != 0 || D > 256) throw std::invalid_argument("paged_attention: Hq a multiple of Hkv, D <= 256");
  if (slots.dtype() != mx::int32 || slots.ndim() != 2 || slots.shape(0) != q.shape(0))
    throw std::invalid_argument("paged_attention: slots int32 [B, T]");
  if (k_pool.shape(1) % kBlockSlots)  // the keys in 16-slot blocks (paged_write.h)
    throw std::invalid_argument("paged_attention: a key pool's slots a multiple of 16");
  if (detect_isa() == Isa::none) throw std::runtime_error("paged_attention: the CPU lacks AVX2/FMA");
  const int T = slots.shape(1);
  if (mask_kind == "causal" && q.shape(2) > T) throw std::invalid_argument("paged_attention: more queries than keys");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {q, k_pool, v_pool, slots};
  if (mask_kind == "array") {
    if (mask.dtype() != mx::bool_ || mask.ndim() != 4 || mask.shape(1) != 1 || mask.shape(2) != q.shape(2) ||
        mask.shape(3) != T || (mask.shape(0) != 1 && mask.shape(0) != q.shape(0)))
      throw std::invalid_argument("paged_attention: a bool mask [B or 1, 1, L, T]");
    inputs.push_back(mask);
  } else if (!mask_kind.empty() && mask_kind != "causal") {
    throw std::invalid_argument("paged_attention: mask is '', 'causal' or 'array'");
  }
  return mx::array(out_shape(q, merge_heads), mx::float32,
                   std::make_shared<Attention>(s, scale, mask_kind == "causal", true, merge_heads), inputs);
}

namespace {
bool slots_in_range(const int32_t* slots, int64_t n, int64_t rows) {
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] < 0 || slots[i] >= rows) return false;
  return true;
}
}  // namespace

void Attention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  AttentionArgs a{};
  a.B = q.shape(0), a.Hq = q.shape(1), a.L = q.shape(2), a.D = q.shape(3);
  a.scale = scale_, a.causal = causal_;
  a.out = out.data<float>();
  a.os[0] = static_cast<int64_t>(a.Hq) * a.L * a.D;
  a.os[1] = merged_ ? a.D : static_cast<int64_t>(a.L) * a.D;
  a.os[2] = merged_ ? static_cast<int64_t>(a.Hq) * a.D : a.D;
  const size_t mask_at = paged_ ? 4 : 3;
  if (paged_) {
    const auto& slots = inputs[3];
    a.Hkv = k.shape(0), a.T = slots.shape(1);
    a.ks[0] = a.vs[0] = 0, a.ks[1] = a.vs[1] = static_cast<int64_t>(k.shape(1)) * a.D, a.ks[2] = a.vs[2] = a.D;
    a.slot_stride = slots.shape(1), a.blocked = true;
  } else {
    a.Hkv = k.shape(1), a.T = length_ > 0 ? length_ : k.shape(2);
  }
  if (inputs.size() > mask_at) {
    const auto& m = inputs[mask_at];
    a.mask = m.data<bool>();
    a.ms[0] = m.shape(0) == 1 ? 0 : m.strides(0), a.ms[1] = m.strides(2), a.ms[2] = m.strides(3);
  }
  const int64_t pool_rows = paged_ ? k.shape(1) : 0;
  const mx::array slots = paged_ ? inputs[3] : mx::array(0);
  // weak copies, as MLX's own ops take: MLX keeps the buffers alive until the task has run, and a
  // held reference would keep a paged cache's pool from being donated to the next step's write
  encoder.dispatch([a, q = mx::array::unsafe_weak_copy(inputs[0]), k = mx::array::unsafe_weak_copy(inputs[1]),
                    v = mx::array::unsafe_weak_copy(inputs[2]), slots = paged_ ? mx::array::unsafe_weak_copy(slots) : slots,
                    pool_rows, paged = paged_]() mutable {
    std::vector<float> qc, kc, vc;
    std::vector<int32_t> sc;
    a.q = rows_of(q, qc, a.qs);
    if (!paged) {
      a.k = rows_of(k, kc, a.ks), a.v = rows_of(v, vc, a.vs);
    } else if (a.k = row_major(k, kc), a.v = row_major(v, vc), a.slots = row_major(slots, sc);
               !slots_in_range(a.slots, static_cast<int64_t>(a.B) * a.T, pool_rows)) {
      std::fill(a.out, a.out + static_cast<int64_t>(a.B) * a.Hq * a.L * a.D, std::nanf(""));  // a table bug: NaN, never a stray read
      return;
    }
    attention_run(a);
  });
}

void attention_run(const AttentionArgs& a) {
  const int qb = query_block(a.L);
  const int64_t tasks = static_cast<int64_t>(a.B) * a.Hkv * ((a.L + qb - 1) / qb);
  if (tasks == 0 || a.T == 0) return;
  auto kernel = detect_isa() == Isa::avx512 ? attention_avx512 : attention_avx2;
  auto& p = pool();
  const int parts = static_cast<int>(std::min<int64_t>(p.size(), tasks));
  // contiguous task ranges: a row's KV heads share its pool rows (and cache lines the
  // hardware prefetcher pulled for a neighbour head), so one core takes them in turn
  p.run([&](int part) {
    if (part >= parts) return;
    for (int64_t t = tasks * part / parts; t < tasks * (part + 1) / parts; ++t) kernel(a, t);
  }, parts);
}

bool slots_valid(const int32_t* slots, int64_t n, int64_t rows) { return slots_in_range(slots, n, rows); }

void Attention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchAttention runs on the CPU only");
}

}  // namespace specbatch
