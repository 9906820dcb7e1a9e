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
CUDA-graph safe. The FP8 ops have no autograd formulas: they are the pieces a caller's own
backward (or an FP8 module) is built from.

Parts of an FP8 operand that no expert owns are not written and hold whatever the allocator gave:
rows past ``sum(splits)`` (data and scales), columns past the last expert's segment. No GEMM reads
them. The GEMMs' outputs are ordinary fresh outputs: their rows past ``sum(splits)`` are zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _C
from ._bridge import grouped, is_packed, routing_for_capacity, routing_like, routing_of, routing_tensor, stream_of
from .ops import Experts, _as_list

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
                  amax_epsilon: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(rows data, rows scales, columns data, columns scales, columns offsets, routing); the parts
    not requested are empty ``[0]`` tensors."""
    outs = _quantize_outputs(x, splits, rowwise, columnwise)
    stream = stream_of(x)
    r = routing_of("quantize_fp8", "x", x, splits, stream)
    rd, rs, cd, cs, co = (t if want else None for t, want in zip(outs, (rowwise,) * 2 + (columnwise,) * 3))
    _C.quantize_fp8(x, r, rd, rs, cd, cs, co, pow2_scales, amax_epsilon, stream)
    return outs + (routing_tensor(r),)


@_quantize_fp8.register_fake
def _(x, splits, rowwise, columnwise, pow2_scales, amax_epsilon):
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
    return _weight_outputs(weight, rowwise, columnwise)


@torch.library.custom_op("moe_engine::grouped_linear_fp8", mutates_args=())
def _grouped_linear_fp8(x_data: Tensor, x_scales: Tensor, weight_data: Tensor, weight_scales: Tensor, splits: Tensor,
                        bias: List[Tensor], row_scale: Optional[Tensor], out_dtype: torch.dtype,
                        routing: Optional[Tensor] = None) -> Tensor:
    y = torch.empty(_extent(x_data, 0), _extent(weight_data, 1), dtype=out_dtype, device=x_data.device)
    stream = stream_of(x_data)
    r = routing_of("grouped_linear_forward", "x.data", x_data, splits, stream, routing)
    _C.grouped_linear_fp8_forward(x_data, x_scales, weight_data, weight_scales, r, y, grouped(bias, 1), row_scale,
                                  stream)
    return y


@_grouped_linear_fp8.register_fake
def _(x_data, x_scales, weight_data, weight_scales, splits, bias, row_scale, out_dtype, routing=None):
    return x_data.new_empty(_extent(x_data, 0), _extent(weight_data, 1), dtype=out_dtype)


@torch.library.custom_op("moe_engine::grouped_linear_fp8_dgrad", mutates_args=())
def _grouped_linear_fp8_dgrad(dy_data: Tensor, dy_scales: Tensor, weight_data_t: Tensor, weight_scales_t: Tensor,
                              splits: Tensor, out_dtype: torch.dtype, routing: Optional[Tensor] = None) -> Tensor:
    dx = torch.empty(_extent(dy_data, 0), _extent(weight_data_t, 1), dtype=out_dtype, device=dy_data.device)
    stream = stream_of(dy_data)
    r = routing_of("grouped_linear_dgrad", "dy.data", dy_data, splits, stream, routing)
    _C.grouped_linear_fp8_dgrad(dy_data, dy_scales, weight_data_t, weight_scales_t, r, dx, stream)
    return dx


@_grouped_linear_fp8_dgrad.register_fake
def _(dy_data, dy_scales, weight_data_t, weight_scales_t, splits, out_dtype, routing=None):
    return dy_data.new_empty(_extent(dy_data, 0), _extent(weight_data_t, 1), dtype=out_dtype)


# `out_mode`, not `mode`: torch.compile functionalizes a mutating op through auto_functionalized,
# whose own keyword `mode` an argument of that name would collide with.
@torch.library.custom_op("moe_engine::grouped_linear_fp8_wgrad_", mutates_args=("out",))
def _grouped_linear_fp8_wgrad_(dy_data: Tensor, dy_scales: Tensor, dy_offsets: Tensor, x_data: Tensor,
                               x_scales: Tensor, x_offsets: Tensor, splits: Tensor, num_tokens: int,
                               out: List[Tensor], out_mode: str, routing: Optional[Tensor] = None) -> None:
    stream = stream_of(dy_data)
    r = routing_for_capacity("grouped_linear_wgrad", num_tokens, splits, stream, routing)
    _C.grouped_linear_fp8_wgrad(dy_data, dy_scales, dy_offsets, x_data, x_scales, x_offsets, r, grouped(out, 2),
                                out_mode, stream)


@_grouped_linear_fp8_wgrad_.register_fake
def _(dy_data, dy_scales, dy_offsets, x_data, x_scales, x_offsets, splits, num_tokens, out, out_mode, routing=None):
    return None


# ---- the functional API ----


_FROM_QUANTIZE = "an Fp8Tensor (from moe_engine.torch.quantize_fp8)"
_FROM_QUANTIZE_WEIGHT = "an Fp8Weight (from moe_engine.torch.quantize_fp8_weight)"


def _expect(op: str, name: str, value, kind: type, what: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{op}: {name}: expected {what}, got {type(value).__name__}")


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
    rd, rs, cd, cs, co, routing = _quantize_fp8(x.detach(), splits, bool(rowwise), bool(columnwise),
                                                bool(pow2_scales), float(amax_epsilon))
    return Fp8Tensor(Fp8Rows(rd, rs) if rowwise else None, Fp8Columns(cd, cs, co) if columnwise else None,
                     _extent(x, 0), routing)


def quantize_fp8_weight(weight: Experts, rowwise: bool = True, columnwise: bool = True, pow2_scales: bool = False,
                        amax_epsilon: float = 0.0) -> Fp8Weight:
    """A weight packed ``[G, N, K]`` or G tensors ``[N, K]`` (N, K multiples of 16) in 128 x 128
    blocks: ``rowwise`` the forward's ``data``/``scales``, ``columnwise`` the transposed copy
    ``data_t``/``scales_t`` that dgrad reads (same bytes and scales per block). Always packed."""
    experts = _as_list(weight)
    for t in experts:
        _expect("quantize_fp8_weight", "weight", t, Tensor, "a [G, N, K] tensor or G tensors [N, K]")
    d, s, dt, st = _quantize_fp8_weight([t.detach() for t in experts], bool(rowwise), bool(columnwise),
                                        bool(pow2_scales), float(amax_epsilon))
    return Fp8Weight(d if rowwise else None, s if rowwise else None, dt if columnwise else None,
                     st if columnwise else None)


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
    if dy.num_tokens != x.num_tokens:
        raise ValueError(f"{op}: dy and x were quantized from token buffers of T = {dy.num_tokens} and "
                         f"T = {x.num_tokens} rows; expected the same T")
    if out is None:
        G, N, K = _extent(splits, 0), dy.columns.data.shape[0], x.columns.data.shape[0]
        out = torch.empty(G, N, K, dtype=out_dtype, device=dy.columns.data.device)
    routing = dy.routing if dy.routing is not None else x.routing
    _grouped_linear_fp8_wgrad_(dy.columns.data, dy.columns.scales, dy.columns.offsets, x.columns.data,
                               x.columns.scales, x.columns.offsets, splits, dy.num_tokens, _as_list(out), mode,
                               routing)
    return out
