// A stack of layers for the offload tests (CPU and GPU suites): layer i is a GroupedMLP followed by
// a GroupedLinear [H -> H] with a probs-scaled bias (two contexts per layer), weights accumulating
// into float32 main_grad. One step runs forward and backward, with or without an
// ActivationOffload, on one stream; what it hands back is copied to the host.
#pragma once

#include <memory>
#include <vector>

#include "moe_engine/modules.hpp"
#include "moe_engine/offload.hpp"
#include "moe_engine/runtime.hpp"
#include "test_support.hpp"

namespace moe::test {

struct StackShape {
  int layers = 4;
  int64_t groups = 4, hidden = 64, ffn = 96;
  bool delay_wgrad = false;
  int opt_out_layer = -1;  // this layer's MLP is built with offload_activations = false
};

// What one step hands back, on the device (run(): nothing synchronizes, so it can be captured).
struct DeviceStep {
  Tensor y, dx;
  std::vector<Tensor> dprobs;  // per layer from the top: the linear's dscales, the MLP's dprobs
  int64_t saved_bytes = 0;
  std::vector<bool> mlp_offloaded;
};

struct StepResult {
  Tensor y, dx;                     // host copies
  std::vector<Tensor> dprobs;       // host copies, per layer from the top: the linear's dscales, the MLP's dprobs
  int64_t saved_bytes = 0;          // on the device right after the forward, all contexts
  std::vector<bool> mlp_offloaded;  // per layer: its MLP context was offloaded
};

class OffloadStack {
 public:
  OffloadStack(const StackShape& shape, Device device) : shape_(shape), device_(device) {
    for (int i = 0; i < shape.layers; ++i) {
      GroupedMLPOptions mo;
      mo.device = device;
      mo.bias = true;
      mo.seed = 100 + uint64_t(i);
      mo.accumulate_into_main_grad = true;
      mo.delay_wgrad_compute = shape.delay_wgrad;
      mo.offload_activations = i != shape.opt_out_layer;
      mlps_.push_back(std::make_unique<GroupedMLP>(shape.groups, shape.hidden, shape.ffn, mo));
      GroupedLinearOptions lo;
      lo.device = device;
      lo.bias = lo.scale_bias = true;
      lo.seed = 200 + uint64_t(i);
      lo.accumulate_into_main_grad = true;
      lo.delay_wgrad_compute = shape.delay_wgrad;
      linears_.push_back(std::make_unique<GroupedLinear>(shape.groups, shape.hidden, shape.hidden, lo));
      for (Parameter* p : {&mlps_.back()->fc1_weight(), &mlps_.back()->fc2_weight(), &linears_.back()->weight()}) {
        Shape s{shape.groups};
        for (int64_t d : p->expert_shape()) s.push_back(d);
        main_grads_.push_back(Tensor::zeros(s, DType::kFloat32, device));
        p->set_main_grad(GroupedParam::packed(main_grads_.back()));
      }
    }
  }

  // One forward + backward over `x` [T, H] with per-layer routings and probs [T]; dy [T, H].
  StepResult step(const Tensor& x, const std::vector<GroupLayout>& routing, const Tensor& probs, const Tensor& dy,
                  ActivationOffload* offload, Stream stream) {
    DeviceStep d = run(x, routing, probs, dy, offload, stream);
    StepResult r;
    r.saved_bytes = d.saved_bytes;
    r.mlp_offloaded = d.mlp_offloaded;
    r.y = host(d.y, stream);
    r.dx = host(d.dx, stream);
    for (const Tensor& t : d.dprobs) r.dprobs.push_back(host(t, stream));
    return r;
  }

  // The step's work, enqueued on `stream` (forward, backward, backward_dw); no synchronization.
  DeviceStep run(const Tensor& x, const std::vector<GroupLayout>& routing, const Tensor& probs, const Tensor& dy,
                 ActivationOffload* offload, Stream stream) {
    const ExecContext exec{stream, {}};
    const int L = shape_.layers;
    std::vector<MlpContext> mlp_ctx(static_cast<size_t>(L));
    std::vector<LinearContext> lin_ctx(static_cast<size_t>(L));
    DeviceStep r;
    Tensor h = x;
    for (int i = 0; i < L; ++i) {
      if (offload) offload->begin_layer(i, stream);
      MlpForwardResult m = mlps_[size_t(i)]->forward(h, routing[size_t(i)], probs, true, exec);
      LinearForwardResult l = linears_[size_t(i)]->forward(m.y, routing[size_t(i)], probs, true, exec);
      mlp_ctx[size_t(i)] = std::move(m.ctx);
      lin_ctx[size_t(i)] = std::move(l.ctx);
      if (offload) {
        offload->offload(mlp_ctx[size_t(i)], stream);
        offload->offload(lin_ctx[size_t(i)], stream);
      }
      h = l.y;  // the previous activation is now held by the contexts only
    }
    for (int i = 0; i < L; ++i) {
      r.saved_bytes += mlp_ctx[size_t(i)].saved_bytes();
      r.mlp_offloaded.push_back(mlp_ctx[size_t(i)].offloaded());
    }
    Tensor grad = dy;
    for (int i = L - 1; i >= 0; --i) {
      if (offload) offload->restore(lin_ctx[size_t(i)], stream);
      LinearBackwardResult lb = linears_[size_t(i)]->backward(lin_ctx[size_t(i)], grad, exec);
      if (offload) offload->restore(mlp_ctx[size_t(i)], stream);
      MlpBackwardResult mb = mlps_[size_t(i)]->backward(mlp_ctx[size_t(i)], lb.dx, exec);
      grad = mb.dx;
      r.dprobs.push_back(lb.dscales);
      r.dprobs.push_back(mb.dprobs);
    }
    for (int i = 0; i < L; ++i) mlps_[size_t(i)]->backward_dw(exec), linears_[size_t(i)]->backward_dw(exec);
    // Nothing above waits for the device: the copies race the compute unless the events order them.
    r.y = h;
    r.dx = grad;
    return r;
  }

  const std::vector<Tensor>& main_grads() const { return main_grads_; }

  std::vector<Tensor> main_grads_on_host(Stream stream) const {
    std::vector<Tensor> out;
    for (const Tensor& g : main_grads_) out.push_back(host(g, stream));
    return out;
  }

 private:
  static Tensor host(const TensorView& t, Stream stream) {
    Tensor h = Tensor::empty(t.shape(), t.dtype());
    copy_tensor(h, t, stream);
    if (t.device().is_cuda()) synchronize(stream);  // (a CUDA build on a machine without a GPU has no stream)
    return h;
  }

  StackShape shape_;
  Device device_;
  std::vector<std::unique_ptr<GroupedMLP>> mlps_;
  std::vector<std::unique_ptr<GroupedLinear>> linears_;
  std::vector<Tensor> main_grads_;
};

}  // namespace moe::test
