// The group layout: how the packed token matrix is split among G experts. `splits[G]` lives on
// the device with the tokens; the exclusive prefix sum `offsets[G+1]` is computed there too, so no
// op ever reads splits on the host (the contract that makes everything CUDA-graph safe).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "moe_engine/device.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/tensor.hpp"

namespace moe {

// What kernels report about their inputs. Lives in device memory; written by kernels, read by
// DeviceErrorFlag::check on the host outside graph capture.
enum DeviceErrorBits : uint32_t {
  kNegativeSplit = 1u << 0,          // some splits[g] < 0
  kSplitsExceedCapacity = 1u << 1,   // sum(splits) > capacity T
  kExpertIndexOutOfRange = 1u << 2,  // some routing index (permute_plan's indices) not in [0, E)
  kRowOutOfRange = 1u << 3,          // some row_of entry (the permute ops) neither -1 nor a routed row
};

// One bad entry [token, choice] of a [T, k] routing tensor.
struct DeviceErrorEntry {
  int64_t token;   // t
  int64_t choice;  // j
  int64_t value;   // the entry
  int64_t bound;   // what it must be below: E for an index, offsets[G] for a row
};

// Each kind of error keeps the details of the first report of that kind.
struct DeviceErrorRecord {
  uint32_t bits;     // DeviceErrorBits of every error since the last check
  int32_t group;     // splits errors: the first negative split's expert (or -1)
  int64_t value;     //   its split value
  int64_t total;     //   sum of the non-negative splits (saturated at INT64_MAX)
  int64_t capacity;  //   the buffer capacity T
  DeviceErrorEntry index;  // kExpertIndexOutOfRange: an index outside [0, E)
  DeviceErrorEntry row;    // kRowOutOfRange: a row_of entry outside [0, offsets[G]), not -1
};

// Owns one DeviceErrorRecord on a device (host memory for the CPU).
class MOE_API DeviceErrorFlag {
 public:
  explicit DeviceErrorFlag(Device device = Device::cpu());
  Device device() const { return record_.device(); }
  DeviceErrorRecord* record() const { return record_.data_as<DeviceErrorRecord>(); }

  // Waits for `stream`, reads the record and clears it. Returns the record as it was.
  // Must not be called while `stream` is being captured into a CUDA graph (throws
  // kInvalidArgument).
  DeviceErrorRecord read_and_clear(Stream stream = nullptr);
  // read_and_clear, then throws Error(kDeviceReported, <what was wrong>) if any bit was set.
  void check(Stream stream = nullptr);

 private:
  Tensor record_;
};

// Human-readable text for a record ("splits[3] = -2 is negative ..."); empty if no bit is set.
MOE_API std::string describe_device_errors(const DeviceErrorRecord& record);

// A view of one routing: splits, their device-computed offsets and the buffer capacity T.
// Rows [offsets[g], offsets[g+1]) belong to expert g; rows past offsets[G] belong to none and are
// never written by any op.
class MOE_API GroupLayout {
 public:
  GroupLayout() = default;

  // Computes offsets ([G+1] int64, on the splits' device) from splits ([G] int64 or int32), G >= 1.
  // - CPU: synchronously; negative splits or sum(splits) > capacity throw kInvalidArgument.
  // - CUDA: one kernel on `stream`, fixed launch shape, graph safe. Bad splits are sanitized
  //   (negative -> 0, offsets clamped to [0, capacity], so nothing downstream can go out of bounds)
  //   and reported through `errors` (required on CUDA), which the host checks outside capture.
  static GroupLayout compute(const TensorView& splits, int64_t capacity, const TensorView& offsets,
                             DeviceErrorFlag* errors = nullptr, Stream stream = nullptr);

  bool defined() const { return num_groups_ > 0; }
  int64_t num_groups() const { return num_groups_; }
  int64_t capacity() const { return capacity_; }
  const TensorView& splits() const { return splits_; }
  const TensorView& offsets() const { return offsets_; }
  Device device() const { return offsets_.device(); }
  DeviceErrorRecord* error_record() const { return error_record_; }

 private:
  TensorView splits_;
  TensorView offsets_;
  int64_t num_groups_ = 0;
  int64_t capacity_ = 0;
  DeviceErrorRecord* error_record_ = nullptr;
};

// Zeroes rows [offsets[G], T) of t ([T, ...], rows contiguous, on the layout's device): the rows
// no expert owns, which no op writes. Fresh outputs of the PyTorch layer get defined zeros there
// (the gradient of an unrouted row is exactly zero). On CUDA one kernel of fixed shape that reads
// offsets[G] on the device: graph safe; with sum(splits) == T it writes nothing.
MOE_API void zero_unrouted_rows(const TensorView& t, const GroupLayout& groups, Stream stream = nullptr);

// The same for several tensors of one routing (undefined views are skipped): one kernel on CUDA.
MOE_API void zero_unrouted_rows(std::span<const TensorView> tensors, const GroupLayout& groups,
                                Stream stream = nullptr);

}  // namespace moe
