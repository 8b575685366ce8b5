#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "attention.h"
#include "gemv.h"
#include "linear.h"
#include "mlx/version.h"
#include "pool.h"

namespace nb = nanobind;

NB_MODULE(_ext, m) {
  m.doc() = "specbatch's CPU kernels as MLX primitives";
  m.def("small_linear", &specbatch::small_linear, nb::arg("x"), nb::arg("w"),
        "y = x @ w.T for up to 32 rows of x (float32, CPU), weights read once for all rows");
  m.def("attention", &specbatch::attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
        nb::arg("mask_kind"), nb::arg("mask"),
        "softmax(q k^T * scale) v over a strided KV; mask_kind '', 'causal' or 'array' (bool mask)");
  m.def("isa", [] { return specbatch::isa_name(specbatch::detect_isa()); });
  m.def("threads", [] { return specbatch::pool().size(); });
  // the MLX this was compiled against; the loader refuses to run beside another one
  m.attr("built_for_mlx") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) +
                            "." + std::to_string(MLX_VERSION_PATCH);
  m.attr("max_rows") = specbatch::kMaxRows;
}
