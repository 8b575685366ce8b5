// The quantized blocks' tile on AVX2 (compiled with -mavx2 -mfma -mf16c; the walk and the layout:
// blocks_impl.h): 8 weight rows a vector, the same FMAs in the same order as the AVX-512 tile, so
// both give every row the same bits.
#include <immintrin.h>

#include "blocks_impl.h"

namespace specbatch {
namespace {

struct Avx2 {
  using Vec = __m256;
  using Words = __m256i;
  // token rows x vectors within the 16 registers: 2 x 4 or 4 x 2 accumulators, the weight vectors and x
  static constexpr int kLanes = 8, kPassRows = 4;
  static constexpr int units(int rows) { return rows <= 2 ? 4 : 2; }

  static Vec zero() { return _mm256_setzero_ps(); }
  static Words load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  template <int BITS, int J>
  static Vec values(Words w) {
    constexpr bool top = J == 32 / BITS - 1;
    if constexpr (top) w = _mm256_srli_epi32(w, BITS);  // a signed convert: keep the top bit clear
    return _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(((1 << BITS) - 1) << (BITS * (top ? J - 1 : J)))));
  }
  static Vec halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec broadcast(float v) { return _mm256_set1_ps(v); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
};

}  // namespace

void gemv_blocks_avx2(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N,
                        bool again) {
  blocks_impl::gemv_blocks<Avx2>(x, M, K, w, n0, n1, y, N, again);
}

}  // namespace specbatch
