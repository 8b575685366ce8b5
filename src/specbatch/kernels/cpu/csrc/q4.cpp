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
  std::vector<mx::array> arrays;  // half, q, scales, biases: held, so no buffer moves or frees
  Q4View view;
};

std::mutex registry_mu;
std::unordered_map<const void*, Entry>& registry() {
  static std::unordered_map<const void*, Entry> r;
  return r;
}

// The 16 values of a group as MLX's dequantize gives them: fp16(fp16(q * s) + b), widened.
__attribute__((target("avx512f,f16c"))) inline __m512 table(uint16_t s, uint16_t b) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 t = _mm512_mul_ps(iota, _mm512_set1_ps(_cvtsh_ss(s)));  // exact in float32
  t = _mm512_cvtph_ps(_mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  t = _mm512_add_ps(t, _mm512_set1_ps(_cvtsh_ss(b)));
  return _mm512_cvtph_ps(_mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The 16 weights k .. k + 15 of a group (`bytes`: its 8 bytes holding them) looked up in `t`.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 weights16(__m128i bytes, __m512 t) {
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  // vpermps reads an index's low 4 bits only: the nibble, in element order
  return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(bytes, dup)), shifts), t);
}

// NB weight rows at once: NB independent accumulator chains per token row (one chain alone
// waits on each FMA's latency), each still summing its k in order.
template <int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void tile(const float* x, int K, const Q4View& w, int n,
                                                                     float* y, int N) {
  const int G = K / 32;
  const uint8_t* q = w.q + (long)n * K / 2;
  const uint16_t* s = w.scales + (long)n * G;
  const uint16_t* b = w.biases + (long)n * G;
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512 w0[NB], w1[NB];
    for (int i = 0; i < NB; ++i) {
      const uint8_t* qi = q + (long)i * K / 2 + 16 * g;
      if (g % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(qi + (long)NB * 4 * K / 2), _MM_HINT_T0);
      const __m512 t = table(s[(long)i * G + g], b[(long)i * G + g]);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qi));
      w0[i] = weights16(bytes, t), w1[i] = weights16(_mm_srli_si128(bytes, 8), t);
    }
    for (int j = 0; j < MB; ++j) {  // k in order per lane, as the float16 path sums it
      const __m512 x0 = _mm512_loadu_ps(x + (long)j * K + 32 * g), x1 = _mm512_loadu_ps(x + (long)j * K + 32 * g + 16);
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(w1[i], x1, _mm512_fmadd_ps(w0[i], x0, acc[i][j]));
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(long)j * N + n + i] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int MB>
void rows(const float* x, int K, const Q4View& w, int n0, int n1, float* y, int N) {
  constexpr int NB = MB > 2 ? 2 : 4;  // accumulators, tables and weights within 32 registers
  int n = n0;
  for (; n + NB <= n1; n += NB) tile<NB, MB>(x, K, w, n, y, N);
  for (; n < n1; ++n) tile<1, MB>(x, K, w, n, y, N);
}

}  // namespace

void gemv_q4_avx512(const float* x, int M, int K, const Q4View& w, int n0, int n1, float* y, int N) {
  if (M == 1) return rows<1>(x, K, w, n0, n1, y, N);
  if (M == 2) return rows<2>(x, K, w, n0, n1, y, N);
  rows<3>(x, K, w, n0, n1, y, N);
}

namespace {
// Every weight the blocks give against the float16 matrix, bit for bit.
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) bool rebuilds(const uint16_t* half, int N, int K,
                                                                         const Q4View& w) {
  const int G = K / 32;
  alignas(64) float got[16];
  for (int n = 0; n < N; ++n)
    for (int g = 0; g < G; ++g) {
      const __m512 t = table(w.scales[(long)n * G + g], w.biases[(long)n * G + g]);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + (long)n * K / 2 + 16 * g));
      for (int h = 0; h < 2; ++h) {
        _mm512_store_ps(got, weights16(h ? _mm_srli_si128(bytes, 8) : bytes, t));
        const uint16_t* want = half + (long)n * K + 32 * g + 16 * h;
        for (int l = 0; l < 16; ++l)
          if (_cvtss_sh(got[l], _MM_FROUND_TO_NEAREST_INT) != want[l]) return false;
      }
    }
  return true;
}
}  // namespace

bool q4_register(const mx::array& half, const mx::array& q, const mx::array& scales, const mx::array& biases) {
  if (detect_isa() != Isa::avx512 || half.dtype() != mx::float16 || half.ndim() != 2 || q.dtype() != mx::uint32 ||
      scales.dtype() != mx::float16 || biases.dtype() != mx::float16)
    return false;
  const int N = half.shape(0), K = half.shape(1);
  if (K % 32 != 0 || q.shape() != mx::Shape{N, K / 8} || scales.shape() != mx::Shape{N, K / 32} ||
      biases.shape() != scales.shape())
    return false;
  for (const auto* a : {&half, &q, &scales, &biases})
    if (!a->flags().row_contiguous) return false;
  mx::eval({half, q, scales, biases});
  Q4View view{reinterpret_cast<const uint8_t*>(q.data<uint32_t>()), scales.data<uint16_t>(), biases.data<uint16_t>()};
  if (!rebuilds(half.data<uint16_t>(), N, K, view)) return false;
  std::lock_guard<std::mutex> lock(registry_mu);
  registry()[half.data<uint16_t>()] = Entry{{half, q, scales, biases}, view};
  return true;
}

Q4View q4_lookup(const void* data) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(data);
  return it == registry().end() ? Q4View{} : it->second.view;
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
