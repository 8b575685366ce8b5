// A single-output op's task, set up as MLX's own CPU ops set theirs up.
#pragma once

#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace specbatch {

namespace mx = mlx::core;

// Allocates `out`, registers it and `inputs` with the stream's encoder, and returns weak copies
// of the inputs for the task to capture: MLX keeps their buffers until the task has run, and a
// held reference would keep a paged cache's pool from being donated to the next write.
inline std::vector<mx::array> task_inputs(mx::cpu::CommandEncoder& encoder, const std::vector<mx::array>& inputs,
                                          mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  std::vector<mx::array> weak;
  for (const auto& in : inputs) weak.push_back(mx::array::unsafe_weak_copy(in));
  return weak;
}

}  // namespace specbatch
