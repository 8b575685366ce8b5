#include "q4.h"

#include <immintrin.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "gemv.h"
#include "mlx/transforms.h"

namespace specbatch {
namespace {

struct Entry {
  mx::array half;                // the registry's key: held, so its buffer never moves or frees
  std::vector<uint16_t> packed;  // [N, ceil(K / 64), 16] (below)
  std::vector<float> sb;         // [N, K / 32, 2]: each group's scale and bias, widened
};

std::mutex registry_mu;
std::unordered_map<const void*, Entry>& registry() {
  static std::unordered_map<const void*, Entry> r;
  return r;
}

// The 16 values of a group as MLX's dequantize gives them: fp16(fp16(q * s) + b), widened.
__attribute__((target("avx512f,f16c"))) inline __m512 table(const float* sb) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 t = _mm512_mul_ps(iota, _mm512_set1_ps(sb[0]));  // exact in float32
  t = _mm512_cvtph_ps(_mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  t = _mm512_add_ps(t, _mm512_set1_ps(sb[1]));
  return _mm512_cvtph_ps(_mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
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
__attribute__((target("avx512f,avx512bw,f16c"), always_inline)) inline void block(const float* x, int K, int k0,
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
      const __m512 xv = _mm512_loadu_ps(x + (long)j * K + k0 + 16 * c);
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
__attribute__((target("avx512f,avx512bw,f16c"))) void tile(const float* x, int K, const Q4View& w, int n, float* y,
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

}  // namespace

void gemv_q4_avx512(const float* x, int M, int K, const Q4View& w, int n0, int n1, float* y, int N) {
  if (M == 1) return rows<1>(x, K, w, n0, n1, y, N);
  if (M == 2) return rows<2>(x, K, w, n0, n1, y, N);
  if (M == 3) return rows<3>(x, K, w, n0, n1, y, N);
  rows<4>(x, K, w, n0, n1, y, N);
}

namespace {
// Every weight the packed blocks give against the float16 matrix, bit for bit.
__attribute__((target("avx512f,avx512bw,f16c"))) bool rebuilds(const uint16_t* half, int N, int K, const Q4View& w) {
  const int G = K / 32, blocks = (K + 63) / 64;
  alignas(64) float got[16];
  for (int n = 0; n < N; ++n)
    for (int g = 0; g < G; ++g) {
      const uint16_t* p = w.packed + ((long)n * blocks + g / 2) * 16;
      const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      const __m512 t = table(w.sb + ((long)n * G + g) * 2);
      for (int h = 0; h < 2; ++h) {
        _mm512_store_ps(got, chunk(idx, 2 * (g % 2) + h, t));
        const uint16_t* want = half + (long)n * K + 32 * g + 16 * h;
        for (int l = 0; l < 16; ++l)
          if (_cvtss_sh(got[l], _MM_FROUND_TO_NEAREST_INT) != want[l]) return false;
      }
    }
  return true;
}

__attribute__((target("f16c"))) std::vector<float> widen_pairs(const uint16_t* s, const uint16_t* b, size_t n) {
  std::vector<float> out(2 * n);
  for (size_t i = 0; i < n; ++i) out[2 * i] = _cvtsh_ss(s[i]), out[2 * i + 1] = _cvtsh_ss(b[i]);
  return out;
}
}  // namespace

int64_t q4_register(const mx::array& half, const mx::array& q, const mx::array& scales, const mx::array& biases) {
  if (detect_isa() != Isa::avx512 || half.dtype() != mx::float16 || half.ndim() != 2 || q.dtype() != mx::uint32 ||
      scales.dtype() != mx::float16 || biases.dtype() != mx::float16)
    return 0;
  const int N = half.shape(0), K = half.shape(1);
  if (K % 32 != 0 || q.shape() != mx::Shape{N, K / 8} || scales.shape() != mx::Shape{N, K / 32} ||
      biases.shape() != scales.shape())
    return 0;
  for (const auto* a : {&half, &q, &scales, &biases})
    if (!a->flags().row_contiguous) return 0;
  mx::eval({half, q, scales, biases});
  Entry e{half, pack(reinterpret_cast<const uint8_t*>(q.data<uint32_t>()), N, K),
          widen_pairs(scales.data<uint16_t>(), biases.data<uint16_t>(), scales.size())};
  if (!rebuilds(half.data<uint16_t>(), N, K, Q4View{e.packed.data(), e.sb.data()})) return 0;
  const int64_t bytes = static_cast<int64_t>(e.packed.size() * sizeof(uint16_t) + e.sb.size() * sizeof(float));
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().insert_or_assign(half.data<uint16_t>(), std::move(e));
  return bytes;
}

Q4View q4_lookup(const void* data) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(data);
  return it == registry().end() ? Q4View{} : Q4View{it->second.packed.data(), it->second.sb.data()};
}

void q4_forget(const mx::array& half) {
  if (half.dtype() != mx::float16 || half.data_shared_ptr() == nullptr) return;
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().erase(half.data<uint16_t>());
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
