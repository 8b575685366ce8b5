// The 4-bit blocks' tile on AVX2 (compiled with -mavx2 -mfma; the walk: blocks_impl.h). No 16-lane
// table lookup here, so each 8-weight vector is computed, q * scale + bias in one FMA: the value
// the AVX-512 table holds. Lane l sums k = l (mod 8) in k order and the lanes end in
// gemv_avx2's sum (reduce_avx2.h), so every row's bits are the float32 matrix's on this path too.
#include <immintrin.h>

#include "blocks_impl.h"
#include "reduce_avx2.h"

namespace specbatch {
namespace {

struct Avx2 {
  using Vec = __m256;
  // 4 rows x 2 weight rows: 8 accumulators, 2 weight vectors and x within the 16 registers (1 x 8
  // and 2 x 6 tiles measured no better)
  static constexpr int kBlockBytes = 32;  // 64 nibbles
  static constexpr int kOnePass = 1, kPassRows = 4;

  static Vec zero() { return _mm256_setzero_ps(); }
  static float sum(Vec v) { return hsum(v); }

  // Weights 16c + 8h + 0..7 of the block at p (word l holds nibble c of weight 16c + l) as
  // float32: q * s + b, rounded once.
  template <int C, int H>
  __attribute__((always_inline)) static Vec weights(const uint8_t* p, const float* sb) {
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * H)));
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(words, 4 * C), _mm256_set1_epi32(15));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_broadcast_ss(sb), _mm256_broadcast_ss(sb + 1));
  }

  // Half chunk (C, H) of one block for NB weight rows and MB token rows.
  template <int NB, int MB, int C, int H>
  __attribute__((always_inline)) static void half_chunk(const float* x, int K, int k0, const uint8_t* const (&p)[NB],
                                                        const float* const (&sb)[NB], Vec (&acc)[NB][MB]) {
    Vec wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = weights<C, H>(p[i], sb[i] + 2 * (C / 2));
    for (int j = 0; j < MB; ++j) {
      Vec xv = _mm256_loadu_ps(x + (long)j * K + k0 + 16 * C + 8 * H);
      asm("" : "+x"(xv));  // one load per x vector, not one folded into each FMA
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }

  template <int NB, int MB, int CHUNKS>
  __attribute__((always_inline)) static void block(const float* x, int K, int k0, const uint8_t* const (&p)[NB],
                                                   const float* const (&sb)[NB], Vec (&acc)[NB][MB]) {
    half_chunk<NB, MB, 0, 0>(x, K, k0, p, sb, acc);
    half_chunk<NB, MB, 0, 1>(x, K, k0, p, sb, acc);
    half_chunk<NB, MB, 1, 0>(x, K, k0, p, sb, acc);
    half_chunk<NB, MB, 1, 1>(x, K, k0, p, sb, acc);
    if constexpr (CHUNKS == 4) {
      half_chunk<NB, MB, 2, 0>(x, K, k0, p, sb, acc);
      half_chunk<NB, MB, 2, 1>(x, K, k0, p, sb, acc);
      half_chunk<NB, MB, 3, 0>(x, K, k0, p, sb, acc);
      half_chunk<NB, MB, 3, 1>(x, K, k0, p, sb, acc);
    }
  }
};

}  // namespace

void gemv_q4_avx2(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N) {
  blocks_impl::gemv<Avx2>(x, M, K, w, n0, n1, y, N);
}

}  // namespace specbatch
