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
from . import fp8, ops
from ._bridge import _plain_eager
from ._bridge import dtype_name as _dtype_name
from ._contract import WeightGradContract
from .fp8 import Fp8Recipe, Fp8WeightCache, check_recipe, packed_bias
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
        while self.queue:
            self.queue.pop(0)()
        for hook in self.hooks:
            hook()


def _mark_delayed(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        p.skip_backward_post_hook = True  # Megatron DDP then hooks via register_wgrad_accumulation_and_reduce_hooks


# ---- GroupedLinear ----


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module: "GroupedLinear", x, splits, row_scale, *params):
        n = len(params) if not module.has_bias else len(params) // 2
        weights, biases = list(params[:n]), list(params[n:])
        y, routing = ops._grouped_linear(x, weights, splits, biases, row_scale)
        keep_x = any(w.requires_grad for w in weights)
        ctx.save_for_backward(x if keep_x else None, splits, row_scale, routing, *params)
        ctx.module, ctx.n = module, n
        return y

    @staticmethod
    def backward(ctx, dy):
        m: GroupedLinear = ctx.module
        x, splits, row_scale, routing, *params = ctx.saved_tensors
        weights, biases = params[: ctx.n], params[ctx.n :]
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        need_w, need_b = any(need[4 : 4 + ctx.n]), any(need[4 + ctx.n :])  # inputs: module, x, splits, row_scale, params
        dx, db, ds = ops.linear_grads_but_weight(dy, weights, biases, splits, row_scale, need[1], need_b, need[3],
                                                 routing)
        dw: List[Optional[Tensor]] = [None] * len(weights)
        if need_w:

            # The contract reads the parameters' attributes (main_grad, ...): the module's own
            # objects, since a saved tensor may come back as another Python object (saved-tensor
            # hooks, e.g. activation offload).
            contract, names, params = m._weight_grad, m.weight_names(), m.weights()
            if m.delay_wgrad_compute:

                def job(dy=dy, x=x, splits=splits, routing=routing):
                    targets, mode = contract.targets(params, names, delayed=True)
                    ops._grouped_linear_wgrad_(dy, x, splits, targets, mode, routing)
                    contract.finish_delayed(params, targets)

                m._delayed.queue.append(job)
                dw = contract.queued(params, names)
            else:
                targets, mode = contract.targets(params, names)
                ops._grouped_linear_wgrad_(dy, x, splits, targets, mode, routing)
                dw = contract.outcome(params, targets)
        return (None, dx, None, ds, *dw, *db)


class _GroupedLinearFp8Function(torch.autograd.Function):
    """GroupedLinear with FP8 GEMMs: forward quantizes x's rows (and, for the FP8 wgrad, its
    columns in the same pass, kept for backward instead of x); backward quantizes dy's rows (dgrad)
    and columns (wgrad) in one pass. A GEMM the recipe overrides runs in the module's dtype."""

    @staticmethod
    def forward(ctx, module: "GroupedLinear", x, splits, row_scale, w_data, w_scales, w_data_t, w_scales_t, *params):
        recipe = module.fp8_recipe
        fprop_hp, dgrad_hp, wgrad_hp = recipe.override_linear_precision
        n = len(params) if not module.has_bias else len(params) // 2
        weights, biases = list(params[:n]), list(params[n:])
        need_w = any(w.requires_grad for w in weights)
        x_columns = need_w and not wgrad_hp
        pow2, eps = recipe.pow2_scales, recipe.amax_epsilon
        if fprop_hp:
            y, routing = ops._grouped_linear(x, weights, splits, biases, row_scale)
            if x_columns:
                _, _, xd, xs, xo, _ = fp8._quantize_fp8(x, splits, False, True, pow2, eps, routing)
        else:
            rd, rs, xd, xs, xo, routing = fp8._quantize_fp8(x, splits, True, x_columns, pow2, eps)
            y = fp8._grouped_linear_fp8(rd, rs, w_data, w_scales, splits, packed_bias(biases), row_scale, x.dtype,
                                        routing)
        kept_columns = (xd, xs, xo) if x_columns else (None,) * 3
        kept_weight = (w_data_t, w_scales_t) if not dgrad_hp else (None, None)
        ctx.save_for_backward(x if (need_w and wgrad_hp) else None, *kept_columns, splits, row_scale, routing,
                              *kept_weight, *params)
        ctx.module, ctx.n, ctx.recipe = module, n, recipe
        return y

    @staticmethod
    def backward(ctx, dy):
        m: GroupedLinear = ctx.module
        x, xd, xs, xo, splits, row_scale, routing, w_data_t, w_scales_t, *params = ctx.saved_tensors
        weights, biases = params[: ctx.n], params[ctx.n :]
        _, dgrad_hp, wgrad_hp = ctx.recipe.override_linear_precision
        pow2, eps = ctx.recipe.pow2_scales, ctx.recipe.amax_epsilon
        # inputs: module, x, splits, row_scale, the four FP8 weight tensors, params
        need = ctx.needs_input_grad
        need_x, need_s = bool(need[1]), bool(need[3])
        need_w, need_b = any(need[8 : 8 + ctx.n]), any(need[8 + ctx.n :])
        dy = dy.contiguous()
        dgrad_fp8, wgrad_fp8 = need_x and not dgrad_hp, need_w and not wgrad_hp
        if dgrad_fp8 or wgrad_fp8:  # one pass over dy for both forms
            dr, drs, dcd, dcs, dco, _ = fp8._quantize_fp8(dy, splits, dgrad_fp8, wgrad_fp8, pow2, eps, routing)
        dx = None
        if dgrad_fp8:
            dx = fp8._grouped_linear_fp8_dgrad(dr, drs, w_data_t, w_scales_t, splits, dy.dtype, routing)
        elif need_x:
            dx = ops._grouped_linear_dgrad(dy, list(weights), splits, routing)
        _, db, ds = ops.linear_grads_but_weight(dy, weights, biases, splits, row_scale, False, need_b, need_s, routing)
        dw: List[Optional[Tensor]] = [None] * len(weights)
        if need_w:
            # The operands the wgrad reads, and only those: a delayed wgrad keeps them until backward_dw.
            if wgrad_fp8:
                num_tokens = dy.shape[0]

                def wgrad(targets, mode, dy_cols=(dcd, dcs, dco), x_cols=(xd, xs, xo), splits=splits,
                          routing=routing):
                    fp8._grouped_linear_fp8_wgrad_(*dy_cols, *x_cols, splits, num_tokens, targets, mode, routing)
            else:

                def wgrad(targets, mode, dy=dy, x=x, splits=splits, routing=routing):
                    ops._grouped_linear_wgrad_(dy, x, splits, targets, mode, routing)

            dw = _weight_grads(m, m._weight_grad, m.weights(), m.weight_names(), wgrad)
        return (None, dx, None, ds, None, None, None, None, *dw, *db)


def _weight_grads(m, contract: WeightGradContract, params, names, wgrad) -> List[Optional[Tensor]]:
    """Runs ``wgrad(targets, mode)`` now or queues it for backward_dw, per the contract; returns
    what autograd gets for the weight. The contract reads the module's own parameter objects (a
    saved tensor may come back as another Python object through saved-tensor hooks)."""
    if m.delay_wgrad_compute:

        def job():
            targets, mode = contract.targets(params, names, delayed=True)
            wgrad(targets, mode)
            contract.finish_delayed(params, targets)

        m._delayed.queue.append(job)
        return contract.queued(params, names)
    targets, mode = contract.targets(params, names)
    wgrad(targets, mode)
    return contract.outcome(params, targets)


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
        fprop_hp, dgrad_hp, _ = self._fp8_recipe.override_linear_precision
        if fprop_hp and dgrad_hp:
            return (None,) * 4
        w = self._fp8_weight.get(self.weights(), self._fp8_recipe, not fprop_hp, not dgrad_hp)
        return w.data, w.scales, w.data_t, w.scales_t

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


class _GroupedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module: "GroupedMLP", x, splits, probs, *params):
        w1, b1, w2, b2 = module._split_params(params)
        need_act = x.requires_grad or (probs is not None and probs.requires_grad) or any(
            p.requires_grad for p in (*w1, *b1, *w2))
        save_fc1_out = need_act and not module.recompute_fc1
        y, fc1_out, routing = ops._expert_mlp(x, probs, w1, b1, w2, b2, splits, module._glu_text, module.fusion,
                                              save_fc1_out)
        keep_x = any(w.requires_grad for w in w1) or (need_act and module.recompute_fc1)
        ctx.save_for_backward(x if keep_x else None, splits, probs, fc1_out if save_fc1_out else None, routing,
                              *params)
        ctx.module = module
        return y

    @staticmethod
    def backward(ctx, dy):
        m: GroupedMLP = ctx.module
        x, splits, probs, fc1_out, routing, *params = ctx.saved_tensors
        w1, b1, w2, b2 = m._split_params(params)
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        need_dx, need_dprobs = bool(need[1]), probs is not None and bool(need[3])
        wants_w1, wants_b1, wants_w2, wants_b2 = m._split_params(need[4:])  # inputs: module, x, splits, probs, params
        need_bias = any(wants_b1) or any(wants_b2)
        need_w1, need_w2 = any(wants_w1), any(wants_w2)
        glu, fusion = m._glu_text, m.fusion

        def run(g1, mode1, g2, mode2, dx=need_dx, dp=need_dprobs, bias=need_bias):
            return ops._expert_mlp_backward_(dy, x, probs, w1, b1, w2, b2, splits, fc1_out, glu, fusion, dx, dp, bias,
                                             bias, g1, mode1, g2, mode2, routing)

        def split():
            # Everything but the weight gradients now, writing out what they read (dL/dh, FC2's
            # input): the queued job then runs only the two wgrad GEMMs (the same ops on the same
            # operands as one call, so the same bits).
            dx, dprobs, db1, db2, d_fc1, act = ops._expert_mlp_backward_(
                dy, x, probs, w1, b1, w2, b2, splits, fc1_out, glu, fusion, need_dx, need_dprobs, need_bias, need_bias,
                [], "write", [], "write", routing, need_w1, need_w2)
            kept_act = act if need_w2 else None
            kept_d_fc1, kept_x = (d_fc1, x) if need_w1 else (None, None)
            del act, d_fc1

            def wgrads(g1, mode1, g2, mode2):
                if g2:
                    ops._grouped_linear_wgrad_(dy, kept_act, splits, g2, mode2, routing)
                if g1:
                    ops._grouped_linear_wgrad_(kept_d_fc1, kept_x, splits, g1, mode1, routing)

            return (dx, dprobs, db1, db2), wgrads

        dw1, dw2, results = _mlp_weight_grads(m, need_w1, need_w2, len(w1), len(w2), run, split)
        dx, dprobs, db1, db2 = results[:4]
        db1s = ops.split_like(db1, b1, 1) if (b1 and need_bias) else [None] * len(b1)
        db2s = ops.split_like(db2, b2, 1) if (b2 and need_bias) else [None] * len(b2)
        return (None, dx if need_dx else None, None, dprobs if need_dprobs else None,
                *dw1, *db1s, *dw2, *db2s)


# The bf16 MLP as two autograd nodes, for the peak memory of backward: one node would return FC2's
# and FC1's weight gradients together and run FC1's GEMMs while dy, the kept pre-activation and the
# activation's scratch are still held. As two, autograd hands FC2's weight gradient on (into .grad,
# freed) before FC1's exists, and FC1's node holds only dL/d(fc1_out), x and its own outputs: the
# peak of an eager MLP. The same ops in the same order as the one node, so the same bits.


class _Handoff:
    """y from FC1's node to FC2's: y is FC2's node's output but made by FC1's forward (one fused
    call); returned by FC2's node as an input, it would become a view, which in-place use of the
    MLP's output must not meet."""

    __slots__ = ("y",)


class _GroupedMLPFc1Function(torch.autograd.Function):
    """Forward: the whole MLP (``ops._expert_mlp``, fc1_out kept); returns fc1_out, the edge to
    FC2's node, and the routing tensor; y goes to FC2's node through ``handoff``. Backward: from
    dL/d(fc1_out), dx and FC1's weight and bias gradients (under the module's contract)."""

    @staticmethod
    def forward(ctx, module: "GroupedMLP", handoff: _Handoff, x, splits, probs, *params):
        w1, b1, w2, b2 = module._split_params(params)
        handoff.y, fc1_out, routing = ops._expert_mlp(x, probs, w1, b1, w2, b2, splits, module._glu_text,
                                                      module.fusion, True)
        keep_x = any(w.requires_grad for w in w1)
        ctx.save_for_backward(x if keep_x else None, splits, routing, *w1)
        ctx.module = module
        ctx.mark_non_differentiable(routing)
        return fc1_out, routing

    @staticmethod
    def backward(ctx, d_fc1, _d_routing):
        m: GroupedMLP = ctx.module
        x, splits, routing, *w1 = ctx.saved_tensors
        need = ctx.needs_input_grad  # inputs: module, handoff, x, splits, probs, params
        wants_w1, wants_b1, wants_w2, wants_b2 = m._split_params(need[5:])
        d_fc1 = d_fc1.contiguous()
        b1 = m.fc1.biases()  # for the bias gradients' layout only
        dx, db1s, _ = ops.linear_grads_but_weight(d_fc1, w1, b1, splits, None, bool(need[2]), any(wants_b1), False,
                                                  routing)
        dw1: List[Optional[Tensor]] = [None] * len(w1)
        if any(wants_w1):

            def wgrad(targets, mode):
                ops._grouped_linear_wgrad_(d_fc1, x, splits, targets, mode, routing)

            dw1 = _weight_grads(m, m._fc1_grad, m.fc1.weights(), m.fc1.weight_names(), wgrad)
        return (None, None, dx, None, None, *dw1, *db1s, *(None,) * (len(wants_w2) + len(wants_b2)))


class _GroupedMLPFc2Function(torch.autograd.Function):
    """Forward: hands on y (made by FC1's node). Backward: FC2's dgrad and the activation's
    backward into dL/d(fc1_out) for FC1's node, dprobs, FC2's weight and bias gradients."""

    @staticmethod
    def forward(ctx, module: "GroupedMLP", handoff: _Handoff, fc1_out, routing, splits, probs, *params):
        ctx.save_for_backward(fc1_out, splits, probs, routing, *params)
        ctx.module = module
        y, handoff.y = handoff.y, None
        return y

    @staticmethod
    def backward(ctx, dy):
        m: GroupedMLP = ctx.module
        fc1_out, splits, probs, routing, *params = ctx.saved_tensors
        w1, b1, w2, b2 = m._split_params(params)
        need = ctx.needs_input_grad  # inputs: module, handoff, fc1_out, routing, splits, probs, params
        wants_w1, wants_b1, wants_w2, wants_b2 = m._split_params(need[6:])
        need_d_fc1, need_dprobs = bool(need[2]), probs is not None and bool(need[5])
        need_w2, need_b2 = any(wants_w2), any(wants_b2)
        names2, p2, c2 = m.fc2.weight_names(), m.fc2.weights(), m._fc2_grad
        g2, mode2 = c2.targets(p2, names2) if need_w2 else ([], "write")
        _, dprobs, _, db2, d_fc1, _ = ops._expert_mlp_backward_(
            dy.contiguous(), None, probs, w1, b1, w2, b2, splits, fc1_out, m._glu_text, m.fusion, False, need_dprobs,
            False, need_b2, [], "write", g2, mode2, routing, need_d_fc1)
        dw2 = c2.outcome(p2, g2) if need_w2 else [None] * len(w2)
        db2s = ops.split_like(db2, b2, 1) if (b2 and need_b2) else [None] * len(b2)
        return (None, None, d_fc1 if need_d_fc1 else None, None, None, dprobs if need_dprobs else None,
                *(None,) * (len(wants_w1) + len(wants_b1)), *dw2, *db2s)


def _mlp_two_nodes(module: "GroupedMLP", x: Tensor, probs: Optional[Tensor], params) -> bool:
    """Whether the bf16 MLP runs as two autograd nodes: in plain eager mode (torch.compile, tracing
    and dispatch modes take the one node), when both halves have gradients to make, fc1_out is kept
    (not recompute_fc1) and the weight gradients are immediate (a delayed wgrad keeps both weights'
    work for backward_dw)."""
    if module.recompute_fc1 or module.delay_wgrad_compute or not torch.is_grad_enabled():
        return False
    if not _plain_eager((x,)):
        return False
    w1, b1, w2, b2 = module._split_params(params)
    fc1_grads = x.requires_grad or any(p.requires_grad for p in (*w1, *b1))
    fc2_grads = (probs is not None and probs.requires_grad) or any(p.requires_grad for p in (*w2, *b2))
    return fc1_grads and fc2_grads


def _fc1_node_params(module: "GroupedMLP", params) -> tuple:
    """The parameters as FC1's node takes them: FC2's detached. Its forward (the whole MLP) reads
    them but gives them no gradient; as its autograd inputs, FC2's weight gradient would wait in
    autograd's buffer until FC1's node had run (a parameter's gradient is accumulated once every
    node that took it is done), beside FC1's."""
    w1, b1, w2, b2 = module._split_params(params)
    return (*w1, *b1, *(p.detach() for p in w2), *(p.detach() for p in b2))


def _mlp_forward_two_nodes(module: "GroupedMLP", x: Tensor, splits: Tensor, probs: Optional[Tensor],
                           params) -> Tensor:
    handoff = _Handoff()
    fc1_out, routing = _GroupedMLPFc1Function.apply(module, handoff, x, splits, probs,
                                                    *_fc1_node_params(module, params))
    return _GroupedMLPFc2Function.apply(module, handoff, fc1_out, routing, splits, probs, *params)


class _GroupedMLPFp8Function(torch.autograd.Function):
    """GroupedMLP with its six GEMMs in FP8 (``fp8._expert_mlp_fp8``): forward keeps the
    pre-activation's rows and, for FC1's weight gradient, x's columns, or x's rows where
    ``fp8.expert_mlp_fp8_keeps_x_rows(T, G)`` (many experts of few tokens), all FP8; the contract
    is the bf16 module's."""

    @staticmethod
    def forward(ctx, module: "GroupedMLP", x, splits, probs, *tensors):
        w8, params = tensors[:8], tensors[8:]
        w1, b1, w2, b2 = module._split_params(params)
        recipe = module.fp8_recipe
        need_w1 = any(w.requires_grad for w in w1)
        need_act = x.requires_grad or (probs is not None and probs.requires_grad) or any(
            p.requires_grad for p in params)
        save_x = fp8.saved_x_form(need_w1, x.shape[0], splits.shape[0])
        y, *saved_x, hd, hs, routing = fp8._expert_mlp_fp8(
            x, probs, w8[0], w8[1], w8[4], w8[5], packed_bias(b1), packed_bias(b2), splits, module._glu_text,
            module.fusion, save_x, need_act, recipe.pow2_scales, recipe.amax_epsilon)
        kept_h = (hd, hs) if need_act else (None,) * 2
        ctx.save_for_backward(*fp8.kept_x(save_x, saved_x), *kept_h, splits, probs, routing, *w8, *params)
        ctx.module, ctx.recipe = module, recipe
        return y

    @staticmethod
    def backward(ctx, dy):
        m: GroupedMLP = ctx.module
        xd, xs, xo, xrd, xrs, hd, hs, splits, probs, routing, *rest = ctx.saved_tensors
        w8, params = rest[:8], rest[8:]
        w1, b1, w2, b2 = m._split_params(params)
        need = ctx.needs_input_grad  # inputs: module, x, splits, probs, the 8 FP8 weight tensors, params
        dy = dy.contiguous()
        need_dx, need_dprobs = bool(need[1]), probs is not None and bool(need[3])
        wants_w1, wants_b1, wants_w2, wants_b2 = m._split_params(need[12:])
        need_bias = any(wants_b1) or any(wants_b2)
        need_w1, need_w2 = any(wants_w1), any(wants_w2)
        glu, fusion, pow2, eps = m._glu_text, m.fusion, ctx.recipe.pow2_scales, ctx.recipe.amax_epsilon
        pb1, pb2 = packed_bias(b1), packed_bias(b2)

        def run(g1, mode1, g2, mode2, dx=need_dx, dp=need_dprobs, bias=need_bias):
            return fp8._expert_mlp_fp8_backward_(dy, xd, xs, xo, xrd, xrs, hd, hs, probs, *w8, pb1, pb2, splits, glu,
                                                 fusion, pow2, eps, dx, dp, bias, g1, mode1, g2, mode2, routing)

        dw1, dw2, (dx, dprobs, db1, db2) = _mlp_weight_grads(m, need_w1, need_w2, len(w1), len(w2), run)
        db1s = ops.split_like(db1, b1, 1) if (b1 and need_bias) else [None] * len(b1)
        db2s = ops.split_like(db2, b2, 1) if (b2 and need_bias) else [None] * len(b2)
        return (None, dx if need_dx else None, None, dprobs if need_dprobs else None, *(None,) * 8,
                *dw1, *db1s, *dw2, *db2s)


def _mlp_weight_grads(m: "GroupedMLP", need_w1: bool, need_w2: bool, n1: int, n2: int, run, split=None):
    """The MLP's backward under the contract. ``run(g1, mode1, g2, mode2, dx=, dp=, bias=)`` runs
    the backward op with the weight gradients into g1 / g2 (empty: not computed). Immediate: one
    run computes everything. Delayed: ``split()``, where given, computes dx, dprobs and the bias
    gradients and returns them with ``wgrads(g1, mode1, g2, mode2)``, the weight gradients from what
    it kept, which the queued job runs in backward_dw; without it, this run computes dx, dprobs and
    the bias gradients and the queued one both weights' gradients in one pass (recomputing FC2's
    dgrad and the GLU backward). Returns (what autograd gets for FC1's and FC2's weights, the
    results of run or split)."""
    names1, names2 = m.fc1.weight_names(), m.fc2.weight_names()
    c1, c2 = m._fc1_grad, m._fc2_grad
    p1, p2 = m.fc1.weights(), m.fc2.weights()  # the contract's parameters (see _weight_grads)
    dw1: List[Optional[Tensor]] = [None] * n1
    dw2: List[Optional[Tensor]] = [None] * n2
    if m.delay_wgrad_compute:
        results = None
        if need_w1 or need_w2:
            if split is not None:
                results, wgrads = split()  # the job holds what wgrads reads, not run's operands
            else:

                def wgrads(g1, mode1, g2, mode2):
                    run(g1, mode1, g2, mode2, dx=False, dp=False, bias=False)

            def job():
                g1, mode1 = c1.targets(p1, names1, delayed=True) if need_w1 else ([], "write")
                g2, mode2 = c2.targets(p2, names2, delayed=True) if need_w2 else ([], "write")
                wgrads(g1, mode1, g2, mode2)
                if need_w1:
                    c1.finish_delayed(p1, g1)
                if need_w2:
                    c2.finish_delayed(p2, g2)

            m._delayed.queue.append(job)
            dw1 = c1.queued(p1, names1) if need_w1 else dw1
            dw2 = c2.queued(p2, names2) if need_w2 else dw2
        return dw1, dw2, results if results is not None else run([], "write", [], "write")
    g1, mode1 = c1.targets(p1, names1) if need_w1 else ([], "write")
    g2, mode2 = c2.targets(p2, names2) if need_w2 else ([], "write")
    results = run(g1, mode1, g2, mode2)
    dw1 = c1.outcome(p1, g1) if need_w1 else dw1
    dw2 = c2.outcome(p2, g2) if need_w2 else dw2
    return dw1, dw2, results


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
    ``fp8_recipe``: an ``Fp8Recipe`` to run all six GEMMs in FP8 (no override may be set; backward
    keeps the pre-activation's rows and x's columns in FP8, x's rows instead of its columns where
    those would be more than twice the bytes; ``fusion`` other than ``none`` fuses the
    steps around the GLU on CUDA; no ``recompute_fc1``).
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
        self._fp8_recipe = self._checked_recipe(fp8_recipe, dtype, hidden, ffn)
        self._fp8_weights = (Fp8WeightCache(), Fp8WeightCache())
        self._glu = _C.GluSpec(activation, glu_layout, float(limit), float(alpha), float(offset))
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
        recipe = _check_fp8_module("GroupedMLP", recipe, True, dtype, {"hidden": hidden, "ffn": ffn})
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
        """FC1's and FC2's cached quantized weights, (data, scales, data_t, scales_t) each."""
        out = []
        for cache, params in zip(self._fp8_weights, (self.fc1.weights(), self.fc2.weights())):
            w = cache.get(params, self._fp8_recipe, True, True)
            out += [w.data, w.scales, w.data_t, w.scales_t]
        return tuple(out)

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
                if not k.startswith("fc1."):
                    continue
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
