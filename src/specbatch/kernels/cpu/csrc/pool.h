// A small persistent thread pool: a decode step runs ~100 pool passes of 20-500 us each, so
// workers spin up to 2 ms before sleeping (a wake on this VM's pinned cores cost ~100 us;
// one process, interleaved, 2,000 against 60 us: plain width 8 0.91-1.01x and width 1
// 0.94-0.98x the time, width-1 speculation even). A worker the cap leaves out never spins.
#pragma once

#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace specbatch {

class Pool {
 public:
  explicit Pool(int threads);
  ~Pool();
  // The threads a kernel splits over: every one, or fewer while cap() is set.
  int size() const {
    const int n = static_cast<int>(workers_.size()) + 1, c = cap_.load(std::memory_order_relaxed);
    return c > 0 && c < n ? c : n;
  }
  // Kernels evaluated from now on split over at most `threads` (0: all), until the next call:
  // a small graph computing on one core while the caller builds the next on the other. The
  // sums never depend on it (each output is one thread's whole).
  static void cap(int threads) { cap_.store(threads, std::memory_order_relaxed); }
  // How long an idle worker spins before it sleeps (microseconds; 2,000 by default); returns
  // the setting it replaced.
  static int spin(int us) { return spin_us_.exchange(us, std::memory_order_relaxed); }
  // Each pool thread on a core of its own (the caller, MLX's stream thread, on the first CPU
  // the process may use, worker i on the i-th): left to the scheduler, a woken worker at times
  // shared the caller's core and a width-1 round took twice as long (10-20% of rounds). On by
  // default; SPECBATCH_CPU_PIN=0 or pin(false) leaves placement to the OS.
  void pin(bool on) { pinned_.store(on ? 1 : 0, std::memory_order_relaxed); }
  bool pinned() const { return pinned_.load(std::memory_order_relaxed) != 0; }
  // Runs fn(0..parts-1) (parts: what the caller planned from one size() read), part 0 on the
  // calling thread; returns when all are done. Callers on different threads (MLX runs one
  // stream thread per stream) take turns.
  void run(const std::function<void(int)>& fn, int parts);
  // Runs fn(a, b) over [0, n) cut into size() parts (each a multiple of `align` long, so a
  // vector never straddles two), or once on this thread where n * cost < `alone` (decode
  // shapes: a pool wake costs more than it saves).
  void split(int64_t n, int64_t cost, int64_t alone, const std::function<void(int64_t, int64_t)>& fn,
             int64_t align = 1);

 private:
  void work(int id);
  void place(int slot);  // applies the pinned_ placement to this thread, when it changed
  std::vector<int> cpus_;  // the CPUs the process may use, at construction
  std::atomic<int> pinned_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one run at a time: a second stream's kernel waits for the first's
  std::mutex mu_;
  std::condition_variable wake_;
  const std::function<void(int)>* job_ = nullptr;
  int parts_ = 0;
  std::atomic<unsigned> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  bool stop_ = false;
  static inline std::atomic<int> cap_{0};
  static inline std::atomic<int> spin_us_{2000};
};

Pool& pool();

}  // namespace specbatch
