// The machine's float32 FMA peak (probe.cpp).
#pragma once

namespace specbatch {

// GFLOPS of `iters` rounds of 12 independent FMA chains on every pool thread at once (the
// widest vectors the CPU runs: AVX-512, else AVX2); 0 without AVX2.
double fma_peak_gflops(long iters);

}  // namespace specbatch
