// The quantized blocks' tile on AVX-512 (compiled with -mavx512f -mavx512bw; the walk and the
// layout: blocks_impl.h): 16 weight rows a vector.
#include <immintrin.h>

#include "blocks_impl.h"

namespace specbatch {
namespace {

struct Avx512 {
  using Vec = __m512;
  using Words = __m512i;
  // token rows x vectors within the 32 registers: 4 x 4 or 8 x 2 accumulators, the weight vectors
  // and x (6 x 4 measured the same)
  static constexpr int kLanes = 16, kPassRows = 8;
  static constexpr int units(int rows) { return rows <= 4 ? 4 : 2; }

  static Vec zero() { return _mm512_setzero_ps(); }
  static Words load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  // q * 2^(BITS J), exact in float32 (at most 8 significant bits); the top value shifted down
  // first, so a signed convert reads it
  template <int BITS, int J>
  static Vec values(Words w) {
    constexpr bool top = J == 32 / BITS - 1;
    if constexpr (top) w = _mm512_srli_epi32(w, BITS);
    return _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(((1 << BITS) - 1) << (BITS * (top ? J - 1 : J)))));
  }
  static Vec halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec broadcast(float v) { return _mm512_set1_ps(v); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
};

}  // namespace

void gemv_blocks_avx512(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N,
                        bool again) {
  blocks_impl::gemv_blocks<Avx512>(x, M, K, w, n0, n1, y, N, again);
}

}  // namespace specbatch
