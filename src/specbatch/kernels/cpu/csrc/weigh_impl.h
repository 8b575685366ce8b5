// The value weighing of the attention body (acc[r] = sum_j p[r][j] v[j]), included by
// attention_impl.h inside its anonymous namespace, with W float lanes and KeyRows.

// Keys [j0, j1) pulled in ahead of use. A paged row's keys jump to another place in the pool
// every block, where the hardware prefetcher restarts its stream; dense keys gained ~8% too.
constexpr int kAheadKeys = 32;
inline void prefetch_rows(const KeyRows& k, int j0, int j1, int D, int from = 0) {
  for (int j = j0; j < j1; ++j) {
    const char* row = reinterpret_cast<const char*>(k.at(j) + from);
    for (int b = 0; b < D * 4; b += 64) __builtin_prefetch(row + b);
  }
}

// acc[r] (+)= sum_j p[r][j - j0] v[j] over keys [j0, j1) and the head's vectors [n0, n0 + NV), RN
// rows kept in registers (acc rows NA vectors apart; `resume`: on from what acc holds, else from
// zero); one multiply and one add per term, in key order (no contraction: -ffp-contract=off).
// Rows `pull` floats wide from vector n0 are prefetched kAheadKeys ahead, up to `seen` (0: none;
// a task's first chunk pulls in its own). Inlined: called out of line per chunk, prefill's
// attention took ~5% longer.
template <int NV, int RN, int NA = NV>
__attribute__((always_inline)) inline void weigh_rows(const float* p, int stride, const KeyRows& v, int j0, int j1,
                                                      int seen, float* acc, int n0, int pull, bool resume = false) {
  vf sum[RN][NV] = {};
  if (resume)
    for (int r = 0; r < RN; ++r)
      for (int n = 0; n < NV; ++n) sum[r][n] = load(acc + r * NA * W + (n0 + n) * W);
  for (int j = j0; j < j1; ++j) {
    if (pull && j + kAheadKeys < seen) prefetch_rows(v, j + kAheadKeys, j + kAheadKeys + 1, pull, n0 * W);
    vf vj[NV];
    const float* vrow = v.at(j) + n0 * W;
    for (int n = 0; n < NV; ++n) vj[n] = load(vrow + n * W);
    for (int r = 0; r < RN; ++r) {
      const vf pr = splat(p[static_cast<size_t>(r) * stride + j - j0]);
      for (int n = 0; n < NV; ++n) sum[r][n] += pr * vj[n];
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int n = 0; n < NV; ++n) store(acc + r * NA * W + (n0 + n) * W, sum[r][n]);
}

// Keys a sliced pass takes at a time: their value rows (16 KB at D = 64) stay in L1 while every
// slice of every row group reads them, so each value line comes from memory once, in order.
constexpr int kSliceKeys = 64;

// A head too wide for several rows' sums in the registers (AVX2, D = 64: 8 vectors) in slices
// of 2 vectors against up to 6 rows, kSliceKeys keys at a time: each value read once per 6 rows,
// not once per row, and each element summed in key order (a sum stored and reloaded is exact).
template <int NV>
void weigh_sliced(const float* p, int stride, int rows, const KeyRows& v, int j0, int j1, int seen, float* acc) {
  constexpr int S = 2;
  for (int k0 = j0; k0 < j1; k0 += kSliceKeys) {
    const int k1 = std::min(j1, k0 + kSliceKeys);
    const bool resume = k0 > j0;
    for (int r = 0; r < rows; r += 6) {
      const float* pr = p + r * stride + (k0 - j0);
      float* ar = acc + r * NV * W;
      for (int n0 = 0; n0 < NV; n0 += S) {
        const int pull = r == 0 && n0 == 0 ? NV * W : 0;  // whole rows, once a slice pass
        switch (std::min(6, rows - r)) {
          case 6: weigh_rows<S, 6, NV>(pr, stride, v, k0, k1, seen, ar, n0, pull, resume); break;
          case 5: weigh_rows<S, 5, NV>(pr, stride, v, k0, k1, seen, ar, n0, pull, resume); break;
          case 4: weigh_rows<S, 4, NV>(pr, stride, v, k0, k1, seen, ar, n0, pull, resume); break;
          case 3: weigh_rows<S, 3, NV>(pr, stride, v, k0, k1, seen, ar, n0, pull, resume); break;
          case 2: weigh_rows<S, 2, NV>(pr, stride, v, k0, k1, seen, ar, n0, pull, resume); break;
          default: weigh_rows<S, 1, NV>(pr, stride, v, k0, k1, seen, ar, n0, pull, resume);
        }
      }
    }
  }
}

// RN rows over the chunk, whole rows prefetched.
template <int NV, int RN>
void weigh_whole(const float* p, int stride, const KeyRows& v, int j0, int j1, int seen, float* acc) {
  weigh_rows<NV, RN>(p, stride, v, j0, j1, seen, acc, 0, NV * W);
}

template <int NV>
void weigh_fixed(const float* p, int stride, int rows, const KeyRows& v, int j0, int j1, int seen, float* acc) {
  constexpr int regs = W == 16 ? 32 : 16;  // rows per pass that fit the registers with the values
  constexpr int R = (regs - NV) / NV >= 4 ? 4 : (regs - NV) / NV >= 2 ? 2 : 1;
  if constexpr (R == 1) return weigh_sliced<NV>(p, stride, rows, v, j0, j1, seen, acc);
  int r = 0;
  for (; r + R <= rows; r += R) weigh_whole<NV, R>(p + r * stride, stride, v, j0, j1, seen, acc + r * NV * W);
  // the rest in one pass where it fits (a decode query group is 3 rows): each pass reads every value
  if (R >= 4 && rows - r == 3) return weigh_whole<NV, 3>(p + r * stride, stride, v, j0, j1, seen, acc + r * NV * W);
  if (R >= 2 && rows - r >= 2) weigh_whole<NV, 2>(p + r * stride, stride, v, j0, j1, seen, acc + r * NV * W), r += 2;
  for (; r < rows; ++r) weigh_whole<NV, 1>(p + r * stride, stride, v, j0, j1, seen, acc + r * NV * W);
}

// Any head size: the same terms in the same order, through memory.
void weigh_any(const float* p, int stride, int rows, const KeyRows& v, int j0, int j1, int D, float* acc) {
  for (int i = 0; i < rows * D; ++i) acc[i] = 0.0f;
  for (int j = j0; j < j1; ++j)
    for (int r = 0; r < rows; ++r) {
      const float pr = p[static_cast<size_t>(r) * stride + j - j0];
      for (int d = 0; d < D; ++d) acc[r * D + d] += pr * v.at(j)[d];
    }
}

// One chunk's weighed values (keys [j0, j1), p [rows][stride] from j0): acc [rows][D], from zero.
void weigh_values(const float* p, int stride, int rows, const KeyRows& v, int j0, int j1, int seen, int D,
                  float* acc) {
  if (D == 4 * W) return weigh_fixed<4>(p, stride, rows, v, j0, j1, seen, acc);
  if (D == 8 * W) return weigh_fixed<8>(p, stride, rows, v, j0, j1, seen, acc);
  if (D == 2 * W) return weigh_fixed<2>(p, stride, rows, v, j0, j1, seen, acc);
  if (D == 16 * W) return weigh_fixed<16>(p, stride, rows, v, j0, j1, seen, acc);  // AVX2, D = 128
  if (D == W) return weigh_fixed<1>(p, stride, rows, v, j0, j1, seen, acc);
  weigh_any(p, stride, rows, v, j0, j1, D, acc);
}
