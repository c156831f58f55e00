// graphmoe/core/shape.hpp: the shape of a contiguous row-major tensor (rank 0 to kMaxRank).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <sstream>
#include <string>

#include "graphmoe/config.hpp"

namespace graphmoe {

using index_t = std::int64_t;

class Shape {
 public:
  static constexpr int kMaxRank = 6;

  Shape() = default;
  Shape(std::initializer_list<index_t> dims) {
    GRAPHMOE_CHECK(dims.size() <= static_cast<std::size_t>(kMaxRank), "Shape", "rank ",
                   dims.size(), " exceeds the maximum rank ", kMaxRank);
    for (index_t d : dims) {
      GRAPHMOE_CHECK(d >= 0, "Shape", "negative size ", d, " in a shape");
      dims_[static_cast<std::size_t>(rank_++)] = d;
    }
  }
  template <class It>
  static Shape from_range(It first, It last) {
    Shape s;
    for (; first != last; ++first) {
      GRAPHMOE_CHECK(s.rank_ < kMaxRank, "Shape", "rank exceeds the maximum rank ", kMaxRank);
      GRAPHMOE_CHECK(*first >= 0, "Shape", "negative size ", *first, " in a shape");
      s.dims_[static_cast<std::size_t>(s.rank_++)] = static_cast<index_t>(*first);
    }
    return s;
  }

  int rank() const { return rank_; }
  index_t operator[](int i) const { return dims_[static_cast<std::size_t>(i)]; }
  // Size of dimension i; negative i counts from the back (-1 is the last dimension).
  index_t dim(int i) const {
    int j = i < 0 ? rank_ + i : i;
    GRAPHMOE_CHECK(j >= 0 && j < rank_, "Shape::dim", "dimension ", i, " out of range for shape ",
                   *this);
    return dims_[static_cast<std::size_t>(j)];
  }
  index_t numel() const {
    index_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[static_cast<std::size_t>(i)];
    return n;
  }
  // Product of all dimensions but the last: the number of rows when viewed as a matrix (also when
  // the last dimension is 0: a (5, 0) matrix has 5 rows).
  index_t rows() const {
    index_t n = 1;
    for (int i = 0; i + 1 < rank_; ++i) n *= dims_[static_cast<std::size_t>(i)];
    return n;
  }
  // The last dimension (1 for a scalar).
  index_t cols() const { return rank_ == 0 ? 1 : dims_[static_cast<std::size_t>(rank_ - 1)]; }
  const index_t* begin() const { return dims_.data(); }
  const index_t* end() const { return dims_.data() + rank_; }

  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a.dims_[static_cast<std::size_t>(i)] != b.dims_[static_cast<std::size_t>(i)]) return false;
    return true;
  }
  friend std::ostream& operator<<(std::ostream& os, const Shape& s) {
    os << '(';
    for (int i = 0; i < s.rank_; ++i) os << (i ? ", " : "") << s.dims_[static_cast<std::size_t>(i)];
    return os << ')';
  }
  std::string str() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  std::array<index_t, kMaxRank> dims_{};
  int rank_ = 0;
};

}  // namespace graphmoe
