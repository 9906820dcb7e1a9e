// Parameter (values + training attributes) and the state-dict helpers of the modules.
#include <cstring>
#include <string>
#include <vector>

#include "modules/parameter_io.hpp"
#include "moe_engine/modules.hpp"
#include "moe_engine/runtime.hpp"

namespace moe {

Parameter::Parameter(int64_t groups, const Shape& expert_shape, DType dtype, Device device, ExpertLayout layout)
    : value_(GroupedTensor::zeros(groups, expert_shape, dtype, device, layout)) {}

void Parameter::set_main_grad(const GroupedParam& main_grad) {
  MOE_CHECK(main_grad.defined(), ErrorCode::kInvalidArgument, "set_main_grad: undefined main_grad");
  MOE_CHECK(main_grad.num_groups() == num_groups() && main_grad.expert_shape() == expert_shape(), ErrorCode::kShape,
            "set_main_grad: expected ", num_groups(), " x ", expert_shape().to_string(), " like the parameter, got ",
            main_grad.describe());
  MOE_CHECK(main_grad.dtype() == DType::kFloat32, ErrorCode::kDType, "set_main_grad: main_grad must be float32, got ",
            main_grad.describe());
  MOE_CHECK(main_grad.device() == device(), ErrorCode::kDevice, "set_main_grad: main_grad is on ",
            to_string(main_grad.device()), ", the parameter on ", to_string(device()));
  // Contiguity needs no check here: GroupedParam rejects non-contiguous experts when built.
  main_grad_ = main_grad;
}

namespace {

const Tensor& cpu_contiguous(const Tensor& t, const std::string& key) {
  MOE_CHECK(t.device().is_cpu(), ErrorCode::kInvalidArgument, "checkpoint key normalization of '", key,
            "' needs CPU tensors, got ", t.view().describe());
  MOE_CHECK(t.view().is_contiguous(), ErrorCode::kShape, "checkpoint key normalization of '", key,
            "' needs contiguous tensors, got ", t.view().describe());
  return t;
}

}  // namespace

void normalize_grouped_keys(std::map<std::string, Tensor>& state, const std::string& key, int64_t groups,
                            ExpertLayout layout) {
  MOE_CHECK(groups >= 1, ErrorCode::kInvalidArgument, "normalize_grouped_keys: expected G >= 1, got ", groups);
  const bool packed_present = state.count(key) > 0;
  int64_t indexed = 0;
  for (int64_t g = 0; g < groups; ++g) indexed += int64_t(state.count(key + std::to_string(g)));
  if (layout == ExpertLayout::kPacked && !packed_present && indexed == groups) {
    // Stack key0..key{G-1} into key [G, ...].
    const Tensor& first = cpu_contiguous(state.at(key + "0"), key + "0");
    const Tensor stacked =
        GroupedTensor::zeros(groups, first.shape(), first.dtype(), Device::cpu(), ExpertLayout::kPacked).packed();
    for (int64_t g = 0; g < groups; ++g) {
      const std::string k = key + std::to_string(g);
      const Tensor& t = cpu_contiguous(state.at(k), k);
      MOE_CHECK(t.shape() == first.shape() && t.dtype() == first.dtype(), ErrorCode::kShape, "checkpoint key '", k,
                "' is ", t.view().describe(), ", but '", key, "0' is ", first.view().describe());
      std::memcpy(static_cast<uint8_t*>(stacked.data()) + size_t(g) * t.nbytes(), t.data(), t.nbytes());
    }
    for (int64_t g = 0; g < groups; ++g) state.erase(key + std::to_string(g));
    state.emplace(key, stacked);
  } else if (layout == ExpertLayout::kPerExpert && packed_present && indexed == 0) {
    // Split key [G, ...] along dim 0, or [G*N, ...] into G equal chunks.
    const Tensor packed = cpu_contiguous(state.at(key), key);
    MOE_CHECK(packed.dim() >= 1, ErrorCode::kShape, "checkpoint key '", key, "' is a scalar");
    Shape expert;
    if (packed.size(0) == groups) {
      expert = Shape(packed.shape().begin() + 1, packed.shape().end());
    } else {
      MOE_CHECK(packed.size(0) % groups == 0, ErrorCode::kShape, "checkpoint key '", key, "' is ",
                packed.view().describe(), ": its first dimension does not split into ", groups, " experts");
      expert = packed.shape();
      expert[0] = packed.size(0) / groups;
    }
    state.erase(key);
    const size_t bytes = packed.nbytes() / size_t(groups);
    for (int64_t g = 0; g < groups; ++g) {
      Tensor t = Tensor::empty(expert, packed.dtype());
      std::memcpy(t.data(), static_cast<const uint8_t*>(packed.data()) + size_t(g) * bytes, bytes);
      state.emplace(key + std::to_string(g), t);
    }
  }
}

namespace detail {

void init_uniform(const GroupedTensor& t, uint64_t seed, float lo, float hi) {
  const GroupedParam& v = t.view();
  if (t.layout() == ExpertLayout::kPacked) {
    fill_uniform(t.packed(), seed, lo, hi);
    return;
  }
  const Tensor packed =
      GroupedTensor::zeros(v.num_groups(), v.expert_shape(), v.dtype(), v.device(), ExpertLayout::kPacked).packed();
  fill_uniform(packed, seed, lo, hi);
  for (int64_t g = 0; g < v.num_groups(); ++g) copy_tensor(t.experts()[size_t(g)], packed.view().select(g));
  if (v.device().is_cuda()) synchronize(nullptr);
}

void zero(const GroupedTensor& t, Stream stream) {
  if (t.layout() == ExpertLayout::kPacked) {
    fill_bytes(t.packed(), 0, stream);
    return;
  }
  for (const Tensor& e : t.experts()) fill_bytes(e, 0, stream);
}

void export_param(std::map<std::string, Tensor>& state, const std::string& key, const GroupedTensor& param) {
  if (param.layout() == ExpertLayout::kPacked) {
    state[key] = param.packed();
    return;
  }
  for (size_t g = 0; g < param.experts().size(); ++g) state[key + std::to_string(g)] = param.experts()[g];
}

void import_param(std::map<std::string, Tensor>& state, const std::string& key, const GroupedTensor& param) {
  const GroupedParam& v = param.view();
  normalize_grouped_keys(state, key, v.num_groups(), param.layout());
  // Per-expert keys for only some experts (left alone by the normalization): name the missing
  // ones, not the packed key a packed module looked for.
  if (param.layout() == ExpertLayout::kPacked && !state.count(key)) {
    std::string missing;
    int64_t present = 0, shown = 0;
    for (int64_t g = 0; g < v.num_groups(); ++g) {
      const std::string k = key + std::to_string(g);
      if (state.count(k)) ++present;
      else if (shown++ < 8) missing += (missing.empty() ? "'" : ", '") + k + "'";
    }
    MOE_CHECK(present == 0, ErrorCode::kInvalidArgument, "load_state_dict: the checkpoint holds per-expert tensors '",
              key, "0'.. for ", present, " of ", v.num_groups(), " experts; missing: ", missing, shown > 8 ? ", ..." : "");
  }
  auto take = [&](const std::string& k, const TensorView& dst) {
    auto it = state.find(k);
    MOE_CHECK(it != state.end(), ErrorCode::kInvalidArgument, "load_state_dict: missing key '", k, "' (expected ",
              dst.describe(), ")");
    TensorView src = it->second.view();
    // A packed [G*N, ...] tensor (TransformerEngine's single grouped parameter) is [G, N, ...].
    if (src.is_contiguous() && src.numel() == dst.numel() && src.dim() == dst.dim() - 1 && src.dim() >= 1 &&
        src.size(0) == dst.size(0) * dst.size(1))
      src = src.reshape(dst.shape());
    MOE_CHECK(src.shape() == dst.shape(), ErrorCode::kShape, "load_state_dict: key '", k, "' is ",
              it->second.view().describe(), ", expected shape ", dst.shape().to_string());
    MOE_CHECK(src.dtype() == dst.dtype(), ErrorCode::kDType, "load_state_dict: key '", k, "' is ",
              dtype_name(src.dtype()), ", expected ", dtype_name(dst.dtype()));
    MOE_CHECK(src.is_contiguous(), ErrorCode::kShape, "load_state_dict: key '", k, "' is not contiguous");
    copy_tensor(dst, src);
    state.erase(it);
  };
  if (param.layout() == ExpertLayout::kPacked) {
    take(key, param.packed());
  } else {
    for (size_t g = 0; g < param.experts().size(); ++g) take(key + std::to_string(g), param.experts()[g]);
  }
  if (v.device().is_cuda()) synchronize(nullptr);
}

void check_no_unexpected_keys(const std::map<std::string, Tensor>& state, const std::string& prefix,
                              const char* who) {
  std::string unexpected;
  for (const auto& [k, t] : state)
    if (k.starts_with(prefix)) unexpected += (unexpected.empty() ? "'" : ", '") + k + "'";
  MOE_CHECK(unexpected.empty(), ErrorCode::kInvalidArgument, who, ": unexpected keys ", unexpected);
}

}  // namespace detail
}  // namespace moe
