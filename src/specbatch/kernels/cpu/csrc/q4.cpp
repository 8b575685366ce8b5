#include "q4.h"

#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "mlx/ops.h"
#include "mlx/transforms.h"

namespace specbatch {
namespace {

struct Entry {
  mx::array weight;              // the registry's key: held, so its buffer never moves or frees
  std::vector<uint16_t> packed;  // [N, ceil(K / 64), 16] (below)
  std::vector<float> sb;         // [N, K / 32, 2]: each group's scale and bias, widened
};

std::mutex registry_mu;
std::unordered_map<const void*, Entry>& registry() {
  static std::unordered_map<const void*, Entry> r;
  return r;
}

// The tiles' layout (gemv.h's Q4View): a block of 64 weights (two groups) is 16 words, word l
// holding in its nibble c the weight 16c + l (why: q4_avx512.cpp).
std::vector<uint16_t> pack(const uint8_t* q, int N, int K) {
  const int blocks = (K + 63) / 64;
  std::vector<uint16_t> out(static_cast<size_t>(N) * blocks * 16, 0);
  for (long n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      const uint8_t byte = q[(n * K + k) / 2];
      const int nibble = k % 2 ? byte >> 4 : byte & 15, b = k / 64, c = (k % 64) / 16;
      out[(n * blocks + b) * 16 + k % 16] |= static_cast<uint16_t>(nibble << (4 * c));
    }
  return out;
}

// Every value of the matrix (float32, or float16 widened) against its blocks' q * s + b, rounded
// once (what both tiles compute), bit for bit; q uint8 pairs as MLX packs them (element 2i in
// byte i's low nibble), sb each group's widened scale and bias. The repacked copy is the tests'
// to check (the tiles against the float32 path at every row count), not each load's.
bool rebuilds(const mx::array& m, const uint8_t* q, const std::vector<float>& sb) {
  const int N = m.shape(0), K = m.shape(1), G = K / 32;
  for (long n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      const long at = n * K + k;
      const int nibble = k % 2 ? q[at / 2] >> 4 : q[at / 2] & 15;
      const float* g = sb.data() + (n * G + k / 32) * 2;
      const float got = std::fma(static_cast<float>(nibble), g[0], g[1]);
      const float want = m.dtype() == mx::float32 ? m.data<float>()[at] : static_cast<float>(m.data<mx::float16_t>()[at]);
      if (std::memcmp(&got, &want, sizeof(float)) != 0) return false;
    }
  return true;
}

// Each group's scale and bias as float32, side by side.
std::vector<float> widen_pairs(const mx::array& scales, const mx::array& biases) {
  auto s = mx::astype(scales, mx::float32), b = mx::astype(biases, mx::float32);
  mx::eval({s, b});
  std::vector<float> out(2 * s.size());
  for (size_t i = 0; i < s.size(); ++i) out[2 * i] = s.data<float>()[i], out[2 * i + 1] = b.data<float>()[i];
  return out;
}
}  // namespace

int64_t q4_register(const mx::array& weight, const mx::array& q, const mx::array& scales, const mx::array& biases) {
  if (detect_isa() == Isa::none || (weight.dtype() != mx::float32 && weight.dtype() != mx::float16) ||
      weight.ndim() != 2 || q.dtype() != mx::uint32 || scales.dtype() != mx::float16 || biases.dtype() != mx::float16)
    return 0;
  const int N = weight.shape(0), K = weight.shape(1);
  if (K % 32 != 0 || q.shape() != mx::Shape{N, K / 8} || scales.shape() != mx::Shape{N, K / 32} ||
      biases.shape() != scales.shape())
    return 0;
  for (const auto* a : {&weight, &q, &scales, &biases})
    if (!a->flags().row_contiguous) return 0;
  mx::eval({weight, q, scales, biases});
  const auto* nibbles = reinterpret_cast<const uint8_t*>(q.data<uint32_t>());
  Entry e{weight, pack(nibbles, N, K), widen_pairs(scales, biases)};
  if (!rebuilds(weight, nibbles, e.sb)) return 0;
  const int64_t bytes = static_cast<int64_t>(e.packed.size() * sizeof(uint16_t) + e.sb.size() * sizeof(float));
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().insert_or_assign(weight.data<void>(), std::move(e));
  return bytes;
}

Q4View q4_lookup(const void* data) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(data);
  return it == registry().end() ? Q4View{} : Q4View{it->second.packed.data(), it->second.sb.data()};
}

void q4_forget(const mx::array& weight) {
  if (weight.data_shared_ptr() == nullptr) return;
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().erase(weight.data<void>());
}

void q4_clear() {
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().clear();
}

int q4_count() {
  std::lock_guard<std::mutex> lock(registry_mu);
  return static_cast<int>(registry().size());
}

}  // namespace specbatch
