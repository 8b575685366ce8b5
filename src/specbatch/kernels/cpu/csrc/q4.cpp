#include "q4.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "gemv.h"
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

// The 16 values of a group: q * scale + bias in float32, one rounding (the FMA's), as MLX's
// quantized_matmul computes the blocks with float32 activations (and llama.cpp's Q4_1, d * q + m).
__attribute__((target("avx512f"))) inline __m512 table(const float* sb) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(iota, _mm512_set1_ps(sb[0]), _mm512_set1_ps(sb[1]));
}

// A block of 64 weights (two groups) is 16 words; word l holds, in its nibble c, the weight
// 16c + l of the block, so one widening load and a shift by 4c give chunk c's 16 table
// indices in lane order (vpermps reads an index's low 4 bits only). Against the checkpoint's
// order (element 2i in byte i's low nibble) that saves a byte shuffle a chunk: one process,
// one core, the target's 210 matrices, 1 / 2 / 3 rows 0.65 / 0.60 / 0.63x the time.
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

// Chunk c of a block whose words widen to `idx`, looked up in its group's table.
__attribute__((target("avx512f"))) inline __m512 chunk(__m512i idx, int c, __m512 t) {
  return _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4 * c), t);
}

// The 4 chunks (or 2, a last half block) of one 64-weight block for NB weight rows and MB token
// rows: each chunk's NB weight vectors are looked up once and met by every token row.
template <int NB, int MB, int CHUNKS>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void block(const float* x, int K, int k0,
                                                                                  const uint16_t* const (&p)[NB],
                                                                                  const float* const (&sb)[NB],
                                                                                  __m512 (&acc)[NB][MB]) {
  __m512i idx[NB];
  __m512 t[NB][2];
  for (int i = 0; i < NB; ++i) {
    idx[i] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[i])));
    t[i][0] = table(sb[i]);
    if (CHUNKS == 4) t[i][1] = table(sb[i] + 2);
  }
  for (int c = 0; c < CHUNKS; ++c) {  // k in order per lane, as the float16 path sums it
    __m512 wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = chunk(idx[i], c, t[i][c / 2]);
    for (int j = 0; j < MB; ++j) {
      __m512 xv = _mm512_loadu_ps(x + (long)j * K + k0 + 16 * c);
      // one load per x vector: GCC otherwise folds it into each of the NB FMAs, and the loads
      // bound the tile (one core, in cache, 2 x 4 tile: 2.24 -> 1.42 ns a group)
      asm("" : "+v"(xv));
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
}

// Blocks read ahead of the one in hand, in the nibbles' and the scales' streams (a row or more
// ahead at the target's widths; a prefetch never faults). The target's 210 layer matrices, one
// process each, alternating, best of 40: 1 row 4.27-4.35 ms at 8 blocks ahead (nibbles only),
// 3.68-3.92 at 64 (and at 128), 4.05-4.37 at 16-32; 2 rows -7%, 3 rows -8%, 4 rows -2%.
constexpr int kAhead = 64;

// NB weight rows at once: NB independent accumulator chains per token row (one chain alone
// waits on each FMA's latency), each still summing its k in order. Whole blocks in the loop,
// with their chunk count known to the compiler (a runtime count left the weights on the stack:
// one core, 1 / 4 token rows 0.90 / 0.80x the time).
template <int NB, int MB>
__attribute__((target("avx512f,avx512bw"))) void tile(const float* x, int K, const Q4View& w, int n, float* y,
                                                           int N) {
  const int G = K / 32, blocks = (K + 63) / 64, whole = G / 2;
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* p[NB];
  const float* sb[NB];
  for (int i = 0; i < NB; ++i) p[i] = w.packed + (long)(n + i) * blocks * 16, sb[i] = w.sb + (long)(n + i) * G * 2;
  for (int b = 0; b < whole; ++b) {
    for (int i = 0; i < NB; ++i) {  // both streams, a cache line of scales every 4 blocks
      _mm_prefetch(reinterpret_cast<const char*>(p[i] + kAhead * 16), _MM_HINT_T0);
      if (b % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(sb[i] + kAhead * 4), _MM_HINT_T0);
    }
    block<NB, MB, 4>(x, K, 64 * b, p, sb, acc);
    for (int i = 0; i < NB; ++i) p[i] += 16, sb[i] += 4;
  }
  if (whole < blocks) block<NB, MB, 2>(x, K, 64 * whole, p, sb, acc);  // K / 32 odd
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(long)j * N + n + i] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int MB>
void rows(const float* x, int K, const Q4View& w, int n0, int n1, float* y, int N) {
  constexpr int NB = MB > 3 ? 2 : 4;  // accumulators, tables and weights within 32 registers
  int n = n0;
  for (; n + NB <= n1; n += NB) tile<NB, MB>(x, K, w, n, y, N);
  for (; n < n1; ++n) tile<1, MB>(x, K, w, n, y, N);
}

// 5-32 token rows: 2-row weight tiles met by up to 8 token rows a pass. Beyond 8 rows, blocks of
// weight rows (in L2) against 8-row slabs of x (in L1 across the block's tiles), as the float32
// kernel's prefill blocking; the blocks stream from memory once either way.
constexpr int kPassRows = 8, kBlockRows = 48;

template <int MB>
void pass(const float* x, int K, const Q4View& w, int n, float* y, int N) {
  tile<2, MB>(x, K, w, n, y, N);
}

// Token rows [m, m + up to 8) against the 2-row weight tile at n.
void slab(const float* x, int rows, int K, const Q4View& w, int n, float* y, int N) {
  switch (rows) {
    case 1: return pass<1>(x, K, w, n, y, N);
    case 2: return pass<2>(x, K, w, n, y, N);
    case 3: return pass<3>(x, K, w, n, y, N);
    case 4: return pass<4>(x, K, w, n, y, N);
    case 5: return pass<5>(x, K, w, n, y, N);
    case 6: return pass<6>(x, K, w, n, y, N);
    case 7: return pass<7>(x, K, w, n, y, N);
    default: return pass<8>(x, K, w, n, y, N);
  }
}

void passes(const float* x, int M, int K, const Q4View& w, int n0, int n1, float* y, int N) {
  const int even = n0 + (n1 - n0) / 2 * 2;
  for (int b0 = n0; b0 < even; b0 += kBlockRows) {
    const int b1 = std::min(even, b0 + kBlockRows);
    for (int m = 0; m < M; m += kPassRows)
      for (int n = b0; n < b1; n += 2)
        slab(x + (long)m * K, std::min(kPassRows, M - m), K, w, n, y + (long)m * N, N);
  }
  if (even < n1)  // an odd last weight row
    for (int m = 0; m < M; ++m) tile<1, 1>(x + (long)m * K, K, w, even, y + (long)m * N, N);
}

}  // namespace

void gemv_q4_avx512(const float* x, int M, int K, const Q4View& w, int n0, int n1, float* y, int N) {
  if (M == 1) return rows<1>(x, K, w, n0, n1, y, N);
  if (M == 2) return rows<2>(x, K, w, n0, n1, y, N);
  if (M == 3) return rows<3>(x, K, w, n0, n1, y, N);
  if (M == 4) return rows<4>(x, K, w, n0, n1, y, N);
  passes(x, M, K, w, n0, n1, y, N);
}

namespace {
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
