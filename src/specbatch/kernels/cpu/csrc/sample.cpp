#include "sample.h"

#include <algorithm>
#include <stdexcept>

#include "gemv.h"
#include "mlx/backend/cpu/encoder.h"
#include "noise.h"
#include "pool.h"
#include "strided.h"
#include "task.h"

namespace specbatch {

namespace {
constexpr int kSpan = 8192;        // tokens a task takes: 6 spans for a 49,152-token vocabulary
constexpr int64_t kAlone = 12288;  // fewer tokens in all: one thread (a pool wake costs more)
}  // namespace

mx::array sample_tokens(const mx::array& logits, const mx::array& temperatures, const mx::array& seeds,
                        const mx::array& positions) {
  if (logits.dtype() != mx::float32 || logits.ndim() != 3 || logits.shape(2) < 1)
    throw std::invalid_argument("sample_tokens: logits must be float32 [B, N, V]");
  const int B = logits.shape(0), N = logits.shape(1);
  if (temperatures.dtype() != mx::float32 || temperatures.ndim() != 1 || temperatures.shape(0) != B)
    throw std::invalid_argument("sample_tokens: temperatures must be float32 [B]");
  if (seeds.dtype() != mx::uint32 || seeds.ndim() != 1 || seeds.shape(0) != B)
    throw std::invalid_argument("sample_tokens: seeds must be uint32 [B]");
  if (positions.dtype() != mx::int32 || positions.ndim() != 2 || positions.shape(0) != B || positions.shape(1) != N)
    throw std::invalid_argument("sample_tokens: positions must be int32 [B, N]");
  if (detect_isa() == Isa::none) throw std::runtime_error("sample_tokens: the CPU lacks AVX2/FMA");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({B, N}, mx::int32, std::make_shared<SampleTokens>(s), {logits, temperatures, seeds, positions});
}

void SampleTokens::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  auto weak = task_inputs(encoder, inputs, out);  // before out.data(): it allocates out
  encoder.dispatch([in = std::move(weak), yp = out.data<int32_t>()]() {
    std::vector<float> lc, tc;
    std::vector<uint32_t> sc;
    std::vector<int32_t> pc;
    const float* lp = row_major(in[0], lc);
    const float* tp = row_major(in[1], tc);
    const uint32_t* sp = row_major(in[2], sc);
    const int32_t* pp = row_major(in[3], pc);
    const int N = in[0].shape(1), V = in[0].shape(2);
    const int64_t rows = static_cast<int64_t>(in[0].shape(0)) * N;
    // A row's vocabulary in spans (a width-1 verify has 2 rows for 2 threads), each span's
    // best kept, then combined in span order: the same token as one pass over the row.
    const int span = std::min(V, kSpan);
    const int spans = (V + span - 1) / span;
    std::vector<ArgBest> best(static_cast<size_t>(rows) * spans);
    auto pass = detect_isa() == Isa::avx512 ? sample_span_avx512 : sample_span_avx2;
    auto body = [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = t / spans;
        const int v0 = static_cast<int>(t % spans) * span, v1 = std::min(V, v0 + span);
        const float temp = tp[r / N];
        // as `mx.maximum(T, 1e-6)`, then the division: the same float32 divisor
        const float denom = temp > 0.0f ? std::max(temp, 1e-6f) : 0.0f;
        best[t] = pass(gumbel_key(sp[r / N], static_cast<uint32_t>(pp[r])), lp + r * V, denom, v0, v1);
      }
    };
    pool().split(rows * spans, span, kAlone, body);
    for (int64_t r = 0; r < rows; ++r) {
      ArgBest b = best[r * spans];
      for (int s = 1; s < spans; ++s) {
        const ArgBest& c = best[r * spans + s];
        if (arg_beats(c.value, c.index, b.value, b.index)) b = c;
      }
      yp[r] = b.index;
    }
  });
}

void SampleTokens::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchSampleTokens runs on the CPU only");
}

}  // namespace specbatch
