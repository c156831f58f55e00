// graphmoe/backend/cpu/heads.hpp: the CPU system's key/value head sharing and head joins and
// splits (contract and argument checks: ops/heads.hpp, which calls these through the backend tag).
#pragma once

#include <algorithm>

#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

template <class T>
void repeat_heads(cpu, const Tensor<T, cpu>& x, index_t kv_heads, index_t heads,
                  Tensor<T, cpu>& y) {
  const index_t n = x.rows(), dh = x.cols() / kv_heads, g = heads / kv_heads;
  for (index_t i = 0; i < n; ++i) {
    const T* xr = x.data() + i * kv_heads * dh;
    T* yr = y.data() + i * heads * dh;
    for (index_t h = 0; h < heads; ++h) std::copy(xr + (h / g) * dh, xr + (h / g + 1) * dh, yr + h * dh);
  }
}

template <class T>
void repeat_heads_backward(cpu, const Tensor<T, cpu>& dy, index_t kv_heads, index_t heads,
                           Tensor<T, cpu>& dx) {
  const index_t n = dy.rows(), dh = dy.cols() / heads, g = heads / kv_heads;
  for (index_t i = 0; i < n; ++i) {
    const T* dyr = dy.data() + i * heads * dh;
    T* dxr = dx.data() + i * kv_heads * dh;
    for (index_t c = 0; c < kv_heads; ++c)
      for (index_t j = 0; j < dh; ++j) {
        T s = dyr[(c * g) * dh + j];
        for (index_t r = 1; r < g; ++r) s += dyr[(c * g + r) * dh + j];
        dxr[c * dh + j] = s;
      }
  }
}

template <class T>
void concat_heads(cpu, const Tensor<T, cpu>& a, const Tensor<T, cpu>& b, index_t heads,
                  Tensor<T, cpu>& y) {
  const index_t n = a.rows(), wa = a.cols() / heads, wb = b.cols() / heads, w = wa + wb;
  for (index_t i = 0; i < n; ++i)
    for (index_t h = 0; h < heads; ++h) {
      T* yr = y.data() + i * heads * w + h * w;
      std::copy_n(a.data() + i * heads * wa + h * wa, wa, yr);
      std::copy_n(b.data() + i * heads * wb + h * wb, wb, yr + wa);
    }
}

template <class T>
void split_heads(cpu, const Tensor<T, cpu>& x, index_t heads, index_t width_a, Tensor<T, cpu>& a,
                 Tensor<T, cpu>& b) {
  const index_t n = x.rows(), w = x.cols() / heads, wa = width_a, wb = w - wa;
  for (index_t i = 0; i < n; ++i)
    for (index_t h = 0; h < heads; ++h) {
      const T* xr = x.data() + i * heads * w + h * w;
      std::copy_n(xr, wa, a.data() + i * heads * wa + h * wa);
      std::copy_n(xr + wa, wb, b.data() + i * heads * wb + h * wb);
    }
}

}  // namespace graphmoe
