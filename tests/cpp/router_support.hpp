// Helpers of the router suites (CPU and GPU): inputs whose logits every backend computes exactly,
// outputs that start poisoned with a tail no op may touch, and runs of the router ops on a device.
#pragma once

#include <cstring>
#include <optional>
#include <vector>

#include "oracle/router_oracle.hpp"
#include "test_support.hpp"

namespace moe::test {

// Values n * unit with n uniform in [-2, 2]: exact in every float dtype, and x W^T of such x (unit
// 1/4) and weight (unit 1/8) is exact in float32 for H < 2^16: every backend and the oracle see the
// same logits, so the choices can be compared exactly.
inline Tensor dyadic_tensor(Shape shape, DType dtype, Rng& rng, double unit) {
  Tensor t = Tensor::empty(shape, dtype);
  oracle::Vector v(static_cast<size_t>(t.numel()));
  for (double& x : v) x = double(rng.integer(-2, 2)) * unit;
  oracle::assign(t, v);
  return t;
}

// Expert biases of whole units 0, 1, 2: an expert with a larger bias always wins (scores are in
// (0, 1)), so near-ties between a score plus a bias and another cannot arise.
inline Tensor tier_bias(int64_t experts, DType dtype, Rng& rng) {
  Tensor t = Tensor::empty({experts}, dtype);
  oracle::Vector v(static_cast<size_t>(experts));
  for (double& b : v) b = double(rng.integer(0, 2));
  oracle::assign(t, v);
  return t;
}

// The router's float type for inputs of `dtype`.
inline DType router_acc(DType dtype) {
  return dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

// A poisoned tensor of `shape` plus `extra` rows (entries for 1-D, one more value for a scalar),
// and the view of its first part: what an op may write. tail_untouched() checks the rest. A
// matrix may also get `extra_cols` columns past each row (a row stride of cols + extra_cols).
struct Padded {
  Tensor storage;
  TensorView view;

  Padded() = default;
  Padded(Shape shape, DType dtype, Device device, int64_t extra = 2, int64_t extra_cols = 0) {
    if (shape.size() == 0) {
      storage = poisoned({1 + extra}, dtype).to(device);
      view = storage.view().select(0);
      return;
    }
    Shape with_tail = shape;
    with_tail[0] += extra;
    if (extra_cols > 0) with_tail[1] += extra_cols;
    storage = poisoned(with_tail, dtype).to(device);
    view = storage.view().slice(0, shape[0]);
    if (extra_cols > 0)
      view = TensorView(view.data(), shape, {with_tail[1], 1}, dtype, device);
  }
  Tensor host() const {
    Tensor h = Tensor::empty(storage.shape(), storage.dtype());
    copy_tensor(h, storage);
    synchronize(nullptr);
    return h;
  }
  // The view's values on the host (contiguous).
  Tensor values() const {
    Tensor h = Tensor::empty(view.shape(), view.dtype());
    if (view.is_contiguous()) {
      copy_tensor(h, view);
      synchronize(nullptr);
      return h;
    }
    const Tensor all = host();  // a padded matrix: its rows gathered on the host
    const size_t es = view.element_size(), row = size_t(view.size(1)) * es;
    for (int64_t r = 0; r < view.size(0); ++r)
      std::memcpy(static_cast<uint8_t*>(h.data()) + size_t(r) * row,
                  static_cast<const uint8_t*>(all.data()) + size_t(r * view.stride(0)) * es, row);
    return h;
  }
  // Every byte of the storage outside the view still poison.
  bool tail_untouched() const {
    const Tensor h = host();
    const auto* p = static_cast<const uint8_t*>(h.data());
    const size_t es = view.element_size();
    const bool strided = view.dim() == 2 && view.stride(0) != view.size(1);
    const size_t rows = strided ? size_t(view.size(0)) : 0, row_bytes = strided ? size_t(view.stride(0)) * es : 0,
                 used = strided ? size_t(view.size(1)) * es : 0;
    for (size_t i = strided ? 0 : view.nbytes(); i < h.nbytes(); ++i) {
      if (strided && i / row_bytes < rows && i % row_bytes < used) continue;
      if (p[i] != kPoison) return false;
    }
    return true;
  }
};

inline Tensor workspace_tensor(size_t bytes, Device device) {
  return bytes == 0 ? Tensor() : Tensor::empty({int64_t(bytes)}, DType::kUInt8, device);
}

inline Workspace workspace_of(const Tensor& t, Device device) {
  return t.defined() ? Workspace{t.data(), t.nbytes(), device} : Workspace{nullptr, 0, device};
}

// router_forward's outputs on a device: logits, indices, probs, counts, and optionally the losses.
struct RouterRun {
  Padded logits, indices, probs, counts, aux_loss, aux_counts, z_loss;

  RouterOutputs outputs() const {
    return {logits.view,   indices.view,    probs.view, counts.view,
            aux_loss.view, aux_counts.view, z_loss.view};
  }
  bool tails_untouched() const {
    for (const Padded* p : {&logits, &indices, &probs, &counts, &aux_loss, &aux_counts, &z_loss})
      if (p->storage.defined() && !p->tail_untouched()) return false;
    return true;
  }
  std::vector<int64_t> host_indices() const {
    const Tensor h = indices.values();
    std::vector<int64_t> v(size_t(h.numel()));
    for (int64_t i = 0; i < h.numel(); ++i)
      v[size_t(i)] = h.dtype() == DType::kInt32 ? h.data_as<int32_t>()[i] : h.data_as<int64_t>()[i];
    return v;
  }
  oracle::Choices choices() const {
    const std::vector<int64_t> flat = host_indices();
    const int64_t k = indices.view.size(1);
    oracle::Choices c;
    for (int64_t t = 0; t < indices.view.size(0); ++t)
      c.emplace_back(flat.begin() + t * k, flat.begin() + (t + 1) * k);
    return c;
  }
  static std::vector<int64_t> int64s(const Padded& p) {
    const Tensor h = p.values();
    return std::vector<int64_t>(h.data_as<int64_t>(), h.data_as<int64_t>() + h.numel());
  }
};

// Allocates the outputs (poisoned, with tails) and runs router_forward on x's device. With
// logits_extra_cols the logits' rows are E + logits_extra_cols apart: 1 makes their stride
// unaligned for TMA, so on Hopper the logits take the SIMT kernels instead of the grouped GEMM.
inline RouterRun run_router_forward(const TensorView& x, const TensorView& weight,
                                    const TensorView& bias, const RouterSpec& spec,
                                    DType index_dtype = DType::kInt64, bool losses = true,
                                    Stream stream = nullptr, int64_t logits_extra_cols = 0) {
  const Device device = x.device();
  const int64_t T = x.size(0), E = weight.size(0), k = spec.topk;
  const DType acc = router_acc(x.dtype());
  RouterRun r;
  r.logits = Padded({T, E}, acc, device, 2, logits_extra_cols);
  r.indices = Padded({T, k}, index_dtype, device);
  r.probs = Padded({T, k}, acc, device);
  r.counts = Padded({E}, DType::kInt64, device);
  if (losses) {
    r.aux_loss = Padded({}, acc, device);
    r.aux_counts = Padded({E}, DType::kInt64, device);
    r.z_loss = Padded({}, acc, device);
  }
  const Tensor ws = workspace_tensor(router_forward_workspace_size(T, E), device);
  router_forward(x, weight, bias, r.outputs(), spec, {stream, workspace_of(ws, device)});
  synchronize(stream);
  return r;
}

struct RouterBackwardRun {
  Padded dx, dweight;
};

// router_backward on x's device after `forward`, with dweight written in `dweight_dtype` (mode
// kWrite) into a fresh tensor.
inline RouterBackwardRun run_router_backward(const RouterOutputGrads& d_out, const TensorView& x,
                                             const TensorView& weight, const RouterRun& forward,
                                             const RouterSpec& spec,
                                             DType dweight_dtype = DType::kFloat32,
                                             Stream stream = nullptr) {
  const Device device = x.device();
  RouterBackwardRun r;
  r.dx = Padded(x.shape(), x.dtype(), device);
  r.dweight = Padded(weight.shape(), dweight_dtype, device);
  const Tensor ws = workspace_tensor(
      router_backward_workspace_size(x.size(0), weight.size(0), x.size(1), x.dtype()), device);
  router_backward(d_out, x, weight, forward.logits.view, forward.indices.view,
                  forward.aux_counts.view, {r.dx.view, r.dweight.view}, spec,
                  {stream, workspace_of(ws, device)});
  synchronize(stream);
  return r;
}

// What the router's accumulating outputs give on `device` for host x, weight, d_probs and a
// starting dx: counts_total after two forwards (from zeros), total_loss beside aux_loss and z_loss,
// dx written by one backward and dx added into `dx_start` by another (accumulate_dx).
struct RouterAccumulation {
  Tensor counts, counts_total, aux_loss, z_loss, total_loss, dx_written, dx_added;
};
inline RouterAccumulation run_router_accumulation(const Tensor& x, const Tensor& weight, const Tensor& d_probs,
                                                  const Tensor& dx_start, const RouterSpec& spec, Device device) {
  const int64_t T = x.size(0), E = weight.size(0), k = spec.topk;
  const DType acc = router_acc(x.dtype());
  const Tensor xd = x.to(device), wd = weight.to(device);
  auto make = [&](Shape shape, DType dt) { return Tensor::zeros(shape, dt, device); };
  const Tensor logits = make({T, E}, acc), indices = make({T, k}, DType::kInt32), probs = make({T, k}, acc),
               counts = make({E}, DType::kInt64), aux = make({}, acc), aux_counts = make({E}, DType::kInt64),
               z = make({}, acc), counts_total = make({E}, DType::kInt64), total = make({}, acc);
  const Tensor fws = workspace_tensor(router_forward_workspace_size(T, E), device);
  RouterOutputs out{logits, indices, probs, counts, aux, aux_counts, z};
  out.counts_total = counts_total;
  out.total_loss = total;
  for (int i = 0; i < 2; ++i) router_forward(xd, wd, {}, out, spec, {nullptr, workspace_of(fws, device)});
  const Tensor bws = workspace_tensor(router_backward_workspace_size(T, E, x.size(1), x.dtype()), device);
  const Tensor written = make(x.shape(), x.dtype()), added = dx_start.to(device), g = d_probs.to(device);
  router_backward({g, {}, {}}, xd, wd, logits, indices, {}, {written, {}}, spec, {nullptr, workspace_of(bws, device)});
  RouterGrads accumulate{added, {}};
  accumulate.accumulate_dx = true;
  router_backward({g, {}, {}}, xd, wd, logits, indices, {}, accumulate, spec, {nullptr, workspace_of(bws, device)});
  synchronize(nullptr);
  const Device cpu = Device::cpu();
  return {counts.to(cpu), counts_total.to(cpu), aux.to(cpu), z.to(cpu), total.to(cpu), written.to(cpu), added.to(cpu)};
}

// A scalar tensor holding v.
inline Tensor scalar_tensor(double v, DType dtype, Device device = Device::cpu()) {
  Tensor t = Tensor::empty({}, dtype);
  oracle::assign(t, {v});
  return t.to(device);
}

// The value of a 0-d tensor.
inline double scalar_value(const TensorView& t) {
  Tensor h = Tensor::empty({1}, t.dtype());
  copy_tensor(h.view().select(0), t);
  synchronize(nullptr);
  return oracle::to_vector(h)[0];
}

}  // namespace moe::test
