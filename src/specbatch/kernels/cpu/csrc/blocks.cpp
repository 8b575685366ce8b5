#include "blocks.h"

#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "mlx/ops.h"
#include "q4_impl.h"
#include "mlx/transforms.h"

namespace specbatch {
namespace {

struct Entry {
  mx::array weight;             // the registry's key: held, so its buffer never moves or frees
  std::vector<uint8_t> packed;  // 8 bits: [N, ceil(K / 64), 64]; 4 bits: q4_impl.h's records (below)
  std::vector<uint16_t> sb;     // 8 bits: [N, K / 32, 2], each group's scale and bias, float16 bits, then padding
  int K;
  int bits;
};

std::mutex registry_mu;
std::unordered_map<const void*, Entry>& registry() {
  static std::unordered_map<const void*, Entry> r;
  return r;
}

// The 8-bit tiles' layout (gemv.h's BlockView), from q's elements packed as MLX packs them (element
// i of a row in bits [bits * i, bits * (i + 1)) of its uint32 words, little-endian): a block is its
// 64 bytes in order, a half block (K / 32 odd) padded with zeros.
int element(const uint8_t* q, long at, int bits) {
  return bits == 8 ? q[at] : at % 2 ? q[at / 2] >> 4 : q[at / 2] & 15;
}

std::vector<uint8_t> pack8(const uint8_t* q, int N, int K) {
  const int blocks = (K + 63) / 64;
  std::vector<uint8_t> out(static_cast<size_t>(N) * blocks * 64, 0);
  for (long n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) out[(n * blocks + k / 64) * 64 + k % 64] = static_cast<uint8_t>(element(q, n * K + k, 8));
  return out;
}

// The 4-bit tiles' records (q4_impl.h): per tile group of 64 weight rows (the last padded with
// zero rows) and group of 32 k, the 4 x 4 x 16 words of nibbles, then each slab's 16 scales and 16
// biases as their float16 bits. `value(n, k)` gives a nibble, `half(n, g, which)` a scale (0) or
// bias (1).
template <class Value, class Half>
std::vector<uint8_t> pack4(int N, int K, Value value, Half half) {
  namespace q4 = q4_impl;
  const int G = K / 32, groups = (N + q4::kTileRows - 1) / q4::kTileRows;
  std::vector<uint8_t> out(static_cast<size_t>(groups) * G * q4::kRecordBytes, 0);
  for (long n = 0; n < N; ++n) {
    const long tg = n / q4::kTileRows, slab = n % q4::kTileRows / q4::kSlab, lane = n % q4::kSlab;
    for (int g = 0; g < G; ++g) {
      uint8_t* record = out.data() + (tg * G + g) * q4::kRecordBytes;
      for (int k = 32 * g; k < 32 * (g + 1); ++k) {
        auto* word = reinterpret_cast<uint32_t*>(record + ((k % 32 / 8 * q4::kSlabs + slab) * q4::kSlab + lane) * 4);
        *word |= static_cast<uint32_t>(value(n, k)) << (4 * (k % 8));
      }
      auto* halves = reinterpret_cast<uint16_t*>(record + q4::kWordsBytes) + slab * 2 * q4::kSlab + lane;
      halves[0] = half(n, g, 0), halves[q4::kSlab] = half(n, g, 1);
    }
  }
  return out;
}

// Element (n, k) and the scale / bias of row n's group g, read back out of pack4's records.
int record_nibble(const std::vector<uint8_t>& packed, int K, long n, int k) {
  namespace q4 = q4_impl;
  const long tg = n / q4::kTileRows, slab = n % q4::kTileRows / q4::kSlab, lane = n % q4::kSlab;
  const uint8_t* record = packed.data() + (tg * (K / 32) + k / 32) * q4::kRecordBytes;
  uint32_t word;
  std::memcpy(&word, record + ((k % 32 / 8 * q4::kSlabs + slab) * q4::kSlab + lane) * 4, 4);
  return (word >> (4 * (k % 8))) & 15;
}

uint16_t record_half(const std::vector<uint8_t>& packed, int K, long n, int g, int which) {
  namespace q4 = q4_impl;
  const long tg = n / q4::kTileRows, slab = n % q4::kTileRows / q4::kSlab, lane = n % q4::kSlab;
  uint16_t h;
  std::memcpy(&h, packed.data() + (tg * (K / 32) + g) * q4::kRecordBytes + q4::kWordsBytes +
                      ((slab * 2 + which) * q4::kSlab + lane) * 2, 2);
  return h;
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
// The bytes a decode row reads of an entry's blocks (4 bits: the records, padding rows and all).
int64_t held_bytes(const Entry& e) {
  return static_cast<int64_t>(e.packed.size() + (e.sb.empty() ? 0 : (e.sb.size() - kScalePad) * sizeof(uint16_t)));
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
  Entry e{weight, {}, {}, K, bits};
  if (bits == 8) {
    e.packed = pack8(elements, N, K), e.sb = std::move(sb);
  } else {
    e.packed = pack4(N, K, [&](long n, int k) { return element(elements, n * K + k, 4); },
                     [&](long n, int g, int which) { return sb[(n * (K / 32) + g) * 2 + which]; });
  }
  const int64_t bytes = held_bytes(e);
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
  const int32_t* at = ids.data<int32_t>();
  for (int r = 0; r < R; ++r)  // the gathered row must be the registered one's, value for value (what the blocks rebuild)
    if (at[r] < 0 || at[r] >= N || std::memcmp(rows.data<uint8_t>() + r * row_bytes, weight.data<uint8_t>() + at[r] * row_bytes, row_bytes))
      return 0;
  Entry e{rows, {}, {}, K, whole.bits};
  if (whole.bits == 4) {
    e.packed = pack4(R, K, [&](long r, int k) { return record_nibble(whole.packed, K, at[r], k); },
                     [&](long r, int g, int which) { return record_half(whole.packed, K, at[r], g, which); });
  } else {
    const size_t packed_row = whole.packed.size() / N;
    e.packed.resize(R * packed_row), e.sb.assign(static_cast<size_t>(R) * G * 2 + kScalePad, 0);
    for (int r = 0; r < R; ++r) {
      std::memcpy(e.packed.data() + r * packed_row, whole.packed.data() + at[r] * packed_row, packed_row);
      std::memcpy(e.sb.data() + static_cast<size_t>(r) * G * 2, whole.sb.data() + static_cast<size_t>(at[r]) * G * 2, G * 2 * sizeof(uint16_t));
    }
  }
  const int64_t bytes = held_bytes(e);
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
