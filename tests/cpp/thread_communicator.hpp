// An in-process moe::Communicator for the expert-parallel tests: P ranks are P threads of one
// process sharing one group; all_to_all copies rows between the ranks' tensors (host memory, or one
// GPU's memory, every rank on its own stream) and blocks the host until every rank's copies are done.
// A test transport only: it cannot be captured in a CUDA graph (it waits on the host).
#pragma once

#include <barrier>
#include <memory>
#include <vector>

#include "moe_engine/communicator.hpp"
#include "moe_engine/runtime.hpp"
#include "moe_engine/tensor.hpp"

namespace moe::test {

class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), sync_(size), posts_(size_t(size)) {}
  int size() const { return size_; }

  struct Post {
    TensorView send;
    std::vector<int64_t> send_rows;
  };

  void all_to_all(int rank, const TensorView& send, const std::vector<int64_t>& send_rows, const TensorView& recv,
                  const std::vector<int64_t>& recv_rows, Stream stream) {
    synchronize(stream);  // send is complete before any peer reads it
    posts_[size_t(rank)] = {send, send_rows};
    sync_.arrive_and_wait();
    int64_t row_elems = 1;
    for (int d = 1; d < recv.dim(); ++d) row_elems *= recv.size(d);
    int64_t at = 0;
    for (int s = 0; s < size_; ++s) {
      const Post& p = posts_[size_t(s)];
      int64_t from = 0;
      for (int d = 0; d < rank; ++d) from += p.send_rows[size_t(d)];
      const int64_t n = recv_rows[size_t(s)];
      if (p.send_rows[size_t(rank)] != n) throw Error(ErrorCode::kInvalidArgument, "ThreadGroup: row counts differ");
      if (n > 0) copy_tensor(flat(recv, at, n, row_elems), flat(p.send, from, n, row_elems), stream);
      at += n;
    }
    synchronize(stream);  // recv is complete, and no peer's send is read any more
    sync_.arrive_and_wait();
  }

 private:
  static TensorView flat(const TensorView& t, int64_t row, int64_t rows, int64_t row_elems) {
    return TensorView(static_cast<char*>(t.data()) + row * row_elems * int64_t(t.element_size()), {rows * row_elems},
                      t.dtype(), t.device());
  }

  int size_;
  std::barrier<> sync_;
  std::vector<Post> posts_;
};

class ThreadCommunicator : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  void all_to_all(const TensorView& send, const std::vector<int64_t>& send_rows, const TensorView& recv,
                  const std::vector<int64_t>& recv_rows, Stream stream) override {
    group_->all_to_all(rank_, send, send_rows, recv, recv_rows, stream);
  }

 private:
  std::shared_ptr<ThreadGroup> group_;
  int rank_;
};

}  // namespace moe::test
