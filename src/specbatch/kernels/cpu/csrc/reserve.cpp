#include "reserve.h"

#include <cstring>
#include <stdexcept>
#include <sys/mman.h>
#include <unistd.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace specbatch {

void zero_lazily(char* p, size_t n) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + n;
  const uintptr_t a = (begin + page - 1) / page * page, b = end / page * page;
  // a few pages: writing them costs less than the call and the faults after it
  if (b < a + 4 * page) {
    std::memset(p, 0, n);
    return;
  }
  std::memset(p, 0, a - begin);
  std::memset(reinterpret_cast<char*>(b), 0, end - b);
  if (madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED) != 0) std::memset(reinterpret_cast<char*>(a), 0, b - a);
}

mx::array pool_reserve(const mx::array& pool, int axis, int64_t slots, int64_t keep) {
  if (axis < 0 || axis >= pool.ndim())
    throw std::invalid_argument("pool_reserve: the slot axis must be one of the pool's axes");
  if (keep < 0 || keep > pool.shape(axis) || keep > slots)
    throw std::invalid_argument("pool_reserve: keep within both the old and the new slot counts");
  if (slots > INT32_MAX) throw std::invalid_argument("pool_reserve: at most 2^31 - 1 slots");
  auto shape = pool.shape();
  shape[axis] = static_cast<int>(slots);
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, pool.dtype(), std::make_shared<PoolReserve>(s, axis, keep), {pool});
}

void PoolReserve::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& in = inputs[0];
  if (!in.flags().row_contiguous) throw std::invalid_argument("pool_reserve: a row-contiguous pool");
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(in);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  int64_t outer = 1, inner = in.itemsize();  // [outer, slots, inner bytes]
  for (int i = 0; i < axis_; ++i) outer *= in.shape(i);
  for (int i = axis_ + 1; i < in.ndim(); ++i) inner *= in.shape(i);
  const int64_t had = in.shape(axis_), slots = out.shape(axis_);
  encoder.dispatch([in, y = out.data<char>(), outer, inner, had, slots, keep = keep_]() {
    const char* x = in.data<char>();
    for (int64_t o = 0; o < outer; ++o) {
      char* row = y + o * slots * inner;
      if (keep) std::memcpy(row, x + o * had * inner, keep * inner);
      zero_lazily(row + keep * inner, (slots - keep) * inner);
    }
  });
}

void PoolReserve::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchPoolReserve runs on the CPU only");
}

}  // namespace specbatch
