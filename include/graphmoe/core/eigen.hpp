// graphmoe/core/eigen.hpp: Eigen maps over CPU tensors (host code only).
#pragma once

#include <Eigen/Core>

#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using MatrixMap = Eigen::Map<RowMatrix<T>, Eigen::Unaligned>;
template <class T>
using VectorMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>, Eigen::Unaligned>;

// The tensor as a (rows, cols) row-major matrix: all dimensions but the last are flattened.
template <class T>
MatrixMap<T> as_matrix(const Tensor<T, cpu>& t) {
  return MatrixMap<T>(t.data(), t.rows(), t.cols());
}
// The tensor as a (rows, cols) matrix with an explicit split of its elements.
template <class T>
MatrixMap<T> as_matrix(const Tensor<T, cpu>& t, index_t rows, index_t cols) {
  GRAPHMOE_CHECK(rows * cols == t.numel(), "as_matrix", "cannot view shape ", t.shape(), " as (",
                 rows, ", ", cols, ")");
  return MatrixMap<T>(t.data(), rows, cols);
}
template <class T>
VectorMap<T> as_vector(const Tensor<T, cpu>& t) {
  return VectorMap<T>(t.data(), t.numel());
}

}  // namespace graphmoe
