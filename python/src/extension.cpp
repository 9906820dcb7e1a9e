// moe_engine._C: the Python face of the C++ library, kept thin. It links no framework: tensors
// cross as DLPack arrays (nb::ndarray; torch tensors pass straight through, see TensorArg), and
// CUDA work runs on the stream the caller passes (moe_engine.torch passes PyTorch's current one).
//
// Routing: every op takes a Routing, the group offsets of one `splits` for a buffer of T rows. Only
// route() (or route_capacity(), given T as a number) makes one, by running GroupLayout::compute
// (Python cannot construct a Routing), so the offsets a kernel sees were always computed and
// checked (CPU) or sanitized (CUDA) by it. A layer computes its routing once in forward and its
// backward reuses it: the routing is handed to torch as a tensor over the offsets whose storage
// owns the Routing (offsets_capsule), and find_routing gets the very same Routing back from that
// tensor.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moe_engine/moe_engine.hpp"

namespace nb = nanobind;

namespace moe_python {

// A tensor argument: whatever nanobind imports as an nb::ndarray (a DLPack producer or capsule).
struct TensorArg {
  nb::ndarray<> array;
};

// torch.Tensor and torch.utils.dlpack.to_dlpack, found once PyTorch has been imported (this module
// never imports it). Strong references, kept for the life of the process.
struct TorchExport {
  PyObject* tensor_type = nullptr;
  PyObject* to_dlpack = nullptr;
};

const TorchExport& torch_export() {
  static TorchExport found;
  if (found.tensor_type != nullptr) return found;
  PyObject* torch = PyImport_GetModule(nb::str("torch").ptr());  // new reference, or NULL: not imported
  if (torch == nullptr) {
    PyErr_Clear();
    return found;
  }
  PyObject* tensor_type = PyObject_GetAttrString(torch, "Tensor");
  PyObject* dlpack = PyImport_ImportModule("torch.utils.dlpack");
  PyObject* to_dlpack = dlpack ? PyObject_GetAttrString(dlpack, "to_dlpack") : nullptr;
  Py_XDECREF(dlpack);
  Py_DECREF(torch);
  if (tensor_type == nullptr || to_dlpack == nullptr || !PyType_Check(tensor_type)) {
    PyErr_Clear();  // a torch still being imported: try again next time
    Py_XDECREF(tensor_type);
    Py_XDECREF(to_dlpack);
    return found;
  }
  found.to_dlpack = to_dlpack;
  found.tensor_type = tensor_type;
  return found;
}

}  // namespace moe_python

namespace nanobind::detail {

// Torch tensors are exported with torch.utils.dlpack.to_dlpack (at::toDLPack: it wraps the tensor
// and touches no stream) rather than the t.__dlpack__() that nanobind's ndarray caster calls:
//  - __dlpack__ synchronizes with the consumer's stream when given one (stream other than -1): it
//    records an event on the current stream and makes the consumer's stream wait; for None (the
//    DLPack default) that is the legacy default stream, which fails a CUDA-graph capture. nanobind
//    passes no stream, so what happens depends on the torch version's default for it; to_dlpack has
//    no such argument.
//  - __dlpack__ refuses tensors that require grad (every parameter) and tensors on a GPU other than
//    the current one; nanobind then falls back to to_dlpack anyway, after two raised exceptions.
//  - __dlpack__ is Python code: about 2.3 us per tensor against 0.3 us for to_dlpack.
// Anything else (numpy arrays, DLPack capsules, other frameworks) goes through nanobind's caster.
template <>
struct type_caster<moe_python::TensorArg> {
  NB_TYPE_CASTER(moe_python::TensorArg, const_name("Tensor"))

  bool from_python(handle src, uint8_t flags, cleanup_list* cleanup) noexcept {
    make_caster<nb::ndarray<>> array;
    const moe_python::TorchExport& torch = moe_python::torch_export();
    if (torch.tensor_type != nullptr && PyObject_TypeCheck(src.ptr(), (PyTypeObject*)torch.tensor_type)) {
      PyObject* args[] = {src.ptr()};
      object capsule = steal(PyObject_Vectorcall(torch.to_dlpack, args, 1, nullptr));
      if (!capsule.is_valid()) {
        PyErr_Clear();
        return false;
      }
      if (!array.from_python(capsule, flags, cleanup)) return false;
    } else if (!array.from_python(src, flags, cleanup)) {
      return false;
    }
    value.array = std::move(array.value);
    return true;
  }

  static handle from_cpp(const moe_python::TensorArg&, rv_policy, cleanup_list*) noexcept { return handle(); }
};

}  // namespace nanobind::detail

namespace moe_python {
namespace {

using namespace moe;

// A grouped parameter: (tensors, pointer table or None). One tensor of rank expert_rank + 1 is the
// packed layout, otherwise one tensor per expert (the table holds their addresses on CUDA); an
// empty list is no parameter.
using GroupedArg = std::pair<std::vector<TensorArg>, std::optional<TensorArg>>;

// ---- DLPack arrays as TensorViews ----

std::string dlpack_dtype_name(nb::dlpack::dtype dt) {
  using Code = nb::dlpack::dtype_code;
  const char* kind = nullptr;
  switch (Code(dt.code)) {
    case Code::Int: kind = "int"; break;
    case Code::UInt: kind = "uint"; break;
    case Code::Float: kind = "float"; break;
    case Code::Bfloat: kind = "bfloat"; break;
    case Code::Complex: kind = "complex"; break;
    case Code::Bool: return "bool";
    default: return "DLPack type code " + std::to_string(int(dt.code)) + " of " + std::to_string(int(dt.bits)) + " bits";
  }
  std::string name = kind + std::to_string(int(dt.bits));
  if (dt.lanes != 1) name += "x" + std::to_string(int(dt.lanes));
  return name;
}

// DLPack 1.1's float8 codes (kDLFloat8_e4m3fn, kDLFloat8_e5m2), by value: older nanobind releases
// (pyproject.toml accepts >= 2.0) do not name them.
constexpr uint8_t kDLFloat8E4M3FN = 10, kDLFloat8E5M2 = 12;

DType dtype_of(const char* op, const char* name, nb::dlpack::dtype dt) {
  using Code = nb::dlpack::dtype_code;
  if (dt.lanes == 1 && dt.bits == 8 && dt.code == kDLFloat8E4M3FN) return DType::kFloat8E4M3;
  if (dt.lanes == 1 && dt.bits == 8 && dt.code == kDLFloat8E5M2) return DType::kFloat8E5M2;
  if (dt.lanes == 1) {
    switch (Code(dt.code)) {
      case Code::Float:
        if (dt.bits == 64) return DType::kFloat64;
        if (dt.bits == 32) return DType::kFloat32;
        if (dt.bits == 16) return DType::kFloat16;
        break;
      case Code::Bfloat:
        if (dt.bits == 16) return DType::kBFloat16;
        break;
      case Code::Int:
        if (dt.bits == 64) return DType::kInt64;
        if (dt.bits == 32) return DType::kInt32;
        break;
      case Code::UInt:
        if (dt.bits == 8) return DType::kUInt8;
        break;
      default: break;
    }
  }
  throw_error(ErrorCode::kDType, op, ": ", name, ": unsupported dtype ", dlpack_dtype_name(dt),
              "; expected one of float64, float32, bfloat16, float16, float8_e4m3, float8_e5m2, int64, int32, uint8");
}

// Pinned host memory (kDLCUDAHost) is host memory; managed memory belongs to its GPU.
std::optional<Device> known_device(const nb::ndarray<>& a) {
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value: return Device::cpu();
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value: return Device::cuda(a.device_id());
    default: return std::nullopt;
  }
}

TensorView view_of(const char* op, const char* name, const TensorArg& t) {
  const nb::ndarray<>& a = t.array;
  const std::optional<Device> device = known_device(a);
  MOE_CHECK(device.has_value(), ErrorCode::kDevice, op, ": ", name, ": expected a CPU or CUDA tensor, got DLPack device type ",
            a.device_type());
  MOE_CHECK(a.ndim() <= size_t(kMaxDims), ErrorCode::kShape, op, ": ", name, ": expected at most ", kMaxDims,
            " dimensions, got ", a.ndim());
  const DType dtype = dtype_of(op, name, a.dtype());
  const int ndim = int(a.ndim());
  const Shape shape(a.shape_ptr(), a.shape_ptr() + ndim);
  // Strides in elements (nanobind fills them in when the producer leaves them out). Those of an
  // extent-1 dimension, and all of a tensor without elements, address nothing: they become the
  // contiguous ones, as torch's is_contiguous() ignores them (the gradient of a sum over an empty
  // tensor comes with strides [0, 0], for one).
  Shape strides(a.stride_ptr(), a.stride_ptr() + ndim);
  const bool empty = shape.numel() == 0;
  for (int64_t d = ndim - 1, contiguous = 1; d >= 0; --d) {
    if (empty || shape[int(d)] == 1) strides[int(d)] = contiguous;
    contiguous *= std::max<int64_t>(shape[int(d)], 1);
  }
  // data(): the address with DLPack's byte offset applied (a const pointer in older nanobind releases).
  void* data = const_cast<void*>(static_cast<const void*>(a.data()));
  return TensorView(data, shape, strides, dtype, *device);
}

GroupedParam param_of(const char* op, const char* name, const GroupedArg& arg, int expert_rank) {
  const auto& [items, table] = arg;
  if (items.empty()) return {};
  // GroupedParam's own message would name neither the op nor the argument.
  const auto contiguous = [&](const TensorView& v) {
    MOE_CHECK(v.is_contiguous(), ErrorCode::kShape, op, ": ", name, ": expected contiguous expert tensors (",
              "call .contiguous() on the weight), got ", v.describe());
    return v;
  };
  if (items.size() == 1) {
    const TensorView v = view_of(op, name, items[0]);
    if (v.dim() == expert_rank + 1) return GroupedParam::packed(contiguous(v));
  }
  std::vector<TensorView> experts;
  experts.reserve(items.size());
  for (const TensorArg& item : items) experts.push_back(contiguous(view_of(op, name, item)));
  return GroupedParam::per_expert(std::move(experts), table ? view_of(op, name, *table) : TensorView());
}

Stream stream_of(uintptr_t stream) { return reinterpret_cast<Stream>(stream); }

// The buffer capacity T: the rows of the op's [T, ...] token tensor, which must be 2-D (a 3-D
// [B, S, H] batch would otherwise read as T = B and the splits would seem to overflow it).
int64_t rows_of(const char* op, const char* name, const TensorView& t) {
  MOE_CHECK(t.dim() == 2, ErrorCode::kShape, op, ": ", name, ": expected a 2-D [T, ...] token tensor (flatten ",
            "batch and sequence into T rows sorted by expert), got ", t.describe());
  return t.size(0);
}

// ---- the device error flags: one per GPU, for the life of the process ----

std::mutex flags_mutex;
std::map<int, std::unique_ptr<DeviceErrorFlag>> flags;

DeviceErrorFlag& error_flag(Device device) {
  std::lock_guard<std::mutex> lock(flags_mutex);
  auto& flag = flags[device.index];
  // Created on first use (a cudaMalloc, which CUDA refuses during graph capture: the PyTorch
  // layer creates it before any op runs on a device, see moe_engine/torch/_bridge.py).
  if (!flag) flag = std::make_unique<DeviceErrorFlag>(device);
  return *flag;
}

// ---- routing ----

std::atomic<uint64_t> layout_computations{0};

// One GroupLayout::compute result, with the splits and offsets buffers it views kept alive. While
// it lives, its offsets buffer belongs to it (no allocator can hand that address to another
// tensor), so the registry below maps (device, offsets address) to it without ambiguity.
class Routing {
 public:
  Routing(nb::ndarray<> splits, nb::ndarray<> offsets, const GroupLayout& layout)
      : splits_(std::move(splits)), offsets_(std::move(offsets)), layout_(layout) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry()[key(layout_.device(), layout_.offsets().data())] = this;
  }
  ~Routing() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(key(layout_.device(), layout_.offsets().data()));
    if (it != registry().end() && it->second == this) registry().erase(it);
  }
  Routing(const Routing&) = delete;
  Routing& operator=(const Routing&) = delete;

  const GroupLayout& layout() const { return layout_; }

  // The live routing whose offsets are at `address` on `device`, or nullptr.
  static Routing* find(Device device, const void* address) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(key(device, address));
    return it == registry().end() ? nullptr : it->second;
  }
  static size_t live() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    return registry().size();
  }

 private:
  using Key = std::pair<int, const void*>;
  static Key key(Device device, const void* address) { return {device.is_cpu() ? -1 : device.index, address}; }
  static std::mutex& registry_mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<Key, Routing*>& registry() {
    static std::map<Key, Routing*> r;
    return r;
  }

  nb::ndarray<> splits_, offsets_;
  GroupLayout layout_;
};

// Offsets of `splits` into `offsets` (int64 [G+1] on the splits' device) for a buffer of `capacity`
// rows. Bad splits throw on the CPU; on CUDA they are sanitized and recorded in the device's error flag.
nb::object route_for(const TensorArg& splits_arg, const TensorArg& offsets_arg, int64_t capacity, uintptr_t stream,
                     const char* op) {
  const TensorView splits = view_of(op, "splits", splits_arg);
  const TensorView offsets = view_of(op, "offsets", offsets_arg);
  GroupLayout layout;
  if (splits.device().is_cuda()) {  // a kernel launch: without the GIL
    nb::gil_scoped_release release;
    layout = GroupLayout::compute(splits, capacity, offsets, &error_flag(splits.device()), stream_of(stream));
  } else {  // G additions
    layout = GroupLayout::compute(splits, capacity, offsets, nullptr, stream_of(stream));
  }
  ++layout_computations;
  return nb::cast(new Routing(splits_arg.array, offsets_arg.array, layout), nb::rv_policy::take_ownership);
}

// The routing for the rows of `tokens`, the op's [T, ...] token tensor.
nb::object route(const TensorArg& splits_arg, const TensorArg& offsets_arg, const TensorArg& tokens_arg,
                 uintptr_t stream, const std::string& op, const std::string& tokens_name) {
  const int64_t capacity = rows_of(op.c_str(), tokens_name.c_str(), view_of(op.c_str(), tokens_name.c_str(), tokens_arg));
  return route_for(splits_arg, offsets_arg, capacity, stream, op.c_str());
}

// The routing for a buffer of `capacity` rows that no tensor of the op has as its extent: the FP8
// wgrad reads columns copies [K, C], whose C = fp8_columns_capacity(T, G) does not determine T.
nb::object route_capacity(const TensorArg& splits_arg, const TensorArg& offsets_arg, int64_t capacity,
                          uintptr_t stream, const std::string& op) {
  return route_for(splits_arg, offsets_arg, capacity, stream, op.c_str());
}

// The live Routing that `offsets` is the offsets tensor of, if it was computed from `splits` (the
// same buffer) for `capacity` rows; None otherwise (a copy, a tensor of another routing, anything).
nb::object find_routing(const TensorArg& offsets_arg, const TensorArg& splits_arg, int64_t capacity) {
  const nb::ndarray<>& offsets = offsets_arg.array;
  const nb::ndarray<>& splits = splits_arg.array;
  const std::optional<Device> device = known_device(offsets);
  Routing* routing = device ? Routing::find(*device, offsets.data()) : nullptr;
  if (routing == nullptr) return nb::none();
  const GroupLayout& g = routing->layout();
  const nb::dlpack::dtype int64{uint8_t(nb::dlpack::dtype_code::Int), 64, 1};
  const bool same_offsets = offsets.dtype() == int64 && offsets.ndim() == 1 &&
                            int64_t(offsets.shape(0)) == g.num_groups() + 1 && offsets.stride(0) == 1;
  const bool same_splits = splits.data() == g.splits().data() && known_device(splits) == g.splits().device() &&
                           splits.ndim() == 1 && int64_t(splits.shape(0)) == g.num_groups() &&
                           splits.dtype().bits == uint8_t(8 * g.splits().element_size());
  if (!same_offsets || !same_splits || capacity != g.capacity()) return nb::none();
  return nb::find(routing);
}

// DLPack's unversioned managed tensor (DLManagedTensor), the struct a "dltensor" capsule holds.
struct ManagedTensor {
  nb::dlpack::dltensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};

// The export of a routing's offsets: the tensor made from it keeps the Routing (a Python object)
// alive until its storage is freed.
struct OffsetsExport {
  ManagedTensor managed{};
  int64_t shape[1] = {0};
  int64_t strides[1] = {1};
  PyObject* routing = nullptr;
};

bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// Torch frees a storage on whichever thread drops it last (an autograd worker, say), with or
// without the GIL: take it before touching the Routing. At interpreter exit the routing is left to
// the interpreter.
void release_offsets_export(ManagedTensor* managed) {
  auto* e = static_cast<OffsetsExport*>(managed->manager_ctx);
  if (python_alive()) {
    const PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(e->routing);
    PyGILState_Release(gil);
  }
  delete e;
}

// A capsule nobody consumed (torch renames the ones it takes to "used_dltensor").
void offsets_capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* managed = static_cast<ManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  managed->deleter(managed);
}

nb::object offsets_capsule(Routing& routing) {
  const TensorView& offsets = routing.layout().offsets();
  auto e = std::make_unique<OffsetsExport>();
  e->shape[0] = offsets.size(0);
  nb::dlpack::dltensor& t = e->managed.dl_tensor;
  t.data = offsets.data();
  t.device = {offsets.device().is_cpu() ? int32_t(nb::device::cpu::value) : int32_t(nb::device::cuda::value),
              offsets.device().is_cpu() ? 0 : offsets.device().index};
  t.ndim = 1;
  t.dtype = {uint8_t(nb::dlpack::dtype_code::Int), 64, 1};
  t.shape = e->shape;
  t.strides = e->strides;
  e->managed.manager_ctx = e.get();
  e->managed.deleter = release_offsets_export;
  PyObject* capsule = PyCapsule_New(&e->managed, "dltensor", offsets_capsule_destructor);
  if (capsule == nullptr) throw nb::python_error();
  e->routing = nb::find(&routing).release().ptr();
  e.release();
  return nb::steal(capsule);
}

// ---- ops ----

// One op call: its name (for messages) and stream. run() releases the GIL, so every Python
// argument is read before.
struct Call {
  const char* op;
  Stream stream;

  TensorView operator()(const char* name, const TensorArg& t) const { return view_of(op, name, t); }
  TensorView operator()(const char* name, const std::optional<TensorArg>& t) const {
    return t ? view_of(op, name, *t) : TensorView();
  }
  GroupedParam param(const char* name, const GroupedArg& g, int expert_rank) const {
    return param_of(op, name, g, expert_rank);
  }

  // Runs the op, then zeroes the unrouted rows of its fresh [T, ...] outputs `token_outputs` (no
  // expert writes them; the gradient of an unrouted row is exactly zero).
  template <class Op>
  void run(const Routing& routing, std::initializer_list<TensorView> token_outputs, Op&& op_fn) const {
    const GroupLayout groups = routing.layout();
    const std::vector<TensorView> outputs(token_outputs);
    nb::gil_scoped_release release;
    op_fn(groups, ExecContext{stream, {}});
    zero_unrouted_rows(outputs, groups, stream);
  }
};

ExecContext with_workspace(ExecContext exec, const TensorView& ws) {
  if (ws.defined()) exec.workspace = {ws.data(), ws.nbytes(), ws.device()};
  return exec;
}

void grouped_linear_forward_py(const TensorArg& x_arg, const GroupedArg& weight_arg, const Routing& routing,
                               const TensorArg& y_arg, const GroupedArg& bias_arg,
                               const std::optional<TensorArg>& row_scale_arg, uintptr_t stream) {
  const Call c{"grouped_linear_forward", stream_of(stream)};
  const TensorView x = c("x", x_arg), y = c("y", y_arg), row_scale = c("row_scale", row_scale_arg);
  const GroupedParam weight = c.param("weight", weight_arg, 2), bias = c.param("bias", bias_arg, 1);
  c.run(routing, {y}, [&](const GroupLayout& g, const ExecContext& e) {
    grouped_linear_forward(x, weight, g, y, {bias, row_scale}, e);
  });
}

void grouped_linear_dgrad_py(const TensorArg& dy_arg, const GroupedArg& weight_arg, const Routing& routing,
                             const TensorArg& dx_arg, uintptr_t stream) {
  const Call c{"grouped_linear_dgrad", stream_of(stream)};
  const TensorView dy = c("dy", dy_arg), dx = c("dx", dx_arg);
  const GroupedParam weight = c.param("weight", weight_arg, 2);
  c.run(routing, {dx}, [&](const GroupLayout& g, const ExecContext& e) { grouped_linear_dgrad(dy, weight, g, dx, e); });
}

void grouped_linear_wgrad_py(const TensorArg& dy_arg, const TensorArg& x_arg, const Routing& routing,
                             const GroupedArg& dweight_arg, const std::string& mode, uintptr_t stream) {
  const Call c{"grouped_linear_wgrad", stream_of(stream)};
  const TensorView dy = c("dy", dy_arg), x = c("x", x_arg);
  const GroupedParam dweight = c.param("out", dweight_arg, 2);
  const GradMode grad_mode = parse_grad_mode(mode);
  c.run(routing, {}, [&](const GroupLayout& g, const ExecContext& e) {
    grouped_linear_wgrad(dy, x, g, dweight, grad_mode, e);
  });
}

void grouped_linear_dbias_py(const TensorArg& dy_arg, const Routing& routing, const GroupedArg& dbias_arg,
                             const std::string& mode, const std::optional<TensorArg>& row_scale_arg,
                             uintptr_t stream) {
  const Call c{"grouped_linear_dbias", stream_of(stream)};
  const TensorView dy = c("dy", dy_arg), row_scale = c("row_scale", row_scale_arg);
  const GroupedParam dbias = c.param("dbias", dbias_arg, 1);
  const GradMode grad_mode = parse_grad_mode(mode);
  c.run(routing, {}, [&](const GroupLayout& g, const ExecContext& e) {
    grouped_linear_dbias(dy, g, dbias, grad_mode, row_scale, e);
  });
}

void grouped_linear_dscales_py(const TensorArg& dy_arg, const GroupedArg& bias_arg, const Routing& routing,
                               const TensorArg& dscales_arg, uintptr_t stream) {
  const Call c{"grouped_linear_dscales", stream_of(stream)};
  const TensorView dy = c("dy", dy_arg), dscales = c("dscales", dscales_arg);
  const GroupedParam bias = c.param("bias", bias_arg, 1);
  c.run(routing, {dscales}, [&](const GroupLayout& g, const ExecContext& e) {
    grouped_linear_dscales(dy, bias, g, dscales, false, e);
  });
}

// ---- FP8 block scaling (moe_engine/fp8.hpp) ----

// The Python layer allocates every FP8 operand; an absent one (rows or columns not requested, a
// weight without its transposed copy) is None, an undefined view the op then checks for.

void quantize_fp8_py(const TensorArg& x_arg, const Routing& routing, const std::optional<TensorArg>& rows_data,
                     const std::optional<TensorArg>& rows_scales, const std::optional<TensorArg>& columns_data,
                     const std::optional<TensorArg>& columns_scales, const std::optional<TensorArg>& columns_offsets,
                     bool pow2_scales, float amax_epsilon, uintptr_t stream) {
  const Call c{"quantize_fp8", stream_of(stream)};
  const TensorView x = c("x", x_arg);
  const Fp8Rows rows{c("rows.data", rows_data), c("rows.scales", rows_scales)};
  const Fp8Columns columns{c("columns.data", columns_data), c("columns.scales", columns_scales),
                           c("columns.offsets", columns_offsets)};
  const Fp8Recipe recipe{pow2_scales, amax_epsilon};
  // Rows past offsets[G] stay unwritten: FP8 operands are no gradients, and no GEMM reads them.
  c.run(routing, {}, [&](const GroupLayout& g, const ExecContext& e) { quantize_fp8(x, g, rows, columns, recipe, e); });
}

void quantize_fp8_weight_py(const GroupedArg& weight_arg, const std::optional<TensorArg>& data,
                            const std::optional<TensorArg>& scales, const std::optional<TensorArg>& data_t,
                            const std::optional<TensorArg>& scales_t, bool pow2_scales, float amax_epsilon,
                            uintptr_t stream) {
  const Call c{"quantize_fp8_weight", stream_of(stream)};
  const GroupedParam weight = c.param("weight", weight_arg, 2);
  const Fp8Weight out{c("out.data", data), c("out.scales", scales), c("out.data_t", data_t),
                      c("out.scales_t", scales_t)};
  const Fp8Recipe recipe{pow2_scales, amax_epsilon};
  nb::gil_scoped_release release;
  quantize_fp8_weight(weight, out, recipe, ExecContext{c.stream, {}});
}

void grouped_linear_fp8_forward_py(const TensorArg& x_data, const TensorArg& x_scales, const TensorArg& w_data,
                                   const TensorArg& w_scales, const Routing& routing, const TensorArg& y_arg,
                                   const GroupedArg& bias_arg, const std::optional<TensorArg>& row_scale_arg,
                                   uintptr_t stream) {
  const Call c{"grouped_linear_forward", stream_of(stream)};
  const Fp8Rows x{c("x.data", x_data), c("x.scales", x_scales)};
  const Fp8Weight weight{c("weight.data", w_data), c("weight.scales", w_scales), {}, {}};
  const TensorView y = c("y", y_arg), row_scale = c("row_scale", row_scale_arg);
  const GroupedParam bias = c.param("bias", bias_arg, 1);
  c.run(routing, {y}, [&](const GroupLayout& g, const ExecContext& e) {
    grouped_linear_forward(x, weight, g, y, {bias, row_scale}, e);
  });
}

void grouped_linear_fp8_dgrad_py(const TensorArg& dy_data, const TensorArg& dy_scales, const TensorArg& w_data_t,
                                 const TensorArg& w_scales_t, const Routing& routing, const TensorArg& dx_arg,
                                 uintptr_t stream) {
  const Call c{"grouped_linear_dgrad", stream_of(stream)};
  const Fp8Rows dy{c("dy.data", dy_data), c("dy.scales", dy_scales)};
  const Fp8Weight weight{{}, {}, c("weight.data_t", w_data_t), c("weight.scales_t", w_scales_t)};
  const TensorView dx = c("dx", dx_arg);
  c.run(routing, {dx}, [&](const GroupLayout& g, const ExecContext& e) { grouped_linear_dgrad(dy, weight, g, dx, e); });
}

void grouped_linear_fp8_wgrad_py(const TensorArg& dy_data, const TensorArg& dy_scales, const TensorArg& dy_offsets,
                                 const TensorArg& x_data, const TensorArg& x_scales, const TensorArg& x_offsets,
                                 const Routing& routing, const GroupedArg& dweight_arg, const std::string& mode,
                                 uintptr_t stream) {
  const Call c{"grouped_linear_wgrad", stream_of(stream)};
  const Fp8Columns dy{c("dy.data", dy_data), c("dy.scales", dy_scales), c("dy.offsets", dy_offsets)};
  const Fp8Columns x{c("x.data", x_data), c("x.scales", x_scales), c("x.offsets", x_offsets)};
  const GroupedParam dweight = c.param("dweight", dweight_arg, 2);
  const GradMode grad_mode = parse_grad_mode(mode);
  c.run(routing, {}, [&](const GroupLayout& g, const ExecContext& e) {
    grouped_linear_wgrad(dy, x, g, dweight, grad_mode, e);
  });
}

void glu_forward_py(const TensorArg& h_arg, const std::optional<TensorArg>& probs_arg, const Routing& routing,
                    const TensorArg& out_arg, const GluSpec& spec, uintptr_t stream) {
  const Call c{"glu_forward", stream_of(stream)};
  const TensorView h = c("h", h_arg), probs = c("probs", probs_arg), out = c("out", out_arg);
  c.run(routing, {out}, [&](const GroupLayout& g, const ExecContext& e) { glu_forward(h, probs, g, out, spec, e); });
}

void glu_backward_py(const TensorArg& h_arg, const std::optional<TensorArg>& probs_arg, const TensorArg& d_out_arg,
                     const Routing& routing, const TensorArg& dh_arg, const std::optional<TensorArg>& dprobs_arg,
                     const GluSpec& spec, uintptr_t stream) {
  const Call c{"glu_backward", stream_of(stream)};
  const TensorView h = c("h", h_arg), probs = c("probs", probs_arg), d_out = c("d_out", d_out_arg);
  const GluBackwardOutputs outputs{c("dh", dh_arg), c("dprobs", dprobs_arg), {}};
  c.run(routing, {outputs.dh, outputs.dprobs}, [&](const GroupLayout& g, const ExecContext& e) {
    glu_backward(h, probs, d_out, g, outputs, spec, e);
  });
}

ExpertMlpWeights mlp_weights_of(const Call& c, const GroupedArg& w1, const GroupedArg& b1, const GroupedArg& w2,
                                const GroupedArg& b2) {
  return {c.param("fc1_weight", w1, 2), c.param("fc1_bias", b1, 1), c.param("fc2_weight", w2, 2),
          c.param("fc2_bias", b2, 1)};
}

void expert_mlp_forward_py(const TensorArg& x_arg, const std::optional<TensorArg>& probs_arg, const GroupedArg& w1,
                           const GroupedArg& b1, const GroupedArg& w2, const GroupedArg& b2, const Routing& routing,
                           const TensorArg& y_arg, const std::optional<TensorArg>& fc1_out_arg, const GluSpec& glu,
                           const std::string& fusion, const std::optional<TensorArg>& workspace_arg,
                           uintptr_t stream) {
  const Call c{"expert_mlp_forward", stream_of(stream)};
  const TensorView x = c("x", x_arg), probs = c("probs", probs_arg), y = c("y", y_arg),
                   fc1_out = c("fc1_out", fc1_out_arg), workspace = c("workspace", workspace_arg);
  const ExpertMlpWeights weights = mlp_weights_of(c, w1, b1, w2, b2);
  const ExpertMlpSpec spec{glu, parse_fusion(fusion)};
  c.run(routing, {y}, [&](const GroupLayout& g, const ExecContext& e) {
    expert_mlp_forward(x, probs, weights, g, y, fc1_out, spec, with_workspace(e, workspace));
  });
}

// The weight gradients go into the given buffers with their modes; the bias gradients are written.
void expert_mlp_backward_py(const TensorArg& dy_arg, const std::optional<TensorArg>& x_arg,
                            const std::optional<TensorArg>& probs_arg, const GroupedArg& w1, const GroupedArg& b1,
                            const GroupedArg& w2, const GroupedArg& b2, const Routing& routing,
                            const std::optional<TensorArg>& fc1_out_arg, const std::optional<TensorArg>& dx_arg,
                            const std::optional<TensorArg>& dprobs_arg, const GroupedArg& fc1_weight_grad,
                            const std::string& fc1_weight_mode, const GroupedArg& fc1_bias_grad,
                            const GroupedArg& fc2_weight_grad, const std::string& fc2_weight_mode,
                            const GroupedArg& fc2_bias_grad, const std::optional<TensorArg>& d_fc1_arg,
                            const std::optional<TensorArg>& act_arg, const GluSpec& glu, const std::string& fusion,
                            const std::optional<TensorArg>& workspace_arg, uintptr_t stream) {
  const Call c{"expert_mlp_backward", stream_of(stream)};
  const TensorView dy = c("dy", dy_arg), x = c("x", x_arg), probs = c("probs", probs_arg),
                   fc1_out = c("fc1_out", fc1_out_arg), workspace = c("workspace", workspace_arg);
  const ExpertMlpWeights weights = mlp_weights_of(c, w1, b1, w2, b2);
  ExpertMlpGrads grads;
  grads.dx = c("dx", dx_arg);
  grads.dprobs = c("dprobs", dprobs_arg);
  grads.fc1_weight = {c.param("fc1_weight_grad", fc1_weight_grad, 2), parse_grad_mode(fc1_weight_mode)};
  grads.fc1_bias = {c.param("fc1_bias_grad", fc1_bias_grad, 1), GradMode::kWrite};
  grads.fc2_weight = {c.param("fc2_weight_grad", fc2_weight_grad, 2), parse_grad_mode(fc2_weight_mode)};
  grads.fc2_bias = {c.param("fc2_bias_grad", fc2_bias_grad, 1), GradMode::kWrite};
  grads.d_fc1 = c("d_fc1", d_fc1_arg);
  grads.act = c("act", act_arg);
  const ExpertMlpSpec spec{glu, parse_fusion(fusion)};
  c.run(routing, {grads.dx, grads.dprobs, grads.d_fc1, grads.act}, [&](const GroupLayout& g, const ExecContext& e) {
    expert_mlp_backward(dy, x, probs, weights, g, fc1_out, grads, spec, with_workspace(e, workspace));
  });
}

// ---- the FP8 expert MLP (moe_engine/expert_mlp_fp8.hpp) ----

// A quantized weight from its tensors; the transposed copy is None where the op does not read it
// (forward reads data and scales only).
Fp8Weight fp8_weight_of(const Call& c, const char* data_name, const TensorArg& data, const char* scales_name,
                        const TensorArg& scales, const char* data_t_name, const std::optional<TensorArg>& data_t,
                        const char* scales_t_name, const std::optional<TensorArg>& scales_t) {
  return {c(data_name, data), c(scales_name, scales), c(data_t_name, data_t), c(scales_t_name, scales_t)};
}

// What forward keeps: x's columns or x's rows (at most one; None: not kept, no FC1 weight gradient)
// and h's rows (None: a forward without backward).
ExpertMlpFp8Saved fp8_saved_of(const Call& c, const std::optional<TensorArg>& x_data,
                               const std::optional<TensorArg>& x_scales, const std::optional<TensorArg>& x_offsets,
                               const std::optional<TensorArg>& x_rows_data,
                               const std::optional<TensorArg>& x_rows_scales, const std::optional<TensorArg>& h_data,
                               const std::optional<TensorArg>& h_scales) {
  return {{c("saved.x.data", x_data), c("saved.x.scales", x_scales), c("saved.x.offsets", x_offsets)},
          {c("saved.fc1_out.data", h_data), c("saved.fc1_out.scales", h_scales)},
          {c("saved.x_rows.data", x_rows_data), c("saved.x_rows.scales", x_rows_scales)}};
}

void expert_mlp_fp8_forward_py(const TensorArg& x_arg, const std::optional<TensorArg>& probs_arg,
                               const TensorArg& w1_data, const TensorArg& w1_scales, const TensorArg& w2_data,
                               const TensorArg& w2_scales, const GroupedArg& b1, const GroupedArg& b2,
                               const Routing& routing, const TensorArg& y_arg,
                               const std::optional<TensorArg>& saved_x_data,
                               const std::optional<TensorArg>& saved_x_scales,
                               const std::optional<TensorArg>& saved_x_offsets,
                               const std::optional<TensorArg>& saved_x_rows_data,
                               const std::optional<TensorArg>& saved_x_rows_scales,
                               const std::optional<TensorArg>& saved_h_data,
                               const std::optional<TensorArg>& saved_h_scales, const GluSpec& glu,
                               const std::string& fusion, bool pow2_scales, float amax_epsilon,
                               const std::optional<TensorArg>& workspace_arg, uintptr_t stream) {
  const Call c{"expert_mlp_fp8_forward", stream_of(stream)};
  const TensorView x = c("x", x_arg), probs = c("probs", probs_arg), y = c("y", y_arg),
                   workspace = c("workspace", workspace_arg);
  const ExpertMlpFp8Weights weights{
      fp8_weight_of(c, "fc1.data", w1_data, "fc1.scales", w1_scales, "fc1.data_t", {}, "fc1.scales_t", {}),
      fp8_weight_of(c, "fc2.data", w2_data, "fc2.scales", w2_scales, "fc2.data_t", {}, "fc2.scales_t", {}),
      c.param("fc1_bias", b1, 1), c.param("fc2_bias", b2, 1)};
  const ExpertMlpFp8Saved saved =
      fp8_saved_of(c, saved_x_data, saved_x_scales, saved_x_offsets, saved_x_rows_data, saved_x_rows_scales,
                   saved_h_data, saved_h_scales);
  const ExpertMlpSpec spec{glu, parse_fusion(fusion)};
  const Fp8Recipe recipe{pow2_scales, amax_epsilon};
  c.run(routing, {y}, [&](const GroupLayout& g, const ExecContext& e) {
    expert_mlp_forward(x, probs, weights, g, y, saved, spec, recipe, with_workspace(e, workspace));
  });
}

// The weight gradients go into the given buffers with their modes; the bias gradients are written.
void expert_mlp_fp8_backward_py(
    const TensorArg& dy_arg, const std::optional<TensorArg>& saved_x_data,
    const std::optional<TensorArg>& saved_x_scales, const std::optional<TensorArg>& saved_x_offsets,
    const std::optional<TensorArg>& saved_x_rows_data, const std::optional<TensorArg>& saved_x_rows_scales,
    const TensorArg& saved_h_data, const TensorArg& saved_h_scales, const std::optional<TensorArg>& probs_arg,
    const TensorArg& w1_data, const TensorArg& w1_scales, const TensorArg& w1_data_t, const TensorArg& w1_scales_t,
    const TensorArg& w2_data, const TensorArg& w2_scales, const TensorArg& w2_data_t, const TensorArg& w2_scales_t,
    const GroupedArg& b1, const GroupedArg& b2, const Routing& routing, const std::optional<TensorArg>& dx_arg,
    const std::optional<TensorArg>& dprobs_arg, const GroupedArg& fc1_weight_grad, const std::string& fc1_weight_mode,
    const GroupedArg& fc1_bias_grad, const GroupedArg& fc2_weight_grad, const std::string& fc2_weight_mode,
    const GroupedArg& fc2_bias_grad, const GluSpec& glu, const std::string& fusion, bool pow2_scales,
    float amax_epsilon, const std::optional<TensorArg>& workspace_arg, uintptr_t stream) {
  const Call c{"expert_mlp_fp8_backward", stream_of(stream)};
  const TensorView dy = c("dy", dy_arg), probs = c("probs", probs_arg), workspace = c("workspace", workspace_arg);
  const ExpertMlpFp8Weights weights{
      fp8_weight_of(c, "fc1.data", w1_data, "fc1.scales", w1_scales, "fc1.data_t", w1_data_t, "fc1.scales_t",
                    w1_scales_t),
      fp8_weight_of(c, "fc2.data", w2_data, "fc2.scales", w2_scales, "fc2.data_t", w2_data_t, "fc2.scales_t",
                    w2_scales_t),
      c.param("fc1_bias", b1, 1), c.param("fc2_bias", b2, 1)};
  const ExpertMlpFp8Saved saved =
      fp8_saved_of(c, saved_x_data, saved_x_scales, saved_x_offsets, saved_x_rows_data, saved_x_rows_scales,
                   saved_h_data, saved_h_scales);
  ExpertMlpGrads grads;
  grads.dx = c("dx", dx_arg);
  grads.dprobs = c("dprobs", dprobs_arg);
  grads.fc1_weight = {c.param("fc1_weight_grad", fc1_weight_grad, 2), parse_grad_mode(fc1_weight_mode)};
  grads.fc1_bias = {c.param("fc1_bias_grad", fc1_bias_grad, 1), GradMode::kWrite};
  grads.fc2_weight = {c.param("fc2_weight_grad", fc2_weight_grad, 2), parse_grad_mode(fc2_weight_mode)};
  grads.fc2_bias = {c.param("fc2_bias_grad", fc2_bias_grad, 1), GradMode::kWrite};
  const ExpertMlpSpec spec{glu, parse_fusion(fusion)};
  const Fp8Recipe recipe{pow2_scales, amax_epsilon};
  c.run(routing, {grads.dx, grads.dprobs}, [&](const GroupLayout& g, const ExecContext& e) {
    expert_mlp_backward(dy, saved, probs, weights, g, grads, spec, recipe, with_workspace(e, workspace));
  });
}

// ---- the GLU spec as one value ----

// Its one-line form, "activation=clamped_qgeglu,layout=blocks:32,limit=7,alpha=1.702,offset=1":
// what the custom ops take (a string crosses torch's dispatcher; GluSpec.parse reads it back).
std::string format_float(float v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);  // the shortest text that reads back as v
  return std::string(buf, r.ptr);
}

std::string glu_spec_text(const GluSpec& s) {
  return "activation=" + std::string(activation_name(s.activation)) + ",layout=" + s.layout.name() +
         ",limit=" + format_float(s.limit) + ",alpha=" + format_float(s.alpha) + ",offset=" + format_float(s.offset);
}

GluSpec parse_glu_spec(const std::string& text) {
  GluSpec s;
  auto fail = [&](const std::string& why) {
    throw_error(ErrorCode::kInvalidArgument, "GluSpec: ", why, " in '", text,
                "'; expected 'activation=A,layout=L,limit=X,alpha=X,offset=X' (every item optional)");
  };
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    const size_t eq = item.find('=');
    if (eq == std::string::npos) fail("no '=' in '" + item + "'");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    auto number = [&]() {
      float v = 0;
      const auto r = std::from_chars(value.data(), value.data() + value.size(), v);
      if (r.ec != std::errc() || r.ptr != value.data() + value.size()) fail("'" + value + "' is not a number");
      return v;
    };
    if (key == "activation") s.activation = parse_activation(value);
    else if (key == "layout") s.layout = GluLayout::parse(value);
    else if (key == "limit") s.limit = number();
    else if (key == "alpha") s.alpha = number();
    else if (key == "offset") s.offset = number();
    else fail("unknown item '" + key + "'");
    begin = end + 1;
  }
  return s;
}

// ---- the MoE layer's ops: router (moe_engine/router.hpp), permute (moe_engine/permute.hpp) ----

// The spec crosses as its fields (a custom op's arguments are plain values).
RouterSpec router_spec_of(const std::string& score, int64_t topk, int64_t num_groups, int64_t topk_groups,
                          bool norm_topk_prob, double scaling_factor, double aux_loss_coeff, double z_loss_coeff) {
  RouterSpec spec;
  spec.score = parse_router_score(score);
  spec.topk = topk;
  spec.num_groups = num_groups;
  spec.topk_groups = topk_groups;
  spec.norm_topk_prob = norm_topk_prob;
  spec.scaling_factor = float(scaling_factor);
  spec.aux_loss_coeff = float(aux_loss_coeff);
  spec.z_loss_coeff = float(z_loss_coeff);
  return spec;
}

void router_forward_py(const TensorArg& x_arg, const TensorArg& weight_arg, const std::optional<TensorArg>& bias_arg,
                       const TensorArg& logits, const TensorArg& indices, const TensorArg& probs,
                       const TensorArg& counts, const std::optional<TensorArg>& aux_loss,
                       const std::optional<TensorArg>& aux_loss_counts, const std::optional<TensorArg>& z_loss,
                       const RouterSpec& spec, const std::optional<TensorArg>& workspace_arg, uintptr_t stream) {
  const Call c{"router_forward", stream_of(stream)};
  const TensorView x = c("x", x_arg), weight = c("weight", weight_arg), bias = c("expert_bias", bias_arg),
                   workspace = c("workspace", workspace_arg);
  const RouterOutputs out{c("logits", logits), c("indices", indices),          c("probs", probs),
                          c("counts", counts), c("aux_loss", aux_loss),        c("aux_loss_counts", aux_loss_counts),
                          c("z_loss", z_loss)};
  nb::gil_scoped_release release;
  router_forward(x, weight, bias, out, spec, with_workspace(ExecContext{c.stream, {}}, workspace));
}

void router_backward_py(const std::optional<TensorArg>& d_probs, const std::optional<TensorArg>& d_aux_loss,
                        const std::optional<TensorArg>& d_z_loss, const TensorArg& x_arg, const TensorArg& weight_arg,
                        const TensorArg& logits_arg, const TensorArg& indices_arg,
                        const std::optional<TensorArg>& aux_loss_counts_arg, const std::optional<TensorArg>& dx,
                        const std::optional<TensorArg>& dweight, const std::string& dweight_mode,
                        const RouterSpec& spec, const std::optional<TensorArg>& workspace_arg, uintptr_t stream) {
  const Call c{"router_backward", stream_of(stream)};
  const RouterOutputGrads d_out{c("d_probs", d_probs), c("d_aux_loss", d_aux_loss), c("d_z_loss", d_z_loss)};
  const TensorView x = c("x", x_arg), weight = c("weight", weight_arg), logits = c("logits", logits_arg),
                   indices = c("indices", indices_arg), aux_loss_counts = c("aux_loss_counts", aux_loss_counts_arg),
                   workspace = c("workspace", workspace_arg);
  const RouterGrads grads{c("dx", dx), c("dweight", dweight), parse_grad_mode(dweight_mode)};
  nb::gil_scoped_release release;
  router_backward(d_out, x, weight, logits, indices, aux_loss_counts, grads, spec,
                  with_workspace(ExecContext{c.stream, {}}, workspace));
}

void router_update_expert_bias_py(const TensorArg& bias_arg, const TensorArg& counts_arg, double rate,
                                  uintptr_t stream) {
  const Call c{"router_update_expert_bias", stream_of(stream)};
  const TensorView bias = c("expert_bias", bias_arg), counts = c("counts", counts_arg);
  nb::gil_scoped_release release;
  router_update_expert_bias(bias, counts, float(rate), ExecContext{c.stream, {}});
}

// The plan's group layout becomes a Routing over the plan's splits and offsets, so the permute ops
// (and any op given its routing tensor) use the layout the plan computed.
nb::object permute_plan_py(const TensorArg& indices_arg, const TensorArg& row_of, const TensorArg& splits_arg,
                           const TensorArg& offsets_arg, const std::optional<TensorArg>& dropped,
                           std::optional<double> capacity_factor, const std::optional<TensorArg>& workspace_arg,
                           uintptr_t stream) {
  const Call c{"permute_plan", stream_of(stream)};
  const TensorView indices = c("indices", indices_arg), workspace = c("workspace", workspace_arg);
  const PermutePlanOutputs out{c("row_of", row_of), c("splits", splits_arg), c("offsets", offsets_arg),
                               c("dropped", dropped)};
  DeviceErrorFlag* errors = indices.device().is_cuda() ? &error_flag(indices.device()) : nullptr;
  GroupLayout layout;
  {
    nb::gil_scoped_release release;
    layout = permute_plan(indices, out, capacity_factor, errors, with_workspace(ExecContext{c.stream, {}}, workspace));
  }
  ++layout_computations;
  return nb::cast(new Routing(splits_arg.array, offsets_arg.array, layout), nb::rv_policy::take_ownership);
}

// Fresh sorted buffers get zeros past the routed rows (no op writes them), as the expert ops' outputs do.
void permute_py(const TensorArg& x_arg, const std::optional<TensorArg>& probs_arg, const TensorArg& row_of_arg,
                const Routing& routing, const TensorArg& x_sorted_arg, const std::optional<TensorArg>& probs_sorted_arg,
                uintptr_t stream) {
  const Call c{"permute", stream_of(stream)};
  const TensorView x = c("x", x_arg), probs = c("probs", probs_arg), row_of = c("row_of", row_of_arg),
                   x_sorted = c("x_sorted", x_sorted_arg), probs_sorted = c("probs_sorted", probs_sorted_arg);
  c.run(routing, {x_sorted, probs_sorted}, [&](const GroupLayout& g, const ExecContext& e) {
    permute(x, probs, row_of, g, x_sorted, probs_sorted, e);
  });
}

void unpermute_py(const TensorArg& out_arg, const std::optional<TensorArg>& probs_arg, const TensorArg& row_of_arg,
                  const Routing& routing, const TensorArg& y_arg, uintptr_t stream) {
  const Call c{"unpermute", stream_of(stream)};
  const TensorView out = c("out", out_arg), probs = c("probs", probs_arg), row_of = c("row_of", row_of_arg),
                   y = c("y", y_arg);
  c.run(routing, {}, [&](const GroupLayout& g, const ExecContext& e) { unpermute(out, probs, row_of, g, y, e); });
}

void permute_backward_py(const TensorArg& d_sorted_arg, const std::optional<TensorArg>& d_probs_sorted_arg,
                         const TensorArg& row_of_arg, const Routing& routing, const TensorArg& dx_arg,
                         const std::optional<TensorArg>& d_probs_arg, uintptr_t stream) {
  const Call c{"permute_backward", stream_of(stream)};
  const TensorView d_sorted = c("d_sorted", d_sorted_arg), d_probs_sorted = c("d_probs_sorted", d_probs_sorted_arg),
                   row_of = c("row_of", row_of_arg), dx = c("dx", dx_arg), d_probs = c("d_probs", d_probs_arg);
  c.run(routing, {}, [&](const GroupLayout& g, const ExecContext& e) {
    permute_backward(d_sorted, d_probs_sorted, row_of, g, dx, d_probs, e);
  });
}

void unpermute_backward_py(const TensorArg& dy_arg, const std::optional<TensorArg>& out_arg,
                           const std::optional<TensorArg>& probs_arg, const TensorArg& row_of_arg,
                           const Routing& routing, const TensorArg& d_out_arg,
                           const std::optional<TensorArg>& d_probs_arg, uintptr_t stream) {
  const Call c{"unpermute_backward", stream_of(stream)};
  const TensorView dy = c("dy", dy_arg), out = c("out", out_arg), probs = c("probs", probs_arg),
                   row_of = c("row_of", row_of_arg), d_out = c("d_out", d_out_arg), d_probs = c("d_probs", d_probs_arg);
  c.run(routing, {d_out}, [&](const GroupLayout& g, const ExecContext& e) {
    unpermute_backward(dy, out, probs, row_of, g, d_out, d_probs, e);
  });
}

void bind_layer_ops(nb::module_& m) {
  using nb::arg;
  nb::class_<RouterSpec>(m, "RouterSpec", "One routing of T tokens over E experts (moe::RouterSpec).")
      .def(
          "__init__",
          [](RouterSpec* self, const std::string& score, int64_t topk, int64_t num_groups, int64_t topk_groups,
             bool norm, double scaling, double aux, double z) {
            new (self) RouterSpec(router_spec_of(score, topk, num_groups, topk_groups, norm, scaling, aux, z));
          },
          arg("score") = "softmax", arg("topk") = 2, arg("num_groups") = 1, arg("topk_groups") = 1,
          arg("norm_topk_prob") = true, arg("scaling_factor") = 1.0, arg("aux_loss_coeff") = 0.0,
          arg("z_loss_coeff") = 0.0)
      .def("check", [](const RouterSpec& s, int64_t num_experts, const std::string& who) {
        check_router_spec(s, num_experts, who);
      }, arg("num_experts"), arg("who"), "Raises ValueError where the spec cannot route over num_experts experts.")
      .def_prop_ro("score", [](const RouterSpec& s) { return std::string(router_score_name(s.score)); })
      .def_ro("topk", &RouterSpec::topk)
      .def_ro("num_groups", &RouterSpec::num_groups)
      .def_ro("topk_groups", &RouterSpec::topk_groups)
      .def_ro("norm_topk_prob", &RouterSpec::norm_topk_prob)
      .def_ro("scaling_factor", &RouterSpec::scaling_factor)
      .def_ro("aux_loss_coeff", &RouterSpec::aux_loss_coeff)
      .def_ro("z_loss_coeff", &RouterSpec::z_loss_coeff)
      .def("__repr__", [](const RouterSpec& s) { return "RouterSpec(" + describe(s) + ")"; });
  m.def("router_forward_workspace_size", &router_forward_workspace_size, arg("tokens"), arg("num_experts"));
  m.def(
      "router_backward_workspace_size",
      [](int64_t tokens, int64_t num_experts, int64_t hidden, const std::string& dtype) {
        return router_backward_workspace_size(tokens, num_experts, hidden, dtype_from_name(dtype));
      },
      arg("tokens"), arg("num_experts"), arg("hidden"), arg("dtype"));
  m.def("router_forward", &router_forward_py, arg("x"), arg("weight"), arg("expert_bias").none(), arg("logits"),
        arg("indices"), arg("probs"), arg("counts"), arg("aux_loss").none(), arg("aux_loss_counts").none(),
        arg("z_loss").none(), arg("spec"), arg("workspace").none(), arg("stream"));
  m.def("router_backward", &router_backward_py, arg("d_probs").none(), arg("d_aux_loss").none(),
        arg("d_z_loss").none(), arg("x"), arg("weight"), arg("logits"), arg("indices"),
        arg("aux_loss_counts").none(), arg("dx").none(), arg("dweight").none(), arg("dweight_mode"), arg("spec"),
        arg("workspace").none(), arg("stream"));
  m.def("router_update_expert_bias", &router_update_expert_bias_py, arg("expert_bias"), arg("counts"), arg("rate"),
        arg("stream"));
  m.def("permuted_rows", &permuted_rows, arg("tokens"), arg("topk"), arg("num_experts"),
        arg("capacity_factor").none() = nb::none(), "The rows R of the expert-sorted buffer (moe::permuted_rows).");
  m.def("expert_capacity", &expert_capacity, arg("tokens"), arg("topk"), arg("num_experts"), arg("capacity_factor"));
  m.def("permute_plan_workspace_size", &permute_plan_workspace_size, arg("tokens"), arg("topk"), arg("num_experts"));
  m.def("permute_plan", &permute_plan_py, arg("indices"), arg("row_of"), arg("splits"), arg("offsets"),
        arg("dropped").none(), arg("capacity_factor").none(), arg("workspace").none(), arg("stream"),
        "Runs moe::permute_plan and returns its group layout as a Routing over `splits` and `offsets`.");
  m.def("permute", &permute_py, arg("x"), arg("probs").none(), arg("row_of"), arg("routing"), arg("x_sorted"),
        arg("probs_sorted").none(), arg("stream"));
  m.def("unpermute", &unpermute_py, arg("out"), arg("probs").none(), arg("row_of"), arg("routing"), arg("y"),
        arg("stream"));
  m.def("permute_backward", &permute_backward_py, arg("d_sorted"), arg("d_probs_sorted").none(), arg("row_of"),
        arg("routing"), arg("dx"), arg("d_probs").none(), arg("stream"));
  m.def("unpermute_backward", &unpermute_backward_py, arg("dy"), arg("out").none(), arg("probs").none(),
        arg("row_of"), arg("routing"), arg("d_out"), arg("d_probs").none(), arg("stream"));
}

// ---- errors ----

// Reads and clears the error flag of GPU `device` (waits for `stream`); raises if a kernel
// reported bad splits. No flag yet (no op has run there): nothing to report.
void check_errors_py(int device, uintptr_t stream) {
  DeviceErrorFlag* flag = nullptr;
  {
    std::lock_guard<std::mutex> lock(flags_mutex);
    auto it = flags.find(device);
    if (it != flags.end()) flag = it->second.get();
  }
  if (flag == nullptr) return;
  nb::gil_scoped_release release;
  flag->check(stream_of(stream));
}

void init_device_py(int device) {
  nb::gil_scoped_release release;
  error_flag(Device::cuda(device));
}

// moe::Error -> ValueError for bad arguments, NotImplementedError, DeviceError (a RuntimeError)
// for what kernels reported, MemoryError for failed allocations, RuntimeError otherwise; the
// message is the C++ one.
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
        case ErrorCode::kOutOfMemory:
          type = PyExc_MemoryError;
          break;
        default:
          break;
      }
      PyErr_SetString(type, e.what());  // e.what() names the code
    }
  });
}

void bind_ops(nb::module_& m) {
  using nb::arg;
  m.def("route", &route, arg("splits"), arg("offsets"), arg("tokens"), arg("stream"), arg("op"), arg("tokens_name"),
        "Computes the group offsets of `splits` into `offsets` (int64 [G+1], on the splits' device) for the rows of "
        "`tokens` with GroupLayout::compute (on `stream`), and returns the Routing that the ops take. The offsets "
        "buffer is handed over: nothing may write into it while the Routing lives.");
  m.def("find_routing", &find_routing, arg("offsets"), arg("splits"), arg("capacity"),
        "The live Routing whose offsets tensor (from Routing.offsets_capsule) `offsets` is, if it was computed from "
        "the same `splits` buffer for `capacity` rows; None otherwise.");
  m.def("group_layout_computations", [] { return layout_computations.load(); },
        "How many times route() has run GroupLayout::compute in this process (for tests).");
  m.def("live_routings", &Routing::live, "How many Routing objects are alive (for tests).");
  m.def(
      "tensor_info",
      [](const TensorArg& t) {
        const TensorView v = view_of("tensor_info", "t", t);
        nb::dict d;
        d["dtype"] = dtype_name(v.dtype());
        d["shape"] = std::vector<int64_t>(v.shape().begin(), v.shape().end());
        d["strides"] = std::vector<int64_t>(v.strides().begin(), v.strides().end());
        d["device"] = to_string(v.device());
        d["data"] = reinterpret_cast<uintptr_t>(v.data());
        return d;
      },
      arg("t"), "How the ops see a tensor argument: dtype, shape, strides (elements), device, data address.");
  nb::class_<Routing>(m, "Routing",
                      "The group offsets of one splits tensor for a buffer of T rows, as GroupLayout::compute made "
                      "them (only route() and route_capacity() create one). Holds the splits and offsets buffers alive.")
      .def_prop_ro("num_groups", [](const Routing& r) { return r.layout().num_groups(); })
      .def_prop_ro("capacity", [](const Routing& r) { return r.layout().capacity(); })
      .def_prop_ro("device", [](const Routing& r) { return to_string(r.layout().device()); })
      .def("offsets_capsule", &offsets_capsule,
           "A DLPack capsule over the offsets whose consumer (torch.utils.dlpack.from_dlpack) keeps this routing "
           "alive as long as the tensor's storage lives; find_routing gets the routing back from that tensor.");

  nb::class_<GluSpec>(m, "GluSpec",
                      "The expert MLP's activation (a GLU: swiglu, clamped_qgeglu; or non-gated: srelu, gelu_tanh) "
                      "with its parameters and, for a GLU, the gate/linear column layout.")
      .def(
          "__init__",
          [](GluSpec* self, const std::string& activation, const std::string& layout, float limit, float alpha,
             float offset) { new (self) GluSpec{parse_activation(activation), limit, alpha, offset, GluLayout::parse(layout)}; },
          arg("activation") = "swiglu", arg("layout") = "halves", arg("limit") = 7.0f, arg("alpha") = 1.702f,
          arg("offset") = 1.0f)
      .def_static("parse", &parse_glu_spec, arg("text"), "The spec of a GluSpec.text string.")
      .def_prop_ro("text", &glu_spec_text, "One line that GluSpec.parse reads back (what the custom ops take).")
      .def_prop_ro("activation", [](const GluSpec& s) { return std::string(activation_name(s.activation)); })
      .def_prop_ro("layout", [](const GluSpec& s) { return s.layout.name(); })
      .def_prop_ro("gated", &GluSpec::gated, "True for a GLU (FC1 has 2F columns), false for srelu and gelu_tanh.")
      .def("fc1_width", [](const GluSpec& s, int64_t ffn) { return fc1_width(s, ffn); }, arg("ffn"),
           "FC1's output width for F = ffn features: 2F for a GLU, F otherwise.")
      .def("check", [](const GluSpec& s, int64_t ffn, const std::string& who) { check_glu_spec(s, ffn, who); },
           arg("ffn"), arg("who"),
           "Raises, the message starting with `who`, where the spec cannot serve F = ffn features (moe::check_glu_spec).")
      .def_ro("limit", &GluSpec::limit)
      .def_ro("alpha", &GluSpec::alpha)
      .def_ro("offset", &GluSpec::offset)
      .def("__eq__", [](const GluSpec& a, const GluSpec& b) { return glu_spec_text(a) == glu_spec_text(b); })
      .def("__repr__", [](const GluSpec& s) { return "GluSpec.parse('" + glu_spec_text(s) + "')"; });

  m.def("grouped_linear_forward", &grouped_linear_forward_py, arg("x"), arg("weight"), arg("routing"), arg("y"),
        arg("bias"), arg("row_scale").none(), arg("stream"));
  m.def("grouped_linear_dgrad", &grouped_linear_dgrad_py, arg("dy"), arg("weight"), arg("routing"), arg("dx"),
        arg("stream"));
  m.def("grouped_linear_wgrad", &grouped_linear_wgrad_py, arg("dy"), arg("x"), arg("routing"), arg("out"),
        arg("mode"), arg("stream"));
  m.def("grouped_linear_dbias", &grouped_linear_dbias_py, arg("dy"), arg("routing"), arg("dbias"), arg("mode"),
        arg("row_scale").none(), arg("stream"));
  m.def("grouped_linear_dscales", &grouped_linear_dscales_py, arg("dy"), arg("bias"), arg("routing"),
        arg("dscales"), arg("stream"));
  m.def("route_capacity", &route_capacity, arg("splits"), arg("offsets"), arg("capacity"), arg("stream"), arg("op"),
        "route() for a buffer of `capacity` rows given as a number (the FP8 wgrad's operands do not carry T).");
  m.def("fp8_columns_capacity", &fp8_columns_capacity, arg("capacity"), arg("num_groups"),
        "The columns C of an FP8 columnwise copy for T tokens and G experts: round_up(T + 127 G, 128).");
  m.def("fp8_scales_pitch", &fp8_scales_pitch, arg("capacity"),
        "The row pitch S of rowwise FP8 scales for T tokens: round_up(T, 4), at least 4.");
  m.def("quantize_fp8", &quantize_fp8_py, arg("x"), arg("routing"), arg("rows_data").none(),
        arg("rows_scales").none(), arg("columns_data").none(), arg("columns_scales").none(),
        arg("columns_offsets").none(), arg("pow2_scales"), arg("amax_epsilon"), arg("stream"));
  m.def("quantize_fp8_weight", &quantize_fp8_weight_py, arg("weight"), arg("data").none(), arg("scales").none(),
        arg("data_t").none(), arg("scales_t").none(), arg("pow2_scales"), arg("amax_epsilon"), arg("stream"));
  m.def("grouped_linear_fp8_forward", &grouped_linear_fp8_forward_py, arg("x_data"), arg("x_scales"),
        arg("weight_data"), arg("weight_scales"), arg("routing"), arg("y"), arg("bias"), arg("row_scale").none(),
        arg("stream"));
  m.def("grouped_linear_fp8_dgrad", &grouped_linear_fp8_dgrad_py, arg("dy_data"), arg("dy_scales"),
        arg("weight_data_t"), arg("weight_scales_t"), arg("routing"), arg("dx"), arg("stream"));
  m.def("grouped_linear_fp8_wgrad", &grouped_linear_fp8_wgrad_py, arg("dy_data"), arg("dy_scales"),
        arg("dy_offsets"), arg("x_data"), arg("x_scales"), arg("x_offsets"), arg("routing"), arg("out"),
        arg("mode"), arg("stream"));
  m.def("glu_forward", &glu_forward_py, arg("h"), arg("probs").none(), arg("routing"), arg("out"), arg("spec"),
        arg("stream"));
  m.def("glu_backward", &glu_backward_py, arg("h"), arg("probs").none(), arg("d_out"), arg("routing"), arg("dh"),
        arg("dprobs").none(), arg("spec"), arg("stream"));
  m.def("expert_mlp_forward", &expert_mlp_forward_py, arg("x"), arg("probs").none(), arg("fc1_weight"),
        arg("fc1_bias"), arg("fc2_weight"), arg("fc2_bias"), arg("routing"), arg("y"), arg("fc1_out").none(),
        arg("spec"), arg("fusion"), arg("workspace").none(), arg("stream"));
  m.def("expert_mlp_backward", &expert_mlp_backward_py, arg("dy"), arg("x").none(), arg("probs").none(),
        arg("fc1_weight"), arg("fc1_bias"), arg("fc2_weight"), arg("fc2_bias"), arg("routing"),
        arg("fc1_out").none(), arg("dx").none(), arg("dprobs").none(), arg("fc1_weight_grad"),
        arg("fc1_weight_mode"), arg("fc1_bias_grad"), arg("fc2_weight_grad"), arg("fc2_weight_mode"),
        arg("fc2_bias_grad"), arg("d_fc1").none(), arg("act").none(), arg("spec"), arg("fusion"),
        arg("workspace").none(), arg("stream"));
  m.def("expert_mlp_fp8_forward", &expert_mlp_fp8_forward_py, arg("x"), arg("probs").none(), arg("fc1_data"),
        arg("fc1_scales"), arg("fc2_data"), arg("fc2_scales"), arg("fc1_bias"), arg("fc2_bias"), arg("routing"),
        arg("y"), arg("saved_x_data").none(), arg("saved_x_scales").none(), arg("saved_x_offsets").none(),
        arg("saved_x_rows_data").none(), arg("saved_x_rows_scales").none(), arg("saved_h_data").none(),
        arg("saved_h_scales").none(), arg("spec"), arg("fusion"), arg("pow2_scales"), arg("amax_epsilon"),
        arg("workspace").none(), arg("stream"),
        "The expert MLP with its six GEMMs in FP8 (forward): y, and what backward needs kept in FP8 (x's columns "
        "or x's rows when given, for the FC1 weight gradient, at most one of the two: "
        "expert_mlp_fp8_keeps_x_rows says which; h's rows when given). The weights arrive quantized. fusion: none "
        "runs every step as its own op; otherwise, on CUDA, the steps around the GLU run fused (the same bytes).");
  m.def("expert_mlp_fp8_backward", &expert_mlp_fp8_backward_py, arg("dy"), arg("saved_x_data").none(),
        arg("saved_x_scales").none(), arg("saved_x_offsets").none(), arg("saved_x_rows_data").none(),
        arg("saved_x_rows_scales").none(), arg("saved_h_data"), arg("saved_h_scales"),
        arg("probs").none(), arg("fc1_data"), arg("fc1_scales"), arg("fc1_data_t"), arg("fc1_scales_t"),
        arg("fc2_data"), arg("fc2_scales"), arg("fc2_data_t"), arg("fc2_scales_t"), arg("fc1_bias"),
        arg("fc2_bias"), arg("routing"), arg("dx").none(), arg("dprobs").none(), arg("fc1_weight_grad"),
        arg("fc1_weight_mode"), arg("fc1_bias_grad"), arg("fc2_weight_grad"), arg("fc2_weight_mode"),
        arg("fc2_bias_grad"), arg("spec"), arg("fusion"), arg("pow2_scales"), arg("amax_epsilon"),
        arg("workspace").none(), arg("stream"));
  m.def(
      "expert_mlp_fp8_saved_shapes",
      [](int64_t T, int64_t G, int64_t H, int64_t F, const GluSpec& glu) {
        const ExpertMlpFp8SavedShapes s = expert_mlp_fp8_saved_shapes(T, G, H, F, {glu});
        auto list = [](const Shape& shape) { return std::vector<int64_t>(shape.begin(), shape.end()); };
        nb::dict d;
        d["x_data"] = list(s.x_data);
        d["x_scales"] = list(s.x_scales);
        d["x_offsets"] = list(s.x_offsets);
        d["fc1_out_data"] = list(s.fc1_out_data);
        d["fc1_out_scales"] = list(s.fc1_out_scales);
        d["x_rows_data"] = list(s.x_rows_data);
        d["x_rows_scales"] = list(s.x_rows_scales);
        return d;
      },
      arg("capacity"), arg("num_groups"), arg("hidden"), arg("ffn"), arg("spec"),
      "The shapes of what the FP8 expert MLP's forward keeps, for T tokens and G experts (the spec's activation "
      "sets FC1's width).");
  m.def(
      "expert_mlp_fp8_forward_workspace_size",
      [](int64_t T, int64_t H, int64_t F, const std::string& dtype, const GluSpec& glu) {
        return expert_mlp_fp8_forward_workspace_size(T, H, F, dtype_from_name(dtype), {glu});
      },
      arg("capacity"), arg("hidden"), arg("ffn"), arg("dtype"), arg("spec"));
  m.def(
      "expert_mlp_fp8_backward_workspace_size",
      [](int64_t T, int64_t G, int64_t H, int64_t F, const std::string& dtype, const GluSpec& glu,
         const std::string& fusion, bool x_rows) {
        return expert_mlp_fp8_backward_workspace_size(T, G, H, F, dtype_from_name(dtype), {glu, parse_fusion(fusion)},
                                                      x_rows);
      },
      arg("capacity"), arg("num_groups"), arg("hidden"), arg("ffn"), arg("dtype"), arg("spec"), arg("fusion"),
      arg("x_rows") = false,
      "x_rows: forward kept x's rows and the FC1 weight gradient is asked for (backward makes x's columns).");
  m.def("expert_mlp_fp8_keeps_x_rows", &expert_mlp_fp8_keeps_x_rows, arg("capacity"), arg("num_groups"),
        "True where x's columns would take more than twice the bytes of its rows, fp8_columns_capacity(T, G) > 2 T "
        "(many experts of few tokens each): forward should keep x's rows for the FC1 weight gradient.");
  m.def("check_errors", &check_errors_py, arg("device"), arg("stream") = 0);
  m.def("init_device", &init_device_py, arg("device"));

  m.def(
      "expert_mlp_forward_workspace_size",
      [](int64_t T, int64_t H, int64_t F, const std::string& dtype, bool save_fc1_out, const GluSpec& glu) {
        return expert_mlp_forward_workspace_size(T, H, F, dtype_from_name(dtype), save_fc1_out, {glu});
      },
      arg("capacity"), arg("hidden"), arg("ffn"), arg("dtype"), arg("save_fc1_out"), arg("spec"));
  m.def(
      "expert_mlp_backward_workspace_size",
      [](int64_t T, int64_t H, int64_t F, const std::string& dtype, bool recompute_fc1, const GluSpec& glu,
         const std::string& fusion, bool d_fc1_given) {
        return expert_mlp_backward_workspace_size(T, H, F, dtype_from_name(dtype), recompute_fc1,
                                                  {glu, parse_fusion(fusion)}, d_fc1_given);
      },
      arg("capacity"), arg("hidden"), arg("ffn"), arg("dtype"), arg("recompute_fc1"), arg("spec"), arg("fusion"),
      arg("d_fc1_given") = false);
}

// ---- the training contract's decisions (moe_engine.torch applies them to torch parameters) ----

void bind_contract(nb::module_& m) {
  using nb::arg;
  nb::class_<GradOutcome>(m, "GradOutcome", "What happens to one weight gradient (moe::grad_outcome).")
      .def_ro("deferred", &GradOutcome::deferred)
      .def_prop_ro("target", [](const GradOutcome& o) { return grad_target_name(o.target); })
      .def_prop_ro("mode", [](const GradOutcome& o) { return grad_mode_name(o.mode); })
      .def_prop_ro("handed_back", [](const GradOutcome& o) { return grad_kind_name(o.handed_back); })
      .def_ro("zero_dummy", &GradOutcome::zero_dummy)
      .def_prop_ro("flag", [](const GradOutcome& o) { return flag_update_name(o.flag); });
  m.def(
      "grad_outcome",
      [](bool accumulate_into_main_grad, bool overwrite_main_grad, bool zero_out_wgrad, bool delay_wgrad_compute,
         bool has_grad_added_to_main_grad) {
        return grad_outcome({accumulate_into_main_grad, overwrite_main_grad, zero_out_wgrad, delay_wgrad_compute,
                             has_grad_added_to_main_grad});
      },
      arg("accumulate_into_main_grad"), arg("overwrite_main_grad"), arg("zero_out_wgrad"),
      arg("delay_wgrad_compute"), arg("has_grad_added_to_main_grad"));

  nb::class_<GroupedKeyPlan>(m, "GroupedKeyPlan", "What the checkpoint key normalization does with one parameter.")
      .def_prop_ro("action", [](const GroupedKeyPlan& p) { return grouped_key_action_name(p.action); })
      .def_prop_ro("shape", [](const GroupedKeyPlan& p) { return std::vector<int64_t>(p.shape.begin(), p.shape.end()); })
      .def_ro("missing", &GroupedKeyPlan::missing)
      .def_ro("error", &GroupedKeyPlan::error);
  m.def(
      "plan_grouped_keys",
      [](const std::map<std::string, std::pair<std::vector<int64_t>, std::string>>& entries, const std::string& key,
         int64_t groups, const std::string& layout, const std::vector<int64_t>& expert_shape) {
        std::map<std::string, CheckpointEntry> e;
        for (const auto& [k, v] : entries) e.emplace(k, CheckpointEntry{Shape(v.first.begin(), v.first.end()), v.second});
        return plan_grouped_keys(e, key, groups, parse_expert_layout(layout),
                                 Shape(expert_shape.begin(), expert_shape.end()));
      },
      arg("entries"), arg("key"), arg("groups"), arg("layout"), arg("expert_shape") = std::vector<int64_t>(),
      "entries: {key: (shape, dtype name)} of the checkpoint (key and key0..key{G-1} are read); layout: packed or "
      "per-expert; expert_shape: the module's [N, ...] (lets a packed module take [G*N, ...]).");

  nb::class_<OffloadSchedule>(m, "OffloadSchedule", "The decisions of activation offload (moe::OffloadSchedule).")
      .def(nb::init<int, std::optional<int>, int64_t>(), arg("num_layers"), arg("offload_layers").none() = nb::none(),
           arg("min_bytes") = OffloadOptions{}.min_bytes)
      .def_prop_ro("num_layers", &OffloadSchedule::num_layers)
      .def_prop_ro("offload_layers", &OffloadSchedule::offload_layers)
      .def_prop_ro("min_bytes", &OffloadSchedule::min_bytes)
      .def("offloads", &OffloadSchedule::offloads, arg("layer"), arg("nbytes"), arg("opted_out"))
      .def_static("released_at_forward", &OffloadSchedule::released_at_forward, arg("layer"))
      .def(
          "at_backward",
          [](const OffloadSchedule& s, int layer, bool first) {
            OffloadSchedule::BackwardStart b = s.at_backward(layer, first);
            return std::make_pair(std::move(b.release), std::move(b.reload));
          },
          arg("layer"), arg("first"), "(layers to release, layers whose reload starts), in order")
      .def_static("release_after_kept_reload", &OffloadSchedule::release_after_kept_reload, arg("layer"));
}

}  // namespace
}  // namespace moe_python

NB_MODULE(_C, m) {
  using namespace moe;
  m.doc() = "moe-engine: grouped GEMMs and expert MLPs for MoE training (C++ core)";
  moe_python::register_errors(m);
  // Objects of this module may legitimately outlive it at interpreter exit (a GluSpec in a module
  // or cache of another package, a Routing owned by a torch tensor's storage); nanobind would
  // report them as leaks.
  nb::set_leak_warnings(false);

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

  moe_python::bind_ops(m);
  moe_python::bind_layer_ops(m);
  moe_python::bind_contract(m);
}
