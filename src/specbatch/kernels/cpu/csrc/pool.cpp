#include "pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

namespace specbatch {

namespace {

int default_threads() {
  if (const char* env = std::getenv("SPECBATCH_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

bool pin_by_default() {
  const char* env = std::getenv("SPECBATCH_CPU_PIN");
  return env == nullptr || std::atoi(env) != 0;
}

// The placement this thread last applied (-1: none yet), against Pool::pinned_.
thread_local int applied = -1;
}  // namespace

Pool::Pool(int threads) : pinned_(pin_by_default() ? 1 : 0) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &set)) cpus_.push_back(cpu);
  }
  for (int id = 1; id < threads; ++id) workers_.emplace_back([this, id] { work(id); });
}

void Pool::place(int slot) {
  const int want = pinned_.load(std::memory_order_relaxed);
  if (applied == want) return;
  applied = want;
  // one thread has no partner to collide with; fewer CPUs than threads: never stack two on one
  if (workers_.empty() || cpus_.size() < workers_.size() + 1) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (want) {
    CPU_SET(cpus_[slot], &set);
  } else {
    for (int cpu : cpus_) CPU_SET(cpu, &set);
  }
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void Pool::run(const std::function<void(int)>& fn, int parts) {
  place(0);
  parts = std::min(parts, static_cast<int>(workers_.size()) + 1);
  if (parts <= 1) {  // one part: no worker woken (nor its core kept spinning)
    fn(0);
    return;
  }
  // Two engines' streams computing at once (one finishing a lookahead as the next starts)
  // overwrote each other's job here: the calibration run crashed with a segfault.
  std::lock_guard<std::mutex> turn(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    parts_ = parts;
    pending_.store(static_cast<int>(workers_.size()));
    generation_.fetch_add(1, std::memory_order_release);
  }
  if (sleeping_.load() > 0) wake_.notify_all();
  fn(0);
  while (pending_.load(std::memory_order_acquire) > 0) _mm_pause();
}

void Pool::work(int id) {
  unsigned seen = 0;  // the generation at construction: a run may start before this thread does
  for (;;) {
    auto start = std::chrono::steady_clock::now();
    // a worker the cap leaves out (a draft computing on one core while its caller builds the
    // verify) gets no part, so it sleeps at once and leaves its core to the builder
    const auto spin = std::chrono::microseconds(spin_us_.load(std::memory_order_relaxed));
    auto wanted = [&] { const int c = cap_.load(std::memory_order_relaxed); return c <= 0 || id < c; };
    // one pause a check (~25 ns here) and the clock every 256 (at once first: spin 0 never
    // spins), so a run's start is seen within ~0.1 us; 32 pauses a check cost ~0.7 us a pass
    // (an empty pass 1.06 vs 0.38 us; ~1.5% of a width-1 step, ~140 passes)
    for (unsigned n = 0; generation_.load(std::memory_order_acquire) == seen && wanted(); ++n) {
      _mm_pause();
      if ((n & 255) == 0 && std::chrono::steady_clock::now() - start >= spin) break;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      sleeping_.fetch_add(1);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      sleeping_.fetch_sub(1);
    }
    const std::function<void(int)>* job;
    int parts;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      seen = generation_.load();
      job = job_, parts = parts_;
    }
    place(id);
    if (id < parts) (*job)(id);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void Pool::split(int64_t n, int64_t cost, int64_t alone, const std::function<void(int64_t, int64_t)>& fn,
                 int64_t align) {
  const int parts = size();  // read once: cap() may change while this runs
  if (n * cost < alone || parts == 1) return fn(0, n);
  const int64_t per = ((n + parts - 1) / parts + align - 1) / align * align;
  run([&](int part) { fn(std::min(n, part * per), std::min(n, (part + 1) * per)); }, parts);
}

Pool& pool() {
  static Pool instance(default_threads());
  return instance;
}

}  // namespace specbatch
