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

// The call's work cut into contiguous ranges of equal work, one a pool thread: a unit is one key
// chunk of one task (query rows x keys, in task order), so a range may begin or end inside a
// task. A decode's 3 KV heads on two threads split 1 : 2 by tasks; a causal prefill's late
// blocks see several times the keys of its early ones. A task split so keeps each chunk's
// sums apart (`partials`), folded after the pass.
struct Plan {
  int parts;                   // threads with work: the pool's, or fewer where units are fewer
  std::vector<int64_t> first;  // task t's units: [first[t], first[t + 1])
  std::vector<int64_t> cuts;   // part p's units: [cuts[p], cuts[p + 1])
  std::vector<int64_t> split;  // the tasks a cut falls inside
  std::vector<size_t> at;      // where each split task's partials begin in `partials`
  std::vector<float> partials;
};

static void plan(const AttentionArgs& a, int qb, int64_t tasks, int threads, Plan& p) {
  const int blocks = (a.L + qb - 1) / qb, G = a.Hq / a.Hkv;
  p.first.assign(tasks + 1, 0);
  int64_t total = 0;  // work: query rows x chunks
  for (int64_t t = 0; t < tasks; ++t) {
    const int i0 = static_cast<int>(t % blocks) * qb, n = std::min(qb, a.L - i0);
    const int seen = a.causal ? a.T - a.L + i0 + n : a.T;
    p.first[t + 1] = p.first[t] + (seen + kChunkKeys - 1) / kChunkKeys;
    total += static_cast<int64_t>(n) * (p.first[t + 1] - p.first[t]);
  }
  const int parts = p.parts = static_cast<int>(std::min<int64_t>(threads, p.first[tasks]));
  p.cuts.assign(parts + 1, p.first[tasks]);
  p.split.clear(), p.at.clear();
  size_t floats = 0;
  int64_t t = 0, done = 0;  // work before task t
  for (int part = 0; part < parts; ++part) {
    const int64_t goal = total * part / parts;
    for (;; ++t) {
      const int n = std::min(qb, a.L - static_cast<int>(t % blocks) * qb);
      const int64_t work = static_cast<int64_t>(n) * (p.first[t + 1] - p.first[t]);
      if (done + work > goal) {
        const int64_t c = (goal - done + n / 2) / n;  // whole chunks of task t before the cut
        p.cuts[part] = p.first[t] + c;
        if (c > 0 && c < p.first[t + 1] - p.first[t] && (p.split.empty() || p.split.back() != t)) {
          p.split.push_back(t), p.at.push_back(floats);
          floats += static_cast<size_t>(p.first[t + 1] - p.first[t]) * G * n * (a.D + 2);  // attention_impl.h's partial_at
        }
        break;
      }
      done += work;
    }
  }
  p.partials.resize(floats);
}

void attention_run(const AttentionArgs& a) {
  const int qb = query_block(a.L);
  const int64_t tasks = static_cast<int64_t>(a.B) * a.Hkv * ((a.L + qb - 1) / qb);
  if (tasks == 0 || a.T == 0) return;
  const bool wide = detect_isa() == Isa::avx512;
  auto kernel = wide ? attention_avx512 : attention_avx2;
  auto& pl = pool();
  static thread_local Plan held;  // the caller's: a lambda names the worker's own thread_local
  Plan& p = held;
  plan(a, qb, tasks, pl.size(), p);
  const int parts = p.parts;
  auto partials = [&](int64_t t) {
    const size_t i = std::find(p.split.begin(), p.split.end(), t) - p.split.begin();
    return p.partials.data() + p.at[i];
  };
  // contiguous ranges: a row's KV heads share its pool rows (and cache lines the hardware
  // prefetcher pulled for a neighbour head), so one core takes them in turn
  pl.run([&](int part) {
    if (part >= parts) return;
    const int64_t u0 = p.cuts[part], u1 = p.cuts[part + 1];
    for (int64_t t = std::upper_bound(p.first.begin(), p.first.end(), u0) - p.first.begin() - 1;
         t < tasks && p.first[t] < u1; ++t) {
      const int64_t c0 = std::max(u0, p.first[t]) - p.first[t], c1 = std::min(u1, p.first[t + 1]) - p.first[t];
      const bool whole = c0 == 0 && c1 == p.first[t + 1] - p.first[t];
      if (c1 > c0) kernel(a, t, static_cast<int>(c0), static_cast<int>(c1), whole ? nullptr : partials(t));
    }
  }, parts);
  for (int64_t t : p.split)
    (wide ? attention_fold_avx512 : attention_fold_avx2)(a, t, static_cast<int>(p.first[t + 1] - p.first[t]),
                                                        partials(t));
}

bool slots_valid(const int32_t* slots, int64_t n, int64_t rows) { return slots_in_range(slots, n, rows); }

void Attention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchAttention runs on the CPU only");
}

}  // namespace specbatch
