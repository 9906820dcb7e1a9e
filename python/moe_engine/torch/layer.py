"""The whole MoE layer: router, permute, the expert MLP, unpermute (docs/design.md sections 13-15).

    y = combine(experts(dispatch(x, route(x))))

- ``route``: logits ``x W_r^T`` in float32, scores, the top-k choice (optional expert bias, groups),
  the probabilities, per-expert counts, the auxiliary losses (``moe_engine::router_forward``).
- ``dispatch``: the routing plan (stable expert order, optional capacity with drops) and the
  expert-sorted copy of the tokens with their probs (``moe_engine::permute_plan``, ``permute``).
- ``experts``: a ``GroupedMLP``, which applies the probs to the activation as Megatron-core does.
- ``combine``: each token's k expert rows summed in float32 in a fixed order (``unpermute``).

The router and the routing ops are ``routing.py``'s; with ``ep_group`` the experts are split over
ranks and the tokens exchanged (``expert_parallel.py``). Every op runs on the tensors' device on the
current stream; nothing reads routing values on the host (but the dropless expert-parallel
exchange's counts), so forward and backward can be captured in one CUDA graph and replayed with new
inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.modules.module as _nn_module
from torch import Tensor, nn

from .. import _C
from . import routing as _routing
from ._bridge import _plain_eager, check_int, check_real
from .expert_parallel import expert_parallel_forward, group_rank_size, pair_capacity
from ._autograd import (_GroupedMLPFc1Function, _GroupedMLPFc2Function, _GroupedMLPFunction, _Handoff,
                        _fc1_node_params, _mlp_two_nodes)
from .modules import GroupedMLP, _saving_scope
from .routing import Dispatched, Router, RouterOutput, combine, dispatch

# ---- dispatch + experts + combine as one autograd node (plain eager) ----


class _SubContext:
    """What an autograd Function's forward / backward use of their ctx, for running them inside
    another Function: the outer node saves the tensors (so saved-tensor hooks, offload included,
    see them) and hands them back before the backward; other attributes are set freely."""

    def __init__(self, needs_input_grad, saved_tensors=()):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = saved_tensors

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass  # the outer node marks its own outputs


def _combine_backward(row_of, splits, routing, rows: int, dy: Tensor) -> Tensor:
    """unpermute's own backward, for combine inside a fused node: d_out [R, H]."""
    unpermute = _SubContext((True, False), (None, None, row_of, splits, routing))
    unpermute.rows = rows
    return _routing._unpermute_bwd(unpermute, dy)[0]


def _dispatch_backward(row_of, splits, routing, need_x: bool, need_p: bool, d_sorted, d_probs_sorted, sorted_shape,
                       sorted_dtype):
    """permute's own backward, for dispatch inside a fused node: (dx, dprobs). Autograd would hand it
    zeros for an x_sorted gradient the experts did not make; so does this."""
    permute = _SubContext((need_x, need_p), (row_of, splits, routing))
    permute.with_probs = True
    if d_sorted is None and (need_x or need_p):
        d_sorted = torch.zeros(sorted_shape, dtype=sorted_dtype, device=row_of.device)
    return _routing._permute_bwd(permute, d_sorted, d_probs_sorted)[:2]


class _DispatchExpertsCombine(torch.autograd.Function):
    """permute, the expert MLP (bf16 GroupedMLP) and unpermute, the same ops in the same order as
    the three autograd nodes of dispatch / experts / combine (their own forward and backward code),
    as one node: a step's host time is a large part of a small batch's (docs/performance-log.md,
    issue 25), and each Python node costs the autograd engine's bookkeeping. Bit-identical to the
    three nodes (tested)."""

    @staticmethod
    def forward(ctx, layer: "MoELayer", x, probs, row_of, splits, routing, rows, *params):
        experts: GroupedMLP = layer.experts
        x_sorted, probs_sorted = _routing._permute._impl(x, probs, row_of, splits, routing, rows)
        mlp = _SubContext((False, x.requires_grad, False, probs.requires_grad, *(p.requires_grad for p in params)))
        # The MLP's forward reads requires_grad to decide what backward needs: as in the three nodes.
        x_sorted.requires_grad_(x.requires_grad)
        probs_sorted.requires_grad_(probs.requires_grad)
        with _saving_scope(experts):
            out = _GroupedMLPFunction.forward(mlp, experts, x_sorted, splits, probs_sorted, *params)
            x_sorted.requires_grad_(False)
            probs_sorted.requires_grad_(False)
            y = _routing._unpermute._impl(out, None, row_of, splits, routing)
            ctx.save_for_backward(row_of, splits, routing, *mlp.saved_tensors)
        mlp.saved_tensors = ()  # held by ctx alone (offload may move them)
        ctx.mlp, ctx.rows = mlp, out.shape[0]
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        row_of, splits, routing = saved[:3]
        d_out = _combine_backward(row_of, splits, routing, ctx.rows, dy)
        mlp: _SubContext = ctx.mlp
        mlp.saved_tensors = saved[3:]
        del saved
        grads = _GroupedMLPFunction.backward(mlp, d_out)
        mlp.saved_tensors = ()  # the node outlives its backward (until the graph goes): hold nothing
        need_x, need_p = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx, dprobs = _dispatch_backward(row_of, splits, routing, need_x, need_p, grads[1], grads[3], d_out.shape,
                                        d_out.dtype)
        return (None, dx, dprobs, None, None, None, None, *grads[4:])


# ---- dispatch + FC1's node, FC2's node + combine (plain eager, the MLP in two nodes) ----


class _DispatchFc1(torch.autograd.Function):
    """permute and the MLP's FC1 node (``_GroupedMLPFc1Function``: forward runs the whole MLP),
    one autograd node; returns fc1_out and the sorted probs, the edges to ``_Fc2Combine``. Where the
    MLP runs as two nodes (``_autograd._mlp_two_nodes``), the layer's step does too, for the same
    peak memory (FC2's weight gradient handed on before FC1's is made); bit-identical to the
    separate nodes of dispatch, experts and combine (tested)."""

    @staticmethod
    def forward(ctx, layer: "MoELayer", handoff: _Handoff, x, probs, row_of, splits, routing, rows, *params):
        experts: GroupedMLP = layer.experts
        ctx.set_materialize_grads(False)
        x_sorted, probs_sorted = _routing._permute._impl(x, probs, row_of, splits, routing, rows)
        fc1 = _SubContext(())
        with _saving_scope(experts):
            fc1_out, mlp_routing = _GroupedMLPFc1Function.forward(fc1, experts, handoff, x_sorted, splits,
                                                                  probs_sorted, *params)
            ctx.save_for_backward(row_of, splits, routing, *fc1.saved_tensors)
        fc1.saved_tensors = ()  # held by ctx alone (offload may move them)
        ctx.fc1, ctx.sorted_shape, ctx.sorted_dtype = fc1, x_sorted.shape, x_sorted.dtype
        ctx.mark_non_differentiable(mlp_routing)
        return fc1_out, probs_sorted, mlp_routing

    @staticmethod
    def backward(ctx, d_fc1, d_probs_sorted, _d_routing):
        saved = ctx.saved_tensors
        row_of, splits, routing = saved[:3]
        need = ctx.needs_input_grad  # layer, handoff, x, probs, row_of, splits, routing, rows, params
        need_x, need_p = need[2], need[3]
        fc1: _SubContext = ctx.fc1
        fc1.saved_tensors, fc1.needs_input_grad = saved[3:], (False, False, need_x, False, False, *need[8:])
        del saved  # x_sorted goes with fc1's tensors, before permute's backward
        grads = (None,) * 5 + (None,) * len(need[8:])
        if d_fc1 is not None:
            grads = _GroupedMLPFc1Function.backward(fc1, d_fc1, None)
        fc1.saved_tensors = ()
        dx, dprobs = _dispatch_backward(row_of, splits, routing, need_x, need_p, grads[2], d_probs_sorted,
                                        ctx.sorted_shape, ctx.sorted_dtype)
        return (None, None, dx, dprobs, None, None, None, None, *grads[5:])


class _Fc2Combine(torch.autograd.Function):
    """The MLP's FC2 node (``_GroupedMLPFc2Function``) and unpermute, one autograd node."""

    @staticmethod
    def forward(ctx, layer: "MoELayer", handoff: _Handoff, fc1_out, probs_sorted, mlp_routing, row_of, splits,
                routing, *params):
        experts: GroupedMLP = layer.experts
        fc2 = _SubContext(())
        with _saving_scope(experts):
            out = _GroupedMLPFc2Function.forward(fc2, experts, handoff, fc1_out, mlp_routing, splits, probs_sorted,
                                                 *params)
            y = _routing._unpermute._impl(out, None, row_of, splits, routing)
            ctx.save_for_backward(row_of, splits, routing, *fc2.saved_tensors)
        fc2.saved_tensors = ()
        ctx.fc2, ctx.rows = fc2, out.shape[0]
        return y

    @staticmethod
    def backward(ctx, dy):
        row_of, splits, routing, *fc2_saved = ctx.saved_tensors
        need = ctx.needs_input_grad  # layer, handoff, fc1_out, probs_sorted, mlp_routing, row_of, splits, routing, params
        d_out = _combine_backward(row_of, splits, routing, ctx.rows, dy)
        fc2: _SubContext = ctx.fc2
        fc2.saved_tensors = tuple(fc2_saved)
        fc2.needs_input_grad = (False, False, need[2], False, False, need[3], *need[8:])
        grads = _GroupedMLPFc2Function.backward(fc2, d_out)
        fc2.saved_tensors = ()  # FC1's node runs next: the pre-activation must not outlive this one
        return (None, None, grads[2], grads[5], None, None, None, None, *grads[6:])


def _hooks_on(module: nn.Module) -> bool:
    """Whether calling the module would run hooks (its own or global ones) that the one-node step,
    which does not call it, would skip."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks)


# ---- the layer ----


def _default_glu_layout(activation: str) -> str:
    """MoELayer's GLU layout when none is given: blocks:32 for a GLU (the Hopper FC1 epilogue fuses
    it), halves (no layout) for a non-gated activation. One given is passed on as it is, so a layout
    given for a non-gated activation is GroupedMLP's error."""
    return "blocks:32" if _C.GluSpec(activation).gated else "halves"


# The fused step's two-node form below this many bytes freed: see MoELayer._two_nodes.
_TWO_NODE_MIN_BYTES = 64 << 20


class MoELayer(nn.Module):
    """The MoE layer ``y = sum_j p_tj * expert_{e_tj}(x_t)`` over the top-k experts of each token.

    ``router`` (``Router``: ``router.weight`` ``[E, H]``) chooses; ``experts`` is a ``GroupedMLP`` with
    all its options (activation, ``glu_layout``, bias, fusion, ``recompute_fc1``, layout, the
    main_grad contract, ``delay_wgrad_compute``, ``fp8_recipe``, offload); the router weight follows
    the same main_grad options (its gradient is never delayed). ``aux_loss`` holds the last forward's
    auxiliary loss (load-balancing + z-loss, each times its coefficient; 0-dim, differentiable): add it
    to the training loss. ``capacity_factor``: each expert keeps at most ``ceil(T k / E * factor)``
    assignments, in token order; the dropped ones contribute nothing (Megatron's token dropping
    without padding). Probs are applied to the experts' activations (Megatron-core's contract).

    ``forward(x [T, H]) -> y [T, H]`` is ``combine(experts(dispatch(x, route(x))))``: the four stages
    are methods, for breakdowns or custom compositions. Runs on CPU (float32, bfloat16) and CUDA.

    ``ep_group`` (a ``torch.distributed`` process group of P ranks): expert parallelism. This rank
    holds experts ``local_experts`` (E / P of them, ``experts`` has that many), routes its own tokens
    and exchanges them with the other ranks (``expert_parallel.py``, docs/design.md section 16).
    ``ep_capacity_factor``: None for the dropless exchange (one host read a step), or the factor of
    the fixed per-pair buffers (graph safe; drops counted in ``ep_dropped``, read by ``ep_drops()``).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, *, score: str = "softmax",
                 expert_bias: bool = False, num_groups: Optional[int] = None, topk_groups: Optional[int] = None,
                 norm_topk_prob: bool = True, scaling_factor: float = 1.0, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, capacity_factor: Optional[float] = None, activation: str = "swiglu",
                 glu_layout: Optional[str] = None, bias: bool = False, limit: float = 7.0, alpha: float = 1.702,
                 offset: float = 1.0, fusion: str = "forward", recompute_fc1: bool = False, layout: str = "packed",
                 accumulate_into_main_grad: bool = False, overwrite_main_grad: bool = False,
                 delay_wgrad_compute: bool = False, zero_out_wgrad: bool = False, offload_activations: bool = True,
                 fp8_recipe=None, ep_group=None, ep_capacity_factor: Optional[float] = None, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if capacity_factor is not None:
            capacity_factor = check_real("MoELayer", "capacity_factor", capacity_factor)
            _C.expert_capacity(1, 1, 1, capacity_factor)  # checks the factor, naming it
        self.hidden, self.ffn, self.num_experts, self.topk = (
            check_int("MoELayer", name, value)
            for name, value in (("hidden", hidden), ("ffn", ffn), ("num_experts", num_experts), ("topk", topk)))
        self.capacity_factor = capacity_factor
        self.ep_group = ep_group
        self.ep_rank, self.ep_size = group_rank_size(ep_group) if ep_group is not None else (0, 1)
        if self.num_experts % self.ep_size != 0:
            raise ValueError(f"moe_engine: MoELayer: num_experts = {num_experts} must be a multiple of the expert-"
                             f"parallel group's size {self.ep_size} (each rank holds num_experts / size experts)")
        if ep_capacity_factor is not None:
            if ep_group is None:
                raise ValueError("moe_engine: MoELayer: ep_capacity_factor is given without an ep_group; it sizes the "
                                 "buffers of the expert-parallel exchange")
            ep_capacity_factor = check_real("MoELayer", "ep_capacity_factor", ep_capacity_factor)
            pair_capacity(1, 1, 1, ep_capacity_factor)  # checks the factor, naming it
        self.ep_capacity_factor = ep_capacity_factor
        local_experts = self.num_experts // self.ep_size
        self.router = Router(hidden, num_experts, topk, score=score, expert_bias=expert_bias, num_groups=num_groups,
                             topk_groups=topk_groups, norm_topk_prob=norm_topk_prob, scaling_factor=scaling_factor,
                             aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff,
                             accumulate_into_main_grad=accumulate_into_main_grad,
                             overwrite_main_grad=overwrite_main_grad, zero_out_wgrad=zero_out_wgrad, device=device,
                             dtype=dtype)
        self.experts = GroupedMLP(local_experts, hidden, ffn, bias=bias, activation=activation,
                                  glu_layout=_default_glu_layout(activation) if glu_layout is None else glu_layout,
                                  limit=limit,
                                  alpha=alpha, offset=offset, fusion=fusion, recompute_fc1=recompute_fc1,
                                  layout=layout, accumulate_into_main_grad=accumulate_into_main_grad,
                                  overwrite_main_grad=overwrite_main_grad, delay_wgrad_compute=delay_wgrad_compute,
                                  zero_out_wgrad=zero_out_wgrad, offload_activations=offload_activations,
                                  fp8_recipe=fp8_recipe, device=device, dtype=dtype)
        self.aux_loss: Optional[Tensor] = None
        self.tokens_per_expert: Optional[Tensor] = None  # the last forward's counts [E] int64 (device)
        # Expert parallel: assignments the fixed-capacity exchange could not send, per destination rank.
        self.register_buffer("ep_dropped", torch.zeros(self.ep_size, dtype=torch.int64, device=device)
                             if ep_group is not None else None, persistent=False)
        self.ep_tokens_per_local_expert: Optional[Tensor] = None  # rows each local expert got (EP, device)

    @property
    def local_experts(self) -> range:
        """The global ids of the experts this rank holds (all of them without expert parallelism)."""
        n = self.experts.num_groups
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def route(self, x: Tensor) -> RouterOutput:
        """The router's choice for x [T, H] (sets ``aux_loss`` and ``tokens_per_expert``)."""
        r = self.router(x)
        self.aux_loss, self.tokens_per_expert = r.aux_loss, r.counts
        return r

    def dispatch(self, x: Tensor, r: RouterOutput) -> Dispatched:
        """x sorted by the experts of ``r`` with its probs (the layer's capacity factor)."""
        return dispatch(x, r.probs, r.indices, self.num_experts, self.capacity_factor)

    def combine(self, out: Tensor, d: Dispatched) -> Tensor:
        """The experts' rows back to the tokens, summed (the probs were applied by the experts)."""
        return combine(out, d)

    def forward(self, x: Tensor) -> Tensor:
        self.experts.fc1.check_input("MoELayer", x)
        if self.ep_group is not None:
            return expert_parallel_forward(self, x)[0]
        r = self.route(x)
        if self._fuse_dispatch_and_combine(x, r):
            row_of, splits, routing, _, rows = _routing._plan(r.indices, self.num_experts, self.capacity_factor)
            params = self.experts._params()
            if self._two_nodes(x, r, rows, params):
                handoff = _Handoff()
                fc1_out, probs_sorted, mlp_routing = _DispatchFc1.apply(
                    self, handoff, x, r.probs, row_of, splits, routing, rows, *_fc1_node_params(self.experts, params))
                return _Fc2Combine.apply(self, handoff, fc1_out, probs_sorted, mlp_routing, row_of, splits, routing,
                                         *params)
            return _DispatchExpertsCombine.apply(self, x, r.probs, row_of, splits, routing, rows, *params)
        d = self.dispatch(x, r)
        return self.combine(self.experts(d.x, d.splits, d.probs), d)

    def _fuse_dispatch_and_combine(self, x: Tensor, r: RouterOutput) -> bool:
        """Whether dispatch runs in the experts' first autograd node and combine in their last (one
        node, or two where the MLP's backward is two): plain eager with grad (torch.compile, tracing
        and dispatch modes take the ops), the experts a plain bf16 / fp32 GroupedMLP without hooks
        (a wrapped or hooked module is called as a module)."""
        e = self.experts
        return (torch.is_grad_enabled() and type(e) is GroupedMLP and e.fp8_recipe is None and not _hooks_on(e)
                and _routing._permute._impl is not None and _plain_eager((x, r.probs)))

    def _two_nodes(self, x: Tensor, r: RouterOutput, rows: int, params) -> bool:
        """Whether the fused step runs as two autograd nodes, as the experts' backward does
        (``_autograd._mlp_two_nodes``), rather than one: where it frees at least
        ``_TWO_NODE_MIN_BYTES`` at FC1's GEMMs (d_out, fc1_out and the activation's scratch, rows x
        (H + W + F) elements, beside FC2's weight gradient). Below that the step is short and bound
        by host time, which the second node adds to (the small batch 7-9% slower, H200)."""
        if not _mlp_two_nodes(self.experts, x, r.probs, params):
            return False
        e = self.experts
        return rows * (e.hidden + e._glu.fc1_width(e.ffn) + e.ffn) * x.element_size() >= _TWO_NODE_MIN_BYTES

    def backward_dw(self) -> None:
        """The experts' queued weight gradients (``delay_wgrad_compute``); the router's are never delayed."""
        self.experts.backward_dw()

    def update_expert_bias(self, rate: float) -> None:
        """See ``Router.update_expert_bias``."""
        self.router.update_expert_bias(rate)

    def ep_drops(self, reset: bool = True) -> int:
        """Assignments the fixed-capacity expert-parallel exchange dropped since the last reset (a host
        read: call it outside CUDA-graph capture); ``reset`` clears the count."""
        if self.ep_dropped is None:
            return 0
        n = int(self.ep_dropped.sum().item())
        if reset:
            self.ep_dropped.zero_()
        return n

    def extra_repr(self) -> str:
        ep = "" if self.ep_group is None else (f", ep_rank={self.ep_rank}, ep_size={self.ep_size}, "
                                                f"ep_capacity_factor={self.ep_capacity_factor}")
        return (f"hidden={self.hidden}, ffn={self.ffn}, num_experts={self.num_experts}, topk={self.topk}, "
                f"capacity_factor={self.capacity_factor}" + ep)
