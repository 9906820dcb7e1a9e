"""The weight-gradient contract of DESIGN.md section 4 on torch parameters, with Megatron-LM's
attributes: where a weight gradient goes (a fresh tensor, ``param.main_grad``, or ``param.grad``
after ``backward_dw``) and what backward hands back to autograd for it:

| configuration                                   | returned                                      |
|-------------------------------------------------|-----------------------------------------------|
| plain                                           | the wgrad                                     |
| delayed wgrad                                   | None (``backward_dw`` computes it)            |
| main_grad, param without grad_added_to_main_grad| None                                          |
| main_grad, param with grad_added_to_main_grad   | shared dummy (zeroed if zero_out_wgrad), flag set |
| delayed + main_grad, without the flag           | None                                          |
| delayed + main_grad, with the flag              | shared dummy; flag set when backward_dw runs  |

Returning None keeps autograd from doing ``grad += wgrad`` behind us; the dummy exists because
data-parallel hooks need a gradient object to fire. The C++ modules implement the same table
(``moe::detail::WeightGradContract``); this is its twin on torch parameters, whose attributes
(``main_grad``, ``get_main_grad``, ``overwrite_main_grad``, ...) live in Python.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .ops import new_expert_grads

_FLAG = "grad_added_to_main_grad"


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
        self._dummies: Dict[Tuple, Tensor] = {}

    def _mode(self, params: Sequence[Tensor]) -> str:
        overwrite = {self.overwrite or bool(getattr(p, "overwrite_main_grad", False)) for p in params}
        if len(overwrite) != 1:
            raise ValueError("moe_engine: the experts of one weight disagree on overwrite_main_grad")
        return "overwrite" if overwrite.pop() else "accumulate"

    def main_grad_target(self, params: Sequence[Tensor], names: Sequence[str]) -> Tuple[List[Tensor], str]:
        return [main_grad_of(p, n) for p, n in zip(params, names)], self._mode(params)

    def _dummy(self, p: Tensor) -> Tensor:
        key = (tuple(p.shape), p.dtype, p.device)
        d = self._dummies.get(key)
        if d is None:
            d = self._dummies[key] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        if self.zero_out or getattr(p, "zero_out_wgrad", False):
            d.zero_()
        return d

    def _main_grad_outcome(self, params: Sequence[Tensor], set_flag: bool) -> List[Optional[Tensor]]:
        out: List[Optional[Tensor]] = []
        for p in params:
            if hasattr(p, _FLAG):
                if set_flag:
                    setattr(p, _FLAG, True)
                out.append(self._dummy(p))
            else:
                out.append(None)
        return out

    def targets(self, params, names) -> Tuple[List[Tensor], str]:
        """Where a weight gradient computed now goes, and how: main_grad (accumulate/overwrite)
        or fresh tensors (write)."""
        if self.into_main_grad:
            return self.main_grad_target(params, names)
        return new_expert_grads(params), "write"

    def outcome(self, params, targets) -> List[Optional[Tensor]]:
        """What autograd gets for a gradient computed now into ``targets``."""
        if self.into_main_grad:
            return self._main_grad_outcome(params, set_flag=True)
        return list(targets)

    def queued(self, params, names) -> List[Optional[Tensor]]:
        """What autograd gets for a gradient queued for backward_dw."""
        if self.into_main_grad:
            for p, n in zip(params, names):
                main_grad_of(p, n)  # fail now, not in backward_dw
            return self._main_grad_outcome(params, set_flag=False)
        return [None] * len(params)

    def finish_delayed(self, params, targets) -> None:
        """After backward_dw computed a queued gradient into ``targets``: set the flags, or add the
        gradient to ``param.grad`` (there is no main_grad)."""
        if self.into_main_grad:
            for p in params:
                if hasattr(p, _FLAG):
                    setattr(p, _FLAG, True)
            return
        for p, g in zip(params, targets):
            p.grad = g if p.grad is None else p.grad.add_(g)
