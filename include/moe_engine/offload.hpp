// Activation offloading to host memory (docs/design.md section 8): the tensors a module context keeps
// for backward (LinearContext, MlpContext) go to pinned host memory on a side stream while the
// forward goes on, their device memory is released, and they come back one layer ahead of their
// backward. Results are bit-identical to running without offload: the same bytes come back, whatever
// the dtype (the FP8 modules' saved tensors too: E4M3 data, float32 scales, int64 column offsets).
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
// Schedule (OffloadSchedule below decides it; moe_engine.torch.ActivationOffload follows the same
// one): a context's copies start when offload() is called (on a side stream, after the work
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
#include <optional>
#include <vector>

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

// The decisions of activation offload for a stack of `num_layers` layers, as pure functions: which
// saved tensors go to host memory, when a layer's device copies are released and when its reload
// starts. ActivationOffload below and moe_engine.torch.ActivationOffload (through moe_engine._C)
// both follow it, each with its own streams, events and memory.
class MOE_API OffloadSchedule {
 public:
  // The layers [0, offload_layers) are offloaded (nullopt: all but the last). kInvalidArgument
  // unless num_layers >= 1, 0 <= offload_layers <= num_layers and min_bytes >= 0.
  OffloadSchedule(int num_layers, std::optional<int> offload_layers = std::nullopt,
                  int64_t min_bytes = OffloadOptions{}.min_bytes);

  int num_layers() const { return num_layers_; }
  int offload_layers() const { return offload_layers_; }
  int64_t min_bytes() const { return min_bytes_; }

  // Whether a tensor of `nbytes` that layer `layer` saves for backward goes to host memory;
  // `opted_out`: its module or the tensor itself opted out.
  bool offloads(int layer, int64_t nbytes, bool opted_out) const {
    return layer < offload_layers_ && !opted_out && nbytes >= min_bytes_;
  }
  // Forward: when layer `layer` begins, the layer whose device copies are released (its copies to
  // host memory are waited for), or -1. At most two layers' tensors are resident.
  static int released_at_forward(int layer) { return layer >= 2 ? layer - 2 : -1; }

  struct BackwardStart {
    std::vector<int> release;  // in order: these layers' device copies are released
    std::vector<int> reload;   // in order: these layers' reloads start (if not started yet)
  };
  // Backward: when the backward of `layer` begins (`first`: the first of the step). Only the
  // window of the layer and the one below stays: the first backward releases every other layer,
  // later ones the layers above (done with backward); the reloads of the layer and of the one
  // below start.
  BackwardStart at_backward(int layer, bool first) const;

  // A reload that finds the layer's device copies still held (the last offloaded layer: nothing
  // released it before backward) uses them and copies nothing back. Layer 0 has no layer below
  // whose backward would release it afterwards, so it is released at once.
  static bool release_after_kept_reload(int layer) { return layer == 0; }

 private:
  int num_layers_, offload_layers_;
  int64_t min_bytes_;
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
