// Second translation unit of the consumer: a non-inline function in any graphmoe header would
// now be defined twice and fail to link.
#include <graphmoe/graphmoe.hpp>

float sum_of(const graphmoe::Tensor<float>& t) {
  float s = 0;
  for (graphmoe::index_t i = 0; i < t.numel(); ++i) s += t.data()[i];
  return s;
}
