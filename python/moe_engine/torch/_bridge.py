"""How torch tensors reach the C++ extension: plain descriptors, the current CUDA stream, the
experts' pointer tables. Nothing here reads a tensor's values (no host sync)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch

from .. import _C

_DTYPE_CODES = {
    getattr(torch, name): code for name, code in _C.dtype_codes.items() if hasattr(torch, name)
}


def dtype_code(dtype: torch.dtype) -> int:
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(
            f"moe_engine: unsupported dtype {dtype}; expected one of "
            f"{', '.join(str(d) for d in _DTYPE_CODES)}"
        )
    return code


def desc(t: Optional[torch.Tensor]):
    """(data pointer, shape, strides, dtype code, device index or -1), or () for no tensor."""
    if t is None:
        return ()
    return (t.data_ptr(), tuple(t.shape), t.stride(), dtype_code(t.dtype), t.get_device())


def descs(ts: Sequence[torch.Tensor]) -> list:
    return [desc(t) for t in ts]


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
    _C.init_device(index, torch.cuda.current_stream(index).cuda_stream)
    _READY_DEVICES.add(index)


def stream_of(t: torch.Tensor) -> int:
    """The current CUDA stream of t's device (0 for CPU tensors); prepares the device on first use."""
    if not t.is_cuda:
        return 0
    index = t.get_device()
    if index not in _READY_DEVICES:
        ensure_device(index)
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
    """A grouped parameter for the extension: one packed [G, ...] tensor (rank expert_rank + 1) or
    G per-expert tensors (with their pointer table on CUDA); an empty list is no parameter."""
    if len(ts) == 0 or is_packed(ts, expert_rank):
        return (descs(ts), None)
    return (descs(ts), desc(pointer_table(ts)))


_SPLITS_DTYPES = (torch.int64, torch.int32)


def offsets_for(splits: torch.Tensor) -> torch.Tensor:
    """Scratch for the group offsets every op computes from splits (int64 [G+1]). Hold it in a
    variable across the extension call: a descriptor does not keep its tensor alive. Checks what
    only splits can get wrong here, so the message names splits and what it may be."""
    if not isinstance(splits, torch.Tensor):
        raise TypeError(f"moe_engine: splits must be a [G] int64 or int32 tensor, got {type(splits).__name__}")
    if splits.dtype not in _SPLITS_DTYPES:
        raise ValueError(f"moe_engine: splits must be an int64 or int32 tensor (tokens per expert), got {splits.dtype}")
    if splits.dim() != 1:
        raise ValueError(f"moe_engine: splits must be 1-D [G] (tokens per expert), got shape {tuple(splits.shape)}")
    return torch.empty(splits.shape[0] + 1, dtype=torch.int64, device=splits.device)
