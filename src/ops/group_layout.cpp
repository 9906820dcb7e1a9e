// The group layout's device work: offsets computed from splits where the splits live (validated
// and, on CUDA, sanitized and reported), and the zeroing of unrouted rows. Dispatch by device.
#include <algorithm>
#include <cstring>

#include "core/cuda_api.hpp"
#include "moe_engine/config.hpp"
#include "moe_engine/group_layout.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif

namespace moe {

namespace {
template <class T>
void compute_offsets_cpu(const T* splits, int64_t num_groups, int64_t capacity, int64_t* offsets) {
  int64_t total = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t s = int64_t(splits[g]);
    MOE_CHECK(s >= 0, ErrorCode::kInvalidArgument, "GroupLayout: splits[", g, "] = ", s,
              " is negative (expected every split >= 0)");
    MOE_CHECK(s <= capacity - total, ErrorCode::kInvalidArgument,
              "GroupLayout: sum(splits) exceeds "
              "the buffer capacity T = ",
              capacity, " at expert ", g, " (expected sum(splits) <= T)");
    offsets[g] = total;
    total += s;
  }
  offsets[num_groups] = total;
}
}  // namespace

GroupLayout GroupLayout::compute(const TensorView& splits, int64_t capacity,
                                 const TensorView& offsets, DeviceErrorFlag* errors,
                                 Stream stream) {
  MOE_CHECK(splits.defined() && splits.dim() == 1, ErrorCode::kShape,
            "GroupLayout: splits: expected a 1-D [G] tensor, got ", splits.describe());
  MOE_CHECK(splits.dtype() == DType::kInt64 || splits.dtype() == DType::kInt32, ErrorCode::kDType,
            "GroupLayout: splits: expected int64 or int32, got ", dtype_name(splits.dtype()));
  MOE_CHECK(splits.is_contiguous(), ErrorCode::kShape,
            "GroupLayout: splits must be contiguous, got ", splits.describe());
  const int64_t G = splits.size(0);
  MOE_CHECK(G >= 1, ErrorCode::kShape, "GroupLayout: expected G >= 1 experts, got splits ",
            splits.describe());
  MOE_CHECK(capacity >= 0, ErrorCode::kInvalidArgument, "GroupLayout: capacity T = ", capacity,
            " is negative");
  MOE_CHECK(offsets.defined() && offsets.dim() == 1 && offsets.size(0) == G + 1, ErrorCode::kShape,
            "GroupLayout: offsets: expected a 1-D [G+1] = [", G + 1, "] tensor, got ",
            offsets.describe());
  MOE_CHECK(offsets.dtype() == DType::kInt64, ErrorCode::kDType,
            "GroupLayout: offsets: expected int64, got ", dtype_name(offsets.dtype()));
  MOE_CHECK(offsets.is_contiguous(), ErrorCode::kShape,
            "GroupLayout: offsets must be contiguous, got ", offsets.describe());
  MOE_CHECK(offsets.device() == splits.device(), ErrorCode::kDevice, "GroupLayout: offsets are on ",
            to_string(offsets.device()), " but splits on ", to_string(splits.device()),
            "; expected the same device");
  {
    const auto* s0 = static_cast<const uint8_t*>(splits.data());
    const auto* o0 = static_cast<const uint8_t*>(offsets.data());
    MOE_CHECK(o0 >= s0 + splits.nbytes() || s0 >= o0 + offsets.nbytes(), ErrorCode::kInvalidArgument,
              "GroupLayout: offsets overlap splits in memory; expected separate buffers");
  }
  MOE_CHECK(errors == nullptr || errors->device() == splits.device(), ErrorCode::kDevice,
            "GroupLayout: the error flag is on ", to_string(errors ? errors->device() : Device{}),
            " but splits on ", to_string(splits.device()), "; expected the same device");

  GroupLayout layout;
  layout.splits_ = splits;
  layout.offsets_ = offsets;
  layout.num_groups_ = G;
  layout.capacity_ = capacity;
  layout.error_record_ = errors ? errors->record() : nullptr;

  auto* off = offsets.data_as<int64_t>();
  if (splits.device().is_cpu()) {
    if (splits.dtype() == DType::kInt64)
      compute_offsets_cpu(splits.data_as<int64_t>(), G, capacity, off);
    else
      compute_offsets_cpu(splits.data_as<int32_t>(), G, capacity, off);
    return layout;
  }
  MOE_CHECK(errors != nullptr, ErrorCode::kInvalidArgument,
            "GroupLayout: on CUDA a DeviceErrorFlag is required: bad splits cannot be reported "
            "otherwise");
#if MOE_ENGINE_WITH_CUDA
  const cuda_api::ScopedDevice scoped(splits.device().index);
  cuda::launch_group_offsets(splits.data(), splits.dtype() == DType::kInt32, G, capacity, off,
                             errors->record(), stream);
#else
  (void)stream;
  throw_error(ErrorCode::kNotImplemented, "GroupLayout: this build has no CUDA backend");
#endif
  return layout;
}

void zero_unrouted_rows(const TensorView& t, const GroupLayout& groups, Stream stream) {
  MOE_CHECK(t.defined(), ErrorCode::kShape, "zero_unrouted_rows: expected a [T = ", groups.capacity(),
            ", ...] tensor, got an undefined one");
  zero_unrouted_rows(std::span<const TensorView>(&t, 1), groups, stream);
}

void zero_unrouted_rows(std::span<const TensorView> tensors, const GroupLayout& groups, Stream stream) {
  MOE_CHECK(groups.defined(), ErrorCode::kInvalidArgument, "zero_unrouted_rows: the group layout is undefined");
  for (const TensorView& t : tensors) {  // all checked before any is written
    if (!t.defined()) continue;
    MOE_CHECK(t.dim() >= 1 && t.size(0) == groups.capacity(), ErrorCode::kShape,
              "zero_unrouted_rows: expected a [T = ", groups.capacity(), ", ...] tensor, got ", t.describe());
    MOE_CHECK(t.is_contiguous(), ErrorCode::kShape, "zero_unrouted_rows: expected a contiguous tensor, got ",
              t.describe());
    MOE_CHECK(t.device() == groups.device(), ErrorCode::kDevice, "zero_unrouted_rows: the tensor is on ",
              to_string(t.device()), " but the routing on ", to_string(groups.device()));
  }
  const auto* end = groups.offsets().data_as<int64_t>() + groups.num_groups();
  const auto row_bytes_of = [](const TensorView& t) { return t.size(0) == 0 ? 0 : int64_t(t.nbytes()) / t.size(0); };
  if (groups.device().is_cpu()) {
    for (const TensorView& t : tensors) {
      if (!t.defined()) continue;
      const int64_t rows = t.size(0), row_bytes = row_bytes_of(t), first = std::clamp<int64_t>(*end, 0, rows);
      std::memset(static_cast<uint8_t*>(t.data()) + first * row_bytes, 0, size_t((rows - first) * row_bytes));
    }
    return;
  }
#if MOE_ENGINE_WITH_CUDA
  const cuda_api::ScopedDevice scoped(groups.device().index);
  cuda::ZeroTailTargets targets;
  for (const TensorView& t : tensors) {
    if (!t.defined()) continue;
    if (targets.count == cuda::ZeroTailTargets::kMaxTargets) {
      cuda::launch_zero_unrouted_rows(targets, end, stream);
      targets.count = 0;
    }
    targets.data[targets.count] = static_cast<uint8_t*>(t.data());
    targets.rows[targets.count] = t.size(0);
    targets.row_bytes[targets.count] = row_bytes_of(t);
    ++targets.count;
  }
  if (targets.count > 0) cuda::launch_zero_unrouted_rows(targets, end, stream);
#else
  (void)stream;
  throw_error(ErrorCode::kNotImplemented, "zero_unrouted_rows: this build has no CUDA backend");
#endif
}

}  // namespace moe
