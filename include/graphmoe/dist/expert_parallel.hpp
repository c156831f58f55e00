// graphmoe/dist/expert_parallel.hpp: moving an MoE layer's token rows to the ranks that hold
// their experts, and back (expert parallelism; docs/distributed.md "Expert parallel").
//
// With W ranks and E experts (E a multiple of W), rank r holds experts [r E / W, (r + 1) E / W)
// (expert_shard). Every rank routes its own tokens with its own copy of the router, so the token
// graph (similarity or attention) is computed where the sequences live, before anything moves.
// The layer's dispatch plan groups the rows by global expert id, so the rows for rank r's experts
// are one contiguous block of xs: the send buffer is xs itself, in rank order, with no copy.
//
//   dispatch  (forward, and backward for dys):
//     1. counts: an all-to-all-v of E / W integers per rank: how many rows of each of the
//        receiver's experts the sender has (once per forward; the backward reuses them);
//     2. rows: an all-to-all-v of xs's first offset(E) rows (the capacity-drop bucket, if any,
//        stays home); rank r receives, from each sender in rank order, that sender's rows for
//        r's experts, grouped by expert;
//     3. a local plan (make_dispatch_plan on the received rows' local expert ids, a stable sort)
//        regroups them by local expert, senders in rank order within each expert: the rows the
//        ExpertBank takes.
//   combine  (forward for ys, backward for dxs): the exact reverse: ungroup with the local plan,
//     an all-to-all-v back with the counts swapped, and zero the drop bucket's rows.
//
// Every step is a copy of whole rows: the experts see the same rows and the sender gets back the
// same results as in one process (the only difference to one process is the order in which an
// expert's GEMM meets its rows, which changes float sums in the last bits, and none at all for the
// copies). Bytes per forward on each rank: D sizeof(T) x (rows sent + rows received) for xs, the
// same again for ys, and twice that in the backward; plus E / W integers each way for the counts.
#pragma once

#include <cstdint>
#include <numeric>
#include <vector>

#include "graphmoe/core/communicator.hpp"
#include "graphmoe/ops/dispatch.hpp"

namespace graphmoe::dist {

// The experts [first, first + count) that `rank` of `world` holds in a layer of num_experts: equal
// contiguous blocks. num_experts must be a multiple of the world size.
struct ExpertShard {
  index_t first = 0, count = 0;
};
inline ExpertShard expert_shard(index_t num_experts, int rank, int world) {
  GRAPHMOE_CHECK(world >= 1 && rank >= 0 && rank < world, "dist::expert_shard", "rank ", rank,
                 " out of range for a world of ", world);
  GRAPHMOE_CHECK(num_experts >= world && num_experts % world == 0, "dist::expert_shard",
                 num_experts, " experts do not split into ", world,
                 " equal shards: the number of experts must be a multiple of the number of "
                 "expert-parallel ranks");
  const index_t per = num_experts / world;
  return {rank * per, per};
}

// B: the backend of the rows (their memory must be the communicator's: MoELayer checks it).
template <class T, class B = cpu>
class ExpertExchange {
 public:
  // xs (S, D) is grouped by `plan` (global expert ids 0 .. E - 1, then possibly the drop bucket
  // E). Sends each expert's rows to its rank and assigns lxs (R, D): the rows this rank's experts
  // take, grouped by local expert as local_plan() says. R can be 0 (lxs is then left empty).
  // Collective.
  void dispatch(Communicator& comm, const DispatchPlan<B>& plan, index_t num_experts,
                const Tensor<T, B>& xs, Tensor<T, B>& lxs) {
    constexpr const char* op = "dist::ExpertExchange::dispatch";
    const int world = comm.size();
    const ExpertShard mine = expert_shard(num_experts, comm.rank(), world);
    GRAPHMOE_CHECK(plan.num_experts == num_experts || plan.num_experts == num_experts + 1, op,
                   "the plan has ", plan.num_experts, " experts, expected ", num_experts,
                   " (or one more, the drop bucket)");
    GRAPHMOE_CHECK(!xs.empty() && xs.rank() == 2 && xs.rows() == plan.num_slots(), op,
                   "xs has shape ", xs.shape(), ", expected (", plan.num_slots(), ", D)");
    const index_t per = mine.count, d = xs.cols();
    d_ = d;
    slots_ = plan.num_slots();
    sent_rows_ = plan.offset(num_experts);
    // 1. how many rows of each of rank r's experts this rank has, and the same from every sender
    std::vector<index_t> mine_counts(static_cast<std::size_t>(num_experts));
    for (index_t e = 0; e < num_experts; ++e) mine_counts[static_cast<std::size_t>(e)] = plan.count(e);
    const std::vector<index_t> per_rank(static_cast<std::size_t>(world), per);
    received_.assign(static_cast<std::size_t>(world * per), 0);
    comm.all_to_all_v(mine_counts, per_rank, received_, per_rank);
    send_.assign(static_cast<std::size_t>(world), 0);
    recv_.assign(static_cast<std::size_t>(world), 0);
    recv_rows_ = 0;
    for (int r = 0; r < world; ++r) {
      for (index_t j = 0; j < per; ++j) {
        const auto i = static_cast<std::size_t>(r * per + j);
        send_[static_cast<std::size_t>(r)] += mine_counts[i] * d;
        recv_[static_cast<std::size_t>(r)] += received_[i] * d;
        recv_rows_ += received_[i];
      }
    }
    // 3. (before 2, so that the buffers are sized) the local plan over the received rows
    if (recv_rows_ > 0) {
      if (buf_.empty() || buf_.rows() != recv_rows_ || buf_.cols() != d) {
        buf_ = Tensor<T, B>(Shape{recv_rows_, d});
      }
      Tensor<std::int32_t, cpu> ids(Shape{recv_rows_, 1});
      index_t row = 0;
      for (int r = 0; r < world; ++r) {
        for (index_t j = 0; j < per; ++j) {
          const index_t c = received_[static_cast<std::size_t>(r * per + j)];
          for (index_t i = 0; i < c; ++i) ids.data()[row++] = static_cast<std::int32_t>(j);
        }
      }
      // the ids in B's memory (copy_from_host: the elementwise op of the tensors' backend)
      const Tensor<std::int32_t, B> local_ids(ids.shape());
      copy_from_host(local_ids, ids);
      make_dispatch_plan(local_ids, per, local_);
    } else {
      buf_ = Tensor<T, B>();
      local_ = DispatchPlan<B>{};
    }
    // 2. the rows
    move_in(comm, xs, lxs);
  }

  // The backward's dispatch: dys (S, D) grouped as the forward's xs -> ldys (R, D), with the
  // forward's counts. Collective.
  void dispatch_again(Communicator& comm, const Tensor<T, B>& dys, Tensor<T, B>& ldys) {
    GRAPHMOE_CHECK(!send_.empty(), "dist::ExpertExchange::dispatch_again",
                   "no dispatch() before it (backward before forward?)");
    move_in(comm, dys, ldys);
  }

  // lys (R, D), grouped by local_plan() -> ys (S, D) assigned: every row back on the rank and in
  // the slot it came from; the drop bucket's rows set to zero. Collective.
  void combine(Communicator& comm, const Tensor<T, B>& lys, Tensor<T, B>& ys) {
    constexpr const char* op = "dist::ExpertExchange::combine";
    GRAPHMOE_CHECK(!send_.empty(), op, "no dispatch() before it");
    prepare_output(op, "ys", ys, Shape{slots_, d_});
    if (recv_rows_ > 0) {
      check_shape(op, "lys", lys, Shape{recv_rows_, d_});
      dispatch_backward(local_, lys, buf_);  // ungroup: a copy per row (k = 1)
    }
    comm.all_to_all_v(buf_.data(), recv_rows_ * d_, recv_, ys.data(), ys.numel(), send_,
                      element_type_of<T>);
    if (slots_ > sent_rows_) ys.slice(sent_rows_, slots_).zero();
  }

  // The plan of the rows this rank's experts received (valid when received_rows() > 0).
  const DispatchPlan<B>& local_plan() const { return local_; }
  index_t received_rows() const { return recv_rows_; }
  index_t sent_rows() const { return sent_rows_; }
  // received_counts()[r E/W + j]: rows rank r sent to this rank's expert j (the last dispatch).
  const std::vector<index_t>& received_counts() const { return received_; }

 private:
  void move_in(Communicator& comm, const Tensor<T, B>& rows, Tensor<T, B>& local) {
    constexpr const char* op = "dist::ExpertExchange";
    check_shape(op, "rows", rows, Shape{slots_, d_});
    comm.all_to_all_v(rows.data(), rows.numel(), send_, buf_.data(), recv_rows_ * d_, recv_,
                      element_type_of<T>);
    if (recv_rows_ > 0) {
      if (!local.empty() && local.shape() != buf_.shape()) local = Tensor<T, B>();
      dispatch_forward(local_, buf_, local);  // group by local expert: a copy per row
    } else {
      local = Tensor<T, B>();
    }
  }

  index_t d_ = 0, slots_ = 0, sent_rows_ = 0, recv_rows_ = 0;
  std::vector<index_t> send_, recv_;  // elements to / from each rank
  std::vector<index_t> received_;     // rows per (sender, local expert)
  DispatchPlan<B> local_;
  Tensor<T, B> buf_;  // the received rows in arrival order
};

}  // namespace graphmoe::dist
