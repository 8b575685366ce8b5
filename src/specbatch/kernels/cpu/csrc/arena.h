// Memory for the blocks' records (blocks.cpp) on transparent huge pages. A width-1 step streams
// every record once (~98 MB for the embedded target); on 4 KB pages each 4 KB of the stream
// crosses a page, where the hardware prefetchers stop and a TLB walk may wait, and two threads
// reading the target's 211 matrices' worth of records read ~1.2x faster from 2 MB pages (a
// standalone read here, 4 KB vs 2 MB pages: 25-37 vs 33-44 GB/s). Registrations come once a
// load, so chunks are only bump-allocated, in registration order (a forward's order), and a
// chunk goes back to the system when the last records in it are forgotten.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace specbatch {

// `size` zeroed bytes at `data`, 64-byte aligned, valid while `owner` (or a copy) lives.
struct Span {
  std::shared_ptr<uint8_t> owner;
  uint8_t* data = nullptr;
  size_t size = 0;
};

Span arena_take(size_t bytes);

// A mapping of its own of `bytes` zeroed bytes, asked for huge pages or told never to take them
// (the read probe's buffer: the records' pages, and 4 KB ones for comparison).
Span huge_span(size_t bytes, bool huge);

// Whether chunks ask for huge pages (madvise MADV_HUGEPAGE): on unless SPECBATCH_HUGE_PAGES=0
// when the first chunk is made; the kernel grants them only where THP is "always" or "madvise".
bool arena_huge_pages();

// Bytes of the arena's live chunks, and how many of them the kernel backs with huge pages now
// (AnonHugePages in /proc/self/smaps over the chunks' ranges; 0 where it cannot be read).
struct ArenaUse {
  int64_t bytes = 0, huge_bytes = 0;
};
ArenaUse arena_use();

}  // namespace specbatch
