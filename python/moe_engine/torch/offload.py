"""Activation offloading to pinned host memory (docs/design.md section 8).

The activations that autograd keeps for a layer's backward (for the moe-engine modules: x and the
FC1 pre-activation) are copied to pinned host memory on a side stream as they are saved, their
device memory is released, and they are copied back one layer ahead of the layer's backward.

    offload = ActivationOffload(num_layers=8)            # offloads layers 0..6 (all but the last)
    for i, layer in enumerate(layers):
        with offload.layer(i) as scope:
            x = scope.output(layer(x, splits, probs))
    loss(x).backward()

- What is offloaded: CUDA tensors saved for backward inside ``layer(i)`` of at least ``min_bytes``
  (any dtype: the FP8 modules keep E4M3 data, float32 scales and int64 offsets; copies of the same
  dtype, the FP8 data as bytes: bit-exact), except weights (parameters and the FP8 modules' cached quantized copies,
  ``mark_as_weight``), other leaves that require grad (the caller's inputs: autograd's gradient
  accumulator holds them until backward, so offloading them would free nothing and its reload
  would make a second copy; like weights, they are not counted in ``saved_bytes``) and tensors
  marked with ``mark_not_offload``.
  ``no_offload()`` (or a module built with ``offload_activations=False``) opts out inside an
  offloaded region.
- When: the copy of a tensor starts when it is saved (an event on the current stream orders it
  after the kernel that produced it), so it overlaps the rest of the forward. The device memory of
  layer i is released when layer i + 2 starts (the current stream then waits for layer i's copies),
  so at most two layers' activations are resident during the forward. Backward keeps the same
  window, the layer in backward and the one below it: the reload of layer i starts when the
  backward of layer i + 1 starts, and a layer whose device memory was still held when its reload
  was due (the last offloaded one, released only when backward begins) keeps it and is not
  copied back.
- The schedule (which tensors go, when layers are released and reloaded) is the C++ library's
  ``moe::OffloadSchedule`` (``_C.OffloadSchedule``), which its own ``moe::ActivationOffload``
  follows too; this class applies it with torch's streams, events and allocator.
- Results are bit-identical to running without offload: the same kernels see the same bytes.
- Pinned buffers are allocated on first use per (layer, tensor slot) and kept across steps, so a
  step can be captured in a CUDA graph after one eager step and replayed (the copies and events
  are captured with it).
- Accounting: ``saved_bytes`` is the device memory that the saved tensors of the step's layers
  hold right now (offloaded ones until released, reloaded ones until their backward has used
  them, the others while autograd keeps them; shared storage counted once), and
  ``peak_saved_bytes`` its high-water mark since layer 0 began. ``offload_layers=0`` measures
  a stack without moving anything.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import _C

_STATE = threading.local()


def _opted_out() -> bool:
    return getattr(_STATE, "no_offload", 0) > 0


@contextlib.contextmanager
def no_offload():
    """Tensors saved inside this block stay on the device, even inside an offloaded layer."""
    _STATE.no_offload = getattr(_STATE, "no_offload", 0) + 1
    try:
        yield
    finally:
        _STATE.no_offload -= 1


def mark_not_offload(*tensors: Tensor) -> None:
    """These tensors are never offloaded when saved for backward."""
    for t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"moe_engine: mark_not_offload: expected tensors, got {type(t).__name__}")
        t._moe_no_offload = True


def mark_as_weight(*tensors: Tensor) -> None:
    """These tensors are weights, like parameters: a module holds them across steps (the FP8
    modules' quantized weight copies), so offloading them would free nothing; they are neither
    offloaded nor counted as saved activations."""
    for t in tensors:
        t._moe_weight = True


def _is_weight(t: Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad) or getattr(t, "_moe_weight", False)


def _bytes(t: Tensor) -> Tensor:
    """t's bytes as uint8 elements of the same shape for 1-byte dtypes (the FP8 data), else t: the
    copies are plain byte copies, bit-exact for every dtype."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


@dataclass(eq=False)
class _Saved:
    """An offloaded tensor, as autograd holds it between forward and backward."""
    layer: int
    host: Tensor  # pinned; its shape and dtype are the original's
    source: Optional[Tensor] = None  # the device original, until the layer is released
    device_tensor: Optional[Tensor] = None  # the copy for backward (the original when kept)


class _Kept:
    """A saved tensor that stays on the device (tracked for ``saved_bytes`` only)."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Tensor):
        self.tensor = tensor


@dataclass
class _Layer:
    saved: List[_Saved] = field(default_factory=list)
    offloaded: Optional[torch.cuda.Event] = None  # all of the layer's D2H copies done
    held: List[Tensor] = field(default_factory=list)  # device originals, kept until their copy out ends
    reloaded: Optional[torch.cuda.Event] = None  # None when nothing had to come back
    reload_started: bool = False


class _Scope:
    def __init__(self, offload: "ActivationOffload", index: int):
        self._offload, self._index = offload, index

    def output(self, y: Tensor) -> Tensor:
        """Marks the layer's output: when its gradient arrives (the layer's backward begins), the
        layer's tensors must be back and the previous layer's reload starts."""
        if y.requires_grad:
            y.register_hook(self._offload._backward_hook(self._index))
        return y


class ActivationOffload:
    """Offloads the saved activations of layers ``0 .. offload_layers - 1`` of a stack of
    ``num_layers`` (default: all but the last) to pinned host memory; see the module docstring."""

    def __init__(self, num_layers: int, offload_layers: Optional[int] = None, *, min_bytes: int = 1 << 20,
                 device=None):
        if not torch.cuda.is_available():
            raise RuntimeError("moe_engine: activation offload needs a CUDA device")
        self._schedule = _C.OffloadSchedule(num_layers, offload_layers, min_bytes)
        self.num_layers = num_layers
        self.offload_layers = self._schedule.offload_layers
        self.min_bytes = min_bytes
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self._d2h = torch.cuda.Stream(self.device)
        self._h2d = torch.cuda.Stream(self.device)
        self._pool: Dict[Tuple[int, int], Tensor] = {}  # pinned buffers, kept across steps
        self._layers = [_Layer() for _ in range(num_layers)]
        self._in_backward = False
        self._storages: Dict[int, List[int]] = {}  # device storage address -> [holders, bytes]
        self.saved_bytes = 0
        self.peak_saved_bytes = 0  # of the current / last step
        self.offloaded_bytes = 0  # of the last step: copied to the host
        self.reloaded_bytes = 0  # of the last step: copied back (offloaded minus kept)

    # ---- forward ----

    @contextlib.contextmanager
    def layer(self, index: int):
        """The forward of layer ``index`` (0-based, in order). Yields a scope whose ``output(y)``
        marks the layer's output (needed to schedule the reloads)."""
        if index == 0:
            self._new_step()
        released = _C.OffloadSchedule.released_at_forward(index)
        if released >= 0:
            self._release(released)
        with torch.autograd.graph.saved_tensors_hooks(self._packer(index), self._unpack):
            yield _Scope(self, index)
        st = self._layers[index]
        if st.saved:
            st.offloaded = torch.cuda.Event()
            st.offloaded.record(self._d2h)

    def _new_step(self) -> None:
        # A previous step's records live on in its autograd graph (if any) until that is freed.
        for i in range(self.num_layers):
            self._release(i)
        self._layers = [_Layer() for _ in range(self.num_layers)]
        self._in_backward = False
        self.peak_saved_bytes = self.saved_bytes
        self.offloaded_bytes = self.reloaded_bytes = 0

    def _pinned(self, index: int, slot: int, t: Tensor) -> Tensor:
        buf = self._pool.get((index, slot))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "moe_engine: activation offload met a new tensor shape during CUDA graph capture; run "
                    "one eager step with the same shapes first (it allocates the pinned buffers)")
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._pool[(index, slot)] = buf
        return buf

    def _packer(self, index: int):
        st = self._layers[index]

        def pack(t: Tensor):
            if _is_weight(t) or not t.is_cuda or t.device != self.device:
                return t
            opted_out = _opted_out() or getattr(t, "_moe_no_offload", False)
            if not t.is_contiguous() or not self._schedule.offloads(index, t.numel() * t.element_size(), opted_out):
                kept = _Kept(t)
                self._track(kept, t)
                return kept
            host = self._pinned(index, len(st.saved), t)
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))
            self._d2h.wait_event(produced)
            with torch.cuda.stream(self._d2h):
                _bytes(host).copy_(_bytes(t), non_blocking=True)
            self._hold(t)  # until released
            st.held.append(t)
            rec = _Saved(index, host, source=t)
            st.saved.append(rec)
            self.offloaded_bytes += t.numel() * t.element_size()
            return rec

        return pack

    def _release(self, index: int) -> None:
        """The current stream waits for layer ``index``'s copies out; its device originals are
        dropped (freed, unless kept for backward or held elsewhere)."""
        st = self._layers[index]
        if st.held:
            torch.cuda.current_stream(self.device).wait_event(st.offloaded)
            for t in st.held:
                self._unhold(t.untyped_storage().data_ptr())
            st.held.clear()
            for rec in st.saved:
                rec.source = None

    # ---- backward ----

    def _backward_hook(self, index: int):
        def hook(grad):
            # Only the window of this layer and the one below stays; their reloads start.
            release, reload = self._schedule.at_backward(index, not self._in_backward)
            self._in_backward = True
            for i in release:
                self._release(i)
            for i in reload:
                self._start_reload(i)
            return grad

        return hook

    def _start_reload(self, index: int) -> None:
        st = self._layers[index]
        if st.reload_started or not st.saved:
            return
        st.reload_started = True
        if all(rec.source is not None for rec in st.saved):
            # Still on the device (not released yet): backward uses the originals, which stay
            # held until the layer's backward is over and the current stream has waited for the
            # copies out that read them.
            for rec in st.saved:
                rec.device_tensor, rec.source = rec.source, None
                self._track(rec, rec.device_tensor)
            st.saved = []
            if _C.OffloadSchedule.release_after_kept_reload(index):
                self._release(index)
            return
        main = torch.cuda.current_stream(self.device)
        # The reloaded tensors are allocated on the current stream (freed there after their use in
        # backward); the copy stream starts once the current stream has reached this point.
        for rec in st.saved:
            rec.device_tensor = torch.empty_like(rec.host, device=self.device)
            self._track(rec, rec.device_tensor)
            self.reloaded_bytes += rec.device_tensor.numel() * rec.device_tensor.element_size()
        here = torch.cuda.Event()
        here.record(main)
        self._h2d.wait_event(here)
        self._h2d.wait_event(st.offloaded)
        with torch.cuda.stream(self._h2d):
            for rec in st.saved:
                _bytes(rec.device_tensor).copy_(_bytes(rec.host), non_blocking=True)
        st.reloaded = torch.cuda.Event()
        st.reloaded.record(self._h2d)
        # From here on only autograd holds the records, so each reloaded tensor is freed as soon as
        # its layer's backward has released it.
        st.saved = []

    def _unpack(self, rec):
        if isinstance(rec, _Kept):
            return rec.tensor
        if not isinstance(rec, _Saved):
            return rec
        st = self._layers[rec.layer]
        if not st.reload_started:  # no output() marked for this layer: reload on demand
            self._start_reload(rec.layer)
        if st.reloaded is not None:
            torch.cuda.current_stream(self.device).wait_event(st.reloaded)
        # The record (and so the reloaded copy) lives as long as autograd keeps the saved tensor.
        return rec.device_tensor

    # ---- accounting ----

    def _hold(self, t: Tensor) -> int:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            self._storages[key] = [1, storage.nbytes()]
            self.saved_bytes += storage.nbytes()
            self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)
        else:
            entry[0] += 1
        return key

    def _unhold(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[key]
            self.saved_bytes -= entry[1]

    def _track(self, holder, t: Tensor) -> None:
        """Counts t's storage while autograd keeps ``holder``."""
        weakref.finalize(holder, self._unhold, self._hold(t))

    def pinned_bytes(self) -> int:
        """Pinned host memory held for reuse across steps."""
        return sum(b.numel() * b.element_size() for b in self._pool.values())
