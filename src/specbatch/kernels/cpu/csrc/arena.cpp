#include "arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

namespace specbatch {
namespace {

constexpr size_t kHuge = size_t{2} << 20, kChunk = size_t{32} << 20, kAlign = 64;

// One mapping: `base` (2 MB aligned) for `capacity` bytes, unmapped with the last Span in it.
struct Chunk {
  void* mapping = nullptr;
  size_t mapped = 0;
  uint8_t* base = nullptr;
  size_t capacity = 0, used = 0;
  ~Chunk() {
    if (mapping != nullptr) munmap(mapping, mapped);
  }
};

std::mutex mu;
// Where the next records go, and every chunk made (for arena_use): held only by the Spans in
// them, so a chunk whose records are all forgotten is unmapped at once.
std::weak_ptr<Chunk> current;
std::vector<std::weak_ptr<Chunk>> live;

bool wants_huge() {
  static const bool on = [] {
    const char* v = std::getenv("SPECBATCH_HUGE_PAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

std::shared_ptr<Chunk> make_chunk(size_t bytes, bool huge) {
  auto c = std::make_shared<Chunk>();
  c->capacity = (bytes + kHuge - 1) / kHuge * kHuge;
  c->mapped = c->capacity + kHuge;  // room to start on a 2 MB boundary
  c->mapping = mmap(nullptr, c->mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (c->mapping == MAP_FAILED) {
    c->mapping = nullptr;
    throw std::bad_alloc();
  }
  const auto at = (reinterpret_cast<uintptr_t>(c->mapping) + kHuge - 1) / kHuge * kHuge;
  c->base = reinterpret_cast<uint8_t*>(at);
  // advice only: where THP is off or none is free, the same bytes stay on 4 KB pages
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
  madvise(c->base, c->capacity, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#else
  (void)huge;
#endif
  return c;
}

}  // namespace

Span arena_take(size_t bytes) {
  const size_t size = (bytes + kAlign - 1) / kAlign * kAlign;
  std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<Chunk> chunk = current.lock();
  if (!chunk || chunk->capacity - chunk->used < size) {
    chunk = make_chunk(size > kChunk ? size : kChunk, wants_huge());
    current = chunk;
    live.erase(std::remove_if(live.begin(), live.end(), [](const auto& w) { return w.expired(); }), live.end());
    live.push_back(chunk);
  }
  uint8_t* data = chunk->base + chunk->used;
  chunk->used += size;
  std::memset(data, 0, bytes);  // fresh mappings are zero; this faults the pages in at load, not in a step
  return Span{std::shared_ptr<uint8_t>(chunk, data), data, bytes};
}

Span huge_span(size_t bytes, bool huge) {
  auto c = make_chunk(bytes, huge);
  return Span{std::shared_ptr<uint8_t>(c, c->base), c->base, bytes};
}

bool arena_huge_pages() { return wants_huge(); }

ArenaUse arena_use() {
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  ArenaUse use;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& w : live)
      if (auto c = w.lock()) {
        ranges.emplace_back(reinterpret_cast<uintptr_t>(c->base), reinterpret_cast<uintptr_t>(c->base) + c->capacity);
        use.bytes += static_cast<int64_t>(c->used);
      }
  }
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return use;
  char line[512];
  bool inside = false;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long lo = 0, hi = 0;
    long kb = 0;
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && std::strchr(line, '-') < std::strchr(line, ' ')) {
      inside = false;
      for (const auto& r : ranges) inside = inside || (lo < r.second && hi > r.first);
    } else if (inside && std::sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) {
      use.huge_bytes += kb * 1024;
    }
  }
  std::fclose(f);
  return use;
}

}  // namespace specbatch
