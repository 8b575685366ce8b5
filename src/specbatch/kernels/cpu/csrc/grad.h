// Gradients of a kernel op through MLX's own ops (training a model whose layers were swapped).
#pragma once

#include <functional>
#include <vector>

#include "mlx/array.h"
#include "mlx/transforms.h"

namespace specbatch {

namespace mx = mlx::core;

// The cotangents' vjp through `f` (the op written in MLX ops), for the inputs in `argnums`.
inline std::vector<mx::array> vjp_through(
    const std::function<std::vector<mx::array>(const std::vector<mx::array>&)>& f,
    const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents, const std::vector<int>& argnums) {
  auto grads = mx::vjp(f, primals, cotangents).second;
  std::vector<mx::array> picked;
  for (int arg : argnums) picked.push_back(grads[arg]);
  return picked;
}

}  // namespace specbatch
