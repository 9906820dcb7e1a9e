"""FP8 block scaling (``docs/design.md`` section 12) in PyTorch: the quantized types, their custom
ops (``torch.ops.moe_engine.*``) and the functional API.

The C++ library's operand types become frozen dataclasses that callers pass around:

- ``Fp8Tensor``: an activation or gradient ``[T, K]`` quantized by ``quantize_fp8``, with its
  rowwise form (``Fp8Rows``: 1 x 128 tiles; read by the forward and dgrad GEMMs) and/or its
  columnwise form (``Fp8Columns``: 128 x 1 tiles restarting at each expert's first token, stored
  transposed; read by wgrad);
- ``Fp8Weight``: a weight ``G x [N, K]`` in 128 x 128 blocks (forward) and/or its transposed copy
  (dgrad), from ``quantize_fp8_weight``.

Torch's dispatcher carries tensors only, so the custom ops take and return the dataclasses' tensors
one by one; the functional functions flatten and rebuild them. Every op has a fake implementation
(shapes only), so it traces under ``torch.compile``; none reads ``splits`` on the host, so all are
CUDA-graph safe. The quantizers and GEMMs have no autograd formulas: they are the pieces a
caller's own backward (or an FP8 module) is built from. ``expert_mlp_fp8`` (the C++ FP8 expert MLP)
is differentiable; ``Fp8Recipe`` says how to quantize, and ``Fp8WeightCache`` keeps a module's
quantized weights until they change.

Parts of an FP8 operand that no expert owns are not written and hold whatever the allocator gave:
rows past ``sum(splits)`` (data and scales), columns past the last expert's segment. No GEMM reads
them. The GEMMs' outputs are ordinary fresh outputs: their rows past ``sum(splits)`` are zeros.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _C
from ._bridge import (check_devices, check_writable, dtype_name, grouped, is_packed, routing_for_capacity,
                      routing_is_stale, routing_like, routing_of, routing_source, routing_tensor, stream_of)
from .offload import mark_as_weight
from .ops import Experts, _as_list, _glu_spec, _rows_cols, _workspace, glu_text, new_expert_grads, split_like

FP8_BLOCK = 128  # the tile length along the quantized axis
FP8_DTYPE = torch.float8_e4m3fn  # E4M3: the library's float8_e4m3 (largest finite 448, NaN 0x7f)


def _round_up(n, m):
    return (n + m - 1) // m * m


def fp8_scales_pitch(num_tokens):
    """The row pitch S of rowwise scales ``[ceil(K/128), S]`` for T tokens: ``round_up(T, 4)``, at
    least 4 (C++ ``moe::fp8_scales_pitch``; a SymInt under ``torch.compile``)."""
    return torch.sym_max(4, _round_up(num_tokens, 4))


def fp8_columns_capacity(num_tokens, num_groups):
    """The columns C of a columnwise copy for T tokens and G experts: ``round_up(T + 127 G, 128)``,
    room for every expert's segment to start at a multiple of 128 (C++ ``moe::fp8_columns_capacity``)."""
    return _round_up(num_tokens + (FP8_BLOCK - 1) * num_groups, FP8_BLOCK)


def expert_mlp_fp8_keeps_x_rows(num_tokens, num_groups):
    """Whether the FP8 expert MLP's forward keeps x's rows ``[T, H]`` for the FC1 weight gradient
    instead of its columns ``[H, C]``: where the columns would take more than twice the bytes,
    ``fp8_columns_capacity(T, G) > 2 T`` (many experts of few tokens each; backward then makes the
    columns from the rows). C++ ``moe::expert_mlp_fp8_keeps_x_rows``'s rule, in Python so that it
    decides on the symbolic sizes of a trace too (T and G are static shapes)."""
    return fp8_columns_capacity(num_tokens, num_groups) > 2 * num_tokens


def _describe(t: Optional[Tensor]) -> str:
    if t is None:
        return "None"
    dtype = str(t.dtype)[len("torch."):]
    where = "" if t.device.type == "cpu" else f" on {t.device}"
    return f"{dtype}{list(t.shape)}{where}"


def _repr(obj, names) -> str:
    """The dataclass with its tensors as dtype[shape] (a repr of their values would be pages)."""
    return f"{type(obj).__name__}(" + ", ".join(f"{n}={_describe(getattr(obj, n))}" for n in names) + ")"


@dataclass(frozen=True, repr=False)
class Fp8Rows:
    """A ``[T, K]`` tensor quantized along its features, 1 x 128 tiles.

    data ``[T, K]`` float8_e4m3fn; scales ``[ceil(K/128), S]`` float32, S = ``fp8_scales_pitch(T)``,
    "M-major": the scale of row r, K block b is ``scales[b, r]``. Value = ``data * scale``."""

    data: Tensor
    scales: Tensor

    def __repr__(self) -> str:
        return _repr(self, ("data", "scales"))


@dataclass(frozen=True, repr=False)
class Fp8Columns:
    """A ``[T, K]`` tensor quantized along the tokens of each expert, 128 x 1 tiles, transposed.

    data ``[K, C]`` float8_e4m3fn, C = ``fp8_columns_capacity(T, G)``: expert g's tokens are columns
    ``offsets[g] .. offsets[g] + splits[g]``, zeros up to the next multiple of 128; scales
    ``[C/128, K]`` float32 (128-column block j, feature k); offsets ``[G+1]`` int64,
    ``offsets[g] = sum_{h<g} round_up(splits[h], 128)``."""

    data: Tensor
    scales: Tensor
    offsets: Tensor

    def __repr__(self) -> str:
        return _repr(self, ("data", "scales", "offsets"))


@dataclass(frozen=True, repr=False)
class Fp8Tensor:
    """An activation or output gradient ``[T, K]`` in FP8, as ``quantize_fp8`` makes it.

    ``rows``: the rowwise form (forward's x, dgrad's dy), or None; ``columns``: the columnwise form
    (wgrad's x and dy), or None; ``num_tokens``: T, the token buffer's rows (the columnwise form's
    C does not determine it). ``routing``: the routing tensor of the quantizer's group offsets,
    which the GEMMs reuse when given the same ``splits`` (else they compute the offsets again)."""

    rows: Optional[Fp8Rows]
    columns: Optional[Fp8Columns]
    num_tokens: int
    routing: Optional[Tensor] = field(default=None, compare=False)

    @property
    def shape(self) -> Tuple[int, int]:
        """(T, K) of the tensor that was quantized."""
        K = self.rows.data.shape[1] if self.rows is not None else self.columns.data.shape[0]
        return (self.num_tokens, K)

    def __repr__(self) -> str:
        return f"Fp8Tensor(rows={self.rows!r}, columns={self.columns!r}, num_tokens={self.num_tokens})"


@dataclass(frozen=True, repr=False)
class Fp8Weight:
    """A weight ``G x [N, K]`` in 128 x 128 blocks, as ``quantize_fp8_weight`` makes it.

    data ``[G, N, K]`` float8_e4m3fn and scales ``[G, ceil(N/128), ceil(K/128)]`` float32 (the
    forward's operand), and the transposed copy data_t ``[G, K, N]``, scales_t
    ``[G, ceil(K/128), ceil(N/128)]`` (dgrad's); either pair may be None."""

    data: Optional[Tensor]
    scales: Optional[Tensor]
    data_t: Optional[Tensor] = None
    scales_t: Optional[Tensor] = None

    def __repr__(self) -> str:
        return _repr(self, ("data", "scales", "data_t", "scales_t"))


@dataclass(frozen=True)
class Fp8Recipe:
    """How the FP8 modules and ``expert_mlp_fp8`` quantize (C++ ``moe::Fp8Recipe``, plus
    TransformerEngine's ``override_linear_precision``).

    - ``pow2_scales``: every tile's multiplier rounded down to a power of two, so its scale is an
      exact power of two (TransformerEngine's ``power_2_scale``).
    - ``amax_epsilon``: the lower bound of every tile's amax (finite, >= 0).
    - ``override_linear_precision``: (fprop, dgrad, wgrad); a GEMM whose flag is True runs in the
      module's dtype on the unquantized operands. ``GroupedLinear`` and ``GroupedMLP`` honour it
      (GroupedMLP then runs unfused, as two FP8 GroupedLinear layers around the activation);
      ``expert_mlp_fp8``, the fused MLP, runs all six GEMMs in FP8 and refuses any override.
    """

    pow2_scales: bool = False
    amax_epsilon: float = 0.0
    override_linear_precision: Tuple[bool, bool, bool] = (False, False, False)

    def __post_init__(self):
        if not isinstance(self.pow2_scales, bool):
            raise TypeError(f"Fp8Recipe: pow2_scales: expected a bool, got {type(self.pow2_scales).__name__}")
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"Fp8Recipe: amax_epsilon: expected a float, got {type(eps).__name__}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"Fp8Recipe: amax_epsilon: expected a finite value >= 0, got {eps}")
        override = self.override_linear_precision
        if (not isinstance(override, (tuple, list)) or len(override) != 3
                or not all(isinstance(v, bool) for v in override)):
            raise TypeError("Fp8Recipe: override_linear_precision: expected three bools (fprop, dgrad, wgrad), "
                            f"got {override!r}")
        object.__setattr__(self, "amax_epsilon", float(eps))
        object.__setattr__(self, "override_linear_precision", tuple(override))


def check_recipe(who: str, recipe, all_fp8: bool, name: str = "fp8_recipe") -> Fp8Recipe:
    """``recipe`` (the argument ``name`` of ``who``) as an Fp8Recipe (None: the default one);
    ``all_fp8``: the caller runs every GEMM in FP8, so no override may be set."""
    if recipe is None:
        return Fp8Recipe()
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"{who}: {name}: expected a moe_engine.torch.Fp8Recipe or None, got "
                        f"{type(recipe).__name__}")
    if all_fp8 and any(recipe.override_linear_precision):
        raise ValueError(f"{who}: {name}: the fused expert MLP runs all six GEMMs in FP8; "
                         f"override_linear_precision must be (False, False, False), got "
                         f"{recipe.override_linear_precision} (the modules GroupedLinear and GroupedMLP honour "
                         f"overrides)")
    return recipe


# ---- allocation (shared by the real and the fake implementations) ----


def _extent(t: Tensor, dim: int) -> int:
    """t.shape[dim], or 0 for a tensor of too few dimensions (the C++ op then says what it expected)."""
    return t.shape[dim] if t.dim() > max(dim, -dim - 1) else 0


def _blocks(n):
    return (n + FP8_BLOCK - 1) // FP8_BLOCK


def _quantize_outputs(x: Tensor, splits: Tensor, rowwise: bool, columnwise: bool):
    """rows data, rows scales, columns data, columns scales, columns offsets; those not requested
    are empty."""
    T, K, G = _extent(x, 0), _extent(x, -1), _extent(splits, 0)
    dev = x.device

    def new(requested, shape, dtype):
        return torch.empty(shape if requested else (0,), dtype=dtype, device=dev)

    C = fp8_columns_capacity(T, G)
    return (new(rowwise, (T, K), FP8_DTYPE), new(rowwise, (_blocks(K), fp8_scales_pitch(T)), torch.float32),
            new(columnwise, (K, C), FP8_DTYPE), new(columnwise, (C // FP8_BLOCK, K), torch.float32),
            new(columnwise, (G + 1,), torch.int64))


def _weight_extent(weight: Sequence[Tensor]) -> Tuple[int, int, int]:
    """(G, N, K) of a grouped weight (packed or per expert); zeros where it has no such shape."""
    if len(weight) == 0:
        return 0, 0, 0
    G = weight[0].shape[0] if is_packed(weight, 2) else len(weight)
    return G, _extent(weight[0], -2), _extent(weight[0], -1)


def _weight_outputs(weight: Sequence[Tensor], rowwise: bool, columnwise: bool):
    G, N, K = _weight_extent(weight)
    dev = weight[0].device if len(weight) else torch.device("cpu")

    def new(requested, shape, dtype):
        return torch.empty(shape if requested else (0,), dtype=dtype, device=dev)

    return (new(rowwise, (G, N, K), FP8_DTYPE), new(rowwise, (G, _blocks(N), _blocks(K)), torch.float32),
            new(columnwise, (G, K, N), FP8_DTYPE), new(columnwise, (G, _blocks(K), _blocks(N)), torch.float32))


# ---- custom ops ----


@torch.library.custom_op("moe_engine::quantize_fp8", mutates_args=())
def _quantize_fp8(x: Tensor, splits: Tensor, rowwise: bool, columnwise: bool, pow2_scales: bool,
                  amax_epsilon: float, routing: Optional[Tensor] = None
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(rows data, rows scales, columns data, columns scales, columns offsets, routing); the parts
    not requested are empty ``[0]`` tensors. ``routing``: a routing tensor of the same splits and
    rows to reuse (a module's backward passes its forward's); the returned routing tensor is a new
    tensor over the offsets used."""
    outs = _quantize_outputs(x, splits, rowwise, columnwise)
    stream = stream_of(x)
    r = routing_of("quantize_fp8", "x", x, splits, stream, routing)
    rd, rs, cd, cs, co = (t if want else None for t, want in zip(outs, (rowwise,) * 2 + (columnwise,) * 3))
    _C.quantize_fp8(x, r, rd, rs, cd, cs, co, pow2_scales, amax_epsilon, stream)
    return outs + (routing_tensor(r),)


@_quantize_fp8.register_fake
def _(x, splits, rowwise, columnwise, pow2_scales, amax_epsilon, routing=None):
    check_devices("quantize_fp8", x=x, splits=splits, routing=routing)
    return _quantize_outputs(x, splits, rowwise, columnwise) + (routing_like(splits),)


@torch.library.custom_op("moe_engine::quantize_fp8_weight", mutates_args=())
def _quantize_fp8_weight(weight: List[Tensor], rowwise: bool, columnwise: bool, pow2_scales: bool,
                         amax_epsilon: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(data, scales, data_t, scales_t), packed; the pair not requested is empty ``[0]`` tensors."""
    outs = _weight_outputs(weight, rowwise, columnwise)
    stream = stream_of(weight[0]) if len(weight) else 0
    d, s, dt, st = (t if want else None for t, want in zip(outs, (rowwise, rowwise, columnwise, columnwise)))
    _C.quantize_fp8_weight(grouped(weight, 2), d, s, dt, st, pow2_scales, amax_epsilon, stream)
    return outs


@_quantize_fp8_weight.register_fake
def _(weight, rowwise, columnwise, pow2_scales, amax_epsilon):
    check_devices("quantize_fp8_weight", weight=weight)
    return _weight_outputs(weight, rowwise, columnwise)


# Into existing buffers: a module's weight cache keeps its addresses (a captured CUDA graph reads
# them) when it quantizes a changed weight again.
@torch.library.custom_op("moe_engine::quantize_fp8_weight_", mutates_args=("data", "scales", "data_t", "scales_t"))
def _quantize_fp8_weight_(weight: List[Tensor], data: Optional[Tensor], scales: Optional[Tensor],
                          data_t: Optional[Tensor], scales_t: Optional[Tensor], pow2_scales: bool,
                          amax_epsilon: float) -> None:
    """quantize_fp8_weight into the given tensors; a pair left None is not written."""
    stream = stream_of(weight[0]) if len(weight) else 0
    _C.quantize_fp8_weight(grouped(weight, 2), data, scales, data_t, scales_t, pow2_scales, amax_epsilon, stream)


@_quantize_fp8_weight_.register_fake
def _(weight, data, scales, data_t, scales_t, pow2_scales, amax_epsilon):
    check_devices("quantize_fp8_weight_", weight=weight, data=data, scales=scales, data_t=data_t, scales_t=scales_t)
    return None


@torch.library.custom_op("moe_engine::grouped_linear_fp8", mutates_args=())
def _grouped_linear_fp8(x_data: Tensor, x_scales: Tensor, weight_data: Tensor, weight_scales: Tensor, splits: Tensor,
                        bias: List[Tensor], row_scale: Optional[Tensor], out_dtype: torch.dtype,
                        routing: Optional[Tensor] = None) -> Tensor:
    y = torch.empty(_extent(x_data, 0), _extent(weight_data, 1), dtype=out_dtype, device=x_data.device)
    stream = stream_of(x_data)
    r = routing_of("grouped_linear_forward", "x.data", x_data, splits, stream, routing, stale="grouped_linear_fp8: x")
    _C.grouped_linear_fp8_forward(x_data, x_scales, weight_data, weight_scales, r, y, grouped(bias, 1), row_scale,
                                  stream)
    return y


@_grouped_linear_fp8.register_fake
def _(x_data, x_scales, weight_data, weight_scales, splits, bias, row_scale, out_dtype, routing=None):
    check_devices("grouped_linear_fp8", x_data=x_data, x_scales=x_scales, weight_data=weight_data,
                  weight_scales=weight_scales, splits=splits, bias=bias, row_scale=row_scale, routing=routing)
    return x_data.new_empty(_extent(x_data, 0), _extent(weight_data, 1), dtype=out_dtype)


@torch.library.custom_op("moe_engine::grouped_linear_fp8_dgrad", mutates_args=())
def _grouped_linear_fp8_dgrad(dy_data: Tensor, dy_scales: Tensor, weight_data_t: Tensor, weight_scales_t: Tensor,
                              splits: Tensor, out_dtype: torch.dtype, routing: Optional[Tensor] = None) -> Tensor:
    dx = torch.empty(_extent(dy_data, 0), _extent(weight_data_t, 1), dtype=out_dtype, device=dy_data.device)
    stream = stream_of(dy_data)
    r = routing_of("grouped_linear_dgrad", "dy.data", dy_data, splits, stream, routing,
                   stale="grouped_linear_fp8_dgrad: dy")
    _C.grouped_linear_fp8_dgrad(dy_data, dy_scales, weight_data_t, weight_scales_t, r, dx, stream)
    return dx


@_grouped_linear_fp8_dgrad.register_fake
def _(dy_data, dy_scales, weight_data_t, weight_scales_t, splits, out_dtype, routing=None):
    check_devices("grouped_linear_fp8_dgrad", dy_data=dy_data, dy_scales=dy_scales, weight_data_t=weight_data_t,
                  weight_scales_t=weight_scales_t, splits=splits, routing=routing)
    return dy_data.new_empty(_extent(dy_data, 0), _extent(weight_data_t, 1), dtype=out_dtype)


# `out_mode`, not `mode`: torch.compile functionalizes a mutating op through auto_functionalized,
# whose own keyword `mode` an argument of that name would collide with.
@torch.library.custom_op("moe_engine::grouped_linear_fp8_wgrad_", mutates_args=("out",))
def _grouped_linear_fp8_wgrad_(dy_data: Tensor, dy_scales: Tensor, dy_offsets: Tensor, x_data: Tensor,
                               x_scales: Tensor, x_offsets: Tensor, splits: Tensor, num_tokens: int,
                               out: List[Tensor], out_mode: str, routing: Optional[Tensor] = None) -> None:
    stream = stream_of(dy_data)
    r = routing_for_capacity("grouped_linear_wgrad", num_tokens, splits, stream, routing,
                             stale="grouped_linear_fp8_wgrad: an operand (dy or x)")
    _C.grouped_linear_fp8_wgrad(dy_data, dy_scales, dy_offsets, x_data, x_scales, x_offsets, r, grouped(out, 2),
                                out_mode, stream)


@_grouped_linear_fp8_wgrad_.register_fake
def _(dy_data, dy_scales, dy_offsets, x_data, x_scales, x_offsets, splits, num_tokens, out, out_mode, routing=None):
    check_devices("grouped_linear_fp8_wgrad_", dy_data=dy_data, dy_scales=dy_scales, dy_offsets=dy_offsets,
                  x_data=x_data, x_scales=x_scales, x_offsets=x_offsets, splits=splits, out=out, routing=routing)
    return None


# ---- the functional API ----


_FROM_QUANTIZE = "an Fp8Tensor (from moe_engine.torch.quantize_fp8)"
_FROM_QUANTIZE_WEIGHT = "an Fp8Weight (from moe_engine.torch.quantize_fp8_weight)"


def _expect(op: str, name: str, value, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{op}: {name}: expected {what}, got {type(value).__name__}")


def _expect_number(op: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name}: expected a number, got {type(value).__name__} {value!r}")


def _check_current(op: str, name: str, t8: Fp8Tensor, splits) -> None:
    """An operand quantized with this splits tensor before new values were written into it (in
    place) is laid out by the old values (columns by their offsets, rows past the old sum not
    written): a routing computed again from the new values would read it wrongly. (The GEMM ops
    refuse the routing they are given too; wgrad checks both its operands here.)"""
    if t8.routing is not None and routing_is_stale(t8.routing, splits, t8.num_tokens):
        raise ValueError(f"{op}: {name} was quantized with splits whose values have been overwritten in place since "
                         f"(splits._version moved); quantize it again with the splits as they are now")


def quantize_fp8(x: Tensor, splits: Tensor, rowwise: bool = True, columnwise: bool = False,
                 pow2_scales: bool = False, amax_epsilon: float = 0.0) -> Fp8Tensor:
    """x ``[T, K]`` (bfloat16, float16 or float32; K a multiple of 16) in FP8, in one pass over x:
    ``rowwise`` for the forward / dgrad GEMMs, ``columnwise`` for wgrad (both at once: one read).

    Each tile (TransformerEngine's and DeepGEMM's rule): ``amax = max(max |v|, amax_epsilon)``, the
    multiplier ``m = 448 / amax`` (at most 2^126; with ``pow2_scales`` rounded down to a power of two),
    ``q = E4M3(v * m)`` rounded to nearest even, the stored scale ``1 / m`` (never below 2^-126); an all-zero
    tile has scale 1, a tile with an inf or NaN has scale NaN and NaN codes. ``splits`` ``[G]`` on x's
    device, as for the other ops."""
    # Quantization has no gradient here: detached, a parameter or an activation that requires grad
    # gives operands that do not (no autograd node that could only fail in backward).
    _expect("quantize_fp8", "x", x, Tensor, "a [T, K] tensor")
    _expect_number("quantize_fp8", "amax_epsilon", amax_epsilon)
    rd, rs, cd, cs, co, routing = _quantize_fp8(x.detach(), splits, bool(rowwise), bool(columnwise),
                                                bool(pow2_scales), float(amax_epsilon))
    return Fp8Tensor(Fp8Rows(rd, rs) if rowwise else None, Fp8Columns(cd, cs, co) if columnwise else None,
                     _extent(x, 0), routing)


def quantize_fp8_weight(weight: Experts, rowwise: bool = True, columnwise: bool = True, pow2_scales: bool = False,
                        amax_epsilon: float = 0.0, out: Optional[Fp8Weight] = None) -> Fp8Weight:
    """A weight packed ``[G, N, K]`` or G tensors ``[N, K]`` (N, K multiples of 16) in 128 x 128
    blocks: ``rowwise`` the forward's ``data``/``scales``, ``columnwise`` the transposed copy
    ``data_t``/``scales_t`` that dgrad reads (same bytes and scales per block). Always packed.
    ``out``: an Fp8Weight of this weight's shapes to write the requested pairs into (its tensors
    keep their addresses; returned), instead of new tensors."""
    op = "quantize_fp8_weight"
    _expect_number(op, "amax_epsilon", amax_epsilon)
    experts = _as_list(weight)
    for t in experts:
        _expect(op, "weight", t, Tensor, "a [G, N, K] tensor or G tensors [N, K]")
    detached = [t.detach() for t in experts]
    if out is None:
        d, s, dt, st = _quantize_fp8_weight(detached, bool(rowwise), bool(columnwise), bool(pow2_scales),
                                            float(amax_epsilon))
        return Fp8Weight(d if rowwise else None, s if rowwise else None, dt if columnwise else None,
                         st if columnwise else None)
    _expect(op, "out", out, Fp8Weight, _FROM_QUANTIZE_WEIGHT)
    if rowwise and (out.data is None or out.scales is None):
        raise ValueError(f"{op}: out: rowwise=True writes out.data and out.scales, but out has no such pair")
    if columnwise and (out.data_t is None or out.scales_t is None):
        raise ValueError(f"{op}: out: columnwise=True writes out.data_t and out.scales_t, but out has no such pair")
    check_writable(op, out=[out.data, out.scales, out.data_t, out.scales_t])
    _quantize_fp8_weight_(detached, out.data if rowwise else None, out.scales if rowwise else None,
                          out.data_t if columnwise else None, out.scales_t if columnwise else None,
                          bool(pow2_scales), float(amax_epsilon))
    return out


def grouped_linear_fp8(x: Fp8Tensor, weight: Fp8Weight, splits: Tensor, bias: Optional[Experts] = None,
                       row_scale: Optional[Tensor] = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``y[r] = x[r] W_g^T (+ b_g, or + row_scale[r] * b_g)`` over FP8 operands, scales applied
    every 128 of K: x's rows and the weight's ``data``. y ``[T, N]`` in ``out_dtype`` (bfloat16 or
    float32). bias ``[G, N]`` or G tensors ``[N]``; row_scale ``[T]`` float32. Not differentiable."""
    op = "grouped_linear_fp8"
    _expect(op, "x", x, Fp8Tensor, _FROM_QUANTIZE)
    _expect(op, "weight", weight, Fp8Weight, _FROM_QUANTIZE_WEIGHT)
    if x.rows is None:
        raise ValueError(f"{op}: x: the forward reads the rowwise form, but x has none "
                         "(quantize_fp8 with rowwise=True)")
    _expect(op, "x.rows", x.rows, Fp8Rows, "an Fp8Rows")
    if weight.data is None:
        raise ValueError(f"{op}: weight: the forward reads weight.data, but it is None "
                         "(quantize_fp8_weight with rowwise=True)")
    return _grouped_linear_fp8(x.rows.data, x.rows.scales, weight.data, weight.scales, splits, _as_list(bias),
                               row_scale, out_dtype, x.routing)


def grouped_linear_fp8_dgrad(dy: Fp8Tensor, weight: Fp8Weight, splits: Tensor,
                             out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``dx[r] = dy[r] W_g`` over FP8 operands: dy's rows ``[T, N]`` and the weight's transposed copy
    (``data_t``). dx ``[T, K]`` in ``out_dtype`` (bfloat16 or float32)."""
    op = "grouped_linear_fp8_dgrad"
    _expect(op, "dy", dy, Fp8Tensor, _FROM_QUANTIZE)
    _expect(op, "weight", weight, Fp8Weight, _FROM_QUANTIZE_WEIGHT)
    if dy.rows is None:
        raise ValueError(f"{op}: dy: dgrad reads the rowwise form, but dy has none (quantize_fp8 with rowwise=True)")
    _expect(op, "dy.rows", dy.rows, Fp8Rows, "an Fp8Rows")
    if weight.data_t is None:
        raise ValueError(f"{op}: weight: dgrad reads the transposed copy weight.data_t, but it is None "
                         "(quantize_fp8_weight with columnwise=True)")
    return _grouped_linear_fp8_dgrad(dy.rows.data, dy.rows.scales, weight.data_t, weight.scales_t, splits, out_dtype,
                                     dy.routing)


def grouped_linear_fp8_wgrad(dy: Fp8Tensor, x: Fp8Tensor, splits: Tensor, out: Optional[Experts] = None,
                             mode: str = "write", out_dtype: torch.dtype = torch.bfloat16) -> Experts:
    """``dW_g = dy_g^T x_g`` over the columnwise forms of dy ``[T, N]`` and x ``[T, K]``, into
    ``out`` (packed ``[G, N, K]`` or G tensors; default: a new packed tensor in ``out_dtype``).
    ``mode``: ``write``; ``accumulate`` / ``overwrite`` for float32 main_grad buffers (an empty
    expert leaves an accumulated buffer untouched). Returns ``out``."""
    op = "grouped_linear_fp8_wgrad"
    _expect(op, "dy", dy, Fp8Tensor, _FROM_QUANTIZE)
    _expect(op, "x", x, Fp8Tensor, _FROM_QUANTIZE)
    for name, t in (("dy", dy), ("x", x)):
        if t.columns is None:
            raise ValueError(f"{op}: {name}: wgrad reads the columnwise form, but {name} has none "
                             "(quantize_fp8 with columnwise=True)")
        _expect(op, f"{name}.columns", t.columns, Fp8Columns, "an Fp8Columns")
    if dy.num_tokens != x.num_tokens:
        raise ValueError(f"{op}: dy and x were quantized from token buffers of T = {dy.num_tokens} and "
                         f"T = {x.num_tokens} rows; expected the same T")
    G = _extent(splits, 0) if isinstance(splits, Tensor) else None
    for name, t in (("dy", dy), ("x", x)):
        if G is not None and splits.dim() == 1 and t.columns.offsets.dim() == 1 and t.columns.offsets.shape[0] != G + 1:
            raise ValueError(f"{op}: {name} was quantized for G = {t.columns.offsets.shape[0] - 1} experts (its columns' "
                             f"offsets are [G+1]), but splits has G = {G}")
        _check_current(op, name, t, splits)
    # The columns of each operand are laid out by the offsets of the splits it was quantized with; the
    # GEMM reads both by one routing. Operands of different routings are told apart by where their
    # splits were (buffer and version), never by reading values: no host sync.
    compiling = torch.compiler.is_compiling()  # a trace has no addresses: the op checks its routing when it runs
    sources = [routing_source(t.routing) if t.routing is not None and not compiling else None for t in (dy, x)]
    if sources[0] is not None and sources[1] is not None and (
            sources[0][0] != sources[1][0]
            or (sources[0][1] is not None and sources[1][1] is not None and sources[0][1] != sources[1][1])):
        raise ValueError(f"{op}: dy and x were quantized with different splits (another splits tensor, or new values "
                         "written into it in between): their columns are laid out by different group offsets; "
                         "quantize both with the splits of this wgrad")
    if out is None:
        G, N, K = _extent(splits, 0), dy.columns.data.shape[0], x.columns.data.shape[0]
        out = torch.empty(G, N, K, dtype=out_dtype, device=dy.columns.data.device)
    check_writable(op, out=out)
    routing = dy.routing if dy.routing is not None else x.routing
    _grouped_linear_fp8_wgrad_(dy.columns.data, dy.columns.scales, dy.columns.offsets, x.columns.data,
                               x.columns.scales, x.columns.offsets, splits, dy.num_tokens, _as_list(out), mode,
                               routing)
    return out


# ---- the FP8 expert MLP (moe_engine/expert_mlp_fp8.hpp) ----


_SAVED_X_FORMS = ("none", "columns", "rows")


def saved_x_form(need_fc1_wgrad: bool, num_tokens, num_groups) -> str:
    """What the FP8 MLP's forward keeps of x: ``none`` (no FC1 weight gradient), else ``rows`` or
    ``columns`` by ``expert_mlp_fp8_keeps_x_rows(T, G)``."""
    if not need_fc1_wgrad:
        return "none"
    return "rows" if expert_mlp_fp8_keeps_x_rows(num_tokens, num_groups) else "columns"


def kept_x(form: str, saved: Sequence[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """The forward's five x tensors (columns data, scales, offsets, rows data, scales) with the
    form not kept as None: what backward takes."""
    keep = {"none": (False,) * 5, "columns": (True,) * 3 + (False,) * 2, "rows": (False,) * 3 + (True,) * 2}[form]
    return tuple(t if k else None for t, k in zip(saved, keep))


def _mlp_saved_outputs(x: Tensor, splits: Tensor, fc1_rows, save_x: str, save_fc1_out: bool):
    """What the FP8 MLP's forward keeps (C++ ``expert_mlp_fp8_saved_shapes``): x's columns (data
    ``[H, C]``, scales ``[C/128, H]``, offsets ``[G+1]``) when ``save_x`` is ``columns``, x's rows
    (data ``[T, H]``, scales ``[ceil(H/128), S]``) when it is ``rows``, and h's rows (data
    ``[T, 2F]``, scales ``[ceil(2F/128), S]``); those not kept are empty ``[0]`` tensors."""
    if save_x not in _SAVED_X_FORMS:
        raise ValueError(f"expert_mlp_fp8: save_x: expected one of {', '.join(_SAVED_X_FORMS)}, got {save_x!r}")
    T, H, G = _extent(x, 0), _extent(x, -1), _extent(splits, 0)
    dev = x.device

    def new(kept, shape, dtype):
        return torch.empty(shape if kept else (0,), dtype=dtype, device=dev)

    C = fp8_columns_capacity(T, G)
    columns, rows = save_x == "columns", save_x == "rows"
    return (new(columns, (H, C), FP8_DTYPE), new(columns, (C // FP8_BLOCK, H), torch.float32),
            new(columns, (G + 1,), torch.int64), new(rows, (T, H), FP8_DTYPE),
            new(rows, (_blocks(H), fp8_scales_pitch(T)), torch.float32), new(save_fc1_out, (T, fc1_rows), FP8_DTYPE),
            new(save_fc1_out, (_blocks(fc1_rows), fp8_scales_pitch(T)), torch.float32))


@torch.library.custom_op("moe_engine::expert_mlp_fp8", mutates_args=())
def _expert_mlp_fp8(x: Tensor, probs: Optional[Tensor], w1_data: Tensor, w1_scales: Tensor, w2_data: Tensor,
                    w2_scales: Tensor, b1: List[Tensor], b2: List[Tensor], splits: Tensor, glu: str, fusion: str,
                    save_x: str, save_fc1_out: bool, pow2_scales: bool, amax_epsilon: float
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y [T, H], x's columns data / scales / offsets, x's rows data / scales, h's rows data /
    scales, routing): the expert MLP with its six GEMMs in FP8 over quantized weights (forward
    reads ``data`` and ``scales``). ``save_x`` (for the FC1 weight gradient): ``columns``, ``rows``
    (``saved_x_form`` says which) or ``none``; ``save_fc1_out``: for any backward. What is not kept
    is empty ``[0]`` tensors. ``fusion``: ``none`` runs every step as its own op; otherwise, on
    CUDA, the steps around the GLU run as one pass (the same bytes)."""
    T, H = _rows_cols(x)
    F = _extent(w2_data, 2)
    y = torch.empty(T, H, dtype=x.dtype, device=x.device)
    saved = _mlp_saved_outputs(x, splits, _extent(w1_data, 1), save_x, save_fc1_out)
    stream = stream_of(x)
    r = routing_of("expert_mlp_fp8_forward", "x", x, splits, stream)
    ws = _workspace(_C.expert_mlp_fp8_forward_workspace_size(T, H, F, dtype_name(x.dtype), _glu_spec(glu)), x.device)
    xd, xs, xo, xrd, xrs = kept_x(save_x, saved[:5])
    hd, hs = saved[5:] if save_fc1_out else (None, None)
    _C.expert_mlp_fp8_forward(x, probs, w1_data, w1_scales, w2_data, w2_scales, grouped(b1, 1), grouped(b2, 1), r, y,
                              xd, xs, xo, xrd, xrs, hd, hs, _glu_spec(glu), fusion, pow2_scales, amax_epsilon, ws,
                              stream)
    return (y,) + saved + (routing_tensor(r),)


@_expert_mlp_fp8.register_fake
def _(x, probs, w1_data, w1_scales, w2_data, w2_scales, b1, b2, splits, glu, fusion, save_x, save_fc1_out,
      pow2_scales, amax_epsilon):
    check_devices("expert_mlp_fp8", x=x, probs=probs, w1_data=w1_data, w1_scales=w1_scales, w2_data=w2_data,
                  w2_scales=w2_scales, b1=b1, b2=b2, splits=splits)
    saved = _mlp_saved_outputs(x, splits, _extent(w1_data, 1), save_x, save_fc1_out)
    return (x.new_empty(_rows_cols(x)),) + saved + (routing_like(splits),)


@torch.library.custom_op("moe_engine::expert_mlp_fp8_backward_", mutates_args=("w1_grad", "w2_grad"))
def _expert_mlp_fp8_backward_(
    dy: Tensor, x_data: Optional[Tensor], x_scales: Optional[Tensor], x_offsets: Optional[Tensor],
    x_rows_data: Optional[Tensor], x_rows_scales: Optional[Tensor], h_data: Tensor, h_scales: Tensor,
    probs: Optional[Tensor], w1_data: Tensor, w1_scales: Tensor, w1_data_t: Tensor, w1_scales_t: Tensor,
    w2_data: Tensor, w2_scales: Tensor, w2_data_t: Tensor, w2_scales_t: Tensor, b1: List[Tensor], b2: List[Tensor],
    splits: Tensor, glu: str, fusion: str, pow2_scales: bool, amax_epsilon: float, need_dx: bool, need_dprobs: bool,
    need_bias_grads: bool, w1_grad: List[Tensor], w1_mode: str, w2_grad: List[Tensor], w2_mode: str,
    routing: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx [T, H], dprobs [T] float32, db1 [G, W], db2 [G, H]) (W: FC1's rows); those not asked for (or without
    their bias) are empty. The weight gradients go into w1_grad / w2_grad (empty lists: not
    computed) per their modes; the FC1 weight gradient reads what forward kept of x: its columns
    (x_data, x_scales, x_offsets), or its rows (x_rows_data, x_rows_scales), from which backward
    makes the columns; the other form None."""
    dx, dprobs, db1, db2 = _mlp_fp8_grad_outputs(dy, w1_data, b1, b2, splits, need_dx, need_dprobs, need_bias_grads)
    T, H = _rows_cols(dy)
    stream = stream_of(dy)
    r = routing_of("expert_mlp_fp8_backward", "dy", dy, splits, stream, routing,
                   stale="expert_mlp_fp8_backward: what forward kept of x and h")
    x_from_rows = len(w1_grad) > 0 and x_data is None and x_rows_data is not None
    ws = _workspace(_C.expert_mlp_fp8_backward_workspace_size(T, _extent(splits, 0), H, _extent(w2_data, 2),
                                                              dtype_name(dy.dtype), _glu_spec(glu), fusion,
                                                              x_from_rows),
                    dy.device)
    _C.expert_mlp_fp8_backward(dy, x_data, x_scales, x_offsets, x_rows_data, x_rows_scales, h_data, h_scales, probs,
                               w1_data, w1_scales, w1_data_t, w1_scales_t, w2_data, w2_scales, w2_data_t,
                               w2_scales_t, grouped(b1, 1), grouped(b2, 1), r, dx if need_dx else None,
                               dprobs if need_dprobs else None, grouped(w1_grad, 2), w1_mode,
                               grouped([db1] if db1.numel() else [], 1), grouped(w2_grad, 2), w2_mode,
                               grouped([db2] if db2.numel() else [], 1), _glu_spec(glu), fusion, pow2_scales,
                               amax_epsilon, ws, stream)
    return dx, dprobs, db1, db2


def _mlp_fp8_grad_outputs(dy, w1_data, b1, b2, splits, need_dx, need_dprobs, need_bias_grads):
    T, H = _rows_cols(dy)
    G, F2 = _extent(splits, 0), _extent(w1_data, 1)
    dev, dt = dy.device, dy.dtype
    bias1, bias2 = need_bias_grads and len(b1) > 0, need_bias_grads and len(b2) > 0
    return (torch.empty(T if need_dx else 0, H, dtype=dt, device=dev),
            torch.empty(T if need_dprobs else 0, dtype=torch.float32, device=dev),
            torch.empty(G if bias1 else 0, F2 if bias1 else 0, dtype=dt, device=dev),
            torch.empty(G if bias2 else 0, H if bias2 else 0, dtype=dt, device=dev))


@_expert_mlp_fp8_backward_.register_fake
def _(dy, x_data, x_scales, x_offsets, x_rows_data, x_rows_scales, h_data, h_scales, probs, w1_data, w1_scales,
      w1_data_t, w1_scales_t, w2_data, w2_scales, w2_data_t, w2_scales_t, b1, b2, splits, glu, fusion, pow2_scales,
      amax_epsilon, need_dx, need_dprobs, need_bias_grads, w1_grad, w1_mode, w2_grad, w2_mode, routing=None):
    check_devices("expert_mlp_fp8_backward_", dy=dy, x_data=x_data, x_scales=x_scales, x_offsets=x_offsets,
                  x_rows_data=x_rows_data, x_rows_scales=x_rows_scales, h_data=h_data, h_scales=h_scales, probs=probs,
                  w1_data=w1_data, w1_scales=w1_scales, w1_data_t=w1_data_t, w1_scales_t=w1_scales_t,
                  w2_data=w2_data, w2_scales=w2_scales, w2_data_t=w2_data_t, w2_scales_t=w2_scales_t, b1=b1, b2=b2,
                  splits=splits, w1_grad=w1_grad, w2_grad=w2_grad, routing=routing)
    return _mlp_fp8_grad_outputs(dy, w1_data, b1, b2, splits, need_dx, need_dprobs, need_bias_grads)


def packed_bias(bias: Sequence[Tensor]) -> List[Tensor]:
    """A grouped bias as the one packed ``[G, N]`` tensor the FP8 GEMMs' epilogue reads on the GPU
    (per-expert biases stacked: G x N values, nothing next to the GEMMs)."""
    if len(bias) == 0 or is_packed(bias, 1):
        return list(bias)
    return [torch.stack(list(bias))]


def fp8_weight_tensors(who: str, name: str, weight: Fp8Weight, need_transposed: bool) -> Tuple[Tensor, ...]:
    """(data, scales, data_t, scales_t) of a quantized weight that the FP8 MLP reads: the forward
    reads data, backward data_t too (absent: empty tensors, a forward without backward)."""
    if weight.data is None or weight.scales is None:
        raise ValueError(f"{who}: {name}: the forward reads {name}.data, but it is None "
                         "(quantize_fp8_weight with rowwise=True)")
    if weight.data_t is None or weight.scales_t is None:
        if need_transposed:
            raise ValueError(f"{who}: {name}: backward reads the transposed copy {name}.data_t, but it is None "
                             "(quantize_fp8_weight with columnwise=True)")
        empty = weight.data.new_empty(0)
        return weight.data, weight.scales, empty, empty.float()
    return weight.data, weight.scales, weight.data_t, weight.scales_t


class _ExpertMlpFp8Function(torch.autograd.Function):
    """expert_mlp_fp8 with plain gradients: to x, probs, the biases, and the master weights the
    quantized ones were made from."""

    @staticmethod
    def forward(ctx, x, probs, splits, glu, fusion, recipe, counts, *tensors):
        w1_8, w2_8, rest = tensors[:4], tensors[4:8], tensors[8:]
        nb1, nb2, nm1, _ = counts
        b1, b2 = list(rest[:nb1]), list(rest[nb1 : nb1 + nb2])
        m1 = rest[nb1 + nb2 : nb1 + nb2 + nm1]  # FC1's master weights (FC2's follow)
        need_w1 = any(t.requires_grad for t in m1)
        need_any = (x.requires_grad or (probs is not None and probs.requires_grad)
                    or any(t.requires_grad for t in rest))
        save_x = saved_x_form(need_w1, _extent(x, 0), _extent(splits, 0))
        y, *saved_x, hd, hs, routing = _expert_mlp_fp8(
            x, probs, w1_8[0], w1_8[1], w2_8[0], w2_8[1], packed_bias(b1), packed_bias(b2), splits, glu, fusion,
            save_x, need_any, recipe.pow2_scales, recipe.amax_epsilon)
        ctx.save_for_backward(*kept_x(save_x, saved_x), hd if need_any else None, hs if need_any else None, probs,
                              splits, routing, *tensors)
        ctx.glu, ctx.fusion, ctx.recipe, ctx.counts = glu, fusion, recipe, counts
        return y

    @staticmethod
    def backward(ctx, dy):
        xd, xs, xo, xrd, xrs, hd, hs, probs, splits, routing, *tensors = ctx.saved_tensors
        nb1, nb2, nm1, _ = ctx.counts
        w1_8, w2_8, rest = tensors[:4], tensors[4:8], tensors[8:]
        b1, b2 = rest[:nb1], rest[nb1 : nb1 + nb2]
        m1, m2 = rest[nb1 + nb2 : nb1 + nb2 + nm1], rest[nb1 + nb2 + nm1 :]
        need = ctx.needs_input_grad  # x, probs, splits, glu, fusion, recipe, counts, then the tensors
        wants = need[7 + 8 :]
        want_b = any(wants[: nb1 + nb2])
        want_m1, want_m2 = any(wants[nb1 + nb2 : nb1 + nb2 + nm1]), any(wants[nb1 + nb2 + nm1 :])
        need_dx, need_dp = bool(need[0]), probs is not None and bool(need[1])
        g1 = new_expert_grads(m1) if want_m1 else []
        g2 = new_expert_grads(m2) if want_m2 else []
        dx, dprobs, db1, db2 = _expert_mlp_fp8_backward_(
            dy.contiguous(), xd, xs, xo, xrd, xrs, hd, hs, probs, *w1_8, *w2_8, packed_bias(b1), packed_bias(b2),
            splits, ctx.glu, ctx.fusion, ctx.recipe.pow2_scales, ctx.recipe.amax_epsilon, need_dx, need_dp, want_b,
            g1, "write", g2, "write", routing)
        db1s = split_like(db1, b1, 1) if (b1 and want_b) else [None] * nb1
        db2s = split_like(db2, b2, 1) if (b2 and want_b) else [None] * nb2
        return (dx if need_dx else None, dprobs if need_dp else None, None, None, None, None, None, *(None,) * 8,
                *db1s, *db2s, *(g1 or [None] * nm1), *(g2 or [None] * len(m2)))


def _master_of(who: str, name: str, weight, master) -> List[Tensor]:
    """The tensors that get a weight's gradient: the weight itself when it is not quantized yet,
    else ``master`` (empty: none)."""
    master_name = name.replace("weight", "master_weight")
    if isinstance(weight, Fp8Weight):
        masters = _as_list(master)
        for t in masters:
            _expect(who, master_name, t, Tensor, "a tensor or G tensors")
        return masters
    if master is not None:
        raise ValueError(f"{who}: {master_name} goes with an Fp8Weight {name}, but {name} is not quantized "
                         "(it is the master weight itself)")
    masters = _as_list(weight)
    if not masters:
        raise TypeError(f"{who}: {name}: expected an Fp8Weight, or the weight to quantize (a tensor or G tensors), "
                        f"got {type(weight).__name__}")
    for t in masters:
        _expect(who, name, t, Tensor, "an Fp8Weight, or the weight to quantize (a tensor or G tensors)")
    return masters


def _fp8_weight_of(who: str, name: str, weight, masters: List[Tensor], recipe: Fp8Recipe,
                   backward: bool) -> Tuple[Tensor, ...]:
    if isinstance(weight, Fp8Weight):
        return fp8_weight_tensors(who, name, weight, backward)
    w8 = quantize_fp8_weight(masters, pow2_scales=recipe.pow2_scales, amax_epsilon=recipe.amax_epsilon)
    return w8.data, w8.scales, w8.data_t, w8.scales_t


def expert_mlp_fp8(x: Tensor, fc1_weight: Union[Fp8Weight, Experts], fc2_weight: Union[Fp8Weight, Experts],
                   splits: Tensor, probs: Optional[Tensor] = None, fc1_bias: Optional[Experts] = None,
                   fc2_bias: Optional[Experts] = None, activation: str = "swiglu", layout: str = "halves",
                   limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0, fusion: str = "forward",
                   recipe: Optional[Fp8Recipe] = None, fc1_master_weight: Optional[Experts] = None,
                   fc2_master_weight: Optional[Experts] = None) -> Tensor:
    """The expert MLP ``y = FC2(act(FC1(x) + b1) * p) + p * b2`` with its six GEMMs in FP8
    (``docs/design.md``, "The FP8 expert MLP"); differentiable.

    x ``[T, H]`` bfloat16 or float32 (y, dx and the activations between the GEMMs in its dtype);
    fc1 ``G x [2F, H]`` (rows in ``layout``) for a GLU activation, ``G x [F, H]`` for a non-gated one
    (``srelu``, ``gelu_tanh``), fc2 ``G x [H, F]``; biases unquantized, ``[G, 2F]`` (``[G, F]``) /
    ``[G, H]`` or G tensors; probs ``[T]`` float32. Each weight is either

    - the weight itself (a tensor or G tensors): quantized here with ``recipe`` (both copies), and
      its gradient is returned to it; or
    - an ``Fp8Weight`` with both copies (``quantize_fp8_weight``, e.g. cached across
      micro-batches), whose gradient goes to ``fc1_master_weight`` / ``fc2_master_weight`` when
      given (and nowhere otherwise).

    Forward keeps only FP8 for backward: the pre-activation's rows, and (when the FC1 weight gets a
    gradient) x's columns, or x's rows where ``expert_mlp_fp8_keeps_x_rows(T, G)`` (the columns
    would be more than twice their bytes: many experts of few tokens; backward makes the columns).
    ``recipe``: ``Fp8Recipe`` (default: plain scales); overrides are refused.
    ``fusion``: ``none`` runs every step as its own op; ``forward`` / ``all`` fuse the steps around
    a GLU on CUDA (the same bytes; a non-gated activation runs them as separate ops).
    """
    who = "expert_mlp_fp8"
    recipe = check_recipe(who, recipe, all_fp8=True, name="recipe")
    _expect(who, "x", x, Tensor, "a [T, H] tensor")
    b1, b2 = _as_list(fc1_bias), _as_list(fc2_bias)
    m1 = _master_of(who, "fc1_weight", fc1_weight, fc1_master_weight)
    m2 = _master_of(who, "fc2_weight", fc2_weight, fc2_master_weight)
    differentiable = [x, *b1, *b2, *m1, *m2] + ([probs] if probs is not None else [])
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
    w1_8 = _fp8_weight_of(who, "fc1_weight", fc1_weight, m1, recipe, backward)
    w2_8 = _fp8_weight_of(who, "fc2_weight", fc2_weight, m2, recipe, backward)
    counts = (len(b1), len(b2), len(m1), len(m2))
    return _ExpertMlpFp8Function.apply(x, probs, splits, glu_text(activation, layout, limit, alpha, offset),
                                       _C.fusion_name(fusion), recipe, counts, *w1_8, *w2_8, *b1, *b2, *m1, *m2)


# ---- the modules' weight cache ----


class Fp8WeightCache:
    """One weight's quantized copies (``Fp8Weight``), made once and reused until the weight changes.

    The key is every expert tensor's address and autograd version counter (an optimizer step, a
    ``load_state_dict`` and any in-place change under ``no_grad`` bump it) and the recipe. Changes
    the counter does not see (``param.data.copy_(...)``) need ``invalidate()``. A changed weight is
    quantized again into the same tensors, so their addresses stay what a captured CUDA graph read;
    during a capture the quantization always runs (it is captured: every replay quantizes the
    weight as it is then). The tensors are marked as weights: activation offload leaves them."""

    def __init__(self):
        self._key = None  # what the cached copies were made from
        self._layout = None  # what the cached tensors can hold
        self.weight: Optional[Fp8Weight] = None

    def invalidate(self) -> None:
        self._key = None

    def get(self, params: Sequence[Tensor], recipe: Fp8Recipe, rowwise: bool, columnwise: bool) -> Fp8Weight:
        layout = (tuple(tuple(p.shape) for p in params), params[0].dtype, params[0].device, rowwise, columnwise)
        key = (tuple((p.data_ptr(), p._version) for p in params), recipe.pow2_scales, recipe.amax_epsilon, layout)
        capturing = params[0].is_cuda and torch.cuda.is_current_stream_capturing()
        if key == self._key and not capturing:
            return self.weight
        out = self.weight if layout == self._layout else None
        self.weight = quantize_fp8_weight(list(params), rowwise, columnwise, recipe.pow2_scales,
                                          recipe.amax_epsilon, out=out)
        mark_as_weight(*(t for t in (self.weight.data, self.weight.scales, self.weight.data_t, self.weight.scales_t)
                         if t is not None))
        self._key, self._layout = key, layout
        return self.weight

    def tensors(self, params: Sequence[Tensor], recipe: Fp8Recipe) -> tuple:
        """(data, scales, data_t, scales_t) of the weight as a layer with ``recipe`` reads it: data for
        an FP8 forward, data_t for an FP8 dgrad, None where the recipe overrides that GEMM."""
        fprop_hp, dgrad_hp, _ = recipe.override_linear_precision
        if fprop_hp and dgrad_hp:
            return (None,) * 4
        w = self.get(params, recipe, not fprop_hp, not dgrad_hp)
        return w.data, w.scales, w.data_t, w.scales_t
