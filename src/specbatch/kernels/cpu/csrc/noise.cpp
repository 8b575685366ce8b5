#include "noise.h"

#include <algorithm>
#include <stdexcept>

#include "gemv.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "pool.h"
#include "strided.h"

namespace specbatch {

namespace {
uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}
}  // namespace

uint32_t gumbel_key(uint32_t seed, uint32_t position) {
  return fmix32(seed ^ fmix32(position * 0x9e3779b9u + 0x7f4a7c15u));
}

bool arg_beats(float a, int ia, float b, int ib) {
  if (a != a || b != b) return a != a && (b == b || ia < ib);
  return a > b || (a == b && ia < ib);
}

mx::array gumbel(const mx::array& seeds, const mx::array& positions, int vocab) {
  if (seeds.dtype() != mx::uint32 || seeds.ndim() != 1)
    throw std::invalid_argument("gumbel: seeds must be uint32 [B]");
  if (positions.dtype() != mx::int32 || positions.ndim() != 2 || positions.shape(0) != seeds.shape(0))
    throw std::invalid_argument("gumbel: positions must be int32 [B, N]");
  if (vocab < 1) throw std::invalid_argument("gumbel: vocab must be positive");
  if (detect_isa() == Isa::none) throw std::runtime_error("gumbel: the CPU lacks AVX2/FMA");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array({positions.shape(0), positions.shape(1), vocab}, mx::float32,
                   std::make_shared<Gumbel>(s, vocab), {seeds, positions});
}

void Gumbel::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& seeds = inputs[0];
  const auto& positions = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(seeds);
  encoder.set_input_array(positions);
  encoder.set_output_array(out);
  encoder.dispatch([seeds, positions, yp = out.data<float>(), V = vocab_]() {
    std::vector<uint32_t> sc;
    std::vector<int32_t> pc;
    const uint32_t* sp = row_major(seeds, sc);
    const int32_t* pp = row_major(positions, pc);
    const int N = positions.shape(1);
    const int64_t rows = static_cast<int64_t>(positions.shape(0)) * N;
    auto row = detect_isa() == Isa::avx512 ? gumbel_row_avx512 : gumbel_row_avx2;
    auto body = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        row(gumbel_key(sp[r / N], static_cast<uint32_t>(pp[r])), yp + r * V, V);
    };
    pool().split(rows, 1, 2, body);  // one row: a pool wake costs about what it saves
  });
}

void Gumbel::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("SpecbatchGumbel runs on the CPU only");
}

}  // namespace specbatch
