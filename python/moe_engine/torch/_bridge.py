"""How torch tensors reach the C++ extension: the tensors themselves (``_C`` imports them as DLPack
arrays, see python/src/extension.cpp), the current CUDA stream, the experts' pointer tables, and
the routing. Nothing here reads a tensor's values (no host sync).

The routing of a layer (``_C.Routing``: the group offsets that ``GroupLayout::compute`` made from
``splits``) is computed once per forward and reused by the backward. Torch's dispatcher carries
only tensors, so a forward op returns the routing as a tensor over its offsets (``routing_tensor``)
whose storage owns the ``_C.Routing``; a backward op given that tensor gets the same ``_C.Routing``
back (``routing_of``). A tensor that is not a live routing of the same splits and rows (a copy, a
forged one), or whose splits tensor was written in place since (its version counter moved), is
never trusted: the offsets are then computed again from splits.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import torch
import torch.utils.dlpack

from .. import _C


def dtype_name(dtype: torch.dtype) -> str:
    """The C++ library's name of a torch dtype ("bfloat16", ...)."""
    return str(dtype)[len("torch."):]


_READY_DEVICES = set()


def ensure_device(index: int) -> None:
    """Creates the GPU's device error record (a cudaMalloc) before the first op runs there; CUDA
    refuses allocations during graph capture, so that first op must not be inside one."""
    if index in _READY_DEVICES:
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"moe_engine: first use of cuda:{index} inside CUDA graph capture; call "
            "moe_engine.torch.init_device() (or run any moe_engine op) before capturing"
        )
    _C.init_device(index)
    _READY_DEVICES.add(index)


# The raw cudaStream_t of a device's current stream, as torch.compile's generated code reads it:
# ~0.3 us against ~12 us for torch.cuda.current_stream(index).cuda_stream on an H200 host (it builds
# a Stream object), paid by every op call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(t: torch.Tensor) -> int:
    """The current CUDA stream of t's device (0 for CPU tensors); prepares the device on first use."""
    if not t.is_cuda:
        return 0
    index = t.get_device()
    if index not in _READY_DEVICES:
        ensure_device(index)
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


# Pointer tables of per-expert tensors on CUDA, keyed by the experts' addresses. A table's content
# is a function of its key, so a cached table is never stale; the cache only bounds uploads.
_POINTER_TABLES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_POINTER_TABLES_MAX = 256


def pointer_table(experts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    if len(experts) == 0 or not experts[0].is_cuda:
        return None
    key = (experts[0].get_device(),) + tuple(t.data_ptr() for t in experts)
    table = _POINTER_TABLES.get(key)
    if table is not None:
        _POINTER_TABLES.move_to_end(key)
        return table
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "moe_engine: per-expert tensors at addresses not seen before cannot be used during CUDA "
            "graph capture (their pointer table needs an upload); run the op once before capturing"
        )
    table = torch.tensor(key[1:], dtype=torch.int64).to(experts[0].device)
    _POINTER_TABLES[key] = table
    if len(_POINTER_TABLES) > _POINTER_TABLES_MAX:
        _POINTER_TABLES.popitem(last=False)
    return table


def is_packed(ts: Sequence[torch.Tensor], expert_rank: int) -> bool:
    return len(ts) == 1 and ts[0].dim() == expert_rank + 1


def grouped(ts: Sequence[torch.Tensor], expert_rank: int):
    """A grouped parameter for the extension: (tensors, pointer table or None). One packed
    [G, ...] tensor (rank expert_rank + 1) or G per-expert tensors (with their pointer table on
    CUDA); an empty list is no parameter."""
    if len(ts) == 0 or is_packed(ts, expert_rank):
        return (ts, None)
    return (ts, pointer_table(ts))


def check_int(who: str, name: str, value, minimum: Optional[int] = None) -> int:
    """``value`` as an int: a Python or NumPy integer (not a bool, not a float, which ``int()`` would
    truncate), at least ``minimum``."""
    if isinstance(value, bool):
        raise TypeError(f"moe_engine: {who}: {name} must be an integer, got bool {value}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"moe_engine: {who}: {name} must be an integer, got {type(value).__name__} {value!r}") from None
    if minimum is not None and n < minimum:
        raise ValueError(f"moe_engine: {who}: {name} = {n}; expected >= {minimum}")
    return n


def check_real(who: str, name: str, value) -> float:
    """``value`` as a float: a real number (not a bool or a string, which ``float()`` would take)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"moe_engine: {who}: {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


# ---- calling the custom ops ----


def _plain_eager(args) -> bool:
    """Whether a call with these arguments may skip torch's dispatcher: eager mode on plain tensors
    (no torch.compile / tracing, no fake or functional tensors, no dispatch mode, no functorch
    transform)."""
    if torch.compiler.is_compiling():
        return False
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor:
                return False
            break
    return torch._C._len_torch_dispatch_stack() == 0 and torch._C._functorch.peek_interpreter_stack() is None


class FastOp:
    """A ``torch.library.custom_op`` as the modules call it. In plain eager mode the op's Python
    implementation runs directly (its autograd, when it has one, as an ``autograd.Function`` made of
    the same setup and backward): torch's dispatcher costs 20-90 us of host time per call on an
    H200 host (``docs/performance-log.md``), which a small batch's step, bound by host time, pays
    about ten times. Anywhere else (torch.compile, tracing, fake tensors) the call goes through the
    op, its fake implementation and its registered autograd as before."""

    def __init__(self, op, setup_context=None, backward=None, differentiable=False):
        """setup_context / backward: the op's registered autograd, run as an autograd.Function
        (tensor arguments only: a Function sees no tensor inside a list). differentiable without
        them: calls with grad enabled go through the op."""
        self.op = op
        self._impl = getattr(op, "_init_fn", None)  # the decorated function (torch >= 2.4)
        self._function = None
        self._differentiable = differentiable or backward is not None
        if backward is not None:
            impl = self._impl

            class _Function(torch.autograd.Function):
                @staticmethod
                def forward(ctx, *args):
                    out = impl(*args)
                    setup_context(ctx, args, out)
                    return out

                @staticmethod
                def backward(ctx, *grads):
                    return backward(ctx, *grads)

            self._function = _Function

    def __call__(self, *args, **kwargs):
        if self._impl is None or not _plain_eager(args):
            return self.op(*args, **kwargs)
        try:
            if self._differentiable and torch.is_grad_enabled():
                if self._function is None:
                    return self.op(*args, **kwargs)
                return self._function.apply(*args, *kwargs.values())  # ops with autograd take no defaults
            return self._impl(*args, **kwargs)
        except TypeError:
            # A meta tensor reaches the extension as an unsupported argument type. Through the op
            # the dispatcher picks the fake implementation instead: shapes for all-meta arguments,
            # or the clear error of check_devices for meta tensors mixed with real ones.
            if _any_meta(args) or _any_meta(kwargs.values()):
                return self.op(*args, **kwargs)
            raise


def _any_meta(args) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_meta:
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.is_meta for t in a):
            return True
    return False


def check_devices(op: str, **tensors) -> None:
    """For the fake implementations: every tensor argument (a tensor, a list of them or None) on one
    device. The dispatcher runs an op's fake implementation when any argument is a meta tensor, so a
    meta tensor among real ones would get a real output of the right shape holding uninitialized
    memory; under FakeTensorMode (torch.compile) the devices are the ones of the real tensors."""
    first_name, first = None, None
    for name, value in tensors.items():
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if t is None:
                continue
            if first is None:
                first_name, first = name, t.device
            elif t.device != first:
                raise ValueError(
                    f"moe_engine: {op}: {name} is on {t.device} but {first_name} is on {first}; expected every "
                    "tensor on one device" + (" (a meta tensor has no values to compute with)"
                                              if "meta" in (t.device.type, first.type) else ""))


def check_writable(op: str, **targets) -> None:
    """The buffers an op writes in place (a tensor or a list of them): none may require grad while
    grad mode is on. The op writes them outside autograd, which torch's own in-place operations
    refuse for such leaves: a parameter passed as a gradient buffer would be overwritten and the
    graph would not know. Under torch.no_grad() they are written, as torch's are."""
    if not torch.is_grad_enabled():
        return
    for name, value in targets.items():
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(
                    f"moe_engine: {op}: {name} requires grad (a parameter?) and would be written in place "
                    "outside autograd; expected a gradient buffer (e.g. the parameter's main_grad), or the call "
                    "under torch.no_grad()")


# ---- routing ----

_SPLITS_DTYPES = (torch.int64, torch.int32)


def check_splits(splits: torch.Tensor) -> None:
    """What only splits can get wrong here, so that the message names splits and what it may be."""
    if not isinstance(splits, torch.Tensor):
        raise TypeError(f"moe_engine: splits must be a [G] int64 or int32 tensor, got {type(splits).__name__}")
    if splits.dtype not in _SPLITS_DTYPES:
        raise ValueError(f"moe_engine: splits must be an int64 or int32 tensor (tokens per expert), got {splits.dtype}")
    if splits.dim() != 1:
        raise ValueError(f"moe_engine: splits must be 1-D [G] (tokens per expert), got shape {tuple(splits.shape)}")


# _C.find_routing identifies a routing by the address of its splits buffer, which new values
# written in place (splits.copy_(...), Megatron reusing a buffer across micro-batches) keep. So each
# routing also records the splits tensor's version counter when its offsets were computed (autograd's
# counter, moved by every in-place write, under no_grad too; never a read of the values, so no host
# sync), and a routing whose splits changed since is not reused. Key: the routing's offsets, (device
# index, address), which are the routing's own while it lives; value: ((device index, address) of
# the splits buffer, version). Version None: not checked, for routings made during a CUDA graph
# capture (every replay computes their offsets again from the values in the buffer then) and for
# inference tensors (no version counter). Entries of dead routings are overwritten by the next
# routing at that address; the table is bounded (an entry dropped: that routing is recomputed).
_ROUTING_SOURCES: dict = {}
_ROUTING_SOURCES_MAX = 1 << 16
_TRUSTED = threading.local()


def _version_of(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def record_routing(offsets: torch.Tensor, splits: torch.Tensor) -> None:
    """Notes which splits (buffer and version) the routing over ``offsets`` was computed from; every
    place that makes a ``_C.Routing`` calls it."""
    capturing = splits.is_cuda and torch.cuda.is_current_stream_capturing()
    key = (offsets.get_device(), offsets.data_ptr())
    table = _ROUTING_SOURCES
    table.pop(key, None)  # re-inserted last: the oldest entries are the ones dropped
    table[key] = ((splits.get_device(), splits.data_ptr()), None if capturing else _version_of(splits))
    if len(table) > _ROUTING_SOURCES_MAX:
        del table[next(iter(table))]


def routing_source(routing: torch.Tensor):
    """((device index, address) of the splits buffer, version or None) that the routing tensor's
    routing was computed from, or None when not known."""
    return _ROUTING_SOURCES.get((routing.get_device(), routing.data_ptr()))


def _splits_unchanged(saved: torch.Tensor, splits: torch.Tensor) -> bool:
    """Whether the routing of ``saved`` (found by find_routing: computed from this splits buffer)
    still describes the buffer's values: neither the splits' version counter nor the routing
    tensor's own (a fresh tensor over the offsets, version 0, when the op returned it) has moved."""
    if getattr(_TRUSTED, "depth", 0) == 0 and _version_of(saved) not in (0, None):
        return False  # offsets written into the routing tensor itself (read-only by contract)
    source = routing_source(saved)
    if source is None:
        return False
    version = source[1]
    return version is None or version == _version_of(splits) or getattr(_TRUSTED, "depth", 0) > 0


@contextlib.contextmanager
def forward_routings():
    """Inside, a routing found for its splits buffer is reused even when the buffer was written
    since: for a module's delayed weight gradients (``backward_dw``), whose queued jobs hold the
    forward's operands and routing, laid out by the forward's offsets, while the caller may already
    have reused the splits buffer for the next micro-batch."""
    _TRUSTED.depth = getattr(_TRUSTED, "depth", 0) + 1
    try:
        yield
    finally:
        _TRUSTED.depth -= 1


def routing_is_stale(routing: torch.Tensor, splits, capacity: int) -> bool:
    """Whether ``routing`` (an FP8 operand's) is a live routing of this splits buffer whose values
    were written in place after it was computed; False where that is not known (and while
    torch.compile traces: the ops check it when they run)."""
    if (torch.compiler.is_compiling() or not isinstance(splits, torch.Tensor) or splits.device != routing.device
            or splits.is_meta):
        return False
    return _C.find_routing(routing, splits, capacity) is not None and not _splits_unchanged(routing, splits)


def _stale(stale: Optional[str]):
    """A routing of these splits whose values were written since: for an op whose operands are laid
    out by it (``stale``: the message), an error; for the others, computed again."""
    if stale is not None:
        raise ValueError(f"{stale} was quantized with splits whose values have been overwritten in place since "
                         "(splits._version moved); quantize it again with the splits as they are now")


def routing_of(op: str, tokens_name: str, tokens: torch.Tensor, splits: torch.Tensor, stream: int,
               saved: Optional[torch.Tensor] = None, stale: Optional[str] = None):
    """The ``_C.Routing`` of ``splits`` for the rows of ``tokens`` (the op's [T, ...] token tensor,
    named ``tokens_name`` in ``op``'s messages): the one ``saved`` stands for, when it is the
    routing tensor of a live routing of these splits and rows whose values have not been written
    since, else a new one (``GroupLayout::compute``: one small kernel on ``stream``, into an offsets
    buffer from torch's allocator). ``stale``: "op: operand" for ops whose operand (FP8, laid out by
    the routing it was quantized with) a routing of since-overwritten splits cannot serve: an error
    then, instead of a new routing."""
    if saved is not None:
        found = _C.find_routing(saved, splits, tokens.shape[0] if tokens.dim() > 0 else -1)
        if found is not None:
            if _splits_unchanged(saved, splits):
                return found
            _stale(stale)
    check_splits(splits)
    offsets = torch.empty(splits.shape[0] + 1, dtype=torch.int64, device=splits.device)  # the routing's alone
    routing = _C.route(splits, offsets, tokens, stream, op, tokens_name)
    record_routing(offsets, splits)
    return routing


def routing_for_capacity(op: str, capacity: int, splits: torch.Tensor, stream: int,
                         saved: Optional[torch.Tensor] = None, stale: Optional[str] = None):
    """``routing_of`` for a buffer of ``capacity`` rows given as a number, for ops none of whose
    tensors has T as an extent (the FP8 wgrad reads columns copies [K, C])."""
    if saved is not None:
        found = _C.find_routing(saved, splits, capacity)
        if found is not None:
            if _splits_unchanged(saved, splits):
                return found
            _stale(stale)
    check_splits(splits)
    offsets = torch.empty(splits.shape[0] + 1, dtype=torch.int64, device=splits.device)
    routing = _C.route_capacity(splits, offsets, capacity, stream, op)
    record_routing(offsets, splits)
    return routing


def routing_tensor(routing) -> torch.Tensor:
    """The routing as a tensor that crosses torch's dispatcher: int64 [G+1], its offsets, on the
    splits' device. Its storage holds the ``_C.Routing`` (and with it the splits and offsets
    buffers), so the routing lives as long as autograd keeps the tensor. Read-only by contract."""
    return torch.utils.dlpack.from_dlpack(routing.offsets_capsule())


def routing_like(splits: torch.Tensor) -> torch.Tensor:
    """What a fake implementation returns for a routing tensor."""
    return splits.new_empty(splits.shape[0] + 1, dtype=torch.int64)
