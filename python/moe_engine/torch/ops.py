"""The moe-engine ops as PyTorch custom ops (``torch.ops.moe_engine.*``) and the functional API.

Each custom op has a fake implementation (shapes only), so it traces under ``torch.compile``, and
runs the C++ op on the tensors' device (CPU backend or CUDA kernels) on the current stream.
``splits`` stays a tensor on that device throughout: no op reads it on the host, so every op is
CUDA-graph safe. Fresh outputs hold zeros in the rows past ``sum(splits)``, where no expert writes
(the gradient of an unrouted row is exactly zero).

Routing: the group offsets are computed from ``splits`` once per forward (``GroupLayout::compute``,
one small kernel). The differentiable ops (``grouped_linear_routed``, ``glu_routed``,
``expert_mlp_routed``) return them as a routing tensor with their result, and their backward passes
it to the backward ops' ``routing`` argument, which reuse that computation (see ``_bridge``).
Called without a routing tensor (or with one that is not the live routing of the same splits, or
whose splits were written in place since), a backward op computes the offsets itself.

Weights and biases are passed as lists: ``[w]`` with ``w`` packed ``[G, N, K]`` (``[G, N]`` for a
bias), or G per-expert tensors ``[N, K]`` (``[N]``). The activation (a GLU, or a non-gated one:
``srelu``, ``gelu_tanh``) crosses as one string, ``GluSpec.text`` (``glu_text`` makes it). The differentiable functions at the end
(``grouped_linear``, ``glu``, ``expert_mlp``) return plain gradients; the modules in
``moe_engine.torch.modules`` add the main_grad contract on top of the same ops.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _C
from ._bridge import (FastOp, check_devices, check_writable, dtype_name, ensure_device, grouped, is_packed,
                      routing_like, routing_of, routing_tensor, stream_of)

Experts = Union[Tensor, Sequence[Tensor]]


def _as_list(t: Optional[Experts]) -> List[Tensor]:
    if t is None:
        return []
    if isinstance(t, Tensor):
        return [t]
    return list(t)


def _num_groups(ts: Sequence[Tensor], expert_rank: int) -> int:
    return ts[0].shape[0] if is_packed(ts, expert_rank) else len(ts)


def _expert_shape(ts: Sequence[Tensor], expert_rank: int, op: str = "moe_engine", name: str = "weight"
                  ) -> Tuple[int, ...]:
    """One expert's shape (the last ``expert_rank`` extents) of a grouped parameter, which must have
    a tensor (``name`` in ``op``'s message)."""
    if len(ts) == 0:
        raise ValueError(f"{op}: {name}: expected a packed [G, ...] tensor or G per-expert tensors, got an empty list")
    return tuple(ts[0].shape[-expert_rank:])


def _rows_cols(t: Tensor) -> Tuple[int, int]:
    """(T, C) of a token tensor for the outputs allocated before the C++ op validates it (which
    names a tensor that is not 2-D; unpacking its shape here would fail with a Python message)."""
    return (t.shape[0], t.shape[-1]) if t.dim() > 0 else (0, 0)


_GLU_TEXTS: dict = {}


def check_glu_params(who: str, limit, alpha, offset) -> Tuple[float, float, float]:
    """clamped_qgeglu's parameters as floats, checked for every activation (the others ignore them,
    but a NaN or a limit <= 0 is a mistake either way): numbers, limit > 0 (inf: no clamp), alpha and
    offset finite."""
    values = []
    for name, v in (("limit", limit), ("alpha", alpha), ("offset", offset)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"moe_engine: {who}: {name} must be a number, got {type(v).__name__} {v!r}")
        values.append(float(v))
    limit, alpha, offset = values
    if not limit > 0:  # NaN too
        raise ValueError(f"moe_engine: {who}: limit must be > 0 (inf: no clamp), got {limit}")
    if not (math.isfinite(alpha) and math.isfinite(offset)):
        raise ValueError(f"moe_engine: {who}: alpha and offset must be finite, got alpha = {alpha}, offset = {offset}")
    return limit, alpha, offset


@torch.compiler.assume_constant_result  # a pure function of its arguments: torch.compile runs it, traces nothing
def glu_text(activation: str = "swiglu", layout: str = "halves", limit: float = 7.0, alpha: float = 1.702,
             offset: float = 1.0) -> str:
    """The one-string form of an activation that the custom ops take (``_C.GluSpec.text``);
    checks the names and the layout."""
    key = (activation, layout, limit, alpha, offset)
    text = _GLU_TEXTS.get(key)
    if text is None:
        if not isinstance(activation, str) or not isinstance(layout, str):
            raise TypeError(f"moe_engine: glu_text: activation and layout must be strings, got "
                            f"{type(activation).__name__} and {type(layout).__name__}")
        text = _C.GluSpec(activation, layout, *check_glu_params("glu_text", limit, alpha, offset)).text
        _GLU_TEXTS[key] = text
    return text


@functools.lru_cache(maxsize=None)
def _glu_spec(text: str):
    """The ``_C.GluSpec`` of a custom op's ``glu`` string, parsed once per distinct string."""
    return _C.GluSpec.parse(text)


# The public forward ops keep their schemas: each is the routed op less the routing (an implicit
# composite, so autograd and torch.compile go through the routed op and its formula).
_LIB = torch.library.Library("moe_engine", "FRAGMENT")


def _composite(schema: str, fn) -> None:
    _LIB.define(schema)
    _LIB.impl(schema.split("(", 1)[0], fn, "CompositeImplicitAutograd")


# ---- grouped linear ----


@torch.library.custom_op("moe_engine::grouped_linear_routed", mutates_args=())
def _grouped_linear(
    x: Tensor, weight: List[Tensor], splits: Tensor, bias: List[Tensor], row_scale: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    """grouped_linear, and the routing tensor of the offsets it computed."""
    y = torch.empty(_rows_cols(x)[0], _expert_shape(weight, 2, "grouped_linear_forward")[0], dtype=x.dtype,
                    device=x.device)
    stream = stream_of(x)
    r = routing_of("grouped_linear_forward", "x", x, splits, stream)
    _C.grouped_linear_forward(x, grouped(weight, 2), r, y, grouped(bias, 1), row_scale, stream)
    return y, routing_tensor(r)


@_grouped_linear.register_fake
def _(x, weight, splits, bias, row_scale):
    check_devices("grouped_linear", x=x, weight=weight, splits=splits, bias=bias, row_scale=row_scale)
    return x.new_empty(_rows_cols(x)[0], _expert_shape(weight, 2, "grouped_linear_forward")[0]), routing_like(splits)


_composite("grouped_linear(Tensor x, Tensor[] weight, Tensor splits, Tensor[] bias, Tensor? row_scale) -> Tensor",
           lambda x, weight, splits, bias, row_scale: _grouped_linear(x, weight, splits, bias, row_scale)[0])


@torch.library.custom_op("moe_engine::grouped_linear_dgrad", mutates_args=())
def _grouped_linear_dgrad(dy: Tensor, weight: List[Tensor], splits: Tensor,
                          routing: Optional[Tensor] = None) -> Tensor:
    dx = torch.empty(_rows_cols(dy)[0], _expert_shape(weight, 2, "grouped_linear_dgrad")[1], dtype=dy.dtype,
                     device=dy.device)
    stream = stream_of(dy)
    r = routing_of("grouped_linear_dgrad", "dy", dy, splits, stream, routing)
    _C.grouped_linear_dgrad(dy, grouped(weight, 2), r, dx, stream)
    return dx


@_grouped_linear_dgrad.register_fake
def _(dy, weight, splits, routing=None):
    check_devices("grouped_linear_dgrad", dy=dy, weight=weight, splits=splits, routing=routing)
    return dy.new_empty(_rows_cols(dy)[0], _expert_shape(weight, 2, "grouped_linear_dgrad")[1])


@torch.library.custom_op("moe_engine::grouped_linear_wgrad_", mutates_args=("out",))
def _grouped_linear_wgrad_(dy: Tensor, x: Tensor, splits: Tensor, out: List[Tensor], mode: str,
                           routing: Optional[Tensor] = None) -> None:
    stream = stream_of(dy)
    r = routing_of("grouped_linear_wgrad", "dy", dy, splits, stream, routing)
    _C.grouped_linear_wgrad(dy, x, r, grouped(out, 2), mode, stream)


@_grouped_linear_wgrad_.register_fake
def _(dy, x, splits, out, mode, routing=None):
    check_devices("grouped_linear_wgrad_", dy=dy, x=x, splits=splits, out=out, routing=routing)
    return None


@torch.library.custom_op("moe_engine::grouped_linear_dbias", mutates_args=())
def _grouped_linear_dbias(dy: Tensor, splits: Tensor, row_scale: Optional[Tensor],
                          routing: Optional[Tensor] = None) -> Tensor:
    db = torch.empty(_rows_cols(splits)[0], _rows_cols(dy)[1], dtype=dy.dtype, device=dy.device)
    stream = stream_of(dy)
    r = routing_of("grouped_linear_dbias", "dy", dy, splits, stream, routing)
    _C.grouped_linear_dbias(dy, r, grouped([db], 1), "write", row_scale, stream)
    return db


@_grouped_linear_dbias.register_fake
def _(dy, splits, row_scale, routing=None):
    check_devices("grouped_linear_dbias", dy=dy, splits=splits, row_scale=row_scale, routing=routing)
    return dy.new_empty(_rows_cols(splits)[0], _rows_cols(dy)[1])


@torch.library.custom_op("moe_engine::grouped_linear_dscales", mutates_args=())
def _grouped_linear_dscales(dy: Tensor, bias: List[Tensor], splits: Tensor,
                            routing: Optional[Tensor] = None) -> Tensor:
    ds = torch.empty(_rows_cols(dy)[0], dtype=torch.float32, device=dy.device)
    stream = stream_of(dy)
    r = routing_of("grouped_linear_dscales", "dy", dy, splits, stream, routing)
    _C.grouped_linear_dscales(dy, grouped(bias, 1), r, ds, stream)
    return ds


@_grouped_linear_dscales.register_fake
def _(dy, bias, splits, routing=None):
    check_devices("grouped_linear_dscales", dy=dy, bias=bias, splits=splits, routing=routing)
    return dy.new_empty(_rows_cols(dy)[0], dtype=torch.float32)


# The modules' backward pieces run directly in plain eager mode (FastOp: no dispatcher).
_grouped_linear_dgrad = FastOp(_grouped_linear_dgrad)
_grouped_linear_wgrad_ = FastOp(_grouped_linear_wgrad_)
_grouped_linear_dbias = FastOp(_grouped_linear_dbias)
_grouped_linear_dscales = FastOp(_grouped_linear_dscales)


# ---- GLU activations ----


def _act_features(h: Tensor, glu: str) -> int:
    """F of the activation's output for FC1's output h: half h's columns for a GLU, all of them
    for a non-gated activation."""
    cols = _rows_cols(h)[1]
    return cols // 2 if _glu_spec(glu).gated else cols


def _check_float(op: str, name: str, t: Tensor) -> None:
    """The activation's input must be floating point (its output, allocated in its dtype, would be
    the tensor the C++ op names otherwise)."""
    if not t.is_floating_point():
        raise ValueError(f"{op}: {name}: expected a floating-point tensor, got {dtype_name(t.dtype)}")


@torch.library.custom_op("moe_engine::glu_routed", mutates_args=())
def _glu(h: Tensor, probs: Optional[Tensor], splits: Tensor, glu: str) -> Tuple[Tensor, Tensor]:
    """glu, and the routing tensor of the offsets it computed."""
    _check_float("glu_forward", "h", h)
    out = torch.empty(_rows_cols(h)[0], _act_features(h, glu), dtype=h.dtype, device=h.device)
    stream = stream_of(h)
    r = routing_of("glu_forward", "h", h, splits, stream)
    _C.glu_forward(h, probs, r, out, _glu_spec(glu), stream)
    return out, routing_tensor(r)


@_glu.register_fake
def _(h, probs, splits, glu):
    check_devices("glu", h=h, probs=probs, splits=splits)
    return h.new_empty(_rows_cols(h)[0], _act_features(h, glu)), routing_like(splits)


_composite("glu(Tensor h, Tensor? probs, Tensor splits, str glu) -> Tensor",
           lambda h, probs, splits, glu: _glu(h, probs, splits, glu)[0])


@torch.library.custom_op("moe_engine::glu_backward", mutates_args=())
def _glu_backward(h: Tensor, probs: Optional[Tensor], d_out: Tensor, splits: Tensor, glu: str,
                  routing: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """dh (h's shape: [T, 2F] for a GLU, [T, F] otherwise) and dprobs [T] float32 (empty without probs)."""
    _check_float("glu_backward", "h", h)
    if h.dim() == 2 and d_out.dim() == 2 and d_out.shape[1] != _act_features(h, glu):
        F = _act_features(h, glu)
        raise ValueError(f"glu_backward: d_out: expected [T, F] = [{h.shape[0]}, {F}] for h {list(h.shape)} "
                         f"({'[T, 2F]' if _glu_spec(glu).gated else '[T, F]'}), got {list(d_out.shape)}")
    dh = torch.empty_like(h)
    dprobs = torch.empty(_rows_cols(h)[0] if probs is not None else 0, dtype=torch.float32, device=h.device)
    stream = stream_of(h)
    r = routing_of("glu_backward", "h", h, splits, stream, routing)
    _C.glu_backward(h, probs, d_out, r, dh, dprobs if probs is not None else None, _glu_spec(glu), stream)
    return dh, dprobs


@_glu_backward.register_fake
def _(h, probs, d_out, splits, glu, routing=None):
    check_devices("glu_backward", h=h, probs=probs, d_out=d_out, splits=splits, routing=routing)
    return h.new_empty(h.shape), h.new_empty(_rows_cols(h)[0] if probs is not None else 0, dtype=torch.float32)


# ---- expert MLP ----


def _workspace(nbytes: int, device: torch.device) -> Optional[Tensor]:
    return torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes > 0 else None


def _check_fc2(x: Tensor, w2: Sequence[Tensor], op: str) -> Tuple[int, ...]:
    """FC2's expert shape [H, F]: its H must be x's features (the C++ op takes H from FC2's weight,
    and would name FC1's weight for an FC2 of the wrong H)."""
    shape = _expert_shape(w2, 2, op, "fc2_weight")
    if x.dim() == 2 and len(shape) == 2 and shape[0] != x.shape[1]:
        raise ValueError(f"{op}: fc2_weight: expected G x [H, F] with H = {x.shape[1]} (x's features), got "
                         f"{'[G, H, F] ' + str(list(w2[0].shape)) if is_packed(w2, 2) else 'experts ' + str(list(shape))}")
    return shape


@torch.library.custom_op("moe_engine::expert_mlp_routed", mutates_args=())
def _expert_mlp(x: Tensor, probs: Optional[Tensor], w1: List[Tensor], b1: List[Tensor], w2: List[Tensor],
                b2: List[Tensor], splits: Tensor, glu: str, fusion: str,
                save_fc1_out: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """y [T, H], the pre-activation fc1_out [T, W] ([0, W] when not saved; W = FC1's rows: 2F for a
    GLU, F otherwise) and the routing tensor."""
    T, H = _rows_cols(x)
    W, F = _expert_shape(w1, 2, "expert_mlp_forward", "fc1_weight")[0], _check_fc2(x, w2, "expert_mlp_forward")[1]
    y = torch.empty(T, H, dtype=x.dtype, device=x.device)
    fc1_out = torch.empty(T if save_fc1_out else 0, W, dtype=x.dtype, device=x.device)
    stream = stream_of(x)
    r = routing_of("expert_mlp_forward", "x", x, splits, stream)
    ws = _workspace(_C.expert_mlp_forward_workspace_size(T, H, F, dtype_name(x.dtype), save_fc1_out, _glu_spec(glu)),
                    x.device)
    _C.expert_mlp_forward(x, probs, grouped(w1, 2), grouped(b1, 1), grouped(w2, 2), grouped(b2, 1), r, y,
                          fc1_out if save_fc1_out else None, _glu_spec(glu), fusion, ws, stream)
    return y, fc1_out, routing_tensor(r)


@_expert_mlp.register_fake
def _(x, probs, w1, b1, w2, b2, splits, glu, fusion, save_fc1_out):
    check_devices("expert_mlp", x=x, probs=probs, w1=w1, b1=b1, w2=w2, b2=b2, splits=splits)
    F2 = _expert_shape(w1, 2, "expert_mlp_forward", "fc1_weight")[0]
    _expert_shape(w2, 2, "expert_mlp_forward", "fc2_weight")
    return x.new_empty(x.shape), x.new_empty(_rows_cols(x)[0] if save_fc1_out else 0, F2), routing_like(splits)


_composite("expert_mlp(Tensor x, Tensor? probs, Tensor[] w1, Tensor[] b1, Tensor[] w2, Tensor[] b2, Tensor splits, "
           "str glu, str fusion, bool save_fc1_out) -> (Tensor, Tensor)",
           lambda x, probs, w1, b1, w2, b2, splits, glu, fusion, save_fc1_out:
           _expert_mlp(x, probs, w1, b1, w2, b2, splits, glu, fusion, save_fc1_out)[:2])


@torch.library.custom_op("moe_engine::expert_mlp_backward_", mutates_args=("w1_grad", "w2_grad"))
def _expert_mlp_backward_(
    dy: Tensor, x: Optional[Tensor], probs: Optional[Tensor], w1: List[Tensor], b1: List[Tensor],
    w2: List[Tensor], b2: List[Tensor], splits: Tensor, fc1_out: Optional[Tensor], glu: str, fusion: str,
    need_dx: bool, need_dprobs: bool, need_db1: bool, need_db2: bool, w1_grad: List[Tensor], w1_mode: str,
    w2_grad: List[Tensor], w2_mode: str, routing: Optional[Tensor] = None, need_d_fc1: bool = False,
    need_act: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx [T, H], dprobs [T] float32, db1 [G, W], db2 [G, H], d_fc1 [T, W], act [T, F]); those not
    asked for (or without biases) are empty (W: FC1's rows). The weight gradients go into w1_grad /
    w2_grad (empty lists: not computed) per their modes. ``need_d_fc1`` / ``need_act``: also
    dL/d(fc1_out) and FC2's input as backward makes them, for a caller that runs FC1's gradients or
    FC2's weight gradient itself (the two-node backward, a delayed wgrad)."""
    T, H = _rows_cols(dy)
    W, F = (_expert_shape(w1, 2, "expert_mlp_backward", "fc1_weight")[0],
            _expert_shape(w2, 2, "expert_mlp_backward", "fc2_weight")[1])
    G = _num_groups(w1, 2)
    dev, dt = dy.device, dy.dtype
    dx = torch.empty(T if need_dx else 0, H, dtype=dt, device=dev)
    dprobs = torch.empty(T if need_dprobs else 0, dtype=torch.float32, device=dev)
    bias1, bias2 = need_db1 and len(b1) > 0, need_db2 and len(b2) > 0
    db1 = torch.empty(G if bias1 else 0, W, dtype=dt, device=dev)
    db2 = torch.empty(G if bias2 else 0, H, dtype=dt, device=dev)
    d_fc1 = torch.empty(T if need_d_fc1 else 0, W, dtype=dt, device=dev)
    act = torch.empty(T if need_act else 0, F, dtype=dt, device=dev)
    stream = stream_of(dy)
    r = routing_of("expert_mlp_backward", "dy", dy, splits, stream, routing)
    recompute = fc1_out is None
    ws = _workspace(_C.expert_mlp_backward_workspace_size(T, H, F, dtype_name(dt), recompute, _glu_spec(glu), fusion,
                                                          need_d_fc1), dev)
    _C.expert_mlp_backward(dy, x, probs, grouped(w1, 2), grouped(b1, 1), grouped(w2, 2), grouped(b2, 1), r, fc1_out,
                           dx if need_dx else None, dprobs if need_dprobs else None,
                           grouped(w1_grad, 2), w1_mode, grouped([db1] if bias1 else [], 1),
                           grouped(w2_grad, 2), w2_mode, grouped([db2] if bias2 else [], 1),
                           d_fc1 if need_d_fc1 else None, act if need_act else None, _glu_spec(glu), fusion, ws,
                           stream)
    return dx, dprobs, db1, db2, d_fc1, act


@_expert_mlp_backward_.register_fake
def _(dy, x, probs, w1, b1, w2, b2, splits, fc1_out, glu, fusion, need_dx, need_dprobs, need_db1, need_db2,
      w1_grad, w1_mode, w2_grad, w2_mode, routing=None, need_d_fc1=False, need_act=False):
    check_devices("expert_mlp_backward_", dy=dy, x=x, probs=probs, w1=w1, b1=b1, w2=w2, b2=b2, splits=splits,
                  fc1_out=fc1_out, w1_grad=w1_grad, w2_grad=w2_grad, routing=routing)
    T, H = _rows_cols(dy)
    W, F = (_expert_shape(w1, 2, "expert_mlp_backward", "fc1_weight")[0],
            _expert_shape(w2, 2, "expert_mlp_backward", "fc2_weight")[1])
    G = _num_groups(w1, 2)
    bias1, bias2 = need_db1 and len(b1) > 0, need_db2 and len(b2) > 0
    return (dy.new_empty(T if need_dx else 0, H), dy.new_empty(T if need_dprobs else 0, dtype=torch.float32),
            dy.new_empty(G if bias1 else 0, W), dy.new_empty(G if bias2 else 0, H),
            dy.new_empty(T if need_d_fc1 else 0, W), dy.new_empty(T if need_act else 0, F))


_expert_mlp_backward_ = FastOp(_expert_mlp_backward_)

# ---- helpers shared with the modules ----


def new_expert_grads(like: Sequence[Tensor]) -> List[Tensor]:
    """Fresh gradient buffers shaped like a grouped parameter (packed or per expert)."""
    return [torch.empty_like(t) for t in like]


def split_like(packed: Tensor, like: Sequence[Tensor], expert_rank: int) -> List[Tensor]:
    """A packed [G, ...] result in the layout of `like`: itself, or its G per-expert views."""
    return [packed] if is_packed(like, expert_rank) else list(packed.unbind(0))


# ---- the functional API (differentiable, plain gradients) ----


def grouped_linear(x: Tensor, weight: Experts, splits: Tensor, bias: Optional[Experts] = None,
                   row_scale: Optional[Tensor] = None) -> Tensor:
    """``y[r] = x[r] W_g^T (+ b_g, or + row_scale[r] * b_g)`` for the rows r of expert g.

    x ``[T, K]``; weight packed ``[G, N, K]`` or G tensors ``[N, K]``; splits ``[G]`` int64/int32 on
    x's device; bias ``[G, N]`` or G tensors ``[N]``; row_scale ``[T]`` float32 ("scale_bias").
    Differentiable in x, weight, bias and row_scale.
    """
    return _grouped_linear(x, _as_list(weight), splits, _as_list(bias), row_scale)[0]


def _grouped_linear_setup(ctx, inputs, output):
    x, weight, splits, bias, row_scale = inputs
    ctx.save_for_backward(x, splits, row_scale, output[1], *weight, *bias)
    ctx.n_weight, ctx.n_bias = len(weight), len(bias)


def linear_grads_but_weight(dy: Tensor, weight: Sequence[Tensor], bias: Sequence[Tensor], splits: Tensor,
                            row_scale: Optional[Tensor], need_x: bool, need_bias: bool, need_scale: bool,
                            routing: Optional[Tensor] = None):
    """A grouped linear layer's gradients other than the weight's (the functional API and the
    GroupedLinear module differ only in where that one goes): dx, the bias gradients (a list in
    the bias's layout, Nones when not needed) and the row-scale gradient. dy contiguous;
    ``routing``: the forward's routing tensor."""
    dx = _grouped_linear_dgrad(dy, list(weight), splits, routing) if need_x else None
    db = [None] * len(bias)
    if bias and need_bias:
        db = split_like(_grouped_linear_dbias(dy, splits, row_scale, routing), bias, 1)
    ds = _grouped_linear_dscales(dy, list(bias), splits, routing) if (need_scale and bias) else None
    return dx, db, ds


def _grouped_linear_backward(ctx, dy, _d_routing):
    x, splits, row_scale, routing, *rest = ctx.saved_tensors
    weight, bias = rest[: ctx.n_weight], rest[ctx.n_weight :]
    dy = dy.contiguous()
    need_x, need_w, _, need_b, need_s = ctx.needs_input_grad
    dx, db, ds = linear_grads_but_weight(dy, weight, bias, splits, row_scale, need_x, _any(need_b), need_s, routing)
    dw = [None] * len(weight)  # list inputs take lists of the same length back
    if _any(need_w):
        dw = new_expert_grads(weight)
        _grouped_linear_wgrad_(dy, x, splits, dw, "write", routing)
    return dx, dw, None, db, ds


def _any(flag) -> bool:
    return any(flag) if isinstance(flag, (list, tuple)) else bool(flag)


torch.library.register_autograd("moe_engine::grouped_linear_routed", _grouped_linear_backward,
                                setup_context=_grouped_linear_setup)
_grouped_linear = FastOp(_grouped_linear, differentiable=True)  # its weights are lists: autograd through the op


def glu(h: Tensor, splits: Tensor, probs: Optional[Tensor] = None, activation: str = "swiglu",
        layout: str = "halves", limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0) -> Tensor:
    """The expert MLP's activation times the router probs, for the routed rows: a GLU's
    ``out[r, j] = act(gate_j(h[r]), linear_j(h[r])) * probs[r]``, or a non-gated activation's
    ``out[r, j] = f(h[r, j]) * probs[r]``.

    activation ``swiglu`` or ``clamped_qgeglu`` (limit, alpha, offset): h ``[T, 2F]`` with gate/linear
    columns in ``layout`` (``halves``, ``pairs``, ``blocks:s``); ``srelu`` (relu(h)^2) or
    ``gelu_tanh`` (GELU, tanh approximation): h ``[T, F]``, layout ``halves`` (the default).
    Differentiable in h, probs.
    """
    return _glu(h, probs, splits, glu_text(activation, layout, limit, alpha, offset))[0]


def _glu_setup(ctx, inputs, output):
    h, probs, splits, spec = inputs
    ctx.save_for_backward(h, probs, splits, output[1])
    ctx.spec = spec


def _glu_bwd(ctx, d_out, _d_routing):
    h, probs, splits, routing = ctx.saved_tensors
    dh, dprobs = _glu_backward(h, probs, d_out.contiguous(), splits, ctx.spec, routing)
    return dh, dprobs if probs is not None else None, None, None


torch.library.register_autograd("moe_engine::glu_routed", _glu_bwd, setup_context=_glu_setup)


def expert_mlp(x: Tensor, fc1_weight: Experts, fc2_weight: Experts, splits: Tensor,
               probs: Optional[Tensor] = None, fc1_bias: Optional[Experts] = None,
               fc2_bias: Optional[Experts] = None, activation: str = "swiglu", layout: str = "halves",
               limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0, fusion: str = "forward",
               recompute_fc1: bool = False) -> Tensor:
    """The expert MLP ``y = FC2(act(FC1(x) + b1) * p) + p * b2`` (Megatron's ``p * (W2 act + b2)``).

    x ``[T, H]``; fc1_weight ``[G, 2F, H]`` (rows in ``layout``) for a GLU activation (``swiglu``,
    ``clamped_qgeglu``), ``[G, F, H]`` for a non-gated one (``srelu``, ``gelu_tanh``), or G tensors;
    fc2_weight ``[G, H, F]`` or G tensors; probs ``[T]`` float32. ``fusion``: ``forward`` (the
    activation in FC1's epilogue on Hopper), ``none`` or ``all``. ``recompute_fc1`` keeps only x for
    backward.
    Differentiable in x, probs, the weights and the biases.
    """
    return _expert_mlp(x, probs, _as_list(fc1_weight), _as_list(fc1_bias), _as_list(fc2_weight),
                       _as_list(fc2_bias), splits, glu_text(activation, layout, limit, alpha, offset), fusion,
                       not recompute_fc1)[0]


def _expert_mlp_setup(ctx, inputs, output):
    x, probs, w1, b1, w2, b2, splits, glu, fusion, save = inputs
    _, fc1_out, routing = output
    ctx.save_for_backward(x, probs, splits, fc1_out if save else None, routing, *w1, *b1, *w2, *b2)
    ctx.counts = (len(w1), len(b1), len(w2), len(b2))
    ctx.spec = (glu, fusion)


def _expert_mlp_bwd(ctx, dy, _d_fc1_out, _d_routing):
    x, probs, splits, fc1_out, routing, *rest = ctx.saved_tensors
    n1, nb1, n2, nb2 = ctx.counts
    w1, b1 = rest[:n1], rest[n1 : n1 + nb1]
    w2, b2 = rest[n1 + nb1 : n1 + nb1 + n2], rest[n1 + nb1 + n2 :]
    need = ctx.needs_input_grad
    need_w1, need_w2 = _any(need[2]), _any(need[4])
    need_bias = _any(need[3]) or _any(need[5])
    g1 = new_expert_grads(w1) if need_w1 else []
    g2 = new_expert_grads(w2) if need_w2 else []
    dx, dprobs, db1, db2, *_ = _expert_mlp_backward_(
        dy.contiguous(), x, probs, list(w1), list(b1), list(w2), list(b2), splits, fc1_out, *ctx.spec,
        bool(need[0]), probs is not None and bool(need[1]), need_bias, need_bias, g1, "write", g2, "write", routing)

    def each(grads, like):  # list inputs take lists of the same length back
        return grads if grads else [None] * len(like)

    return (dx if need[0] else None, dprobs if (probs is not None and need[1]) else None,
            each(g1, w1), each(split_like(db1, b1, 1) if (b1 and need_bias) else None, b1),
            each(g2, w2), each(split_like(db2, b2, 1) if (b2 and need_bias) else None, b2)) + (None,) * 4


torch.library.register_autograd("moe_engine::expert_mlp_routed", _expert_mlp_bwd, setup_context=_expert_mlp_setup)
_expert_mlp = FastOp(_expert_mlp, differentiable=True)  # its weights are lists: autograd through the op


# ---- backward pieces (for callers that run their own autograd, e.g. delayed wgrad) ----


def grouped_linear_dgrad(dy: Tensor, weight: Experts, splits: Tensor) -> Tensor:
    """``dx[r] = dy[r] W_g``: dy ``[T, N]`` -> dx ``[T, K]``."""
    return _grouped_linear_dgrad(dy.contiguous(), _as_list(weight), splits)


def grouped_linear_wgrad(dy: Tensor, x: Tensor, splits: Tensor, out: Optional[Experts] = None,
                         mode: str = "write") -> Experts:
    """``dW_g = dy_g^T x_g`` into ``out`` (packed ``[G, N, K]`` or G tensors; default: a new packed
    tensor in dy's dtype). ``mode``: ``write``; ``accumulate`` / ``overwrite`` for float32
    main_grad buffers (an empty expert leaves an accumulated buffer untouched). Returns ``out``."""
    if out is None:
        out = torch.empty(_rows_cols(splits)[0], _rows_cols(dy)[1], _rows_cols(x)[1], dtype=dy.dtype, device=dy.device)
    check_writable("grouped_linear_wgrad", out=out)
    _grouped_linear_wgrad_(dy.contiguous(), x, splits, _as_list(out), mode)
    return out


def grouped_linear_dbias(dy: Tensor, splits: Tensor, row_scale: Optional[Tensor] = None) -> Tensor:
    """``db_g = sum_r dy[r]`` (``sum_r row_scale[r] dy[r]`` with row_scale): ``[G, N]``."""
    return _grouped_linear_dbias(dy.contiguous(), splits, row_scale)


def grouped_linear_dscales(dy: Tensor, bias: Experts, splits: Tensor) -> Tensor:
    """The row-scale gradient of a scale_bias forward, ``<dy[r], b_g>``: ``[T]`` float32."""
    return _grouped_linear_dscales(dy.contiguous(), _as_list(bias), splits)


def glu_backward(h: Tensor, d_out: Tensor, splits: Tensor, probs: Optional[Tensor] = None,
                 activation: str = "swiglu", layout: str = "halves", limit: float = 7.0, alpha: float = 1.702,
                 offset: float = 1.0) -> Tuple[Tensor, Optional[Tensor]]:
    """``(dh, dprobs [T] float32 or None)`` from ``d_out = dL/d(glu(h) * probs)``; dh has h's shape."""
    dh, dprobs = _glu_backward(h, probs, d_out.contiguous(), splits, glu_text(activation, layout, limit, alpha, offset))
    return dh, (dprobs if probs is not None else None)


def expert_mlp_backward(dy: Tensor, x: Optional[Tensor], fc1_weight: Experts, fc2_weight: Experts,
                        splits: Tensor, probs: Optional[Tensor] = None, fc1_bias: Optional[Experts] = None,
                        fc2_bias: Optional[Experts] = None, fc1_out: Optional[Tensor] = None,
                        activation: str = "swiglu", layout: str = "halves", limit: float = 7.0,
                        alpha: float = 1.702, offset: float = 1.0, fusion: str = "forward", need_dx: bool = True,
                        fc1_weight_grad: Optional[Experts] = None, fc2_weight_grad: Optional[Experts] = None,
                        wgrad_mode: str = "write") -> dict:
    """The expert MLP's backward in one call. ``fc1_out``: the pre-activation kept by forward
    (``expert_mlp`` with ``recompute_fc1=False`` saves it), or None to recompute it from x.
    Weight gradients go into ``fc1_weight_grad`` / ``fc2_weight_grad`` per ``wgrad_mode`` (e.g.
    main_grad buffers with ``accumulate``); leave them None for new tensors (``write``) or pass
    ``[]`` to skip one. Returns a dict: dx, dprobs, fc1_weight, fc1_bias, fc2_weight, fc2_bias."""
    w1, w2, b1, b2 = _as_list(fc1_weight), _as_list(fc2_weight), _as_list(fc1_bias), _as_list(fc2_bias)
    g1 = new_expert_grads(w1) if fc1_weight_grad is None else _as_list(fc1_weight_grad)
    g2 = new_expert_grads(w2) if fc2_weight_grad is None else _as_list(fc2_weight_grad)
    check_writable("expert_mlp_backward", fc1_weight_grad=g1, fc2_weight_grad=g2)
    mode1 = "write" if fc1_weight_grad is None else wgrad_mode
    mode2 = "write" if fc2_weight_grad is None else wgrad_mode
    dx, dprobs, db1, db2, *_ = _expert_mlp_backward_(
        dy.contiguous(), x, probs, w1, b1, w2, b2, splits, fc1_out, glu_text(activation, layout, limit, alpha, offset),
        fusion, need_dx, probs is not None, bool(b1), bool(b2), g1, mode1, g2, mode2)
    return {"dx": dx if need_dx else None, "dprobs": dprobs if probs is not None else None,
            "fc1_weight": g1 or None, "fc1_bias": split_like(db1, b1, 1) if b1 else None,
            "fc2_weight": g2 or None, "fc2_bias": split_like(db2, b2, 1) if b2 else None}


def check_errors(device: Union[int, str, torch.device, None] = None) -> None:
    """Raises ``moe_engine.DeviceError`` if a kernel on this GPU saw bad splits (negative, or
    summing past the buffer) since the last check; clears the record. Waits for the current
    stream, so call it outside graph capture (e.g. once per step or at logging intervals). Bad
    splits never make a kernel write outside its buffers; on the CPU they raise at once."""
    if device is None and not torch.cuda.is_available():
        return  # CPU only: bad splits raised when the op ran
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    _C.check_errors(index, torch.cuda.current_stream(index).cuda_stream)


def init_device(device: Union[int, str, torch.device, None] = None) -> None:
    """Creates the GPU's error record (done on first use; call it before a CUDA graph capture
    whose first moe_engine op would otherwise run inside the capture)."""
    if device is None and not torch.cuda.is_available():
        return  # CPU only: bad splits raised when the op ran
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return
    ensure_device(dev.index if dev.index is not None else torch.cuda.current_device())
