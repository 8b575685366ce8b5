#include "spread.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "strided.h"
#include "task.h"

namespace specbatch {

mx::array spread(const mx::array& values, const mx::array& ids, int vocab) {
  if (values.dtype() != mx::float32 || values.ndim() != 2)
    throw std::invalid_argument("spread: values must be float32 [B, n]");
  if (ids.dtype() != mx::int32 || ids.ndim() != 1 || ids.shape(0) != values.shape(1))
    throw std::invalid_argument("spread: ids must be int32 [n], one per column of values");
  if (vocab < 1) throw std::invalid_argument("spread: vocab must be positive");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({values.shape(0), vocab}, mx::float32, std::make_shared<Spread>(s, vocab), {values, ids});
}

void Spread::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto weak = task_inputs(encoder, inputs, out);  // before out.data(): it allocates out
  encoder.dispatch([in = std::move(weak), yp = out.data<float>(), V = vocab_]() {
    std::vector<float> vc;
    std::vector<int32_t> ic;
    const float* vp = row_major(in[0], vc);
    const int32_t* ip = row_major(in[1], ic);
    const int64_t B = in[0].shape(0), n = in[0].shape(1);
    const bool valid = std::all_of(ip, ip + n, [V](int32_t id) { return id >= 0 && id < V; });
    std::fill(yp, yp + B * V, valid ? -std::numeric_limits<float>::infinity() : std::nanf(""));
    if (!valid) return;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < n; ++j) yp[b * V + ip[j]] = vp[b * n + j];
  });
}

void Spread::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchSpread runs on the CPU only");
}

}  // namespace specbatch
