// The collective the expert-parallel MoE layer needs from its process group (docs/design.md section
// 16): an all-to-all of rows. The library ships no transport; a program implements this over NCCL,
// MPI or whatever it trains with (the PyTorch layer uses torch.distributed itself).
#pragma once

#include <cstdint>
#include <vector>

#include "moe_engine/device.hpp"
#include "moe_engine/tensor.hpp"

namespace moe {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // this process's rank in the group, in [0, size())
  virtual int size() const = 0;  // the group's ranks P

  // An all-to-all of rows, collective: every rank of the group calls it, in the same order.
  // `send` and `recv` are contiguous [rows, ...] tensors of one dtype and row shape on every rank, on
  // the layer's device. send's rows are grouped by destination in rank order: send_rows[p] rows go to
  // rank p (their sum at most send's rows); recv gets recv_rows[s] rows from rank s, grouped in rank
  // order from its first row (their sum at most recv's rows). send_rows[p] on this rank equals
  // recv_rows[rank] on rank p. Stream-ordered: reads send after the work already on `stream`, and
  // work enqueued on `stream` afterwards sees recv (an implementation may also block the host).
  virtual void all_to_all(const TensorView& send, const std::vector<int64_t>& send_rows, const TensorView& recv,
                          const std::vector<int64_t>& recv_rows, Stream stream) = 0;
};

}  // namespace moe
