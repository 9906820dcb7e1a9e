#include "moe_engine/grouped_param.hpp"

namespace moe {

GroupedParam GroupedParam::packed(const TensorView& tensor) {
  MOE_CHECK(tensor.defined(), ErrorCode::kInvalidArgument,
            "GroupedParam::packed: undefined tensor");
  MOE_CHECK(tensor.dim() >= 2, ErrorCode::kShape,
            "GroupedParam::packed: expected a [G, ...] tensor of rank >= 2, got ",
            tensor.describe());
  MOE_CHECK(tensor.size(0) >= 1, ErrorCode::kShape,
            "GroupedParam::packed: expected G >= 1 experts, got ", tensor.describe());
  MOE_CHECK(tensor.is_contiguous(), ErrorCode::kShape,
            "GroupedParam::packed: expected a contiguous tensor, got ", tensor.describe());
  GroupedParam p;
  p.packed_ = tensor;
  p.num_groups_ = tensor.size(0);
  p.expert_shape_ = Shape(tensor.shape().begin() + 1, tensor.shape().end());
  p.dtype_ = tensor.dtype();
  p.device_ = tensor.device();
  return p;
}

GroupedParam GroupedParam::per_expert(std::vector<TensorView> experts, TensorView pointer_table) {
  MOE_CHECK(!experts.empty(), ErrorCode::kInvalidArgument,
            "GroupedParam::per_expert: expected G >= 1 tensors, got none");
  const TensorView& first = experts.front();
  for (size_t g = 0; g < experts.size(); ++g) {
    const TensorView& t = experts[g];
    MOE_CHECK(t.defined(), ErrorCode::kInvalidArgument, "GroupedParam::per_expert: tensor ", g,
              " is undefined");
    MOE_CHECK(t.shape() == first.shape(), ErrorCode::kShape, "GroupedParam::per_expert: tensor ", g,
              " has shape ", t.shape().to_string(), ", expected ", first.shape().to_string(),
              " like tensor 0");
    MOE_CHECK(t.dtype() == first.dtype(), ErrorCode::kDType, "GroupedParam::per_expert: tensor ", g,
              " is ", dtype_name(t.dtype()), ", expected ", dtype_name(first.dtype()),
              " like tensor 0");
    MOE_CHECK(t.device() == first.device(), ErrorCode::kDevice, "GroupedParam::per_expert: tensor ",
              g, " is on ", to_string(t.device()), ", expected ", to_string(first.device()),
              " like tensor 0");
    MOE_CHECK(t.is_contiguous(), ErrorCode::kShape, "GroupedParam::per_expert: tensor ", g,
              " is not contiguous: ", t.describe());
  }
  if (pointer_table.defined()) {
    MOE_CHECK(pointer_table.dim() == 1 && pointer_table.size(0) == int64_t(experts.size()) &&
                  pointer_table.dtype() == DType::kInt64 && pointer_table.is_contiguous(),
              ErrorCode::kShape, "GroupedParam::per_expert: pointer_table: expected a contiguous int64 [",
              experts.size(), "] tensor, got ", pointer_table.describe());
    MOE_CHECK(pointer_table.device() == first.device(), ErrorCode::kDevice,
              "GroupedParam::per_expert: pointer_table is on ", to_string(pointer_table.device()),
              ", expected the experts' device ", to_string(first.device()));
  }
  GroupedParam p;
  p.pointer_table_ = pointer_table;
  p.num_groups_ = int64_t(experts.size());
  p.expert_shape_ = first.shape();
  p.dtype_ = first.dtype();
  p.device_ = first.device();
  p.experts_ = std::move(experts);
  return p;
}

TensorView GroupedParam::expert(int64_t g) const {
  MOE_CHECK(g >= 0 && g < num_groups_, ErrorCode::kInvalidArgument, "GroupedParam: expert ", g,
            " out of range [0, ", num_groups_, ")");
  return is_packed() ? packed_.select(g) : experts_[size_t(g)];
}

std::string GroupedParam::describe() const {
  if (!defined()) return "undefined";
  if (is_packed()) return "packed " + packed_.describe();
  return std::to_string(num_groups_) + " x " + experts_.front().describe();
}

Tensor make_pointer_table(const std::vector<TensorView>& experts) {
  MOE_CHECK(!experts.empty(), ErrorCode::kInvalidArgument, "make_pointer_table: no experts");
  Tensor host = Tensor::empty({int64_t(experts.size())}, DType::kInt64);
  for (size_t g = 0; g < experts.size(); ++g)
    host.data_as<int64_t>()[g] = int64_t(reinterpret_cast<uintptr_t>(experts[g].data()));
  return host.to(experts.front().device());
}

namespace {
Shape packed_shape(int64_t groups, const Shape& expert_shape) {
  MOE_CHECK(groups >= 1, ErrorCode::kInvalidArgument, "GroupedTensor: expected G >= 1, got ", groups);
  Shape shape{groups};
  for (int64_t d : expert_shape) shape.push_back(d);
  return shape;
}
}  // namespace

GroupedTensor GroupedTensor::from_packed(Tensor packed) {
  GroupedTensor t;
  t.packed_ = std::move(packed);
  t.view_ = GroupedParam::packed(t.packed_);
  return t;
}

GroupedTensor GroupedTensor::zeros_async(int64_t groups, const Shape& expert_shape, DType dtype, Device device,
                                         ExpertLayout layout, Stream stream) {
  if (layout != ExpertLayout::kPacked) return zeros(groups, expert_shape, dtype, device, layout);
  return from_packed(Tensor::zeros_async(packed_shape(groups, expert_shape), dtype, device, stream));
}

GroupedTensor GroupedTensor::zeros(int64_t groups, const Shape& expert_shape, DType dtype, Device device,
                                   ExpertLayout layout) {
  if (layout == ExpertLayout::kPacked)
    return from_packed(Tensor::zeros(packed_shape(groups, expert_shape), dtype, device));
  MOE_CHECK(groups >= 1, ErrorCode::kInvalidArgument, "GroupedTensor: expected G >= 1, got ", groups);
  GroupedTensor t;
  std::vector<TensorView> views;
  for (int64_t g = 0; g < groups; ++g) {
    t.experts_.push_back(Tensor::zeros(expert_shape, dtype, device));
    views.push_back(t.experts_.back());
  }
  if (device.is_cuda()) t.pointer_table_ = make_pointer_table(views);
  t.view_ = GroupedParam::per_expert(std::move(views), t.pointer_table_);
  return t;
}

}  // namespace moe
