// ActivationOffload: per step, per layer, the contexts' saved tensors out to pinned host memory on
// one side stream and back on another, ordered against the compute stream with events.
#include "moe_engine/offload.hpp"

#include <cstring>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "core/cuda_api.hpp"
#include "moe_engine/error.hpp"
#include "moe_engine/modules.hpp"

namespace moe {

namespace {

// Host memory a saved tensor goes to: pinned for a CUDA device, plain for the CPU.
class HostBuffer {
 public:
  HostBuffer(size_t bytes, bool pinned) : bytes_(bytes), pinned_(pinned) {
    data_ = pinned ? cuda_api::host_alloc(bytes) : ::operator new(bytes);
  }
  ~HostBuffer() {
    if (pinned_) cuda_api::host_free(data_);
    else ::operator delete(data_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool pinned_ = false;
};

// A CUDA event owned by the offload (no-op handle on the CPU).
struct Event {
  void* handle = nullptr;
  explicit Event(bool cuda) : handle(cuda ? cuda_api::event_create() : nullptr) {}
  ~Event() { cuda_api::event_destroy(handle); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

}  // namespace

OffloadSchedule::OffloadSchedule(int num_layers, std::optional<int> offload_layers, int64_t min_bytes)
    : num_layers_(num_layers), offload_layers_(offload_layers.value_or(num_layers - 1)), min_bytes_(min_bytes) {
  MOE_CHECK(num_layers >= 1, ErrorCode::kInvalidArgument, "ActivationOffload: expected num_layers >= 1, got ",
            num_layers);
  MOE_CHECK(offload_layers_ >= 0 && offload_layers_ <= num_layers, ErrorCode::kInvalidArgument,
            "ActivationOffload: offload_layers must be in [0, ", num_layers, "], got ", offload_layers_);
  MOE_CHECK(min_bytes >= 0, ErrorCode::kInvalidArgument, "ActivationOffload: min_bytes must be >= 0, got ", min_bytes);
}

OffloadSchedule::BackwardStart OffloadSchedule::at_backward(int layer, bool first) const {
  MOE_CHECK(layer >= 0 && layer < num_layers_, ErrorCode::kInvalidArgument, "ActivationOffload: layer ", layer,
            " is not in [0, ", num_layers_, ")");
  BackwardStart s;
  for (int i = first ? 0 : layer + 1; i < num_layers_; ++i)
    if (i != layer && i != layer - 1) s.release.push_back(i);
  s.reload.push_back(layer);
  if (layer >= 1) s.reload.push_back(layer - 1);
  return s;
}

struct ActivationOffload::Impl {
  // One saved tensor of an offloaded context: which field, its shape, where it lives meanwhile.
  struct Saved {
    int field = 0;
    Shape shape;
    DType dtype = DType::kFloat32;
    HostBuffer* host = nullptr;
    Tensor reloaded;  // the device copy once the reload has started (the original when kept)
    Tensor source;    // the device original until the layer is released
  };
  struct Entry {  // one context that went through offload()
    std::vector<Saved> saved;
    bool restored = false;
  };
  struct Layer {
    std::vector<Entry> entries;
    std::vector<Tensor> sources;  // device originals, held until the compute stream has waited for their copies
    std::unique_ptr<Event> offloaded, reloaded;  // all D2H copies of the layer done; its reload done
    std::unique_ptr<Event> marker;                // "the compute stream got here", for the copy streams
    bool has_copies = false, reload_started = false;

    void reset() {  // for a new step; the events are kept
      entries.clear();
      sources.clear();
      has_copies = reload_started = false;
    }
  };

  Device device;
  OffloadSchedule schedule;
  int num_layers;
  bool cuda;
  Stream d2h = nullptr, h2d = nullptr;
  std::vector<Layer> layers;
  std::map<std::tuple<int, int, int>, std::unique_ptr<HostBuffer>> pool;  // (layer, entry, field)
  uint64_t step = 0;
  int current = -1;           // the layer in forward; -1 before the first begin_layer
  bool in_backward = false;
  int64_t offloaded_bytes = 0, reloaded_bytes = 0;

  Impl(Device d, int n, int k, const OffloadOptions& o)
      : device(d),
        schedule(n, k < 0 ? std::nullopt : std::optional<int>(k), o.min_bytes),
        num_layers(n),
        cuda(d.is_cuda()),
        layers(size_t(n)) {
    if (cuda) {
      d2h = cuda_api::stream_create(d.index);
      h2d = cuda_api::stream_create(d.index);
    }
    for (Layer& l : layers) {
      l.offloaded = std::make_unique<Event>(cuda);
      l.reloaded = std::make_unique<Event>(cuda);
      l.marker = std::make_unique<Event>(cuda);
    }
  }

  ~Impl() {
    if (!cuda) return;
    try {
      cuda_api::synchronize(d2h);
      cuda_api::synchronize(h2d);
    } catch (...) {  // a sticky CUDA error: nothing left to wait for
    }
    for (Layer& l : layers) l.sources.clear(), l.entries.clear();
    cuda_api::stream_destroy(d2h);
    cuda_api::stream_destroy(h2d);
  }

  // Orders `waiter` after `event` (CUDA) — the CPU copies are synchronous.
  void wait(Stream waiter, const Event& event) const {
    if (cuda) cuda_api::stream_wait_event(waiter, event.handle);
  }
  void record(const Event& event, Stream stream) const {
    if (cuda) cuda_api::event_record(event.handle, stream);
  }
  void copy(void* dst, const void* src, size_t bytes, Stream stream) const {
    if (bytes == 0) return;
    if (cuda) cuda_api::memcpy_async(dst, src, bytes, stream);
    else std::memcpy(dst, src, bytes);
  }

  void new_step(Stream stream) {
    // A reload that started may still read the pinned buffers the new step's copies overwrite
    // (one that a restore waited for is complete, and waiting again costs nothing).
    for (Layer& l : layers) {
      if (l.reload_started) wait(d2h, *l.reloaded);
      release(l, stream);
      l.reset();
    }
    ++step;
    in_backward = false;
    offloaded_bytes = reloaded_bytes = 0;
  }

  // `stream` waits for the layer's copies to host; its device tensors are dropped (freed in
  // stream order when they were allocated on `stream`).
  void release(Layer& l, Stream stream) {
    if (l.sources.empty()) return;
    wait(stream, *l.offloaded);
    l.sources.clear();
    for (Entry& e : l.entries)
      for (Saved& s : e.saved) s.source = Tensor();
  }

  void begin_layer(int layer, Stream stream) {
    MOE_CHECK(layer >= 0 && layer < num_layers, ErrorCode::kInvalidArgument, "ActivationOffload.begin_layer: layer ",
              layer, " is not in [0, ", num_layers, ")");
    MOE_CHECK(layer == 0 || (layer == current + 1 && !in_backward), ErrorCode::kInvalidArgument,
              "ActivationOffload.begin_layer: layers begin in order 0, 1, ... within a step; expected ",
              in_backward || current < 0 ? 0 : current + 1, ", got ", layer);
    if (layer == 0) new_step(stream);
    if (const int released = OffloadSchedule::released_at_forward(layer); released >= 0)
      release(layers[size_t(released)], stream);
    current = layer;
  }

  template <class Context>
  void offload(Context& ctx, Stream stream, const char* who) {
    MOE_CHECK(current >= 0 && !in_backward, ErrorCode::kInvalidArgument, who,
              ": no layer in forward (call begin_layer first)");
    MOE_CHECK(ctx.live_ && ctx.offload_.owner == nullptr, ErrorCode::kInvalidArgument, who,
              ": expected a fresh context from a forward (it was offloaded already, or used)");
    Layer& l = layers[size_t(current)];
    const int entry_index = int(l.entries.size());
    Entry& entry = l.entries.emplace_back();
    ctx.offload_ = {this, step, current, entry_index, false};
    auto fields = ctx.saved_tensors();
    bool ordered = false;
    for (int f = 0; f < int(fields.size()); ++f) {
      Tensor& t = *fields[size_t(f)];
      if (!t.defined() || !(t.device() == device) ||
          !schedule.offloads(current, int64_t(t.nbytes()), !ctx.offloadable_))
        continue;
      if (!ordered) {  // the copies start after the work enqueued on `stream` so far
        record(*l.marker, stream);
        wait(d2h, *l.marker);
        ordered = true;
      }
      std::unique_ptr<HostBuffer>& host = pool[{current, entry_index, f}];
      if (!host || host->bytes() < t.nbytes()) {
        MOE_CHECK(!cuda || !cuda_api::is_capturing(stream), ErrorCode::kInvalidArgument, who,
                  ": a new tensor size during CUDA graph capture; run one step of the same shapes first");
        host = std::make_unique<HostBuffer>(t.nbytes(), cuda);
      }
      copy(host->data(), t.data(), t.nbytes(), d2h);
      entry.saved.push_back({f, t.shape(), t.dtype(), host.get(), Tensor(), t});
      offloaded_bytes += int64_t(t.nbytes());
      l.sources.push_back(std::move(t));
      t = Tensor();
    }
    if (ordered) {
      record(*l.offloaded, d2h);
      l.has_copies = true;
      ctx.offload_.away = true;
    }
  }

  void start_reload(int layer, Stream stream) {
    Layer& l = layers[size_t(layer)];
    if (l.reload_started || !l.has_copies) return;
    l.reload_started = true;
    if (!l.sources.empty()) {
      // Not released yet: backward uses the originals, which the layer holds on until its
      // backward is over and `stream` has waited for the copies out that read them.
      for (Entry& e : l.entries)
        for (Saved& s : e.saved) s.reloaded = std::move(s.source);
      record(*l.reloaded, stream);
      if (OffloadSchedule::release_after_kept_reload(layer)) release(l, stream);
      return;
    }
    // Allocated in stream order on the compute stream (freed there once backward is done with
    // them); the copy stream starts after that point and after the layer's copies out.
    for (Entry& e : l.entries)
      for (Saved& s : e.saved) s.reloaded = Tensor::empty_async(s.shape, s.dtype, device, stream);
    record(*l.marker, stream);
    wait(h2d, *l.marker);
    wait(h2d, *l.offloaded);
    for (Entry& e : l.entries)
      for (Saved& s : e.saved) {
        copy(s.reloaded.data(), s.host->data(), s.reloaded.nbytes(), h2d);
        reloaded_bytes += int64_t(s.reloaded.nbytes());
      }
    record(*l.reloaded, h2d);
  }

  template <class Context>
  void restore(Context& ctx, Stream stream, const char* who) {
    const detail::OffloadTicket& ticket = ctx.offload_;
    MOE_CHECK(ticket.owner == this, ErrorCode::kInvalidArgument, who,
              ": the context did not go through this ActivationOffload's offload()");
    MOE_CHECK(ticket.step == step, ErrorCode::kInvalidArgument, who,
              ": the context comes from an earlier step (layer 0 has begun again since)");
    Entry& entry = layers[size_t(ticket.layer)].entries[size_t(ticket.entry)];
    MOE_CHECK(!entry.restored, ErrorCode::kInvalidArgument, who, ": the context was restored already");
    const OffloadSchedule::BackwardStart start = schedule.at_backward(ticket.layer, !in_backward);
    in_backward = true;
    for (int i : start.release) release(layers[size_t(i)], stream);
    for (int i : start.reload) start_reload(i, stream);
    Layer& l = layers[size_t(ticket.layer)];
    if (!entry.saved.empty()) {
      wait(stream, *l.reloaded);
      auto fields = ctx.saved_tensors();
      for (Saved& s : entry.saved) *fields[size_t(s.field)] = std::move(s.reloaded);
      entry.saved.clear();
    }
    entry.restored = true;
    ctx.offload_.away = false;
  }

  size_t pinned_bytes() const {
    size_t n = 0;
    for (const auto& [key, buf] : pool) n += buf->bytes();
    return n;
  }
};

ActivationOffload::ActivationOffload(Device device, int num_layers, int offload_layers, const OffloadOptions& options)
    : impl_(std::make_unique<Impl>(device, num_layers, offload_layers, options)) {}
ActivationOffload::~ActivationOffload() = default;

int ActivationOffload::num_layers() const { return impl_->num_layers; }
int ActivationOffload::offload_layers() const { return impl_->schedule.offload_layers(); }
void ActivationOffload::begin_layer(int layer, Stream stream) { impl_->begin_layer(layer, stream); }
void ActivationOffload::offload(LinearContext& ctx, Stream stream) { impl_->offload(ctx, stream, "ActivationOffload.offload"); }
void ActivationOffload::offload(MlpContext& ctx, Stream stream) { impl_->offload(ctx, stream, "ActivationOffload.offload"); }
void ActivationOffload::restore(LinearContext& ctx, Stream stream) { impl_->restore(ctx, stream, "ActivationOffload.restore"); }
void ActivationOffload::restore(MlpContext& ctx, Stream stream) { impl_->restore(ctx, stream, "ActivationOffload.restore"); }
int64_t ActivationOffload::offloaded_bytes() const { return impl_->offloaded_bytes; }
int64_t ActivationOffload::reloaded_bytes() const { return impl_->reloaded_bytes; }
size_t ActivationOffload::pinned_bytes() const { return impl_->pinned_bytes(); }

}  // namespace moe
