// The 8-bit blocks' tile on AVX2 (compiled with -mavx2 -mfma; the walk: blocks_impl.h): each
// 8-weight vector is 8 bytes widened and converted, then q * scale + bias in one FMA. Lane l sums
// k = l (mod 8) in k order and the lanes end in gemv_avx2's sum (reduce_avx2.h), so every row's
// bits are the float32 matrix's on this path too.
#include <immintrin.h>

#include "blocks_impl.h"
#include "reduce_avx2.h"

namespace specbatch {
namespace {

struct Avx2 {
  using Vec = __m256;
  static constexpr int kBlockBytes = 64;
  static constexpr int kOnePass = 1, kPassRows = 4;  // as the 4-bit tile

  static Vec zero() { return _mm256_setzero_ps(); }
  static float sum(Vec v) { return hsum(v); }

  // Weights 8e + 0..7 of the block at p (e = 0..7), group e / 4's scale and bias at sb.
  static Vec eighth(const uint8_t* p, int e, const float* sb) {
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * e)));
    const int g = e / 4;
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_broadcast_ss(sb + 2 * g), _mm256_broadcast_ss(sb + 2 * g + 1));
  }

  template <int NB, int MB, int CHUNKS>
  __attribute__((always_inline)) static void block(const float* x, int K, int k0, const uint8_t* const (&p)[NB],
                                                   const float* const (&sb)[NB], Vec (&acc)[NB][MB]) {
    for (int e = 0; e < 2 * CHUNKS; ++e) {
      Vec wv[NB];
      for (int i = 0; i < NB; ++i) wv[i] = eighth(p[i], e, sb[i]);
      for (int j = 0; j < MB; ++j) {
        Vec xv = _mm256_loadu_ps(x + (long)j * K + k0 + 8 * e);
        asm("" : "+x"(xv));  // one load per x vector, not one folded into each FMA
        for (int i = 0; i < NB; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
      }
    }
  }
};

}  // namespace

void gemv_q8_avx2(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N) {
  blocks_impl::gemv<Avx2>(x, M, K, w, n0, n1, y, N);
}

}  // namespace specbatch
