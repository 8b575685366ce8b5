// Inputs read as row-major buffers. Wrapping each input in mx::contiguous made one more
// graph node per input (664 of a decode step's 1,478), though nearly all of them already
// are contiguous; the kernels check when they run and copy only the rare strided one.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace specbatch {

namespace mx = mlx::core;

// a's elements in row-major order: its own buffer where it is row-contiguous, else `copy`.
template <typename T>
const T* row_major(const mx::array& a, std::vector<T>& copy) {
  if (a.flags().row_contiguous) return a.data<T>();
  copy.resize(a.size());
  const T* src = a.data<T>();
  std::vector<int> index(a.ndim(), 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t at = 0;
    for (int d = 0; d < a.ndim(); ++d) at += static_cast<int64_t>(index[d]) * a.strides(d);
    copy[i] = src[at];
    for (int d = a.ndim() - 1; d >= 0; --d) {  // the next index, last axis fastest
      if (++index[d] < a.shape(d)) break;
      index[d] = 0;
    }
  }
  return copy.data();
}

// A [n0, n1, n2, D] array's rows where D is contiguous: its own buffer and its first three
// strides; anything else copied row-major first (strides of the copy).
inline const float* rows_of(const mx::array& a, std::vector<float>& copy, int64_t* strides) {
  if (a.strides(3) == 1) {
    for (int i = 0; i < 3; ++i) strides[i] = a.strides(i);
    return a.data<float>();
  }
  const int n1 = a.shape(1), n2 = a.shape(2), n3 = a.shape(3);
  strides[0] = static_cast<int64_t>(n1) * n2 * n3, strides[1] = static_cast<int64_t>(n2) * n3, strides[2] = n3;
  return row_major(a, copy);
}

}  // namespace specbatch
