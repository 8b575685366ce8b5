#include "blocks.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "arena.h"
#include "linear.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "blocks_impl.h"

namespace specbatch {
namespace {

namespace walk = blocks_impl;

struct Entry {
  mx::array weight;             // the registry's key: held, so its buffer never moves or frees
  Span packed;  // blocks_impl.h's records (below), in the huge-page arena (arena.h)
  int bits;
};

std::mutex registry_mu;
std::atomic<uint64_t> generation{0};  // bumped by every change to the registry, under registry_mu
std::unordered_map<const void*, Entry>& registry() {
  static std::unordered_map<const void*, Entry> r;
  return r;
}

// Element i of row n, from q packed as MLX packs it (element i of a row in bits [bits * i,
// bits * (i + 1)) of its uint32 words, little-endian).
int element(const uint8_t* q, long at, int bits) {
  return bits == 8 ? q[at] : at % 2 ? q[at / 2] >> 4 : q[at / 2] & 15;
}

// Where weight (n, k)'s word and its group's halves sit in the records (blocks_impl.h): per tile
// group of 64 weight rows (the last padded with zero rows) and group of 32 k, `bits` words of
// every lane, then each slab's 16 scales and 16 biases as their float16 bits.
struct Place {
  long record, word, half;  // byte offsets: the record, weight (n, k)'s word in it, row n's scale in it
  int shift;                // the value's bits in its word
};

Place place(long n, int k, int K, int bits) {
  const long tg = n / walk::kTileRows, slab = n % walk::kTileRows / walk::kSlab, lane = n % walk::kSlab;
  const int per_word = 32 / bits;
  return {(tg * (K / 32) + k / 32) * walk::record_bytes(bits), (k % 32 / per_word) * walk::kLineBytes + (slab * walk::kSlab + lane) * 4,
          walk::words_bytes(bits) + (slab * 2 * walk::kSlab + lane) * 2, bits * (k % per_word)};
}

// The records of an N x K matrix: `value(n, k)` gives an element, `half(n, g, which)` the bits of
// row n's group g scale (0) or bias (1).
template <class Value, class Half>
Span pack(int N, int K, int bits, Value value, Half half) {
  const long groups = (N + walk::kTileRows - 1) / walk::kTileRows;
  Span out = arena_take(static_cast<size_t>(groups) * (K / 32) * walk::record_bytes(bits));
  for (long n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      const Place at = place(n, k, K, bits);
      uint8_t* record = out.data + at.record;
      *reinterpret_cast<uint32_t*>(record + at.word) |= static_cast<uint32_t>(value(n, k)) << at.shift;
      if (k % 32 == 0) {
        auto* halves = reinterpret_cast<uint16_t*>(record + at.half);
        halves[0] = half(n, k / 32, 0), halves[walk::kSlab] = half(n, k / 32, 1);
      }
    }
  return out;
}

// The bytes a decode row reads of an N x K matrix's records: its slabs' words and halves (a
// tile group's padding slabs are never loaded).
int64_t read_bytes(int N, int K, int bits) {
  return static_cast<int64_t>((N + walk::kSlab - 1) / walk::kSlab) * (K / 32) * (walk::record_bytes(bits) / walk::kSlabs);
}

// Element (n, k) and the scale (0) / bias (1) bits of row n's group g, read back out of records.
int record_value(const uint8_t* packed, int K, int bits, long n, int k) {
  const Place at = place(n, k, K, bits);
  uint32_t word;
  std::memcpy(&word, packed + at.record + at.word, 4);
  return (word >> at.shift) & ((1u << bits) - 1);
}

uint16_t record_half(const uint8_t* packed, int K, int bits, long n, int g, int which) {
  const Place at = place(n, 32 * g, K, bits);
  uint16_t h;
  std::memcpy(&h, packed + at.record + at.half + which * walk::kSlab * 2, 2);
  return h;
}

// The checkpoint's float16 scale and bias of each group, side by side as their bits (what the
// records hold).
std::vector<uint16_t> half_pairs(const mx::array& scales, const mx::array& biases) {
  std::vector<uint16_t> out(2 * scales.size(), 0);
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
// once, bit for bit. The repacked copy is the tests' to check (the tiles against the exact
// product at every row count), not each load's.
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
  Entry e{weight, pack(N, K, bits, [&](long n, int k) { return element(elements, n * K + k, bits); },
                       [&](long n, int g, int which) { return sb[(n * (K / 32) + g) * 2 + which]; }),
          bits};
  const int64_t bytes = read_bytes(N, K, bits);
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().insert_or_assign(weight.data<void>(), std::move(e));
  generation.fetch_add(1);
  return bytes;
}

int64_t blocks_register_rows(const mx::array& rows, const mx::array& weight, const mx::array& ids) {
  if (ids.dtype() != mx::int32 || ids.ndim() != 1 || rows.ndim() != 2 || weight.ndim() != 2 ||
      rows.dtype() != weight.dtype() || rows.shape() != mx::Shape{ids.shape(0), weight.shape(1)})
    return 0;
  mx::eval({rows, weight, ids});
  if (!rows.flags().row_contiguous || !weight.flags().row_contiguous) return 0;
  const int N = weight.shape(0), K = weight.shape(1), R = rows.shape(0);
  const size_t row_bytes = static_cast<size_t>(K) * rows.itemsize();
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(weight.data<void>());
  if (it == registry().end()) return 0;
  const Entry& whole = it->second;
  const int32_t* at = ids.data<int32_t>();
  for (int r = 0; r < R; ++r)  // the gathered row must be the registered one's, value for value (what the blocks rebuild)
    if (at[r] < 0 || at[r] >= N || std::memcmp(rows.data<uint8_t>() + r * row_bytes, weight.data<uint8_t>() + at[r] * row_bytes, row_bytes))
      return 0;
  const int bits = whole.bits;
  Entry e{rows, pack(R, K, bits, [&](long r, int k) { return record_value(whole.packed.data, K, bits, at[r], k); },
                     [&](long r, int g, int which) { return record_half(whole.packed.data, K, bits, at[r], g, which); }),
          bits};
  const int64_t bytes = read_bytes(R, K, bits);
  registry().insert_or_assign(rows.data<void>(), std::move(e));
  generation.fetch_add(1);
  return bytes;
}

BlockView blocks_lookup(const void* data) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(data);
  return it == registry().end() ? BlockView{} : BlockView{it->second.packed.data, it->second.bits};
}

void blocks_forget(const mx::array& weight) {
  if (weight.data_shared_ptr() == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    registry().erase(weight.data<void>());
    generation.fetch_add(1);
  }
  forget_resolved();  // outside registry_mu: resolving takes the two the other way round
}

void blocks_clear() {
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    registry().clear();
    generation.fetch_add(1);
  }
  forget_resolved();
}

uint64_t blocks_generation() { return generation.load(); }

int blocks_count() {
  std::lock_guard<std::mutex> lock(registry_mu);
  return static_cast<int>(registry().size());
}

}  // namespace specbatch
