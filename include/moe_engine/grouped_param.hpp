// A per-expert tensor (weight [N,K], bias [N], their gradients) held either packed as one
// [G, ...] tensor ("single grouped weight") or as G separate tensors. Both give bit-identical
// results.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "moe_engine/enum_names.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/tensor.hpp"

namespace moe {

// How G per-expert tensors are held: one [G, ...] tensor or G separate tensors.
enum class ExpertLayout { kPacked, kPerExpert };
template <>
struct EnumNames<ExpertLayout> {
  static constexpr std::string_view kWhat = "expert layout";
  static constexpr EnumName<ExpertLayout> kNames[] = {
      {ExpertLayout::kPacked, "packed"},
      {ExpertLayout::kPerExpert, "per-expert"},
  };
};
inline ExpertLayout parse_expert_layout(std::string_view text) { return parse_enum<ExpertLayout>(text); }
inline const char* expert_layout_name(ExpertLayout layout) { return enum_name(layout); }

class MOE_API GroupedParam {
 public:
  GroupedParam() = default;
  // One contiguous [G, ...] tensor, G >= 1.
  static GroupedParam packed(const TensorView& tensor);
  // G >= 1 contiguous tensors of one shape, dtype and device. On CUDA the kernels read the
  // experts' addresses from `pointer_table`, an int64 [G] device tensor holding them (build it
  // once with make_pointer_table, outside graph capture, and keep it alive with the experts).
  static GroupedParam per_expert(std::vector<TensorView> experts, TensorView pointer_table = {});

  bool defined() const { return num_groups_ > 0; }
  bool is_packed() const { return packed_.defined(); }
  int64_t num_groups() const { return num_groups_; }
  const Shape& expert_shape() const { return expert_shape_; }  // shape of one expert's tensor
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  TensorView expert(int64_t g) const;  // expert g's tensor, whatever the layout
  const TensorView& packed_view() const { return packed_; }            // packed layout only
  const std::vector<TensorView>& experts() const { return experts_; }  // per-expert layout only
  const TensorView& pointer_table() const { return pointer_table_; }   // per-expert, may be undefined
  std::string describe()
      const;  // "packed bfloat16[8, 128, 64] on cpu" / "8 x bfloat16[128, 64] on cpu"

 private:
  TensorView packed_;
  std::vector<TensorView> experts_;
  TensorView pointer_table_;
  Shape expert_shape_;
  int64_t num_groups_ = 0;
  DType dtype_ = DType::kFloat32;
  Device device_;
};

// An int64 [G] tensor on the experts' device holding their data addresses (synchronous upload).
MOE_API Tensor make_pointer_table(const std::vector<TensorView>& experts);

// Owning storage for G per-expert tensors in either layout, with its GroupedParam view (and, on
// CUDA in the per-expert layout, the pointer table the kernels read). Copies share the storage.
class MOE_API GroupedTensor {
 public:
  GroupedTensor() = default;
  static GroupedTensor zeros(int64_t groups, const Shape& expert_shape, DType dtype, Device device,
                             ExpertLayout layout);
  // The packed layout in stream-ordered memory (Tensor::zeros_async: no synchronization, so it can
  // be captured in a CUDA graph); the per-expert layout as zeros() (its pointer table is a
  // synchronous upload).
  static GroupedTensor zeros_async(int64_t groups, const Shape& expert_shape, DType dtype, Device device,
                                   ExpertLayout layout, Stream stream);
  bool defined() const { return view_.defined(); }
  const GroupedParam& view() const { return view_; }
  operator const GroupedParam&() const { return view_; }  // NOLINT: passes where views are expected
  ExpertLayout layout() const { return packed_.defined() ? ExpertLayout::kPacked : ExpertLayout::kPerExpert; }
  const Tensor& packed() const { return packed_; }                // packed layout only
  const std::vector<Tensor>& experts() const { return experts_; }  // per-expert layout only

 private:
  static GroupedTensor from_packed(Tensor packed);

  Tensor packed_;
  std::vector<Tensor> experts_;
  Tensor pointer_table_;
  GroupedParam view_;
};

}  // namespace moe
