"""Expert parallelism: the MoE layer's experts split over the ranks of a ``torch.distributed`` group
(docs/design.md section 16).

Rank r of P holds the contiguous experts ``r L .. (r + 1) L - 1`` (L = E / P); every rank routes its
own tokens with the replicated router and gets its own tokens' outputs back. Two ways to size the
exchange:

- **dropless** (``ep_capacity_factor=None``): the layer's own dispatch sorts the tokens by expert,
  which is also by destination rank; the per-expert counts go through an all-to-all on the device and
  are read on the host once (the step's one host sync, so it cannot be captured in a CUDA graph) to
  size one all-to-all of the rows (and one of their probs). Each source's block arrives in expert
  order; the receiver sorts the blocks by local expert (a stable counting sort: source order within
  an expert), runs the experts, sorts back, and the rows return into the layer's own combine.

      route -> dispatch (permute) -> counts all-to-all -> all-to-all -> sort by local expert
            -> GroupedMLP (L experts) -> unsort -> all-to-all back -> combine (unpermute)

- **fixed capacity** (``ep_capacity_factor=f``): every (source, destination) pair has a buffer of
  ``C = min(T k, ceil(T k / P * f))`` rows, a static shape; the exchanges are all-to-alls with equal
  splits and nothing is read on the host, so forward and backward can be captured and replayed. A
  source sends each destination its first C assignments in token order; the rest are dropped (they
  add nothing to y and get zero gradients, as capacity drops of the layer do) and counted on the
  device in ``MoELayer.ep_dropped`` (per destination), which ``ep_drops()`` reads outside capture.
  ``f = P`` never drops. Each row travels with its local expert id; the receiver sorts by it (a
  stable counting sort) before the experts and back after.

      route -> plan by destination -> permute into [P C] -> all-to-all (rows, probs, ids)
            -> sort by local expert -> GroupedMLP -> unsort -> all-to-all back -> combine

Every step is deterministic: the plans are stable counting sorts, the exchanges move bytes, and each
expert sees its rows in (source rank, token) order, the order a single process would give the
concatenation of the ranks' tokens.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ._bridge import routing_for_capacity, routing_tensor, stream_of
from .routing import _permute, _permute_plan, _unpermute


def group_rank_size(group) -> tuple:
    """(rank, size) of this process in ``group``."""
    if not dist.is_initialized():
        raise ValueError("moe_engine: MoELayer: ep_group is given but torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("moe_engine: MoELayer: this process is not a member of ep_group")
    return rank, dist.get_world_size(group)


def pair_capacity(tokens: int, topk: int, ranks: int, factor: float) -> int:
    """The rows a source may send one destination in fixed-capacity mode:
    ``min(T k, ceil(T k / P * factor))`` (0 when T k = 0)."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"moe_engine: MoELayer: ep_capacity_factor must be a finite number > 0, got {factor}")
    n = tokens * topk
    return min(n, math.ceil(n / ranks * factor))


class _AllToAll(torch.autograd.Function):
    """Rows of x exchanged among the group's ranks; the gradient goes back the same way reversed.
    ``send_sizes`` / ``recv_sizes``: rows per peer (host lists), or None for equal splits."""

    @staticmethod
    def forward(ctx, x: Tensor, out_rows: int, send_sizes: Optional[List[int]], recv_sizes: Optional[List[int]],
                group) -> Tensor:
        out = x.new_empty((out_rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=group)
        ctx.group, ctx.in_rows, ctx.send_sizes, ctx.recv_sizes = group, x.shape[0], send_sizes, recv_sizes
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        dx = d_out.new_empty((ctx.in_rows, *d_out.shape[1:]))
        dist.all_to_all_single(dx, d_out.contiguous(), ctx.send_sizes, ctx.recv_sizes, group=ctx.group)
        return dx, None, None, None, None


def all_to_all(x: Tensor, out_rows: int, send_sizes: Optional[List[int]], recv_sizes: Optional[List[int]],
               group) -> Tensor:
    """Differentiable ``all_to_all_single`` over rows (the gradient takes the reverse exchange)."""
    return _AllToAll.apply(x, out_rows, send_sizes, recv_sizes, group)


class SendPlan(NamedTuple):
    """The fixed-capacity mode's send buffer."""
    row_send: Tensor  # [T, k] int32: the send-buffer row of each assignment, -1 if not sent
    splits: Tensor  # [P] int64: C rows per destination
    routing: Tensor  # the routing tensor of splits (their offsets)
    rows: int  # the send buffer's rows, P C
    ids: Tensor  # [rows] int32: each send row's local expert at its destination (L: none)
    dropped: Tensor  # [P] int64: assignments not sent to each destination


def plan_send(indices: Tensor, row_of_expert: Optional[Tensor], experts_per_rank: int, ranks: int,
              capacity: int) -> SendPlan:
    """The fixed-capacity send buffer ``[P C, H]``: destination d's group is rows ``[d C, (d + 1) C)``
    and holds its first C assignments in token order (a stable counting sort on the device); the
    rest are dropped. ``row_of_expert`` (the layer's own capacity plan, or None) marks assignments the
    layer dropped already (-1)."""

    L, P = experts_per_rank, ranks
    T, k = indices.shape
    dest = torch.div(indices, L, rounding_mode="floor")
    local = (indices - dest * L).to(torch.int32)
    if row_of_expert is not None:
        dest = torch.where(row_of_expert >= 0, dest, P)
    # P + 1 destinations: the last holds what the layer dropped, and is never sent.
    row_of_dest, splits, routing, _ = _permute_plan(dest, P + 1, None)
    pos = row_of_dest.to(torch.int64) - routing.index_select(0, dest.reshape(-1)).view(T, k)
    keep = (dest < P) & (pos < capacity)
    row_send = torch.where(keep, dest * capacity + pos, -1).to(torch.int32)
    rows = P * capacity
    dropped = (splits[:P] - capacity).clamp_min(0)
    send_splits = torch.full((P,), capacity, dtype=torch.int64, device=indices.device)
    send_routing = routing_tensor(routing_for_capacity("MoELayer (expert parallel)", rows, send_splits,
                                                       stream_of(send_splits)))
    # Each send row's local expert; rows nothing is sent from keep L (the receiver's "no expert").
    ids = torch.full((rows + 1,), L, dtype=torch.int32, device=indices.device)
    target = torch.where(row_send >= 0, row_send, rows).reshape(-1).to(torch.int64)
    ids.scatter_(0, target, local.reshape(-1))
    return SendPlan(row_send, send_splits, send_routing, rows, ids[:rows], dropped)


class ExpertParallelStep(NamedTuple):
    """What one EP forward made, for breakdowns and tests."""
    send_sizes: Optional[List[int]]  # rows sent to each peer (dropless; None with fixed capacity)
    recv_sizes: Optional[List[int]]  # rows received from each peer (dropless)
    send: Optional[SendPlan]  # the fixed-capacity exchange's plan (None dropless)
    recv_rows: int
    local_splits: Tensor  # [L] int64: rows each local expert computed (on the device)


def expert_parallel_forward(layer, x: Tensor):
    """The EP layer's forward (``MoELayer.forward`` with ``ep_group``): y [T, H] and the step's record."""
    r = layer.route(x)
    if layer.ep_capacity_factor is None:
        return _dropless_forward(layer, x, r)
    return _fixed_capacity_forward(layer, x, r)


def _local_experts(layer, x_recv: Tensor, p_recv: Tensor, ids_recv: Tensor, groups: int):
    """The experts on the received rows: a stable sort by local expert id (rows with id L, if any, last
    and not computed), the GroupedMLP, the inverse sort. Returns the rows' outputs in received order
    and the local experts' row counts."""

    L, rows = layer.experts.num_groups, x_recv.shape[0]
    row_local, local_splits, local_routing, _ = _permute_plan(ids_recv.view(-1, 1).to(torch.int64), groups, None)
    x_loc, p_loc = _permute(x_recv, p_recv.view(-1, 1), row_local, local_splits, local_routing, rows)
    splits_l = local_splits[:L] if groups > L else local_splits
    out_loc = layer.experts(x_loc, splits_l, p_loc)
    return _unpermute(out_loc, None, row_local, local_splits, local_routing), splits_l


def _dropless_forward(layer, x: Tensor, r):
    """The layer's own dispatch (its expert order is also destination order), the per-expert counts
    exchanged on the device and read once on the host, the rows exchanged by one all-to-all with those
    sizes, sorted by local expert on the receiver (each source's block is already in expert order),
    the experts, the way back, the layer's own combine."""

    group, P, L = layer.ep_group, layer.ep_size, layer.experts.num_groups
    d = layer.dispatch(x, r)
    send_counts = d.splits.view(P, L)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    counts = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # the mode's one host read
    send_sizes, recv_sizes = counts[0], counts[1]
    sent, recv_rows = sum(send_sizes), sum(recv_sizes)
    x_recv = all_to_all(d.x[:sent], recv_rows, send_sizes, recv_sizes, group)
    p_recv = all_to_all(d.probs[:sent], recv_rows, send_sizes, recv_sizes, group)
    ids_recv = torch.repeat_interleave(torch.arange(L, device=x.device).repeat(P), recv_counts.reshape(-1),
                                       output_size=recv_rows)
    y_recv, splits_l = _local_experts(layer, x_recv, p_recv, ids_recv, L)
    y_sent = all_to_all(y_recv, sent, recv_sizes, send_sizes, group)
    # The combine over the sent rows: the plan's routing is recomputed for their count.
    y = _unpermute(y_sent, None, d.row_of, d.splits, d.routing)
    layer.ep_tokens_per_local_expert = splits_l
    return y, ExpertParallelStep(send_sizes, recv_sizes, None, recv_rows, splits_l)


def _fixed_capacity_forward(layer, x: Tensor, r):
    """Static shapes, no host read: per-pair buffers of C rows exchanged with equal splits, with each
    row's local expert id; the receiver's sort by it and its inverse."""

    group, P, L = layer.ep_group, layer.ep_size, layer.experts.num_groups
    T, k = r.indices.shape
    row_of_expert = None
    if layer.capacity_factor is not None:
        row_of_expert, _, _, _ = _permute_plan(r.indices, layer.num_experts, layer.capacity_factor)
    capacity = pair_capacity(T, k, P, layer.ep_capacity_factor)
    plan = plan_send(r.indices, row_of_expert, L, P, capacity)
    layer.ep_dropped.add_(plan.dropped)
    x_send, p_send = _permute(x, r.probs, plan.row_send, plan.splits, plan.routing, plan.rows)
    rows = plan.rows
    x_recv = all_to_all(x_send, rows, None, None, group)
    p_recv = all_to_all(p_send, rows, None, None, group)
    ids_recv = all_to_all(plan.ids, rows, None, None, group)  # int32: no gradient
    y_recv, splits_l = _local_experts(layer, x_recv, p_recv, ids_recv, L + 1)
    y_send = all_to_all(y_recv, rows, None, None, group)
    y = _unpermute(y_send, None, plan.row_send, plan.splits, plan.routing)
    layer.ep_tokens_per_local_expert = splits_l
    return y, ExpertParallelStep(None, None, plan, rows, splits_l)
