// Appending a forward's keys (or values) to a paged cache's pool as one primitive that
// writes in place: MLX's `pool[slots] = rows` after the head-layout transpose cost ~4 graph
// nodes a pool a layer (a copy, index broadcasts, a scatter), +2 ms a width-1 step.
#pragma once

#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace specbatch {

namespace mx = mlx::core;

// pool [H, P, D] float32 (each head's token slots in a row); slots int32 [B * N] (token n of row
// b at slots[b * N + n]); rows [B, H, N, D] float32 (the head layout attention takes) -> the pool
// with those rows stored. `blocked` (a key pool): each 16-slot block of a head stored as [D][16],
// so slot s's element d is at (s / 16) * 16 * D + d * 16 + s % 16 (kBlockSlots; P a multiple).
// A pool whose buffer nothing else holds is written in place (donated), else copied first;
// one op per pool, since an input shared by a primitive's sibling outputs is never donatable.
// A slot outside [0, P) is not written.
constexpr int kBlockSlots = 16;
mx::array paged_write(const mx::array& pool, const mx::array& slots, const mx::array& rows, bool blocked = false);

// The write on rows in memory (the op's task; each layer of the decoder stack): x [B, H, N, D]
// (xs: its [B, H, N] strides, D contiguous) into pool [H, P, D] (each head's slots in a row,
// blocked or not) at slots [B * N].
void paged_rows(const float* x, const int64_t* xs, const int32_t* slots, int B, int H, int N, int D, int64_t P,
                float* pool, bool blocked);

// How many writes so far had to copy their pool (a held reference kept it from donation); a
// decoder stack counts its pools' copies here too.
int64_t paged_write_copies();
void paged_write_copied();

class PagedWrite : public mx::UnaryPrimitive {
 public:
  PagedWrite(mx::Stream stream, bool blocked) : mx::UnaryPrimitive(stream), blocked_(blocked) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "SpecbatchPagedWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return blocked_ == static_cast<const PagedWrite&>(other).blocked_;
  }

 private:
  bool blocked_;
};

}  // namespace specbatch
