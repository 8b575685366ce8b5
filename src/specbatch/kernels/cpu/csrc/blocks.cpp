#include "blocks.h"

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
  mx::array weight;             // the registry's key: held, so its buffer never moves or frees
  std::vector<uint8_t> packed;  // [N, ceil(K / 64), 64 * bits / 8] (below)
  std::vector<uint16_t> sb;     // [N, K / 32, 2]: each group's scale and bias, float16 bits, then padding
  int bits;
};

std::mutex registry_mu;
std::unordered_map<const void*, Entry>& registry() {
  static std::unordered_map<const void*, Entry> r;
  return r;
}

// The tiles' layout (gemv.h's BlockView), from q's elements packed as MLX packs them (element i of
// a row in bits [bits * i, bits * (i + 1)) of its uint32 words, little-endian): at 8 bits a
// block is its 64 bytes in order; at 4 bits 16 words, word l holding in its nibble c the weight
// 16c + l (why: q4_avx512.cpp). A half block (K / 32 odd) is padded with zeros.
int element(const uint8_t* q, long at, int bits) {
  return bits == 8 ? q[at] : at % 2 ? q[at / 2] >> 4 : q[at / 2] & 15;
}

std::vector<uint8_t> pack(const uint8_t* q, int N, int K, int bits) {
  const int blocks = (K + 63) / 64, bytes = 8 * bits;
  std::vector<uint8_t> out(static_cast<size_t>(N) * blocks * bytes, 0);
  for (long n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      uint8_t* block = out.data() + (n * blocks + k / 64) * bytes;
      const int v = element(q, n * K + k, bits), i = k % 64;
      if (bits == 8) {
        block[i] = static_cast<uint8_t>(v);
      } else {
        const uint16_t word = static_cast<uint16_t>(v << (4 * (i / 16)));
        block[2 * (i % 16)] |= word & 0xff, block[2 * (i % 16) + 1] |= word >> 8;
      }
    }
  return out;
}

// The checkpoint's float16 scale and bias of each group, side by side as their bits (what the
// tiles stream), then kScalePad halves.
std::vector<uint16_t> half_pairs(const mx::array& scales, const mx::array& biases) {
  std::vector<uint16_t> out(2 * scales.size() + kScalePad, 0);
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data<mx::float16_t>());
  const auto* b = reinterpret_cast<const uint16_t*>(biases.data<mx::float16_t>());
  for (size_t i = 0; i < scales.size(); ++i) out[2 * i] = s[i], out[2 * i + 1] = b[i];
  return out;
}

float widened(uint16_t bits) {
  mx::float16_t h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}

// Every value of the matrix (float32, or float16 widened) against its blocks' q * s + b, rounded
// once (what every tile computes from the pairs sb), bit for bit. The repacked copy is the
// tests' to check (the tiles against the float32 path at every row count), not each load's.
bool rebuilds(const mx::array& m, const uint8_t* q, const std::vector<uint16_t>& sb, int bits) {
  const int N = m.shape(0), K = m.shape(1), G = K / 32;
  for (long n = 0; n < N; ++n)
    for (int g = 0; g < G; ++g) {
      const float scale = widened(sb[(n * G + g) * 2]), bias = widened(sb[(n * G + g) * 2 + 1]);
      for (long at = n * K + 32 * g; at < n * K + 32 * (g + 1); ++at) {
        const float got = std::fma(static_cast<float>(element(q, at, bits)), scale, bias);
        const float want = m.dtype() == mx::float32 ? m.data<float>()[at] : static_cast<float>(m.data<mx::float16_t>()[at]);
        if (std::memcmp(&got, &want, sizeof(float)) != 0) return false;
      }
    }
  return true;
}
}  // namespace

int64_t blocks_register(const mx::array& weight, const mx::array& q, const mx::array& scales,
                        const mx::array& biases, int bits) {
  // the tiles widen the scales with F16C (every AVX2 CPU measured has it; none: the float32 path)
  if (detect_isa() == Isa::none || !__builtin_cpu_supports("f16c") || (bits != 4 && bits != 8) ||
      (weight.dtype() != mx::float32 && weight.dtype() != mx::float16) || weight.ndim() != 2 ||
      q.dtype() != mx::uint32 || scales.dtype() != mx::float16 || biases.dtype() != mx::float16)
    return 0;
  const int N = weight.shape(0), K = weight.shape(1);
  if (K % 32 != 0 || q.shape() != mx::Shape{N, K * bits / 32} || scales.shape() != mx::Shape{N, K / 32} ||
      biases.shape() != scales.shape())
    return 0;
  for (const auto* a : {&weight, &q, &scales, &biases})
    if (!a->flags().row_contiguous) return 0;
  mx::eval({weight, q, scales, biases});
  const auto* elements = reinterpret_cast<const uint8_t*>(q.data<uint32_t>());
  auto sb = half_pairs(scales, biases);
  if (!rebuilds(weight, elements, sb, bits)) return 0;
  Entry e{weight, pack(elements, N, K, bits), std::move(sb), bits};
  const int64_t bytes = static_cast<int64_t>(e.packed.size() + (e.sb.size() - kScalePad) * sizeof(uint16_t));
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().insert_or_assign(weight.data<void>(), std::move(e));
  return bytes;
}

int64_t blocks_register_rows(const mx::array& rows, const mx::array& weight, const mx::array& ids) {
  if (ids.dtype() != mx::int32 || ids.ndim() != 1 || rows.ndim() != 2 || weight.ndim() != 2 ||
      rows.dtype() != weight.dtype() || rows.shape() != mx::Shape{ids.shape(0), weight.shape(1)})
    return 0;
  mx::eval({rows, weight, ids});
  if (!rows.flags().row_contiguous || !weight.flags().row_contiguous) return 0;
  const int N = weight.shape(0), K = weight.shape(1), G = K / 32, R = rows.shape(0);
  const size_t row_bytes = static_cast<size_t>(K) * rows.itemsize();
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(weight.data<void>());
  if (it == registry().end()) return 0;
  const Entry& whole = it->second;
  const size_t packed_row = whole.packed.size() / N;
  Entry e{rows, std::vector<uint8_t>(R * packed_row), std::vector<uint16_t>(static_cast<size_t>(R) * G * 2 + kScalePad, 0),
          whole.bits};
  for (int r = 0; r < R; ++r) {
    const int n = ids.data<int32_t>()[r];
    // the gathered row must be the registered one's, value for value (what the blocks rebuild)
    if (n < 0 || n >= N || std::memcmp(rows.data<uint8_t>() + r * row_bytes, weight.data<uint8_t>() + n * row_bytes, row_bytes))
      return 0;
    std::memcpy(e.packed.data() + r * packed_row, whole.packed.data() + n * packed_row, packed_row);
    std::memcpy(e.sb.data() + static_cast<size_t>(r) * G * 2, whole.sb.data() + static_cast<size_t>(n) * G * 2, G * 2 * sizeof(uint16_t));
  }
  const int64_t bytes = static_cast<int64_t>(e.packed.size() + (e.sb.size() - kScalePad) * sizeof(uint16_t));
  registry().insert_or_assign(rows.data<void>(), std::move(e));
  return bytes;
}

BlockView blocks_lookup(const void* data) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(data);
  return it == registry().end() ? BlockView{} : BlockView{it->second.packed.data(), it->second.sb.data(), it->second.bits};
}

void blocks_forget(const mx::array& weight) {
  if (weight.data_shared_ptr() == nullptr) return;
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().erase(weight.data<void>());
}

void blocks_clear() {
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().clear();
}

int blocks_count() {
  std::lock_guard<std::mutex> lock(registry_mu);
  return static_cast<int>(registry().size());
}

}  // namespace specbatch
