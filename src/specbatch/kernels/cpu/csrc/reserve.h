// A paged cache's pool grown with headroom that costs no memory until written: a pool that
// grew by 1/16 copied all 60 layer pools into freshly faulted pages (a 1,440-token row's
// decode stalled 30-76 ms every ~96 tokens). Here the slots past `keep` are zero pages the
// kernel hands out on first touch, so a pool can reserve twice what it holds and grow into it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// pool: any dtype, row-contiguous, its slot axis `axis` (0: token-major [P, w]; 1: head-major
// [H, P, D]) -> the same with `slots` along that axis: each outer index's first `keep` slots
// copied, the rest zero (0 <= keep <= min(P, slots)). The zeros are whole pages handed back
// to the kernel where they can be (read as zero, resident only once written).
mx::array pool_reserve(const mx::array& pool, int axis, int64_t slots, int64_t keep);

// Zeroes [p, p + n): pages wholly inside are dropped (MADV_DONTNEED: zero on the next touch,
// no memory until then), the ragged edges written.
void zero_lazily(char* p, size_t n);

class PoolReserve : public mx::UnaryPrimitive {
 public:
  PoolReserve(mx::Stream stream, int axis, int64_t keep) : mx::UnaryPrimitive(stream), axis_(axis), keep_(keep) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "SpecbatchPoolReserve"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PoolReserve&>(other);
    return axis_ == o.axis_ && keep_ == o.keep_;
  }

 private:
  int axis_;
  int64_t keep_;
};

}  // namespace specbatch
