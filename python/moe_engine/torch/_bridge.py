"""How torch tensors reach the C++ extension: the tensors themselves (``_C`` imports them as DLPack
arrays, see python/src/extension.cpp), the current CUDA stream, the experts' pointer tables, and
the routing. Nothing here reads a tensor's values (no host sync).

The routing of a layer (``_C.Routing``: the group offsets that ``GroupLayout::compute`` made from
``splits``) is computed once per forward and reused by the backward. Torch's dispatcher carries
only tensors, so a forward op returns the routing as a tensor over its offsets (``routing_tensor``)
whose storage owns the ``_C.Routing``; a backward op given that tensor gets the same ``_C.Routing``
back (``routing_of``). A tensor that is not a live routing of the same splits and rows (a copy, a
forged one) is never trusted: the offsets are then computed again from splits.
"""

from __future__ import annotations

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
        if self._differentiable and torch.is_grad_enabled():
            if self._function is None:
                return self.op(*args, **kwargs)
            return self._function.apply(*args, *kwargs.values())  # ops with autograd take no defaults
        return self._impl(*args, **kwargs)


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


def routing_of(op: str, tokens_name: str, tokens: torch.Tensor, splits: torch.Tensor, stream: int,
               saved: Optional[torch.Tensor] = None):
    """The ``_C.Routing`` of ``splits`` for the rows of ``tokens`` (the op's [T, ...] token tensor,
    named ``tokens_name`` in ``op``'s messages): the one ``saved`` stands for, when it is the
    routing tensor of a live routing of these splits and rows, else a new one (``GroupLayout::compute``:
    one small kernel on ``stream``, into an offsets buffer from torch's allocator)."""
    if saved is not None:
        found = _C.find_routing(saved, splits, tokens.shape[0] if tokens.dim() > 0 else -1)
        if found is not None:
            return found
    check_splits(splits)
    offsets = torch.empty(splits.shape[0] + 1, dtype=torch.int64, device=splits.device)  # the routing's alone
    return _C.route(splits, offsets, tokens, stream, op, tokens_name)


def routing_for_capacity(op: str, capacity: int, splits: torch.Tensor, stream: int,
                         saved: Optional[torch.Tensor] = None):
    """``routing_of`` for a buffer of ``capacity`` rows given as a number, for ops none of whose
    tensors has T as an extent (the FP8 wgrad reads columns copies [K, C])."""
    if saved is not None:
        found = _C.find_routing(saved, splits, capacity)
        if found is not None:
            return found
    check_splits(splits)
    offsets = torch.empty(splits.shape[0] + 1, dtype=torch.int64, device=splits.device)
    return _C.route_capacity(splits, offsets, capacity, stream, op)


def routing_tensor(routing) -> torch.Tensor:
    """The routing as a tensor that crosses torch's dispatcher: int64 [G+1], its offsets, on the
    splits' device. Its storage holds the ``_C.Routing`` (and with it the splits and offsets
    buffers), so the routing lives as long as autograd keeps the tensor. Read-only by contract."""
    return torch.utils.dlpack.from_dlpack(routing.offsets_capsule())


def routing_like(splits: torch.Tensor) -> torch.Tensor:
    """What a fake implementation returns for a routing tensor."""
    return splits.new_empty(splits.shape[0] + 1, dtype=torch.int64)
