// Activation offloading to host memory (DESIGN.md section 4): the tensors a module context keeps
// for backward (LinearContext, MlpContext) go to pinned host memory on a side stream while the
// forward goes on, their device memory is released, and they come back one layer ahead of their
// backward. Results are bit-identical to running without offload: the same bytes come back.
//
//   ActivationOffload offload(device, num_layers);       // offloads layers 0 .. num_layers - 2
//   for (int i = 0; i < num_layers; ++i) {               // forward
//     offload.begin_layer(i, stream);
//     ctx[i] = mlp[i].forward(x, groups, probs, true, {stream}).ctx;   ...
//     offload.offload(ctx[i], stream);
//   }
//   for (int i = num_layers - 1; i >= 0; --i) {          // backward
//     offload.restore(ctx[i], stream);
//     mlp[i].backward(ctx[i], dy, {stream});  ...
//   }
//
// Schedule: a context's copies start when offload() is called (on a side stream, after the work
// enqueued on `stream` so far, so they overlap the rest of the forward); the device memory of
// layer i is released when layer i + 2 begins (`stream` then waits for layer i's copies), so at
// most two layers' tensors are resident in the forward. Backward keeps the same window: restoring
// layer i starts the reload of layer i - 1, and releases the layers above i. A layer whose device
// memory is still held when its reload is due (the last offloaded one: nothing releases it before
// backward) keeps it and is not copied back. Which tensors go: those a context holds of at least `min_bytes`, on the offload's
// device, from layers below `offload_layers`, unless the module was built with
// offload_activations = false (the per-module opt-out, honoured inside offloaded layers).
//
// Memory: released and reloaded tensors are stream-ordered (Tensor::empty_async) on the
// compute stream, as the modules' outputs are; a saved tensor from plain Tensor::empty is freed
// with cudaFree, which synchronizes the device. Pinned buffers are kept per (layer, tensor) and
// reused by later steps of the same shapes. Weights are never in a context, so never offloaded.
// On a CPU device the same bookkeeping runs with synchronous copies (for tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "moe_engine/device.hpp"
#include "moe_engine/export.hpp"

namespace moe {

class LinearContext;
class MlpContext;

namespace detail {
// Kept in a context that went through ActivationOffload::offload: which offload, step, layer and
// entry hold its tensors, and whether they are away (then backward refuses the context).
struct OffloadTicket {
  const void* owner = nullptr;
  uint64_t step = 0;
  int layer = -1, entry = -1;
  bool away = false;
};
}  // namespace detail

struct OffloadOptions {
  int64_t min_bytes = int64_t(1) << 20;  // smaller saved tensors stay on the device
};

class MOE_API ActivationOffload {
 public:
  // A stack of `num_layers` layers on `device`; the layers [0, offload_layers) are offloaded
  // (offload_layers < 0: all but the last).
  ActivationOffload(Device device, int num_layers, int offload_layers = -1, const OffloadOptions& options = {});
  ~ActivationOffload();  // waits for its copies
  ActivationOffload(const ActivationOffload&) = delete;
  ActivationOffload& operator=(const ActivationOffload&) = delete;

  int num_layers() const;
  int offload_layers() const;

  // Forward: call before enqueuing layer `layer`'s forward on `stream`, layers in order; layer 0
  // begins a new step (anything of the last step not restored is dropped).
  void begin_layer(int layer, Stream stream);
  // After a module's forward in the current layer was enqueued on `stream`: the context's saved
  // tensors start going to host memory and the context drops its device references. Every
  // context of the step goes through offload() and later restore(), offloaded or not.
  void offload(LinearContext& ctx, Stream stream);
  void offload(MlpContext& ctx, Stream stream);
  // Backward, before the context's backward on `stream`: its tensors are back in the context
  // (`stream` waits for their copies) and the reload of the layer below starts.
  void restore(LinearContext& ctx, Stream stream);
  void restore(MlpContext& ctx, Stream stream);

  int64_t offloaded_bytes() const;  // sent to host memory in the current step
  int64_t reloaded_bytes() const;   // copied back in the current step (offloaded, less what was kept)
  size_t pinned_bytes() const;      // host memory held for reuse across steps (pinned on a CUDA device)

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
