"""The weight-gradient contract of docs/design.md section 6 on torch parameters, with Megatron-LM's
attributes: where a weight gradient goes (a fresh tensor, ``param.main_grad``, or ``param.grad``
after ``backward_dw``) and what backward hands back to autograd for it:

| configuration                                   | returned                                      |
|-------------------------------------------------|-----------------------------------------------|
| plain                                           | the wgrad                                     |
| delayed wgrad                                   | None (``backward_dw`` computes it)            |
| main_grad, param without grad_added_to_main_grad| None                                          |
| main_grad, param with grad_added_to_main_grad   | empty sparse zero dummy, flag set             |
| delayed + main_grad, without the flag           | None                                          |
| delayed + main_grad, with the flag              | dummy; flag set when backward_dw runs         |

Returning None keeps autograd from doing ``grad += wgrad`` behind us; the dummy exists because
data-parallel hooks need a gradient object to fire. The dummy is an all-zero sparse tensor of the
weight's shape with no entries (so ``zero_out_wgrad`` holds by construction): autograd adopts it as
``.grad`` without a copy, and it takes no memory. A dense dummy costs a weight-sized ``.grad``
every backward (plus a copy kernel when it is cached, as autograd copies a gradient that something
else references) until Megatron's hook drops it. The decision is the C++ library's
(``moe::grad_outcome``, through ``_C.grad_outcome``), which the C++ modules apply too; this file
applies it to torch parameters, whose attributes (``main_grad``, ``get_main_grad``,
``overwrite_main_grad``, ...) live in Python.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _C
from .ops import new_expert_grads

_FLAG = "grad_added_to_main_grad"

# _C.grad_outcome is pure: one call per distinct case.
_grad_outcome = functools.lru_cache(maxsize=None)(_C.grad_outcome)


def main_grad_of(p: torch.nn.Parameter, name: str) -> Tensor:
    """``param.main_grad`` (refreshed with ``get_main_grad()`` for ``__fsdp_param__``), checked."""
    if getattr(p, "__fsdp_param__", False) and hasattr(p, "get_main_grad"):
        mg = p.get_main_grad()
    else:
        mg = getattr(p, "main_grad", None)
    if mg is None:
        raise RuntimeError(
            f"moe_engine: accumulate_into_main_grad is set but parameter '{name}' has no main_grad "
            "(set param.main_grad to a float32 tensor of the parameter's shape)"
        )
    if mg.dtype != torch.float32 or tuple(mg.shape) != tuple(p.shape) or mg.device != p.device:
        raise ValueError(
            f"moe_engine: main_grad of '{name}' must be float32 {tuple(p.shape)} on {p.device}, got "
            f"{mg.dtype} {tuple(mg.shape)} on {mg.device}"
        )
    if not mg.is_contiguous():
        raise ValueError(f"moe_engine: main_grad of '{name}' must be contiguous, got strides {mg.stride()}")
    return mg


class WeightGradContract:
    """One weight's side of the contract (a weight is 1 packed or G per-expert parameters)."""

    def __init__(self, accumulate_into_main_grad: bool, overwrite_main_grad: bool, zero_out_wgrad: bool):
        if overwrite_main_grad and not accumulate_into_main_grad:
            raise ValueError("moe_engine: overwrite_main_grad needs accumulate_into_main_grad=True")
        self.into_main_grad = accumulate_into_main_grad
        self.overwrite = overwrite_main_grad
        self.zero_out = zero_out_wgrad

    def _outcomes(self, params: Sequence[Tensor], delayed: bool) -> list:
        """The decision for each parameter: the module's options with the parameter's attributes."""
        return [_grad_outcome(self.into_main_grad, self.overwrite or bool(getattr(p, "overwrite_main_grad", False)),
                              self.zero_out or bool(getattr(p, "zero_out_wgrad", False)), delayed, hasattr(p, _FLAG))
                for p in params]

    @staticmethod
    def _dummy(p: Tensor) -> Tensor:
        """An all-zero sparse gradient of p's shape (no entries): it fires the hooks and, adopted
        as ``.grad``, holds no weight-sized memory; adding it to a dense gradient adds nothing."""
        return torch.zeros(p.shape, dtype=p.dtype, device=p.device, layout=torch.sparse_coo)

    def _handed_back(self, params, outcomes, targets) -> List[Optional[Tensor]]:
        out: List[Optional[Tensor]] = []
        for i, (p, o) in enumerate(zip(params, outcomes)):
            if o.handed_back == "grad":
                out.append(targets[i])
            elif o.handed_back == "dummy":
                out.append(self._dummy(p))
            else:
                out.append(None)
        return out

    def targets(self, params, names, delayed: bool = False) -> Tuple[List[Tensor], str]:
        """Where a weight gradient computed now goes, and how: main_grad (accumulate/overwrite) or
        fresh tensors (write; a delayed gradient without main_grad is then added to ``.grad`` by
        ``finish_delayed``). The GEMM covers all experts at once, so they must agree on the mode."""
        outcomes = self._outcomes(params, delayed)
        if outcomes[0].target != "main_grad":
            return new_expert_grads(params), "write"
        modes = {o.mode for o in outcomes}
        if len(modes) != 1:
            raise ValueError("moe_engine: the experts of one weight disagree on overwrite_main_grad")
        return [main_grad_of(p, n) for p, n in zip(params, names)], modes.pop()

    def outcome(self, params, targets) -> List[Optional[Tensor]]:
        """What autograd gets for a gradient computed now into ``targets`` (sets the flags)."""
        outcomes = self._outcomes(params, delayed=False)
        for p, o in zip(params, outcomes):
            if o.flag == "backward":
                setattr(p, _FLAG, True)
        return self._handed_back(params, outcomes, targets)

    def queued(self, params, names) -> List[Optional[Tensor]]:
        """What autograd gets for a gradient queued for backward_dw."""
        outcomes = self._outcomes(params, delayed=True)
        for p, n, o in zip(params, names, outcomes):
            if o.target == "main_grad":
                main_grad_of(p, n)  # fail now, not in backward_dw
        return self._handed_back(params, outcomes, [None] * len(params))

    def finish_delayed(self, params, targets) -> None:
        """After backward_dw computed a queued gradient into ``targets``: set the flags, or add the
        gradient to ``param.grad``."""
        for p, g, o in zip(params, targets, self._outcomes(params, delayed=True)):
            if o.flag == "backward_dw":
                setattr(p, _FLAG, True)
            if o.target == "grad":
                p.grad = g if p.grad is None else p.grad.add_(g)
