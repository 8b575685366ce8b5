// The 4-bit blocks' tile on AVX-512 (compiled with -mavx512f -mavx512bw; the walk: blocks_impl.h).
// Each group's 16 possible values are one FMA, q * scale + bias for q = 0..15 (the float32 values
// the registry checked), and a chunk of 16 weights is one permute of that table.
#include <immintrin.h>

#include "blocks_impl.h"

namespace specbatch {
namespace {

struct Avx512 {
  using Vec = __m512;
  static constexpr int kBlockBytes = 32;  // 64 nibbles
  static constexpr int kOnePass = 3, kPassRows = 8;  // 8 rows x 2 weight rows: 16 of 32 registers

  static Vec zero() { return _mm512_setzero_ps(); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }

  // The 16 values of a group: q * scale + bias in float32, one rounding, as MLX's quantized_matmul
  // computes the blocks with float32 activations (and llama.cpp's Q4_1, d * q + m). A multiply then
  // an add, each reading its scalar as an embedded broadcast: q * scale is exact (4 bits times a
  // float16's 11), so the add's rounding is the FMA's, and Zen 4 runs the pair faster than a
  // broadcast and an FMA (one core, in cache, 1 row: 0.82-0.96 -> 0.74-0.77 ns a 16-weight chunk;
  // whole width-1 forwards ~0.85x). Tiles of more token rows keep the FMA: with the pair, a forward
  // of 4 positions took 1.05-1.15x the time.
  template <int MB>
  static Vec table(const float* sb) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if constexpr (MB > kOnePass) return _mm512_fmadd_ps(iota, _mm512_set1_ps(sb[0]), _mm512_set1_ps(sb[1]));
    __m512 scaled = _mm512_mul_ps(iota, _mm512_set1_ps(sb[0]));
    asm("" : "+v"(scaled));  // GCC would contract the pair back into the FMA
    return _mm512_add_ps(scaled, _mm512_set1_ps(sb[1]));
  }

  // Word l of a block holds, in its nibble c, the weight 16c + l, so one widening load and a
  // shift by 4c give chunk c's 16 table indices in lane order (vpermps reads an index's low 4 bits
  // only). Against the checkpoint's order (element 2i in byte i's low nibble) that saves a byte
  // shuffle a chunk: one process, one core, the target's 210 matrices, 1 / 2 / 3 rows 0.65 /
  // 0.60 / 0.63x the time.
  static Vec chunk(__m512i idx, int c, Vec t) { return _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4 * c), t); }

  // The 4 chunks (or 2) of one block: each chunk's NB weight vectors looked up once and met by
  // every token row.
  template <int NB, int MB, int CHUNKS>
  __attribute__((always_inline)) static void block(const float* x, int K, int k0, const uint8_t* const (&p)[NB],
                                                   const float* const (&sb)[NB], Vec (&acc)[NB][MB]) {
    __m512i idx[NB];
    Vec t[NB][2];
    for (int i = 0; i < NB; ++i) {
      idx[i] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[i])));
      t[i][0] = table<MB>(sb[i]);
      if (CHUNKS == 4) t[i][1] = table<MB>(sb[i] + 2);
    }
    for (int c = 0; c < CHUNKS; ++c) {  // k in order per lane, as the float32 path sums it
      Vec wv[NB];
      for (int i = 0; i < NB; ++i) wv[i] = chunk(idx[i], c, t[i][c / 2]);
      for (int j = 0; j < MB; ++j) {
        Vec xv = _mm512_loadu_ps(x + (long)j * K + k0 + 16 * c);
        // one load per x vector: GCC otherwise folds it into each of the NB FMAs, and the loads
        // bound the tile (one core, in cache, 2 x 4 tile: 2.24 -> 1.42 ns a group)
        asm("" : "+v"(xv));
        for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
      }
    }
  }
};

}  // namespace

void gemv_q4_avx512(const float* x, int M, int K, const BlockView& w, int n0, int n1, float* y, int N) {
  blocks_impl::gemv<Avx512>(x, M, K, w, n0, n1, y, N);
}

}  // namespace specbatch
