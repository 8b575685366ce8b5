// The machine's physical limits, measured: float32 FMA peak and memory read bandwidth (probe.cpp).
#pragma once

namespace specbatch {

// GFLOPS of `iters` rounds of 12 independent FMA chains on every pool thread at once (the
// widest vectors the CPU runs: AVX-512, else AVX2); 0 without AVX2.
double fma_peak_gflops(long iters);

// GB/s every pool thread reaches at once reading its slice of a `bytes` buffer (well past the
// last-level cache) with the widest vector loads, best of `repeats`: what a decode step that only
// streamed its weights could reach. The buffer lies on the pages the blocks' records are asked
// for (arena.h: huge pages unless SPECBATCH_HUGE_PAGES=0), or on 4 KB pages where `small_pages`.
// 0 for an empty buffer or no repeats.
double read_bandwidth_gbs(long bytes, int repeats, bool small_pages = false);

}  // namespace specbatch
