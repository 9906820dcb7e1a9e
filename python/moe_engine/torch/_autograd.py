"""The autograd nodes of ``GroupedLinear`` and ``GroupedMLP`` (``modules.py``): forward runs the
moe-engine ops, backward computes the gradients under the module's training contract
(``_weight_grads`` / ``_mlp_weight_grads``: immediate into ``.grad`` or ``main_grad``, or queued for
``backward_dw``). The bf16 MLP has three forms: one node (``_GroupedMLPFunction``: torch.compile,
tracing, recompute, delayed wgrad), two nodes in plain eager mode (``_GroupedMLPFc1Function`` then
``_GroupedMLPFc2Function``, so that autograd frees FC2's gradient and scratch before FC1's GEMMs), and
the FP8 one (``_GroupedMLPFp8Function``). Each node takes the module as its first argument and reads
its settings; nothing here holds state between steps.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from . import fp8, ops
from ._bridge import _plain_eager
from ._contract import WeightGradContract
from .fp8 import packed_bias

class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, x, splits, row_scale, *params):
        n = len(params) if not module.has_bias else len(params) // 2
        weights, biases = list(params[:n]), list(params[n:])
        y, routing = ops._grouped_linear(x, weights, splits, biases, row_scale)
        keep_x = any(w.requires_grad for w in weights)
        ctx.save_for_backward(x if keep_x else None, splits, row_scale, routing, *params)
        ctx.module, ctx.n = module, n
        return y

    @staticmethod
    def backward(ctx, dy):
        m = ctx.module
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
    def forward(ctx, module, x, splits, row_scale, w_data, w_scales, w_data_t, w_scales_t, *params):
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
        m = ctx.module
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


class _GroupedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, x, splits, probs, *params):
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
        m = ctx.module
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
    def forward(ctx, module, handoff: _Handoff, x, splits, probs, *params):
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
        m = ctx.module
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
    def forward(ctx, module, handoff: _Handoff, fc1_out, routing, splits, probs, *params):
        ctx.save_for_backward(fc1_out, splits, probs, routing, *params)
        ctx.module = module
        y, handoff.y = handoff.y, None
        return y

    @staticmethod
    def backward(ctx, dy):
        m = ctx.module
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


def _mlp_two_nodes(module, x: Tensor, probs: Optional[Tensor], params) -> bool:
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


def _fc1_node_params(module, params) -> tuple:
    """The parameters as FC1's node takes them: FC2's detached. Its forward (the whole MLP) reads
    them but gives them no gradient; as its autograd inputs, FC2's weight gradient would wait in
    autograd's buffer until FC1's node had run (a parameter's gradient is accumulated once every
    node that took it is done), beside FC1's."""
    w1, b1, w2, b2 = module._split_params(params)
    return (*w1, *b1, *(p.detach() for p in w2), *(p.detach() for p in b2))


def _mlp_forward_two_nodes(module, x: Tensor, splits: Tensor, probs: Optional[Tensor],
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
    def forward(ctx, module, x, splits, probs, *tensors):
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
        m = ctx.module
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


def _mlp_weight_grads(m, need_w1: bool, need_w2: bool, n1: int, n2: int, run, split=None):
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
