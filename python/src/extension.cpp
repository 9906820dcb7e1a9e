// moe_engine._C: the Python face of the C++ library, kept thin. Tensors cross as plain
// descriptors (data pointer, shape, strides, dtype code, device index), so the extension links no
// framework; the PyTorch layer (moe_engine/torch) builds them and passes the current CUDA stream.
// Every op computes its group offsets from `splits` itself (one small kernel into caller scratch),
// so no caller can hand a kernel offsets that were not validated.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "moe_engine/moe_engine.hpp"

namespace nb = nanobind;

namespace {

using namespace moe;

// ---- tensors and grouped parameters from Python ----

// (data_ptr, shape, strides, dtype code, device index or -1 for the CPU), or () for "none"
// (nanobind refuses None for plain object parameters).
TensorView view_of(nb::handle h) {
  if (h.is_none()) return {};
  const auto t = nb::borrow<nb::tuple>(h);
  if (t.size() == 0) return {};
  Shape shape, strides;
  for (nb::handle d : nb::borrow<nb::tuple>(t[1])) shape.push_back(nb::cast<int64_t>(d));
  for (nb::handle d : nb::borrow<nb::tuple>(t[2])) strides.push_back(nb::cast<int64_t>(d));
  const int device = nb::cast<int>(t[4]);
  return TensorView(reinterpret_cast<void*>(nb::cast<uintptr_t>(t[0])), shape, strides,
                    DType(nb::cast<int>(t[3])), device < 0 ? Device::cpu() : Device::cuda(device));
}

// ([descriptors], pointer table descriptor or None). One descriptor of rank expert_rank + 1 is
// the packed layout; otherwise one descriptor per expert. An empty list is "no parameter".
GroupedParam param_of(nb::handle h, int expert_rank) {
  if (h.is_none()) return {};
  const auto t = nb::borrow<nb::tuple>(h);
  const auto items = nb::borrow<nb::list>(t[0]);
  if (items.size() == 0) return {};
  if (items.size() == 1) {
    const TensorView v = view_of(items[0]);
    if (v.dim() == expert_rank + 1) return GroupedParam::packed(v);
  }
  std::vector<TensorView> experts;
  experts.reserve(items.size());
  for (nb::handle item : items) experts.push_back(view_of(item));
  return GroupedParam::per_expert(std::move(experts), view_of(t[1]));
}

Stream stream_of(uintptr_t stream) { return reinterpret_cast<Stream>(stream); }

// ---- the device error flags: one per GPU, for the life of the process ----

std::mutex flags_mutex;
std::map<int, std::unique_ptr<DeviceErrorFlag>> flags;

DeviceErrorFlag& error_flag(Device device, Stream) {
  std::lock_guard<std::mutex> lock(flags_mutex);
  auto& flag = flags[device.index];
  // Created on first use (a cudaMalloc, which CUDA refuses during graph capture: the PyTorch
  // layer creates it before any op runs on a device, see moe_engine/torch/_bridge.py).
  if (!flag) flag = std::make_unique<DeviceErrorFlag>(device);
  return *flag;
}

// Offsets of `splits` into `offsets` (int64 [G+1] on the splits' device) for a buffer of
// `capacity` rows. Bad splits throw on the CPU; on CUDA they are sanitized and recorded.
// Runs without the GIL: takes no Python objects.
GroupLayout layout_of(const TensorView& splits, const TensorView& offsets, int64_t capacity,
                      Stream stream) {
  DeviceErrorFlag* flag = splits.device().is_cuda() ? &error_flag(splits.device(), stream) : nullptr;
  return GroupLayout::compute(splits, capacity, offsets, flag, stream);
}

std::vector<TensorView> views_of(nb::handle list) {
  std::vector<TensorView> out;
  for (nb::handle h : nb::borrow<nb::list>(list)) out.push_back(view_of(h));
  return out;
}

// Fresh outputs of the PyTorch layer: their unrouted rows become zeros (see zero_unrouted_rows).
void zero_tails(const std::vector<TensorView>& outputs, const GroupLayout& groups, Stream stream) {
  for (const TensorView& t : outputs)
    if (t.defined()) zero_unrouted_rows(t, groups, stream);
}

ExecContext with_workspace(ExecContext exec, const TensorView& ws) {
  if (ws.defined()) exec.workspace = {ws.data(), ws.nbytes(), ws.device()};
  return exec;
}

// (activation, limit, alpha, offset, layout) -> the GLU spec.
GluSpec glu_of(const nb::tuple& t) {
  GluSpec s;
  s.activation = parse_activation(nb::cast<std::string>(t[0]));
  s.limit = nb::cast<float>(t[1]);
  s.alpha = nb::cast<float>(t[2]);
  s.offset = nb::cast<float>(t[3]);
  s.layout = GluLayout::parse(nb::cast<std::string>(t[4]));
  return s;
}

// The buffer capacity T: the rows of the op's [T, ...] token tensor, which must be 2-D (a 3-D
// [B, S, H] batch would otherwise read as T = B and the splits would seem to overflow it). An
// undefined tensor gives 0; the op's validation names it.
int64_t rows_of(const char* op, const char* name, const TensorView& t) {
  if (!t.defined()) return 0;
  MOE_CHECK(t.dim() == 2, ErrorCode::kShape, op, ": ", name, ": expected a 2-D [T, ...] token tensor (flatten ",
            "batch and sequence into T rows sorted by expert), got ", t.describe());
  return t.size(0);
}

// ---- ops ----

// Where an op runs: the routing (offsets computed from splits for T rows), the stream, and the
// fresh outputs whose unrouted rows become zeros afterwards. run() releases the GIL, so everything
// Python must be read before.
struct OpCall {
  TensorView splits, offsets;
  int64_t capacity;
  Stream stream;
  std::vector<TensorView> zero;

  // `rows` (named `name` in `op`'s messages) holds the token buffer whose rows the splits index.
  OpCall(const char* op, const char* name, const TensorView& rows, nb::handle splits_h, nb::handle offsets_h,
         uintptr_t stream_i, nb::handle zero_h = nb::list())
      : splits(view_of(splits_h)),
        offsets(view_of(offsets_h)),
        capacity(rows_of(op, name, rows)),
        stream(stream_of(stream_i)),
        zero(views_of(zero_h)) {}

  template <class Op>
  void run(Op&& op) const {
    nb::gil_scoped_release release;
    const GroupLayout groups = layout_of(splits, offsets, capacity, stream);
    op(groups, ExecContext{stream, {}});
    zero_tails(zero, groups, stream);
  }
};

void grouped_linear_forward_py(nb::handle x_h, nb::handle weight_h, nb::handle splits_h,
                               nb::handle offsets_h, nb::handle y_h, nb::handle bias_h,
                               nb::handle row_scale_h, nb::handle zero_h, uintptr_t stream_i) {
  const TensorView x = view_of(x_h), y = view_of(y_h), row_scale = view_of(row_scale_h);
  const GroupedParam weight = param_of(weight_h, 2), bias = param_of(bias_h, 1);
  OpCall("grouped_linear_forward", "x", x, splits_h, offsets_h, stream_i, zero_h)
      .run([&](const GroupLayout& g, const ExecContext& e) {
        grouped_linear_forward(x, weight, g, y, {bias, row_scale}, e);
      });
}

void grouped_linear_dgrad_py(nb::handle dy_h, nb::handle weight_h, nb::handle splits_h,
                             nb::handle offsets_h, nb::handle dx_h, nb::handle zero_h, uintptr_t stream_i) {
  const TensorView dy = view_of(dy_h), dx = view_of(dx_h);
  const GroupedParam weight = param_of(weight_h, 2);
  OpCall("grouped_linear_dgrad", "dy", dy, splits_h, offsets_h, stream_i, zero_h)
      .run([&](const GroupLayout& g, const ExecContext& e) {
        grouped_linear_dgrad(dy, weight, g, dx, e);
      });
}

void grouped_linear_wgrad_py(nb::handle dy_h, nb::handle x_h, nb::handle splits_h,
                             nb::handle offsets_h, nb::handle dweight_h, const std::string& mode,
                             uintptr_t stream_i) {
  const TensorView dy = view_of(dy_h), x = view_of(x_h);
  const GroupedParam dweight = param_of(dweight_h, 2);
  const GradMode grad_mode = parse_grad_mode(mode);
  OpCall("grouped_linear_wgrad", "dy", dy, splits_h, offsets_h, stream_i)
      .run([&](const GroupLayout& g, const ExecContext& e) {
        grouped_linear_wgrad(dy, x, g, dweight, grad_mode, e);
      });
}

void grouped_linear_dbias_py(nb::handle dy_h, nb::handle splits_h, nb::handle offsets_h,
                             nb::handle dbias_h, const std::string& mode, nb::handle row_scale_h,
                             uintptr_t stream_i) {
  const TensorView dy = view_of(dy_h), row_scale = view_of(row_scale_h);
  const GroupedParam dbias = param_of(dbias_h, 1);
  const GradMode grad_mode = parse_grad_mode(mode);
  OpCall("grouped_linear_dbias", "dy", dy, splits_h, offsets_h, stream_i)
      .run([&](const GroupLayout& g, const ExecContext& e) {
        grouped_linear_dbias(dy, g, dbias, grad_mode, row_scale, e);
      });
}

void grouped_linear_dscales_py(nb::handle dy_h, nb::handle bias_h, nb::handle splits_h,
                               nb::handle offsets_h, nb::handle dscales_h, nb::handle zero_h, uintptr_t stream_i) {
  const TensorView dy = view_of(dy_h), dscales = view_of(dscales_h);
  const GroupedParam bias = param_of(bias_h, 1);
  OpCall("grouped_linear_dscales", "dy", dy, splits_h, offsets_h, stream_i, zero_h)
      .run([&](const GroupLayout& g, const ExecContext& e) {
        grouped_linear_dscales(dy, bias, g, dscales, false, e);
      });
}

void glu_forward_py(nb::handle h_h, nb::handle probs_h, nb::handle splits_h, nb::handle offsets_h,
                    nb::handle out_h, const nb::tuple& glu, nb::handle zero_h, uintptr_t stream_i) {
  const TensorView h = view_of(h_h), probs = view_of(probs_h), out = view_of(out_h);
  const GluSpec spec = glu_of(glu);
  OpCall("glu_forward", "h", h, splits_h, offsets_h, stream_i, zero_h)
      .run([&](const GroupLayout& g, const ExecContext& e) {
        glu_forward(h, probs, g, out, spec, e);
      });
}

void glu_backward_py(nb::handle h_h, nb::handle probs_h, nb::handle d_out_h, nb::handle splits_h,
                     nb::handle offsets_h, nb::handle dh_h, nb::handle dprobs_h, nb::handle out_h,
                     const nb::tuple& glu, nb::handle zero_h, uintptr_t stream_i) {
  const TensorView h = view_of(h_h), probs = view_of(probs_h), d_out = view_of(d_out_h);
  const GluBackwardOutputs outputs{view_of(dh_h), view_of(dprobs_h), view_of(out_h)};
  const GluSpec spec = glu_of(glu);
  OpCall("glu_backward", "h", h, splits_h, offsets_h, stream_i, zero_h)
      .run([&](const GroupLayout& g, const ExecContext& e) {
        glu_backward(h, probs, d_out, g, outputs, spec, e);
      });
}

// weights: (fc1_weight, fc1_bias, fc2_weight, fc2_bias), each a grouped parameter or None.
ExpertMlpWeights mlp_weights_of(const nb::tuple& w) {
  return {param_of(w[0], 2), param_of(w[1], 1), param_of(w[2], 2), param_of(w[3], 1)};
}

ExpertMlpSpec mlp_spec_of(const nb::tuple& glu, const std::string& fusion) {
  return {glu_of(glu), parse_fusion(fusion)};
}

void expert_mlp_forward_py(nb::handle x_h, nb::handle probs_h, const nb::tuple& weights_t,
                           nb::handle splits_h, nb::handle offsets_h, nb::handle y_h,
                           nb::handle fc1_out_h, const nb::tuple& glu, const std::string& fusion,
                           nb::handle workspace_h, nb::handle zero_h, uintptr_t stream_i) {
  const TensorView x = view_of(x_h), probs = view_of(probs_h), y = view_of(y_h),
                   fc1_out = view_of(fc1_out_h), workspace = view_of(workspace_h);
  const ExpertMlpWeights weights = mlp_weights_of(weights_t);
  const ExpertMlpSpec spec = mlp_spec_of(glu, fusion);
  OpCall("expert_mlp_forward", "x", x, splits_h, offsets_h, stream_i, zero_h)
      .run([&](const GroupLayout& g, const ExecContext& e) {
        expert_mlp_forward(x, probs, weights, g, y, fc1_out, spec, with_workspace(e, workspace));
      });
}

// grads: (dx, dprobs, (fc1_weight, mode), (fc1_bias, mode), (fc2_weight, mode), (fc2_bias, mode)).
void expert_mlp_backward_py(nb::handle dy_h, nb::handle x_h, nb::handle probs_h,
                            const nb::tuple& weights_t, nb::handle splits_h, nb::handle offsets_h,
                            nb::handle fc1_out_h, const nb::tuple& grads_t, const nb::tuple& glu,
                            const std::string& fusion, nb::handle workspace_h, nb::handle zero_h, uintptr_t stream_i) {
  const TensorView dy = view_of(dy_h), x = view_of(x_h), probs = view_of(probs_h),
                   fc1_out = view_of(fc1_out_h), workspace = view_of(workspace_h);
  const ExpertMlpWeights weights = mlp_weights_of(weights_t);
  auto param_grad = [&](nb::handle h, int rank) {
    const auto t = nb::borrow<nb::tuple>(h);
    return ParamGrad{param_of(t[0], rank), parse_grad_mode(nb::cast<std::string>(t[1]))};
  };
  ExpertMlpGrads grads;
  grads.dx = view_of(grads_t[0]);
  grads.dprobs = view_of(grads_t[1]);
  grads.fc1_weight = param_grad(grads_t[2], 2);
  grads.fc1_bias = param_grad(grads_t[3], 1);
  grads.fc2_weight = param_grad(grads_t[4], 2);
  grads.fc2_bias = param_grad(grads_t[5], 1);
  const ExpertMlpSpec spec = mlp_spec_of(glu, fusion);
  OpCall("expert_mlp_backward", "dy", dy, splits_h, offsets_h, stream_i, zero_h)
      .run([&](const GroupLayout& g, const ExecContext& e) {
        expert_mlp_backward(dy, x, probs, weights, g, fc1_out, grads, spec, with_workspace(e, workspace));
      });
}

// ---- errors ----

// Reads and clears the error flag of GPU `device` (waits for `stream`); raises if a kernel
// reported bad splits. No flag yet (no op has run there): nothing to report.
void check_errors_py(int device, uintptr_t stream_i) {
  DeviceErrorFlag* flag = nullptr;
  {
    std::lock_guard<std::mutex> lock(flags_mutex);
    auto it = flags.find(device);
    if (it != flags.end()) flag = it->second.get();
  }
  if (flag == nullptr) return;
  nb::gil_scoped_release release;
  flag->check(stream_of(stream_i));
}

void init_device_py(int device, uintptr_t stream_i) {
  nb::gil_scoped_release release;
  error_flag(Device::cuda(device), stream_of(stream_i));
}

// moe::Error -> ValueError for bad arguments, NotImplementedError, DeviceError (a RuntimeError)
// for what kernels reported, RuntimeError otherwise; the message is the C++ one.
void register_errors(nb::module_& m) {
  static nb::object device_error = nb::steal(PyErr_NewException("moe_engine._C.DeviceError", PyExc_RuntimeError, nullptr));
  m.attr("DeviceError") = device_error;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = PyExc_RuntimeError;
      switch (e.code()) {
        case ErrorCode::kInvalidArgument:
        case ErrorCode::kShape:
        case ErrorCode::kDType:
        case ErrorCode::kAlignment:
        case ErrorCode::kDevice:
        case ErrorCode::kGroupMismatch:
        case ErrorCode::kWorkspace:
          type = PyExc_ValueError;
          break;
        case ErrorCode::kNotImplemented:
          type = PyExc_NotImplementedError;
          break;
        case ErrorCode::kDeviceReported:
          type = device_error.ptr();
          break;
        default:
          break;
      }
      PyErr_SetString(type, e.what());  // e.what() names the code
    }
  });
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "moe-engine: grouped GEMMs and expert MLPs for MoE training (C++ core)";
  register_errors(m);

  nb::dict dtypes;
  for (DType d : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt64,
                  DType::kInt32, DType::kUInt8})
    dtypes[dtype_name(d)] = int(d);
  m.attr("dtype_codes") = dtypes;

  m.def("build_info", [] {
    const BuildInfo b = build_info();
    nb::dict d;
    d["version"] = b.version;
    d["with_cuda"] = b.with_cuda;
    d["cuda_architectures"] = b.cuda_architectures;
    d["cuda_compiler"] = b.cuda_compiler;
    d["cxx_compiler"] = b.cxx_compiler;
    d["build_type"] = b.build_type;
    d["with_openmp"] = b.with_openmp;
    return d;
  });
  m.def("gpus", [] {
    const GpuInventory inv = query_gpus();
    nb::list gpus;
    for (const GpuInfo& g : inv.gpus) {
      nb::dict d;
      d["index"] = g.index;
      d["name"] = g.name;
      d["compute_capability"] = nb::make_tuple(g.major, g.minor);
      d["multiprocessors"] = g.multiprocessors;
      d["memory_bytes"] = g.memory_bytes;
      gpus.append(d);
    }
    return nb::make_tuple(gpus, inv.note);
  });

  // The FC1 row order between GLU layouts: row i of the `to` layout is row perm[i] of `from`.
  m.def("glu_row_permutation", [](const std::string& from, const std::string& to, int64_t ffn) {
    return glu_row_permutation(GluLayout::parse(from), GluLayout::parse(to), ffn);
  });
  m.def("glu_layout_name", [](const std::string& text) { return GluLayout::parse(text).name(); });
  m.def("activation_name", [](const std::string& text) { return std::string(activation_name(parse_activation(text))); });
  m.def("fusion_name", [](const std::string& text) { return std::string(fusion_name(parse_fusion(text))); });

  m.def("expert_mlp_forward_workspace_size",
        [](int64_t T, int64_t H, int64_t F, int dtype, bool save_fc1_out) {
          return expert_mlp_forward_workspace_size(T, H, F, DType(dtype), save_fc1_out);
        });
  m.def("expert_mlp_backward_workspace_size",
        [](int64_t T, int64_t H, int64_t F, int dtype, bool recompute_fc1, const std::string& fusion) {
          return expert_mlp_backward_workspace_size(T, H, F, DType(dtype), recompute_fc1, parse_fusion(fusion));
        });

  m.def("grouped_linear_forward", &grouped_linear_forward_py);
  m.def("grouped_linear_dgrad", &grouped_linear_dgrad_py);
  m.def("grouped_linear_wgrad", &grouped_linear_wgrad_py);
  m.def("grouped_linear_dbias", &grouped_linear_dbias_py);
  m.def("grouped_linear_dscales", &grouped_linear_dscales_py);
  m.def("glu_forward", &glu_forward_py);
  m.def("glu_backward", &glu_backward_py);
  m.def("expert_mlp_forward", &expert_mlp_forward_py);
  m.def("expert_mlp_backward", &expert_mlp_backward_py);
  m.def("check_errors", &check_errors_py, nb::arg("device"), nb::arg("stream") = 0);
  m.def("init_device", &init_device_py, nb::arg("device"), nb::arg("stream") = 0);
}
