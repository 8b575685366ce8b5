#include "linear.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <stdexcept>

#include "gemv.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "pool.h"
#include "strided.h"

namespace specbatch {

Isa detect_isa() {
  __builtin_cpu_init();
  // SPECBATCH_CPU_ISA=avx2 runs the AVX2 kernels on an AVX-512 CPU (tests of that path)
  static const bool avx2_only = [] {
    const char* env = std::getenv("SPECBATCH_CPU_ISA");
    return env != nullptr && std::string(env) == "avx2";
  }();
  if (__builtin_cpu_supports("avx512f") && !avx2_only) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
  return Isa::none;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "none";
  }
}

bool half_weights_supported() {
  static const bool supported = [] {  // asked for every weight of every op built: once a process
    __builtin_cpu_init();
    return detect_isa() == Isa::avx512 || (detect_isa() == Isa::avx2 && __builtin_cpu_supports("f16c"));
  }();
  return supported;
}

bool weight_dtype_ok(const mx::array& w) {
  return w.dtype() == mx::float32 || (w.dtype() == mx::float16 && half_weights_supported());
}

Weights weights_of(const mx::array& w, WeightCopy& copy) {
  // registered blocks are found by the matrix's own buffer (a strided view's copy has none)
  if (w.dtype() != mx::float16) {
    const float* data = row_major(w, copy.f);
    return {data, false, data == w.data<float>() ? blocks_lookup(data) : BlockView{}};
  }
  const uint16_t* data = row_major(w, copy.h);
  return {data, true, data == w.data<uint16_t>() ? blocks_lookup(data) : BlockView{}};
}

void evaluate_constants(const std::vector<mx::array>& weights) {
  std::vector<mx::array> pending;
  for (const auto& w : weights)
    if (!w.is_available()) pending.push_back(w);
  if (!pending.empty()) mx::eval(pending);
}

namespace {
Constant constant_of(const mx::array& a, WeightCopy& copy) {
  return {weights_of(a, copy), a.ndim() > 0 ? static_cast<int>(a.shape(0)) : 1};
}

// The last few sets (the stack's and the MTP step's alternate), round robin. An entry holds its
// arrays, so no reused address can match; a dropped model's weights live until its blocks are
// forgotten (every entry goes then: forget_resolved) or four newer sets replace it. Never
// destroyed (exit order).
struct ResolvedEntry {
  std::vector<mx::array> held;
  uint64_t generation = 0;
  std::shared_ptr<const std::vector<Constant>> table;
};
constexpr int kResolvedEntries = 4;
std::mutex resolved_mu;
ResolvedEntry* resolved_cache = new ResolvedEntry[kResolvedEntries];
int resolved_next = 0;

}  // namespace

std::shared_ptr<const std::vector<Constant>> resolved(const std::vector<mx::array>& held) {
  const uint64_t generation = blocks_generation();
  const auto same = [](const mx::array& a, const mx::array& b) { return a.id() == b.id(); };
  std::lock_guard<std::mutex> lock(resolved_mu);
  for (int i = 0; i < kResolvedEntries; ++i) {
    ResolvedEntry& e = resolved_cache[i];
    if (e.table && e.generation != generation) e = ResolvedEntry{};  // a block set changed since
    if (e.table && std::equal(held.begin(), held.end(), e.held.begin(), e.held.end(), same)) return e.table;
  }
  auto table = std::make_shared<std::vector<Constant>>();
  for (const auto& a : held) {
    WeightCopy copy;
    table->push_back(constant_of(a, copy));
    if (!copy.f.empty() || !copy.h.empty()) return nullptr;
  }
  resolved_cache[resolved_next] = ResolvedEntry{held, generation, table};
  resolved_next = (resolved_next + 1) % kResolvedEntries;
  return table;
}

void forget_resolved() {
  std::lock_guard<std::mutex> lock(resolved_mu);
  for (int i = 0; i < kResolvedEntries; ++i) resolved_cache[i] = ResolvedEntry{};
}

HeldConstants::HeldConstants(const std::vector<mx::array>& held) : kept_(resolved(held)) {
  if (kept_) {
    data_ = kept_->data();
    return;
  }
  copies_.resize(held.size());  // before any pointer into a copy is taken
  for (size_t i = 0; i < held.size(); ++i) local_.push_back(constant_of(held[i], copies_[i]));
  data_ = local_.data();
}

mx::array small_linear(const mx::array& x, const mx::array& w) {
  if (x.dtype() != mx::float32 || !weight_dtype_ok(w))
    throw std::invalid_argument("small_linear: float32 x, float32 or float16 w");
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(1))
    throw std::invalid_argument("small_linear: x [..., K] and w [N, K] expected");
  if (detect_isa() == Isa::none) throw std::runtime_error("small_linear: the CPU lacks AVX2/FMA");
  auto s = mx::default_stream(mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<SmallLinear>(s),
                   {x, w});
}

void SmallLinear::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_output_array(out);
  const int K = w.shape(1), N = w.shape(0);
  const int M = static_cast<int>(x.size() / std::max(1, K));
  encoder.dispatch([x, w, yp = out.data<float>(), M, K, N]() {
    if (M == 0 || N == 0) return;
    std::vector<float> xc;
    WeightCopy wc;
    const float* xp = row_major(x, xc);
    gemv_all(xp, M, K, {{weights_of(w, wc), N, yp, N}});
  });
}

void gemv_all(const float* x, int M, int K, const std::vector<Target>& targets) {
  int N = 0;
  for (const auto& t : targets) N += t.rows;
  const bool wide = detect_isa() == Isa::avx512;
  // `again`: this part already read blocks with this x (k and v after q: x prepared once)
  auto kernel = [wide](const float* x, int M, int K, const Weights& w, int a, int b, float* y, int ldy, bool& again) {
    // registered blocks at every row count (their sums are their own: wider inputs on the kernel
    // keep a decode row's bits)
    if (w.blocks.packed != nullptr) {
      const bool before = again;
      again = true;
      return wide ? gemv_blocks_avx512(x, M, K, w.blocks, a, b, y, ldy, before)
                  : gemv_blocks_avx2(x, M, K, w.blocks, a, b, y, ldy, before);
    }
    if (w.half) {
      const auto* h = static_cast<const uint16_t*>(w.data);
      return wide ? gemv_avx512(x, M, K, h, a, b, y, ldy) : gemv_avx2(x, M, K, h, a, b, y, ldy);
    }
    const auto* f = static_cast<const float*>(w.data);
    wide ? gemv_avx512(x, M, K, f, a, b, y, ldy) : gemv_avx2(x, M, K, f, a, b, y, ldy);
  };
  auto& p = pool();
  // contiguous column blocks, a multiple of 16 rows of w each (whole cache lines of y)
  const int parts = std::min(p.size(), std::max(1, N / 64));
  const int block = ((N + parts - 1) / parts + 15) / 16 * 16;
  p.run([&](int part) {
    if (part >= parts) return;
    const int n0 = std::min(N, part * block), n1 = std::min(N, n0 + block);
    int first = 0;  // the targets' rows [first, first + rows) in the joint numbering
    bool again = false;
    for (const auto& t : targets) {
      const int a = std::max(n0, first), b = std::min(n1, first + t.rows);
      if (a < b) kernel(x, M, K, t.w, a - first, b - first, t.y, t.ldy, again);
      first += t.rows;
    }
  }, parts);
}

// Gradients with MLX's own ops (training a head through a swapped linear still works).
std::vector<mx::array> SmallLinear::vjp(const std::vector<mx::array>& primals,
                                        const std::vector<mx::array>& cotangents,
                                        const std::vector<int>& argnums, const std::vector<mx::array>&) {
  const auto& x = primals[0];
  const auto& w = primals[1];
  const auto& g = cotangents[0];  // [..., N]
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      grads.push_back(mx::matmul(g, w, stream()));  // [..., K]
    } else {
      auto g2 = mx::reshape(g, {-1, w.shape(0)}, stream());
      auto x2 = mx::reshape(x, {-1, w.shape(1)}, stream());
      grads.push_back(mx::matmul(mx::transpose(g2, stream()), x2, stream()));  // [N, K]
    }
  }
  return grads;
}

void SmallLinear::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SmallLinear runs on the CPU only");
}

}  // namespace specbatch
