"""``GroupedLinear`` and ``GroupedMLP``: nn.Modules over the moe-engine ops with the training
contract of TransformerEngine / Megatron-LM (docs/design.md section 6):

- parameters packed (``weight`` ``[G, N, K]``) or per expert (``weight0`` .. ``weight{G-1}``);
- ``accumulate_into_main_grad``: the wgrad GEMM adds into (or, with ``overwrite_main_grad``,
  overwrites) each weight's float32 ``param.main_grad``; ``__fsdp_param__`` parameters are asked
  with ``get_main_grad()``; ``grad_added_to_main_grad`` / ``zero_out_wgrad`` get the dummy-gradient
  treatment (see ``_contract.py`` for the six-row table);
- ``delay_wgrad_compute``: backward computes dgrad (and bias gradients) only; ``backward_dw()`` runs
  the queued weight gradients, then the hooks registered with
  ``register_wgrad_accumulation_and_reduce_hooks``; weights carry ``skip_backward_post_hook``;
- ``load_state_dict`` normalizes checkpoint keys between the packed and per-expert forms (the plan
  comes from the C++ library, ``_C.plan_grouped_keys``, which the C++ modules apply too);
- ``offload_activations=False`` keeps the module's saved tensors on the device inside an
  ``ActivationOffload`` region (the per-module opt-out; ``offload.py``);
- ``fp8_recipe``: the GEMMs run in FP8 block scaling (``fp8.py``) with the same contract; the
  parameters stay in the module's dtype and are quantized once into a cache that is kept until
  they change (``Fp8WeightCache``); backward keeps FP8 tensors only.

The routing ``splits`` is a ``[G]`` tensor on the tokens' device; nothing reads it on the host, so
forward and backward can be captured in a CUDA graph and replayed with new splits. Forward computes
the group offsets once; backward (and ``backward_dw``) reuse them through the forward's routing
tensor (``ops``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor, nn

from .. import _C
from . import ops
from ._autograd import (_GroupedLinearFp8Function, _GroupedLinearFunction, _GroupedMLPFp8Function,
                        _GroupedMLPFunction, _mlp_forward_two_nodes, _mlp_two_nodes)
from ._bridge import dtype_name as _dtype_name
from ._bridge import check_int, forward_routings
from ._contract import WeightGradContract
from .fp8 import Fp8Recipe, Fp8WeightCache, check_recipe
from .ops import check_glu_params
from .offload import no_offload

_LAYOUTS = ("packed", "per-expert")


def normalize_grouped_keys(state: dict, key: str, num_groups: int, packed: bool,
                           expert_shape: Sequence[int] = ()) -> List[str]:
    """Checkpoint key normalization for one grouped parameter ``key`` (PREFIX + name), as the C++
    modules do it (``_C.plan_grouped_keys`` decides; this applies the plan to torch tensors): a
    packed module gets ``key`` stacked from ``key0..key{G-1}`` when all of those are present and
    ``key`` is not; a per-expert module gets ``key`` split (``[G, ...]`` along dim 0, or
    ``[G*N, ...]`` into G equal chunks) when it is present and no indexed key is; with
    ``expert_shape`` (the module's ``[N, ...]``) a packed module's ``[G*N, ...]`` key is reshaped to
    ``[G, N, ...]``. Other mixes are left alone. Returns the indexed keys a packed module misses when
    the checkpoint has only some experts (torch would report only ``key`` as missing)."""
    indexed = [f"{key}{i}" for i in range(num_groups)]
    if any(not isinstance(state[k], Tensor) for k in [key, *indexed] if k in state):
        return []  # nothing to normalize: torch's load names the key that holds no tensor
    entries = {k: (tuple(state[k].shape), _dtype_name(state[k].dtype)) for k in [key, *indexed] if k in state}
    plan = _C.plan_grouped_keys(entries, key, num_groups, "packed" if packed else "per-expert", list(expert_shape))
    if plan.error:
        raise RuntimeError(f"moe_engine: {plan.error}")
    if plan.action == "stack":
        state[key] = torch.stack([state.pop(k) for k in indexed])
    elif plan.action == "split":
        parts = state.pop(key).reshape(num_groups, *plan.shape).unbind(0)
        for k, part in zip(indexed, parts):
            state[k] = part
    elif plan.action == "reshape":
        state[key] = state[key].reshape(plan.shape)
    return plan.missing


class _ExpertParams(nn.Module):
    """G experts' weight ``[N, K]`` (and bias ``[N]``), packed or per expert, with the key
    normalization on load."""

    def __init__(self, num_groups: int, out_features: int, in_features: int, bias: bool, layout: str,
                 device, dtype, fan_in: Optional[int] = None):
        super().__init__()
        if layout not in _LAYOUTS:
            raise ValueError(f"moe_engine: unknown parameter layout '{layout}'; expected packed or per-expert")
        num_groups, out_features, in_features = (check_int("grouped parameters", name, v) for name, v in (
            ("G (num_groups)", num_groups), ("N (out_features)", out_features), ("K (in_features)", in_features)))
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"moe_engine: dtype must be a floating-point dtype (bfloat16, float16, float32, float64), "
                             f"got {dtype}")
        if num_groups < 1 or out_features < 1 or in_features < 1:
            raise ValueError(f"moe_engine: expected G, N, K >= 1, got {num_groups}, {out_features}, {in_features}")
        self.num_groups, self.packed = num_groups, layout == "packed"
        bound = 1.0 / math.sqrt(fan_in or in_features)

        def make(shape):
            return nn.Parameter(torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound))

        if self.packed:
            self.weight = make((num_groups, out_features, in_features))
            if bias:
                self.bias = make((num_groups, out_features))
        else:
            for g in range(num_groups):
                setattr(self, f"weight{g}", make((out_features, in_features)))
            if bias:
                for g in range(num_groups):
                    setattr(self, f"bias{g}", make((out_features,)))
        self.has_bias = bias
        self._missing_experts: List[str] = []
        self._register_load_state_dict_pre_hook(self._normalize_keys)
        self.register_load_state_dict_post_hook(self._name_missing_experts)

    def _normalize_keys(self, state_dict, prefix, *args):
        weight = self.weights()[0]
        expert_shape = weight.shape[1:] if self.packed else weight.shape
        self._missing_experts = normalize_grouped_keys(state_dict, prefix + "weight", self.num_groups, self.packed,
                                                       expert_shape)
        if self.has_bias:
            self._missing_experts += normalize_grouped_keys(state_dict, prefix + "bias", self.num_groups, self.packed,
                                                            expert_shape[:1])

    @staticmethod
    def _name_missing_experts(module, incompatible_keys):
        # The pre-hook cannot tell a strict load from a lenient one (torch passes strict=True to
        # every module); reporting the experts as missing keys lets torch apply either.
        incompatible_keys.missing_keys.extend(module._missing_experts)
        module._missing_experts = []

    def check_input(self, who: str, x: Tensor) -> None:
        """x must have the parameters' dtype and device: say so in the module's terms (the op
        would only say that x differs from a weight)."""
        p = self.weights()[0]
        if not isinstance(x, Tensor):
            raise TypeError(f"moe_engine: {who}: x must be a tensor, got {type(x).__name__}")
        if x.dtype != p.dtype:
            raise ValueError(
                f"moe_engine: {who}: x is {x.dtype} but the module's parameters are {p.dtype}; pass "
                f"x.to({p.dtype}), or build the module with dtype={x.dtype} (or convert it with .to({x.dtype}))"
            )
        if x.device != p.device:
            raise ValueError(
                f"moe_engine: {who}: x is on {x.device} but the module's parameters are on {p.device}; "
                f"move x (x.to('{p.device}')) or the module (.to('{x.device}'))"
            )

    def _list(self, name: str) -> List[nn.Parameter]:
        if self.packed:
            return [getattr(self, name)]
        return [getattr(self, f"{name}{g}") for g in range(self.num_groups)]

    def weights(self) -> List[nn.Parameter]:
        return self._list("weight")

    def biases(self) -> List[nn.Parameter]:
        return self._list("bias") if self.has_bias else []

    def weight_names(self) -> List[str]:
        return ["weight"] if self.packed else [f"weight{g}" for g in range(self.num_groups)]


class _DelayedWgrad:
    """The queue of weight-gradient work and the hooks that backward_dw fires."""

    def __init__(self):
        self.queue: List[Callable[[], None]] = []
        self.hooks: List[Callable[[], None]] = []

    def run(self) -> None:
        if not self.queue:
            return
        # The jobs hold their forward's routing and operands, laid out by the offsets of the splits
        # values of that forward; a caller may have written the next micro-batch's into the buffer.
        with forward_routings():
            while self.queue:
                self.queue.pop(0)()
        for hook in self.hooks:
            hook()


def _mark_delayed(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        p.skip_backward_post_hook = True  # Megatron DDP then hooks via register_wgrad_accumulation_and_reduce_hooks


# ---- GroupedLinear ----


_FP8_DTYPES = (torch.bfloat16, torch.float32)


def _check_fp8_module(who: str, recipe, all_fp8: bool, dtype: torch.dtype, sizes: dict) -> Optional[Fp8Recipe]:
    """The recipe, and what FP8 asks of the module: bfloat16 or float32 parameters (the FP8 GEMMs
    write those), and sizes that are multiples of 16 (the quantized rows' alignment)."""
    if recipe is None:
        return None
    recipe = check_recipe(who, recipe, all_fp8)
    if dtype not in _FP8_DTYPES:
        raise ValueError(f"{who}: fp8_recipe needs bfloat16 or float32 parameters (the FP8 GEMMs write those), "
                         f"got {dtype}")
    odd = {k: v for k, v in sizes.items() if v % 16}
    if odd:
        raise ValueError(f"{who}: fp8_recipe needs sizes that are multiples of 16, got "
                         + ", ".join(f"{k} = {v}" for k, v in odd.items()))
    return recipe


class GroupedLinear(_ExpertParams):
    """G linear layers over one packed token matrix: ``y[r] = x[r] W_g^T (+ b_g or + p[r] b_g)``.

    Args:
        num_groups, in_features, out_features: G, K, N.
        bias: a bias per expert; scale_bias: it is added as ``row_scale[r] * b_g`` (forward then
            takes ``row_scale``, float32 ``[T]``, the router probs).
        layout: ``"packed"`` (``weight`` ``[G, N, K]``) or ``"per-expert"`` (``weight0..``).
        accumulate_into_main_grad, overwrite_main_grad, delay_wgrad_compute, zero_out_wgrad: the
            training contract (module docstring).
        fp8_recipe: an ``Fp8Recipe`` to run the three GEMMs in FP8 (those its
            ``override_linear_precision`` names stay in the module's dtype); None: no FP8.
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = False,
                 scale_bias: bool = False, layout: str = "packed", accumulate_into_main_grad: bool = False,
                 overwrite_main_grad: bool = False, delay_wgrad_compute: bool = False,
                 zero_out_wgrad: bool = False, offload_activations: bool = True,
                 fp8_recipe: Optional[Fp8Recipe] = None, device=None, dtype: torch.dtype = torch.bfloat16):
        if scale_bias and not bias:
            raise ValueError("moe_engine: scale_bias needs bias=True")
        recipe = _check_fp8_module("GroupedLinear", fp8_recipe, False, dtype,
                                   {"in_features": in_features, "out_features": out_features})
        super().__init__(num_groups, out_features, in_features, bias, layout, device, dtype)
        self.in_features, self.out_features = in_features, out_features
        self.scale_bias = scale_bias
        self.delay_wgrad_compute = delay_wgrad_compute
        self._weight_grad = WeightGradContract(accumulate_into_main_grad, overwrite_main_grad, zero_out_wgrad)
        self._delayed = _DelayedWgrad()
        self.offload_activations = offload_activations
        self._fp8_recipe = recipe
        self._fp8_weight = Fp8WeightCache()
        if delay_wgrad_compute:
            _mark_delayed(self.weights())
        _init_device(self.weights()[0])

    @property
    def fp8_recipe(self) -> Optional[Fp8Recipe]:
        """The FP8 recipe (None: the GEMMs run in the module's dtype)."""
        return self._fp8_recipe

    @fp8_recipe.setter
    def fp8_recipe(self, recipe: Optional[Fp8Recipe]) -> None:
        self._fp8_recipe = _check_fp8_module("GroupedLinear", recipe, False, self.weights()[0].dtype,
                                             {"in_features": self.in_features, "out_features": self.out_features})

    def invalidate_fp8_weights(self) -> None:
        """Drops the cached quantized weight: the next forward quantizes it again. Needed only after
        a change that autograd's version counter does not see (``param.data.copy_(...)``,
        ``param.data[...] = ...``); optimizer steps and ``load_state_dict`` are seen."""
        self._fp8_weight.invalidate()

    @torch.compiler.disable  # Python state (the cache) read and written: runs eagerly, outside a trace
    def _fp8_weight_tensors(self):
        """(data, scales, data_t, scales_t) of the cached quantized weight: data for an FP8 forward,
        data_t for an FP8 dgrad (None where the recipe runs that GEMM unquantized)."""
        return self._fp8_weight.tensors(self.weights(), self._fp8_recipe)

    def forward(self, x: Tensor, splits: Tensor, row_scale: Optional[Tensor] = None) -> Tensor:
        """x ``[T, in]`` (rows sorted by expert), splits ``[G]`` -> y ``[T, out]``; rows past
        ``sum(splits)`` of y are zeros."""
        if self.scale_bias and row_scale is None:
            raise ValueError("moe_engine: GroupedLinear(scale_bias=True) needs row_scale")
        if not self.scale_bias and row_scale is not None:
            raise ValueError("moe_engine: row_scale given but the module was built without scale_bias")
        self.check_input("GroupedLinear", x)
        with _saving_scope(self):
            if self._fp8_recipe is None:
                return _GroupedLinearFunction.apply(self, x, splits, row_scale, *self.weights(), *self.biases())
            _check_fp8_dtype("GroupedLinear", x)
            return _GroupedLinearFp8Function.apply(self, x, splits, row_scale, *self._fp8_weight_tensors(),
                                                   *self.weights(), *self.biases())

    def backward_dw(self) -> None:
        """Runs the queued weight gradients in order, then the registered hooks (no-op if none)."""
        self._delayed.run()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        self._delayed.hooks.append(hook)

    def extra_repr(self) -> str:
        fp8_text = "" if self._fp8_recipe is None else f", fp8_recipe={self._fp8_recipe}"
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.has_bias}, scale_bias={self.scale_bias}, layout={'packed' if self.packed else 'per-expert'}"
                + fp8_text)


def _check_fp8_dtype(who: str, x: Tensor) -> None:
    """A module converted after construction (``.half()``) has parameters FP8 cannot write."""
    if x.dtype not in _FP8_DTYPES:
        raise ValueError(f"{who}: fp8_recipe needs bfloat16 or float32 parameters and x (the FP8 GEMMs write those), "
                         f"got {x.dtype}")


# ---- GroupedMLP ----


class _LinearOfMLP:
    """One of GroupedMLP's two layers as ``_GroupedLinearFp8Function`` reads its module: the MLP's
    recipe, delayed-wgrad flag and queue, this layer's parameters and weight-gradient contract."""

    def __init__(self, mlp: "GroupedMLP", params: "_ExpertParams", contract: WeightGradContract):
        self.fp8_recipe = mlp.fp8_recipe
        self.has_bias = params.has_bias
        self.delay_wgrad_compute = mlp.delay_wgrad_compute
        self._delayed = mlp._delayed
        self._weight_grad = contract
        self.weights = params.weights
        self.weight_names = params.weight_names


class GroupedMLP(nn.Module):
    """The expert MLP ``y = FC2(act(FC1(x) + b1) * p) + p * b2`` (Megatron's ``p * (W2 act + b2)``)
    for G experts, with GroupedLinear's training contract for both weights.

    Parameters live in ``fc1`` (``weight`` ``[G, W, H]``; ``bias`` ``[G, W]``) and ``fc2``
    (``weight`` ``[G, H, F]``; ``bias`` ``[G, H]``), packed or per expert (``fc1.weight0`` ..).
    ``activation``: a GLU, ``swiglu`` or ``clamped_qgeglu`` (``limit``, ``alpha``, ``offset``:
    GPT-OSS's 7, 1.702, 1), whose FC1 has W = 2F rows in ``glu_layout`` (``halves``, ``pairs`` or
    ``blocks:s``); or a non-gated activation, ``srelu`` (relu(h)^2) or ``gelu_tanh`` (GELU, tanh
    approximation), whose FC1 has W = F rows (``glu_layout`` stays ``halves``). On Hopper the FC1
    epilogue fuses the activation for the non-gated ones and for ``pairs`` and ``blocks:s``
    (``fusion``). ``recompute_fc1`` keeps only x for backward instead of the ``[T, W]``
    pre-activation.
    ``fp8_recipe``: an ``Fp8Recipe`` to run the six GEMMs in FP8 (backward keeps the
    pre-activation's rows and x's columns in FP8, x's rows instead of its columns where those would
    be more than twice the bytes; ``fusion`` other than ``none`` fuses the steps around the GLU on
    CUDA; no ``recompute_fc1``). A recipe whose ``override_linear_precision`` runs some GEMMs
    unquantized makes the MLP two of GroupedLinear's FP8 layers around the activation op, unfused:
    each GEMM as GroupedLinear runs it, and backward keeps what those layers keep.
    """

    def __init__(self, num_groups: int, hidden: int, ffn: int, *, bias: bool = False,
                 activation: str = "swiglu", glu_layout: str = "halves", limit: float = 7.0,
                 alpha: float = 1.702, offset: float = 1.0, fusion: str = "forward",
                 recompute_fc1: bool = False, layout: str = "packed", accumulate_into_main_grad: bool = False,
                 overwrite_main_grad: bool = False, delay_wgrad_compute: bool = False,
                 zero_out_wgrad: bool = False, offload_activations: bool = True,
                 fp8_recipe: Optional[Fp8Recipe] = None, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.recompute_fc1 = recompute_fc1
        limit, alpha, offset = check_glu_params("GroupedMLP", limit, alpha, offset)
        self._fp8_recipe = self._checked_recipe(fp8_recipe, dtype, hidden, ffn)
        self._fp8_weights = (Fp8WeightCache(), Fp8WeightCache())
        self._glu = _C.GluSpec(activation, glu_layout, limit, alpha, offset)
        self._glu_text = self._glu.text  # what the custom ops take
        self._glu.check(ffn, "GroupedMLP")  # F must suit the layout; a non-gated activation takes none
        self.num_groups, self.hidden, self.ffn = num_groups, hidden, ffn
        self.fc1 = _ExpertParams(num_groups, self._glu.fc1_width(ffn), hidden, bias, layout, device, dtype)
        self.fc2 = _ExpertParams(num_groups, hidden, ffn, bias, layout, device, dtype)
        self.fusion = _C.fusion_name(fusion)
        self.delay_wgrad_compute = delay_wgrad_compute
        self._fc1_grad = WeightGradContract(accumulate_into_main_grad, overwrite_main_grad, zero_out_wgrad)
        self._fc2_grad = WeightGradContract(accumulate_into_main_grad, overwrite_main_grad, zero_out_wgrad)
        self._delayed = _DelayedWgrad()
        self.offload_activations = offload_activations
        if delay_wgrad_compute:
            _mark_delayed(self.fc1.weights() + self.fc2.weights())
        _init_device(self.fc1.weights()[0])

    @property
    def glu_layout(self) -> str:
        return self._glu.layout

    def _checked_recipe(self, recipe, dtype: torch.dtype, hidden: int, ffn: int) -> Optional[Fp8Recipe]:
        recipe = _check_fp8_module("GroupedMLP", recipe, False, dtype, {"hidden": hidden, "ffn": ffn})
        if recipe is not None and self.recompute_fc1:
            raise ValueError("GroupedMLP: fp8_recipe and recompute_fc1=True: the FP8 MLP keeps the pre-activation "
                             "in FP8 (2F + F/16 bytes per token) and has no recompute mode; leave recompute_fc1 False")
        return recipe

    @property
    def fp8_recipe(self) -> Optional[Fp8Recipe]:
        """The FP8 recipe (None: the GEMMs run in the module's dtype)."""
        return self._fp8_recipe

    @fp8_recipe.setter
    def fp8_recipe(self, recipe: Optional[Fp8Recipe]) -> None:
        self._fp8_recipe = self._checked_recipe(recipe, self.fc1.weights()[0].dtype, self.hidden, self.ffn)

    def invalidate_fp8_weights(self) -> None:
        """Drops the cached quantized weights: the next forward quantizes them again. Needed only
        after a change that autograd's version counter does not see (``param.data.copy_(...)``);
        optimizer steps and ``load_state_dict`` are seen."""
        for cache in self._fp8_weights:
            cache.invalidate()

    @torch.compiler.disable  # Python state (the caches) read and written: runs eagerly, outside a trace
    def _fp8_weight_tensors(self):
        """FC1's and FC2's cached quantized weights, (data, scales, data_t, scales_t) each: data for
        an FP8 forward, data_t for an FP8 dgrad (None where the recipe runs that GEMM unquantized)."""
        return (*self._fp8_weights[0].tensors(self.fc1.weights(), self._fp8_recipe),
                *self._fp8_weights[1].tensors(self.fc2.weights(), self._fp8_recipe))

    def _forward_fp8_linears(self, x: Tensor, splits: Tensor, probs: Optional[Tensor]) -> Tensor:
        """The FP8 MLP with a recipe that overrides some GEMMs: FC1 and FC2 as two FP8 grouped-linear
        nodes (GroupedLinear's, each GEMM in FP8 or, where overridden, unquantized) around the
        activation op, unfused; p * b2 as FC2's bias scaled by the probs."""
        w = self._fp8_weight_tensors()
        fc1, fc2 = _LinearOfMLP(self, self.fc1, self._fc1_grad), _LinearOfMLP(self, self.fc2, self._fc2_grad)
        h = _GroupedLinearFp8Function.apply(fc1, x, splits, None, *w[:4], *self.fc1.weights(), *self.fc1.biases())
        act = ops._glu(h, probs, splits, self._glu_text)[0]
        scale = probs if self.fc2.has_bias else None
        return _GroupedLinearFp8Function.apply(fc2, act, splits, scale, *w[4:], *self.fc2.weights(),
                                               *self.fc2.biases())

    def _split_params(self, params):
        n1, nb1 = len(self.fc1.weights()), len(self.fc1.biases())
        n2 = len(self.fc2.weights())
        w1, b1 = list(params[:n1]), list(params[n1 : n1 + nb1])
        w2, b2 = list(params[n1 + nb1 : n1 + nb1 + n2]), list(params[n1 + nb1 + n2 :])
        return w1, b1, w2, b2

    def _params(self):
        """FC1's weights and biases, then FC2's: the tensors the MLP's autograd Functions take."""
        return (*self.fc1.weights(), *self.fc1.biases(), *self.fc2.weights(), *self.fc2.biases())

    def forward(self, x: Tensor, splits: Tensor, probs: Optional[Tensor] = None) -> Tensor:
        """x ``[T, H]`` (rows sorted by expert), splits ``[G]``, probs ``[T]`` float32 (the router
        probs; None: 1) -> y ``[T, H]``; rows past ``sum(splits)`` of y are zeros."""
        self.fc1.check_input("GroupedMLP", x)
        params = self._params()
        with _saving_scope(self):
            if self._fp8_recipe is None:
                if _mlp_two_nodes(self, x, probs, params):
                    return _mlp_forward_two_nodes(self, x, splits, probs, params)
                return _GroupedMLPFunction.apply(self, x, splits, probs, *params)
            _check_fp8_dtype("GroupedMLP", x)
            if any(self._fp8_recipe.override_linear_precision):
                return self._forward_fp8_linears(x, splits, probs)
            return _GroupedMLPFp8Function.apply(self, x, splits, probs, *self._fp8_weight_tensors(), *params)

    def backward_dw(self) -> None:
        """Runs the queued weight gradients in order, then the registered hooks (no-op if none)."""
        self._delayed.run()

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        self._delayed.hooks.append(hook)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False, *,
                        glu_from: Optional[str] = None):
        """As nn.Module's (with the packed / per-expert key normalization); ``glu_from`` names the
        GLU layout of the checkpoint's FC1 rows (e.g. ``halves`` for Megatron), converted to the
        module's. A module with a non-gated activation takes no ``glu_from`` (its FC1 rows have no
        GLU layout)."""
        if glu_from is not None and not self._glu.gated:
            raise ValueError(f"GroupedMLP.load_state_dict: glu_from = {glu_from!r} given, but the module's activation "
                             f"{self._glu.activation} is not gated (FC1's rows have no GLU layout); expected no glu_from")
        if glu_from is not None and _C.glu_layout_name(glu_from) != self.glu_layout:
            perm = torch.tensor(_C.glu_row_permutation(glu_from, self.glu_layout, self.ffn))
            state_dict = dict(state_dict)
            for k, t in state_dict.items():
                if not k.startswith("fc1.") or not isinstance(t, Tensor):
                    continue
                width = 2 * self.ffn * (t.shape[-1] if k.startswith("fc1.weight") and t.dim() > 0 else 1)
                if t.dim() == 0 or t.numel() % width != 0 or (k.startswith("fc1.weight") and t.dim() < 2):
                    raise ValueError(f"GroupedMLP.load_state_dict: {k}: {list(t.shape)} does not hold FC1 rows of "
                                     f"2F = {2 * self.ffn} (glu_from={glu_from!r}); expected the module's "
                                     f"{list(self.state_dict()[k].shape) if k in self.state_dict() else 'shape'}")
                rows = t.reshape(-1, 2 * self.ffn, *t.shape[-1:]) if k.startswith("fc1.weight") else t.reshape(-1, 2 * self.ffn)
                state_dict[k] = rows[:, perm.to(t.device)].reshape(t.shape)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def extra_repr(self) -> str:
        g = self._glu
        act, limit, alpha, offset, layout = g.activation, g.limit, g.alpha, g.offset, g.layout
        extra = f"(limit={limit:g}, alpha={alpha:g}, offset={offset:g})" if act == "clamped_qgeglu" else ""
        fp8_text = "" if self._fp8_recipe is None else f", fp8_recipe={self._fp8_recipe}"
        layout_text = f"glu_layout={layout}, " if g.gated else ""
        return (f"num_groups={self.num_groups}, hidden={self.hidden}, ffn={self.ffn}, activation={act}{extra}, "
                f"{layout_text}fusion={self.fusion}, recompute_fc1={self.recompute_fc1}" + fp8_text)


def _saving_scope(module):
    """Where a module's autograd saves its tensors: as usual, or kept on the device when the module
    has ``offload_activations=False``."""
    return contextlib.nullcontext() if module.offload_activations else no_offload()


def _init_device(p: Tensor) -> None:
    if p.is_cuda:
        ops.init_device(p.device)
