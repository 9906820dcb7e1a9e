// Parameter (values + training attributes), the FP8 buffers and weight cache of the modules, and
// the state-dict helpers.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_api.hpp"
#include "modules/parameter_io.hpp"
#include "moe_engine/modules.hpp"
#include "moe_engine/runtime.hpp"
#include "ops/validate.hpp"

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
  // Contiguity needs no check here: GroupedParam rejects non-contiguous experts when built. The
  // gradient is added into main_grad, so it must not be the parameter's own memory, and no two of
  // its experts may share memory.
  for (int64_t g = 0; g < num_groups(); ++g)
    for (int64_t h = 0; h < num_groups(); ++h) {
      MOE_CHECK(!ops::overlap(main_grad.expert(g), value().expert(h)), ErrorCode::kInvalidArgument,
                "set_main_grad: main_grad's expert ", g, " overlaps the parameter's values (expert ", h,
                "); expected a buffer of its own");
      MOE_CHECK(h >= g || !ops::overlap(main_grad.expert(g), main_grad.expert(h)), ErrorCode::kInvalidArgument,
                "set_main_grad: main_grad's experts ", h, " and ", g,
                " overlap in memory; expected a separate tensor per expert");
    }
  main_grad_ = main_grad;
}

namespace detail {
uint64_t next_module_id() {
  static std::atomic<uint64_t> next{1};
  return next++;
}
}  // namespace detail

namespace detail {

Fp8RowsBuffers Fp8RowsBuffers::empty(int64_t capacity, int64_t features, Device device, Stream stream) {
  const int64_t blocks = (features + kFp8Block - 1) / kFp8Block;
  return {Tensor::empty_async({capacity, features}, DType::kFloat8E4M3, device, stream),
          Tensor::empty_async({blocks, fp8_scales_pitch(capacity)}, DType::kFloat32, device, stream)};
}

int64_t Fp8RowsBuffers::nbytes() const {
  return defined() ? int64_t(data.nbytes() + scales.nbytes()) : 0;
}

Fp8ColumnsBuffers Fp8ColumnsBuffers::empty(int64_t capacity, int64_t groups, int64_t features, Device device,
                                           Stream stream) {
  const int64_t columns = fp8_columns_capacity(capacity, groups);
  return {Tensor::empty_async({features, columns}, DType::kFloat8E4M3, device, stream),
          Tensor::empty_async({columns / kFp8Block, features}, DType::kFloat32, device, stream),
          Tensor::empty_async({groups + 1}, DType::kInt64, device, stream)};
}

int64_t Fp8ColumnsBuffers::nbytes() const {
  return defined() ? int64_t(data.nbytes() + scales.nbytes() + offsets.nbytes()) : 0;
}

Fp8WeightCache::Fp8WeightCache(const Parameter& weight, bool forward_copy, bool dgrad_copy) {
  const Shape& s = weight.expert_shape();
  const int64_t G = weight.num_groups(), N = s[0], K = s[1];
  const int64_t nb = (N + kFp8Block - 1) / kFp8Block, kb = (K + kFp8Block - 1) / kFp8Block;
  // Allocated here, once, so that no later step allocates (a step may be captured in a CUDA graph).
  if (forward_copy) {
    data_ = Tensor::empty({G, N, K}, DType::kFloat8E4M3, weight.device());
    scales_ = Tensor::empty({G, nb, kb}, DType::kFloat32, weight.device());
  }
  if (dgrad_copy) {
    data_t_ = Tensor::empty({G, K, N}, DType::kFloat8E4M3, weight.device());
    scales_t_ = Tensor::empty({G, kb, nb}, DType::kFloat32, weight.device());
  }
  view_ = {data_, scales_, data_t_, scales_t_};
}

bool Fp8WeightCache::fresh_for(const Parameter& weight) const {
  if (!fresh_) return false;
  const GroupedParam& was = source_.view();
  const GroupedParam& now = weight.value();
  if (was.num_groups() != now.num_groups() || was.is_packed() != now.is_packed()) return false;
  if (now.is_packed()) return was.packed_view().data() == now.packed_view().data();
  for (int64_t g = 0; g < now.num_groups(); ++g)
    if (was.expert(g).data() != now.expert(g).data()) return false;
  return true;
}

const Fp8Weight& Fp8WeightCache::get(const Parameter& weight, const Fp8Recipe& recipe, const ExecContext& exec) {
  MOE_CHECK(data_.defined() || data_t_.defined(), ErrorCode::kInternal,
            "Fp8WeightCache: used by a module built without fp8");
  // A CUDA graph capture always records the quantization, so that every replay quantizes the
  // weights as they are then (a replay after an optimizer step reads the new ones). Captured work
  // has not run, so the copies stay as fresh (or stale) as they were for eager calls.
  const bool capturing = weight.device().is_cuda() && cuda_api::is_capturing(exec.stream);
  if (capturing || !fresh_for(weight)) {
    quantize_fp8_weight(weight.value(), view_, recipe, exec);
    ++quantizations_;
    if (!capturing) {
      source_ = weight.storage();
      fresh_ = true;
    }
  }
  return view_;
}

}  // namespace detail

const char* grouped_key_action_name(GroupedKeyPlan::Action action) {
  switch (action) {
    case GroupedKeyPlan::Action::kKeep: return "keep";
    case GroupedKeyPlan::Action::kStack: return "stack";
    case GroupedKeyPlan::Action::kSplit: return "split";
    case GroupedKeyPlan::Action::kReshape: return "reshape";
  }
  return "?";
}

GroupedKeyPlan plan_grouped_keys(const std::map<std::string, CheckpointEntry>& entries, const std::string& key,
                                 int64_t groups, ExpertLayout layout, const Shape& expert_shape) {
  MOE_CHECK(groups >= 1, ErrorCode::kInvalidArgument, "normalize_grouped_keys: expected G >= 1, got ", groups);
  GroupedKeyPlan plan;
  const auto packed = entries.find(key);
  std::vector<const CheckpointEntry*> indexed(size_t(groups), nullptr);
  std::vector<std::string> absent;
  for (int64_t g = 0; g < groups; ++g) {
    const auto it = entries.find(key + std::to_string(g));
    if (it != entries.end()) indexed[size_t(g)] = &it->second;
    else absent.push_back(key + std::to_string(g));
  }
  const int64_t present = groups - int64_t(absent.size());
  auto describe = [](const CheckpointEntry& e) { return e.shape.to_string() + " " + e.dtype; };

  if (layout == ExpertLayout::kPacked) {
    if (packed == entries.end() && present == groups) {
      const CheckpointEntry& first = *indexed[0];
      for (int64_t g = 1; g < groups; ++g) {
        const CheckpointEntry& e = *indexed[size_t(g)];
        if (e.shape == first.shape && e.dtype == first.dtype) continue;
        plan.error = detail::str_cat("checkpoint key '", key, g, "' is ", describe(e), ", but '", key, "0' is ",
                                     describe(first), ": the experts of '", key, "' must share one shape and dtype");
        return plan;
      }
      plan.action = GroupedKeyPlan::Action::kStack;
      plan.shape.push_back(groups);
      for (int64_t d : first.shape) plan.shape.push_back(d);
    } else if (packed == entries.end() && present > 0) {
      plan.missing = std::move(absent);
    } else if (packed != entries.end() && expert_shape.size() >= 1) {
      // TransformerEngine's single grouped parameter [G*N, ...] for a module that holds [G, N, ...].
      const Shape& s = packed->second.shape;
      Shape want{groups};
      for (int64_t d : expert_shape) want.push_back(d);
      if (s.size() == expert_shape.size() && s[0] == groups * expert_shape[0] && s.numel() == want.numel()) {
        plan.action = GroupedKeyPlan::Action::kReshape;
        plan.shape = want;
      }
    }
    return plan;
  }
  if (packed == entries.end() || present > 0) return plan;
  const Shape& s = packed->second.shape;
  if (s.size() == 0 || s[0] % groups != 0) {
    plan.error = detail::str_cat("cannot split checkpoint key '", key, "' ", describe(packed->second),
                                 " into experts: its first dimension does not split into ", groups,
                                 " experts (expected [G, ...] or [G*N, ...])");
    return plan;
  }
  plan.action = GroupedKeyPlan::Action::kSplit;
  if (s[0] == groups) {
    plan.shape = Shape(s.begin() + 1, s.end());
  } else {
    plan.shape = s;
    plan.shape[0] = s[0] / groups;
  }
  return plan;
}

namespace {

const Tensor& cpu_contiguous(const Tensor& t, const std::string& key) {
  MOE_CHECK(t.device().is_cpu(), ErrorCode::kInvalidArgument, "checkpoint key normalization of '", key,
            "' needs CPU tensors, got ", t.view().describe());
  MOE_CHECK(t.view().is_contiguous(), ErrorCode::kShape, "checkpoint key normalization of '", key,
            "' needs contiguous tensors, got ", t.view().describe());
  return t;
}

// The checkpoint's key and key0..key{G-1}, as plan_grouped_keys reads them.
std::map<std::string, CheckpointEntry> entries_of(const std::map<std::string, Tensor>& state, const std::string& key,
                                                  int64_t groups) {
  std::map<std::string, CheckpointEntry> entries;
  auto add = [&](const std::string& k) {
    const auto it = state.find(k);
    if (it != state.end()) entries.emplace(k, CheckpointEntry{it->second.shape(), dtype_name(it->second.dtype())});
  };
  add(key);
  for (int64_t g = 0; g < groups; ++g) add(key + std::to_string(g));
  return entries;
}

// Stacks or splits per the plan, into new CPU tensors (a reshape is the loader's: it views).
void apply_plan(std::map<std::string, Tensor>& state, const std::string& key, int64_t groups,
                const GroupedKeyPlan& plan) {
  MOE_CHECK(plan.error.empty(), ErrorCode::kShape, plan.error);
  if (plan.action == GroupedKeyPlan::Action::kStack) {
    const Tensor& first = cpu_contiguous(state.at(key + "0"), key + "0");
    const Tensor stacked = Tensor::empty(plan.shape, first.dtype());
    for (int64_t g = 0; g < groups; ++g) {
      const std::string k = key + std::to_string(g);
      const Tensor& t = cpu_contiguous(state.at(k), k);
      std::memcpy(static_cast<uint8_t*>(stacked.data()) + size_t(g) * t.nbytes(), t.data(), t.nbytes());
    }
    for (int64_t g = 0; g < groups; ++g) state.erase(key + std::to_string(g));
    state.emplace(key, stacked);
  } else if (plan.action == GroupedKeyPlan::Action::kSplit) {
    const Tensor packed = cpu_contiguous(state.at(key), key);
    state.erase(key);
    const size_t bytes = packed.nbytes() / size_t(groups);
    for (int64_t g = 0; g < groups; ++g) {
      Tensor t = Tensor::empty(plan.shape, packed.dtype());
      std::memcpy(t.data(), static_cast<const uint8_t*>(packed.data()) + size_t(g) * bytes, bytes);
      state.emplace(key + std::to_string(g), t);
    }
  }
}

}  // namespace

void normalize_grouped_keys(std::map<std::string, Tensor>& state, const std::string& key, int64_t groups,
                            ExpertLayout layout) {
  apply_plan(state, key, groups, plan_grouped_keys(entries_of(state, key, groups), key, groups, layout));
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
  const GroupedKeyPlan plan =
      plan_grouped_keys(entries_of(state, key, v.num_groups()), key, v.num_groups(), param.layout(), v.expert_shape());
  // Per-expert keys for only some experts: name the missing ones, not the packed key a packed
  // module looked for.
  if (!plan.missing.empty()) {
    std::string missing;
    for (size_t i = 0; i < plan.missing.size() && i < 8; ++i) missing += (i == 0 ? "'" : ", '") + plan.missing[i] + "'";
    throw_error(ErrorCode::kInvalidArgument, "load_state_dict: the checkpoint holds per-expert tensors '", key,
                "0'.. for ", v.num_groups() - int64_t(plan.missing.size()), " of ", v.num_groups(),
                " experts; missing: ", missing, plan.missing.size() > 8 ? ", ..." : "");
  }
  apply_plan(state, key, v.num_groups(), plan);
  auto take = [&](const std::string& k, const TensorView& dst) {
    auto it = state.find(k);
    MOE_CHECK(it != state.end(), ErrorCode::kInvalidArgument, "load_state_dict: missing key '", k, "' (expected ",
              dst.describe(), ")");
    TensorView src = it->second.view();
    if (plan.action == GroupedKeyPlan::Action::kReshape && src.is_contiguous()) src = src.reshape(plan.shape);
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
