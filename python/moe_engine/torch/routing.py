"""The routing steps of the MoE layer as torch custom ops and functions (docs/design.md sections 13
and 14): the router (``moe_engine::router_forward`` / ``router_backward_`` and the ``Router``
module), the routing plan and the row moves (``permute_plan``, ``permute``, ``unpermute`` and their
backwards), and ``dispatch`` / ``combine`` over them. The layer (``layer.py``) and its expert-parallel
exchange (``expert_parallel.py``) compose them.

Every op runs on the tensors' device on the current stream and reads no routing value on the host.
"""

from __future__ import annotations

import functools
import math
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import _C
from ._bridge import (FastOp, check_devices, check_int, check_real, dtype_name, record_routing, routing_like,
                      routing_of, routing_tensor, stream_of)
from ._contract import WeightGradContract
from .modules import _init_device
from .ops import _workspace


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rows(t: Tensor) -> int:
    return t.shape[0] if t.dim() > 0 else 0


def _check_float_dtype(who: str, dtype) -> None:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"moe_engine: {who}: dtype must be a floating-point dtype (the parameters' own: bfloat16, "
                         f"float16, float32, float64), got {dtype}")



@functools.lru_cache(maxsize=None)
def _router_spec(score: str, topk: int, num_groups: int, topk_groups: int, norm: bool, scaling: float, aux: float,
                 z: float):
    return _C.RouterSpec(score, topk, num_groups, topk_groups, norm, scaling, aux, z)


# ---- router ----


@torch.library.custom_op("moe_engine::router_forward", mutates_args=())
def _router_forward(x: Tensor, weight: Tensor, expert_bias: Optional[Tensor], score: str, topk: int, num_groups: int,
                    topk_groups: int, norm_topk_prob: bool, scaling_factor: float, aux_loss_coeff: float,
                    z_loss_coeff: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logits [T, E], indices [T, k] int64, probs [T, k], counts [E] int64, aux_loss [], aux_loss_counts [E]
    int64, z_loss []); acc tensors in float32 (float64 for float64 x). A loss with coefficient 0 is not computed
    (its tensors are zeros)."""
    spec = _router_spec(score, topk, num_groups, topk_groups, norm_topk_prob, scaling_factor, aux_loss_coeff,
                        z_loss_coeff)
    T, E, acc, dev = _rows(x), _rows(weight), _acc_dtype(x), x.device
    logits = torch.empty(T, E, dtype=acc, device=dev)
    indices = torch.empty(T, topk, dtype=torch.int64, device=dev)
    probs = torch.empty(T, topk, dtype=acc, device=dev)
    counts = torch.empty(E, dtype=torch.int64, device=dev)
    aux = torch.zeros((), dtype=acc, device=dev)
    aux_counts = torch.zeros(E, dtype=torch.int64, device=dev)
    z = torch.zeros((), dtype=acc, device=dev)
    with_aux, with_z = aux_loss_coeff > 0, z_loss_coeff > 0
    ws = _workspace(_C.router_forward_workspace_size(T, E), dev)
    _C.router_forward(x, weight, expert_bias, logits, indices, probs, counts, aux if with_aux else None,
                      aux_counts if with_aux else None, z if with_z else None, spec, ws, stream_of(x))
    return logits, indices, probs, counts, aux, aux_counts, z


@_router_forward.register_fake
def _(x, weight, expert_bias, score, topk, num_groups, topk_groups, norm_topk_prob, scaling_factor, aux_loss_coeff,
      z_loss_coeff):
    check_devices("router_forward", x=x, weight=weight, expert_bias=expert_bias)
    T, E, acc = x.shape[0], weight.shape[0], _acc_dtype(x)
    return (x.new_empty(T, E, dtype=acc), x.new_empty(T, topk, dtype=torch.int64), x.new_empty(T, topk, dtype=acc),
            x.new_empty(E, dtype=torch.int64), x.new_empty((), dtype=acc), x.new_empty(E, dtype=torch.int64),
            x.new_empty((), dtype=acc))


_router_forward = FastOp(_router_forward)


@torch.library.custom_op("moe_engine::router_backward_", mutates_args=("dweight",))
def _router_backward_(d_probs: Optional[Tensor], d_aux_loss: Optional[Tensor], d_z_loss: Optional[Tensor], x: Tensor,
                      weight: Tensor, logits: Tensor, indices: Tensor, aux_loss_counts: Optional[Tensor],
                      need_dx: bool, dweight: List[Tensor], dweight_mode: str, score: str, topk: int,
                      num_groups: int, topk_groups: int, norm_topk_prob: bool, scaling_factor: float,
                      aux_loss_coeff: float, z_loss_coeff: float) -> Tensor:
    """dx [T, H] (empty [0, H] without need_dx); the weight gradient goes into dweight ([] or [dW]) with
    dweight_mode."""
    spec = _router_spec(score, topk, num_groups, topk_groups, norm_topk_prob, scaling_factor, aux_loss_coeff,
                        z_loss_coeff)
    T, E = _rows(x), _rows(weight)
    dx = torch.empty_like(x) if need_dx else x.new_empty(0, x.shape[-1])
    ws = _workspace(_C.router_backward_workspace_size(T, E, x.shape[-1], dtype_name(x.dtype)), x.device)
    _C.router_backward(d_probs, d_aux_loss, d_z_loss, x, weight, logits, indices, aux_loss_counts,
                       dx if need_dx else None, dweight[0] if dweight else None, dweight_mode, spec, ws,
                       stream_of(x))
    return dx


@_router_backward_.register_fake
def _(d_probs, d_aux_loss, d_z_loss, x, weight, logits, indices, aux_loss_counts, need_dx, dweight, dweight_mode,
      score, topk, num_groups, topk_groups, norm_topk_prob, scaling_factor, aux_loss_coeff, z_loss_coeff):
    check_devices("router_backward_", d_probs=d_probs, d_aux_loss=d_aux_loss, d_z_loss=d_z_loss, x=x, weight=weight,
                  logits=logits, indices=indices, aux_loss_counts=aux_loss_counts, dweight=dweight)
    return torch.empty_like(x) if need_dx else x.new_empty(0, x.shape[-1])


_router_backward_ = FastOp(_router_backward_)


class RouterOutput(NamedTuple):
    probs: Tensor  # [T, k] float32: the chosen experts' probabilities (differentiable)
    indices: Tensor  # [T, k] int64: the chosen experts, best first
    counts: Tensor  # [E] int64: tokens routed to each expert (on the device)
    aux_loss: Tensor  # []: load-balancing loss + z-loss, each times its coefficient (differentiable)


class _RouterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, router: "Router", x, weight, expert_bias):
        logits, indices, probs, counts, aux, aux_counts, z = _router_forward(x, weight, expert_bias,
                                                                             *router._spec_args)
        ctx.save_for_backward(x, weight, logits, indices, aux_counts)
        ctx.mark_non_differentiable(indices, counts)
        ctx.router = router
        return probs, indices, counts, aux, z

    @staticmethod
    def backward(ctx, d_probs, _d_indices, _d_counts, d_aux, d_z):
        r: Router = ctx.router
        x, weight, logits, indices, aux_counts = ctx.saved_tensors
        need_dx, need_w = bool(ctx.needs_input_grad[1]), bool(ctx.needs_input_grad[2])
        with_aux, with_z = r.aux_loss_coeff > 0, r.z_loss_coeff > 0
        d_aux = d_aux.contiguous() if (with_aux and d_aux is not None) else None
        d_z = d_z.contiguous() if (with_z and d_z is not None) else None
        d_probs = d_probs.contiguous() if d_probs is not None else None
        if not (need_dx or need_w):
            return None, None, None, None
        targets, mode = r._grad.targets([weight], ["weight"]) if need_w else ([], "write")
        dx = _router_backward_(d_probs, d_aux, d_z, x, weight, logits, indices, aux_counts if with_aux else None,
                               need_dx, targets, mode, *r._spec_args)
        dw = r._grad.outcome([weight], targets)[0] if need_w else None
        return None, dx if need_dx else None, dw, None


class Router(nn.Module):
    """The router of ``MoELayer``: ``weight`` ``[E, H]`` in the layer's dtype; logits in float32.

    ``expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing): a float32 ``[E]`` buffer added to
    the scores for the choice only, with ``counts_since_update``, an int64 ``[E]`` buffer that training
    forwards add their counts into; ``update_expert_bias(rate)`` moves the bias by
    ``rate * sign(mean - count)`` and clears the counts (on the device, no host sync). The weight
    gradient follows the experts' main_grad contract (``accumulate_into_main_grad`` and friends).
    """

    def __init__(self, hidden: int, num_experts: int, topk: int, *, score: str = "softmax",
                 expert_bias: bool = False, num_groups: Optional[int] = None, topk_groups: Optional[int] = None,
                 norm_topk_prob: bool = True, scaling_factor: float = 1.0, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, accumulate_into_main_grad: bool = False,
                 overwrite_main_grad: bool = False, zero_out_wgrad: bool = False, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if (num_groups is None) != (topk_groups is None):
            raise ValueError(f"moe_engine: Router: num_groups = {num_groups} and topk_groups = {topk_groups}: give "
                             "both (group-limited routing) or neither")
        hidden = check_int("Router", "hidden", hidden, 1)
        _check_float_dtype("Router", dtype)
        num_experts, topk = check_int("Router", "num_experts", num_experts), check_int("Router", "topk", topk)
        groups = ((check_int("Router", "num_groups", num_groups), check_int("Router", "topk_groups", topk_groups))
                  if num_groups is not None else (1, 1))
        spec = _router_spec(str(score), int(topk), *groups, bool(norm_topk_prob), float(scaling_factor),
                            float(aux_loss_coeff), float(z_loss_coeff))
        spec.check(int(num_experts), "Router")
        self._spec_args = (spec.score, spec.topk, spec.num_groups, spec.topk_groups, spec.norm_topk_prob,
                           float(scaling_factor), float(aux_loss_coeff), float(z_loss_coeff))
        self.hidden, self.num_experts, self.topk = int(hidden), int(num_experts), int(topk)
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype))
        with torch.no_grad():
            bound = 1.0 / math.sqrt(hidden) if hidden > 0 else 0.0
            self.weight.uniform_(-bound, bound)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
            self.register_buffer("counts_since_update", torch.zeros(num_experts, dtype=torch.int64, device=device),
                                 persistent=False)
        else:
            self.expert_bias = None
            self.counts_since_update = None
        self._grad = WeightGradContract(accumulate_into_main_grad, overwrite_main_grad, zero_out_wgrad)
        _init_device(self.weight)

    @property
    def spec(self):
        """The routing as the C++ op sees it (``_C.RouterSpec``)."""
        return _router_spec(*self._spec_args)

    def forward(self, x: Tensor) -> RouterOutput:
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"moe_engine: Router: x must be [T, {self.hidden}] (tokens, hidden), got {got}")
        if x.dtype != self.weight.dtype or x.device != self.weight.device:
            raise ValueError(f"moe_engine: Router: x is {x.dtype} on {x.device} but the router weight is "
                             f"{self.weight.dtype} on {self.weight.device}")
        probs, indices, counts, aux, z = _RouterFunction.apply(self, x, self.weight, self.expert_bias)
        if self.expert_bias is not None and self.training:
            self.counts_since_update.add_(counts)
        # A loss whose coefficient is 0 is zeros: no add for it (one kernel and allocation less a step).
        loss = aux + z if (self.aux_loss_coeff > 0 and self.z_loss_coeff > 0) else z if self.z_loss_coeff > 0 else aux
        return RouterOutput(probs, indices, counts, loss)

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """``expert_bias += rate * sign(mean(n) - n)`` with n the counts of the training forwards since the
        last update, which it then clears. Call it after the optimizer step (all-reduce ``counts_since_update``
        over data-parallel ranks first where they must agree)."""
        if self.expert_bias is None:
            raise ValueError("moe_engine: Router.update_expert_bias: the router has no expert bias (build it with "
                             "expert_bias=True)")
        _C.router_update_expert_bias(self.expert_bias, self.counts_since_update, float(rate),
                                     stream_of(self.expert_bias))
        self.counts_since_update.zero_()

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_experts={self.num_experts}, {self.spec!r}, "
                f"expert_bias={self.expert_bias is not None}")


# ---- permute / unpermute ----


def _capacity_args(capacity_factor: Optional[float]):
    return None if capacity_factor is None else check_real("dispatch", "capacity_factor", capacity_factor)


@torch.library.custom_op("moe_engine::permute_plan", mutates_args=())
def _permute_plan(indices: Tensor, num_experts: int,
                  capacity_factor: Optional[float]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(row_of [T, k] int32, splits [E] int64, the routing tensor [E + 1] (the experts' offsets over the
    sorted buffer), dropped [E] int64)."""
    _check_plan_args(indices, num_experts)
    T, k = (indices.shape[0], indices.shape[1]) if indices.dim() == 2 else (0, 0)
    dev = indices.device
    row_of = torch.empty(T, k, dtype=torch.int32, device=dev)
    splits = torch.empty(num_experts, dtype=torch.int64, device=dev)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)  # the routing's alone
    dropped = torch.empty(num_experts, dtype=torch.int64, device=dev)
    ws = _workspace(_C.permute_plan_workspace_size(T, k, num_experts), dev)
    r = _C.permute_plan(indices, row_of, splits, offsets, dropped, capacity_factor, ws, stream_of(indices))
    record_routing(offsets, splits)
    return row_of, splits, routing_tensor(r), dropped


def _check_plan_args(indices: Tensor, num_experts: int) -> None:
    if num_experts < 1:
        raise ValueError(f"moe_engine: permute_plan: num_experts = {num_experts}; expected >= 1")
    if indices.dim() != 2:
        raise ValueError(f"moe_engine: permute_plan: indices: expected [T, k] (each token's k experts), got shape "
                         f"{list(indices.shape)}")


def _check_rows(op: str, rows: int) -> None:
    if rows < 0:
        raise ValueError(f"moe_engine: {op}: rows = {rows}; expected >= 0 (the rows of the expert-sorted buffer)")


@_permute_plan.register_fake
def _(indices, num_experts, capacity_factor):
    _check_plan_args(indices, num_experts)
    splits = indices.new_empty(num_experts, dtype=torch.int64)
    return (indices.new_empty(indices.shape, dtype=torch.int32), splits, routing_like(splits),
            indices.new_empty(num_experts, dtype=torch.int64))


_permute_plan = FastOp(_permute_plan)


@torch.library.custom_op("moe_engine::permute", mutates_args=())
def _permute(x: Tensor, probs: Optional[Tensor], row_of: Tensor, splits: Tensor, routing: Tensor,
             rows: int) -> Tuple[Tensor, Tensor]:
    """(x_sorted [R, H], probs_sorted [R] float32 ([0] without probs)); rows past the routed ones are zeros."""
    _check_rows("permute", rows)
    dev = x.device
    x_sorted = torch.empty(rows, x.shape[-1], dtype=x.dtype, device=dev)
    probs_sorted = torch.empty(rows if probs is not None else 0, dtype=_acc_dtype(x), device=dev)
    stream = stream_of(x)
    r = routing_of("permute", "x_sorted", x_sorted, splits, stream, routing)
    _C.permute(x, probs, row_of, r, x_sorted, probs_sorted if probs is not None else None, stream)
    return x_sorted, probs_sorted


@_permute.register_fake
def _(x, probs, row_of, splits, routing, rows):
    check_devices("permute", x=x, probs=probs, row_of=row_of, splits=splits, routing=routing)
    _check_rows("permute", rows)
    return x.new_empty(rows, x.shape[-1]), x.new_empty(rows if probs is not None else 0, dtype=_acc_dtype(x))


@torch.library.custom_op("moe_engine::permute_backward", mutates_args=())
def _permute_backward(d_sorted: Tensor, d_probs_sorted: Optional[Tensor], row_of: Tensor, splits: Tensor,
                      routing: Tensor) -> Tuple[Tensor, Tensor]:
    """(dx [T, H], d_probs [T, k] ([0, k] without d_probs_sorted))."""
    T, k = row_of.shape
    dev = d_sorted.device
    dx = torch.empty(T, d_sorted.shape[-1], dtype=d_sorted.dtype, device=dev)
    d_probs = torch.empty(T if d_probs_sorted is not None else 0, k, dtype=_acc_dtype(d_sorted), device=dev)
    stream = stream_of(d_sorted)
    r = routing_of("permute_backward", "d_sorted", d_sorted, splits, stream, routing)
    _C.permute_backward(d_sorted, d_probs_sorted, row_of, r, dx, d_probs if d_probs_sorted is not None else None,
                        stream)
    return dx, d_probs


@_permute_backward.register_fake
def _(d_sorted, d_probs_sorted, row_of, splits, routing):
    check_devices("permute_backward", d_sorted=d_sorted, d_probs_sorted=d_probs_sorted, row_of=row_of, splits=splits,
                  routing=routing)
    T, k = row_of.shape
    return (d_sorted.new_empty(T, d_sorted.shape[-1]),
            d_sorted.new_empty(T if d_probs_sorted is not None else 0, k, dtype=_acc_dtype(d_sorted)))


_permute_backward = FastOp(_permute_backward)


def _permute_setup(ctx, inputs, output):
    x, probs, row_of, splits, routing, rows = inputs
    ctx.save_for_backward(row_of, splits, routing)
    ctx.with_probs = probs is not None


def _permute_bwd(ctx, d_sorted, d_probs_sorted):
    row_of, splits, routing = ctx.saved_tensors
    need_x, need_p = ctx.needs_input_grad[0], ctx.with_probs and ctx.needs_input_grad[1]
    if not (need_x or need_p):
        return None, None, None, None, None, None
    if need_p and d_probs_sorted is None:
        d_probs_sorted = torch.zeros(d_sorted.shape[0], dtype=torch.float32, device=d_sorted.device)
    dx, d_probs = _permute_backward(d_sorted.contiguous(), d_probs_sorted.contiguous() if need_p else None, row_of,
                                    splits, routing)
    return dx if need_x else None, d_probs if need_p else None, None, None, None, None


torch.library.register_autograd("moe_engine::permute", _permute_bwd, setup_context=_permute_setup)
_permute = FastOp(_permute, _permute_setup, _permute_bwd)


@torch.library.custom_op("moe_engine::unpermute", mutates_args=())
def _unpermute(out: Tensor, probs: Optional[Tensor], row_of: Tensor, splits: Tensor, routing: Tensor) -> Tensor:
    """y [T, H]: y[t] = sum_j p[t, j] out[row(t, j)] in float32 (p = 1 without probs)."""
    y = torch.empty(row_of.shape[0], out.shape[-1], dtype=out.dtype, device=out.device)
    stream = stream_of(out)
    r = routing_of("unpermute", "out", out, splits, stream, routing)
    _C.unpermute(out, probs, row_of, r, y, stream)
    return y


@_unpermute.register_fake
def _(out, probs, row_of, splits, routing):
    check_devices("unpermute", out=out, probs=probs, row_of=row_of, splits=splits, routing=routing)
    return out.new_empty(row_of.shape[0], out.shape[-1])


@torch.library.custom_op("moe_engine::unpermute_backward", mutates_args=())
def _unpermute_backward(dy: Tensor, out: Optional[Tensor], probs: Optional[Tensor], row_of: Tensor, splits: Tensor,
                        routing: Tensor, rows: int, need_dprobs: bool) -> Tuple[Tensor, Tensor]:
    """(d_out [R, H] (zeros past the routed rows), d_probs [T, k] ([0, k] without need_dprobs))."""
    _check_rows("unpermute_backward", rows)
    T, k = row_of.shape
    dev = dy.device
    d_out = torch.empty(rows, dy.shape[-1], dtype=dy.dtype, device=dev)
    d_probs = torch.empty(T if need_dprobs else 0, k, dtype=_acc_dtype(dy), device=dev)
    stream = stream_of(dy)
    r = routing_of("unpermute_backward", "d_out", d_out, splits, stream, routing)
    _C.unpermute_backward(dy, out, probs, row_of, r, d_out, d_probs if need_dprobs else None, stream)
    return d_out, d_probs


@_unpermute_backward.register_fake
def _(dy, out, probs, row_of, splits, routing, rows, need_dprobs):
    check_devices("unpermute_backward", dy=dy, out=out, probs=probs, row_of=row_of, splits=splits, routing=routing)
    _check_rows("unpermute_backward", rows)
    T, k = row_of.shape
    return dy.new_empty(rows, dy.shape[-1]), dy.new_empty(T if need_dprobs else 0, k, dtype=_acc_dtype(dy))


_unpermute_backward = FastOp(_unpermute_backward)


def _unpermute_setup(ctx, inputs, output):
    out, probs, row_of, splits, routing = inputs
    need_p = probs is not None and ctx.needs_input_grad[1]
    ctx.save_for_backward(out if need_p else None, probs, row_of, splits, routing)
    ctx.rows = out.shape[0]


def _unpermute_bwd(ctx, dy):
    out, probs, row_of, splits, routing = ctx.saved_tensors
    need_out, need_p = ctx.needs_input_grad[0], probs is not None and ctx.needs_input_grad[1]
    if not (need_out or need_p):
        return None, None, None, None, None
    d_out, d_probs = _unpermute_backward(dy.contiguous(), out, probs, row_of, splits, routing, ctx.rows, need_p)
    return d_out if need_out else None, d_probs if need_p else None, None, None, None


torch.library.register_autograd("moe_engine::unpermute", _unpermute_bwd, setup_context=_unpermute_setup)
_unpermute = FastOp(_unpermute, _unpermute_setup, _unpermute_bwd)


class Dispatched(NamedTuple):
    x: Tensor  # [R, H]: the tokens sorted by expert (zeros past the routed rows)
    probs: Tensor  # [R] float32: their router probs
    splits: Tensor  # [E] int64: the rows each expert keeps (on the device)
    row_of: Tensor  # [T, k] int32: the row of each (token, choice), -1 if dropped
    routing: Tensor  # [E + 1] int64: the experts' offsets over x (the plan's routing tensor)
    dropped: Tensor  # [E] int64: the assignments each expert dropped for its capacity


def permuted_rows(tokens: int, topk: int, num_experts: int, capacity_factor: Optional[float] = None) -> int:
    """The rows R of the expert-sorted buffer: T k, or min(T k, E C) with a capacity factor (C =
    ceil(T k / E * capacity_factor), Megatron's expert capacity)."""
    return _C.permuted_rows(tokens, topk, num_experts, _capacity_args(capacity_factor))


def _plan(indices: Tensor, num_experts: int, capacity_factor: Optional[float]):
    """dispatch's plan: (row_of, splits, routing, dropped) of permute_plan and the sorted buffer's rows R."""
    row_of, splits, routing, dropped = _permute_plan(indices, int(num_experts), _capacity_args(capacity_factor))
    rows = permuted_rows(indices.shape[0], indices.shape[1], int(num_experts), capacity_factor)
    return row_of, splits, routing, dropped, rows


def dispatch(x: Tensor, probs: Optional[Tensor], indices: Tensor, num_experts: int,
             capacity_factor: Optional[float] = None) -> Dispatched:
    """Sorts the tokens x [T, H] by the experts of indices [T, k] (stable within each expert; with a
    capacity factor each expert keeps its first C assignments in token order), with probs [T, k]
    (float32; None: no probs). Differentiable in x and probs."""
    row_of, splits, routing, dropped, rows = _plan(indices, num_experts, capacity_factor)
    x_sorted, probs_sorted = _permute(x, probs, row_of, splits, routing, rows)
    return Dispatched(x_sorted, probs_sorted, splits, row_of, routing, dropped)


def combine(out: Tensor, d: Dispatched, probs: Optional[Tensor] = None) -> Tensor:
    """y [T, H]: each token's k rows of out [R, H] summed in float32, j in order (times probs [T, k]
    when given); a dropped assignment adds nothing. Differentiable in out and probs."""
    if isinstance(out, Tensor) and out.dim() > 0 and d.x.dim() > 0 and out.shape[0] != d.x.shape[0]:
        raise ValueError(f"moe_engine: combine: out has {out.shape[0]} rows, expected the {d.x.shape[0]} rows of "
                         "the dispatched buffer (d.x)")
    return _unpermute(out, probs, d.row_of, d.splits, d.routing)
