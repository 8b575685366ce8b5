// The 8-bit blocks' tile on AVX-512 (compiled with -mavx512f; the walk: blocks_impl.h). A chunk of
// 16 weights is 16 bytes widened and converted, then q * scale + bias in one FMA: the float32
// value the registry checked (MLX's quantized_matmul with float32 activations; llama.cpp's Q8_0,
// d * q, where the bias is -128 scale). One byte a weight streamed against a float16 matrix's two.
#include <immintrin.h>

#include "blocks_impl.h"

namespace specbatch {
namespace {

struct Avx512 {
  using Vec = __m512;
  static constexpr int kBlockBytes = 64;
  static constexpr int kOnePass = 3, kPassRows = 8;  // as the 4-bit tile: 16 accumulators at most

  static Vec zero() { return _mm512_setzero_ps(); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }

  // Weights 16c + 0..15 of the block at p, group g = c / 2's scale and bias at sb + 2g.
  static Vec chunk(const uint8_t* p, int c, const float* sb) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c)));
    const int g = c / 2;
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(sb[2 * g]), _mm512_set1_ps(sb[2 * g + 1]));
  }

  template <int NB, int MB, int CHUNKS>
  __attribute__((always_inline)) static void block(const float* x, int K, int k0, const uint8_t* const (&p)[NB],
                                                   const float* const (&sb)[NB], Vec (&acc)[NB][MB]) {
    for (int c = 0; c < CHUNKS; ++c) {  // k in order per lane, as the float32 path sums it
      Vec wv[NB];
      for (int i = 0; i < NB; ++i) wv[i] = chunk(p[i], c, sb[i]);
      for (int j = 0; j < MB; ++j) {
        Vec xv = _mm512_loadu_ps(x + (long)j * K + k0 + 16 * c);
        asm("" : "+v"(xv));  // one load per x vector, not one folded into each FMA
        for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
      }
    }
  }
};

}  // namespace

void gemv_q8_avx512(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N) {
  blocks_impl::gemv<Avx512>(x, M, K, w, n0, n1, y, N);
}

}  // namespace specbatch
