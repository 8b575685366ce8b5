#include "paged_write.h"

#include <atomic>
#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "strided.h"

namespace specbatch {

namespace {
std::atomic<int64_t> copies{0};
}  // namespace

int64_t paged_write_copies() { return copies.load(); }
void paged_write_copied() { copies.fetch_add(1); }

mx::array paged_write(const mx::array& pool, const mx::array& slots, const mx::array& rows, bool blocked) {
  if (pool.dtype() != mx::float32 || rows.dtype() != mx::float32)
    throw std::invalid_argument("paged_write: a float32 pool and rows");
  if (rows.ndim() != 4 || pool.ndim() != 3 || pool.shape(0) != rows.shape(1) || pool.shape(2) != rows.shape(3))
    throw std::invalid_argument("paged_write: rows [B, H, N, D] into a pool [H, P, D]");
  if (slots.dtype() != mx::int32 || slots.ndim() != 1 || slots.shape(0) != rows.shape(0) * rows.shape(2))
    throw std::invalid_argument("paged_write: slots int32 [B * N]");
  if (blocked && pool.shape(1) % kBlockSlots)
    throw std::invalid_argument("paged_write: a blocked pool's slots a multiple of 16");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(pool.shape(), mx::float32, std::make_shared<PagedWrite>(s, blocked), {pool, slots, rows});
}

void PagedWrite::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& pool = inputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  // The cache replaced its reference by out, so the pool is usually held by this op alone.
  const bool donated = pool.is_donatable() && pool.flags().row_contiguous;
  if (donated) {
    out.copy_shared_buffer(pool);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    copies.fetch_add(1);
  }
  encoder.set_output_array(out);
  const auto& rows = inputs[2];
  const int B = rows.shape(0), H = rows.shape(1), N = rows.shape(2), D = rows.shape(3);
  const int64_t P = out.shape(1);
  // inputs are ready only inside the task (eval_cpu runs before the ops it depends on have)
  encoder.dispatch([pool = donated ? mx::array(0.0f) : pool, donated, slots = inputs[1], rows,
                    y = out.data<float>(), B, H, N, D, P, blocked = blocked_]() {
    if (!donated) {
      std::vector<float> copy;
      std::memcpy(y, row_major(pool, copy), pool.nbytes());
    }
    std::vector<int32_t> sc;
    std::vector<float> xc;
    int64_t xs[3];  // rows read in place where D is contiguous (a cache's tokens sliced out of its buffer)
    const float* x = rows_of(rows, xc, xs);
    paged_rows(x, xs, row_major(slots, sc), B, H, N, D, P, y, blocked);
  });
}

void paged_rows(const float* x, const int64_t* xs, const int32_t* slots, int B, int H, int N, int D, int64_t P,
                float* pool, bool blocked) {
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) {
      const int64_t slot = slots[b * N + n];
      if (slot < 0 || slot >= P) continue;
      for (int h = 0; h < H; ++h) {
        const float* row = x + b * xs[0] + h * xs[1] + n * xs[2];
        if (!blocked) {
          std::memcpy(pool + (h * P + slot) * D, row, D * sizeof(float));
          continue;
        }
        float* at = pool + h * P * D + slot / kBlockSlots * kBlockSlots * D + slot % kBlockSlots;
        for (int d = 0; d < D; ++d) at[d * kBlockSlots] = row[d];
      }
    }
}

void PagedWrite::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchPagedWrite runs on the CPU only");
}

}  // namespace specbatch
