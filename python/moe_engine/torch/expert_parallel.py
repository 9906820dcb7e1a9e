"""Expert parallelism: the MoE layer's experts split over the ranks of a ``torch.distributed`` group
(docs/design.md section 16).

Rank r of P holds the contiguous experts ``r L .. (r + 1) L - 1`` (L = E / P); every rank routes its
own tokens with the replicated router and gets its own tokens' outputs back.

A token goes to each rank that holds one of its experts **once**, however many of its k experts that
rank holds (as DeepEP's and Megatron's flex dispatchers do): with deepseek-v3's top-8 over 4 ranks of
32 experts a token travels to ~3.6 ranks instead of 8 times, over 2 ranks to 2 instead of 8. Each
sent row carries its k slots' local expert ids (L where the slot's expert is on another rank) and
probs. The receiver plans the slots by local expert (a stable counting sort: source order within an
expert), runs the experts, sums each row's local experts' outputs (the partial combine, float32,
rounded once) and sends one row back per received row; the sender's combine sums its ranks' rows.

    route -> rows by destination -> all-to-all (rows, slot probs, slot ids) -> permute by local
          expert -> GroupedMLP (L experts) -> partial combine -> all-to-all back -> combine

Two ways to size the exchange:

- **dropless** (``ep_capacity_factor=None``): the per-destination counts (rows, assignments) go
  through an all-to-all on the device and are read on the host once (the step's one host sync, so it
  cannot be captured in a CUDA graph) to size the exchange and the experts' buffer exactly.
- **fixed capacity** (``ep_capacity_factor=f``): each destination takes a source's first
  ``C = min(T k, ceil(T k / P * f))`` assignments in token order (then choice order); the rest are
  dropped (they add nothing to y and get zero gradients, as capacity drops of the layer do) and
  counted on the device in ``MoELayer.ep_dropped`` (per destination), which ``ep_drops()`` reads
  outside capture. ``f = P`` never drops. Every (source, destination) pair has a buffer of
  ``min(T, C)`` rows (rows never outnumber assignments) and the receiver's experts a buffer of P C
  rows: static shapes, all-to-alls with equal splits, nothing read on the host, so forward and
  backward can be captured and replayed.

Every step is deterministic: the plans are stable counting sorts, the exchanges move bytes, and each
expert sees its rows in (source rank, token) order, the order a single process would give the
concatenation of the ranks' tokens. The output differs from the single-process layer's only by
rounding: a token's experts on one rank are summed and rounded there, then the ranks' partial sums
are summed (float32) and rounded again.
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


def _exchange_rows(x: Tensor, out_rows: int, send_sizes: Optional[List[int]], recv_sizes: Optional[List[int]],
                   group) -> Tensor:
    """``all_to_all_single`` over rows: x's first ``sum(send_sizes)`` rows out, into the first
    ``sum(recv_sizes)`` of a new [out_rows, ...] tensor (the rest unwritten); None sizes: equal
    splits of all rows."""
    sent = x.shape[0] if send_sizes is None else sum(send_sizes)
    got = out_rows if recv_sizes is None else sum(recv_sizes)
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(out[:got], x[:sent].contiguous(), recv_sizes, send_sizes, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of x exchanged among the group's ranks; the gradient goes back the same way reversed.
    ``send_sizes`` / ``recv_sizes``: rows per peer (host lists), or None for equal splits. The rows
    sent are x's first ``sum(send_sizes)``, the rows received the output's first ``sum(recv_sizes)``
    of ``out_rows``: buffers sized before the sizes were known keep their shapes, and the rows past
    the exchanged ones (never read) are left unwritten, in the gradient too."""

    @staticmethod
    def forward(ctx, x: Tensor, out_rows: int, send_sizes: Optional[List[int]], recv_sizes: Optional[List[int]],
                group) -> Tensor:
        ctx.group, ctx.in_rows, ctx.send_sizes, ctx.recv_sizes = group, x.shape[0], send_sizes, recv_sizes
        return _exchange_rows(x, out_rows, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx, d_out: Tensor):
        return _exchange_rows(d_out, ctx.in_rows, ctx.recv_sizes, ctx.send_sizes, ctx.group), None, None, None, None


def all_to_all(x: Tensor, out_rows: int, send_sizes: Optional[List[int]], recv_sizes: Optional[List[int]],
               group) -> Tensor:
    """Differentiable ``all_to_all_single`` over rows (the gradient takes the reverse exchange):
    x's first ``sum(send_sizes)`` rows out, into the first ``sum(recv_sizes)`` of ``out_rows``."""
    return _AllToAll.apply(x, out_rows, send_sizes, recv_sizes, group)


class SendPlan(NamedTuple):
    """The send buffer: one row per (token, destination rank holding some of its experts)."""
    row_send: Tensor  # [T, P] int32: the send row of token t for rank d, -1 if none
    splits: Tensor  # [P] int64: the buffer's rows per destination
    routing: Tensor  # the routing tensor of splits (their offsets)
    rows: int  # the send buffer's rows
    slots: Tensor  # [rows, 2 k] float32: each row's k slot probs (0 where the slot's expert is on
    #                another rank), then its k slot ids (int32 bits: the local expert, L elsewhere);
    #                differentiable in the probs; one tensor, one exchange
    dropped: Optional[Tensor]  # [P] int64 (fixed capacity): assignments not sent to each destination


def destinations(indices: Tensor, row_of_expert: Optional[Tensor], experts_per_rank: int, ranks: int) -> Tensor:
    """[T, k] int64: the rank of each assignment's expert, ``ranks`` where the layer's own capacity
    plan (``row_of_expert``, or None) dropped it."""
    dest = torch.div(indices, experts_per_rank, rounding_mode="floor")
    return dest if row_of_expert is None else torch.where(row_of_expert >= 0, dest, ranks)


def _rows_by_destination(on: Tensor, first_row: Tensor) -> Tensor:
    """[T, P] int32: token t's row for rank d, ``first_row[d]`` + its rank among d's tokens (token
    order), -1 where ``on`` [T, P] is false. The scan runs along contiguous memory ([P, T])."""
    on_t = on.t().contiguous()
    rank_in_dest = on_t.to(torch.int32).cumsum(1, dtype=torch.int32) - 1
    return torch.where(on_t, rank_in_dest + first_row.view(-1, 1).to(torch.int32), -1).t().contiguous()


def _slot_table(dest: Tensor, indices: Tensor, probs: Tensor, row_send: Tensor, rows: int,
                experts_per_rank: int) -> Tensor:
    """[rows, 2 k] (SendPlan.slots) of the rows ``row_send`` [T, P] places: each row's k slots, the
    local expert and prob of each of its token's assignments sent to that rank (``dest``), L and 0
    for the others. ``rows`` may exceed the rows placed: the rest get no slots."""
    L = experts_per_rank
    T, k = indices.shape
    P = row_send.shape[1]
    dev = indices.device
    match = dest.unsqueeze(1) == torch.arange(P, device=dev).view(1, P, 1)  # [T, P, k]
    local = (indices - dest.clamp_max(P - 1) * L).to(torch.int32).unsqueeze(1)
    ids = torch.where(match, local, L).view(torch.float32)  # int32 bits, carried as float32
    pairs = torch.cat([torch.where(match, probs.unsqueeze(1), 0.0), ids], 2).view(T * P, 2 * k)
    # Pair T P (one past the end) has no slots: the rows no token is placed in take it.
    none = torch.cat([probs.new_zeros(1, k), torch.full((1, k), L, dtype=torch.int32, device=dev).view(torch.float32)],
                     1)
    pairs = torch.cat([pairs, none])
    # Each row's pair by a scatter of distinct targets (the pairs not placed go past the rows, one
    # slot each), so it is deterministic under torch.use_deterministic_algorithms too.
    pair = torch.arange(T * P, device=dev)
    target = torch.where(row_send.reshape(-1) >= 0, row_send.reshape(-1).to(torch.int64), rows + pair)
    pair_of_row = torch.full((rows + T * P,), T * P, dtype=torch.int64, device=dev).scatter_(0, target, pair)[:rows]
    return pairs.index_select(0, pair_of_row)


def _per_destination(dest: Tensor, ranks: int) -> Tensor:
    """[T, P] int32: how many of each token's assignments go to each rank (``dest`` [T, k]; ``ranks``
    there counts nowhere). A comparison and a sum: no scatter, deterministic in every mode."""
    return (dest.unsqueeze(2) == torch.arange(ranks, device=dest.device)).sum(1, dtype=torch.int32)


def plan_send(indices: Tensor, probs: Tensor, row_of_expert: Optional[Tensor], experts_per_rank: int, ranks: int,
              capacity: int) -> SendPlan:
    """The fixed-capacity send buffer: each destination takes its first ``capacity`` assignments in
    token order (then choice order; the rest are dropped and counted), and a token with any kept
    assignment on rank d sends it one row, at ``[d C, (d + 1) C)`` with ``C = min(T, capacity)``
    rows a destination (rows never outnumber assignments). Static shapes, no host read."""

    L, P = experts_per_rank, ranks
    T, k = indices.shape
    dev = indices.device
    dest = destinations(indices, row_of_expert, L, P)
    # Each assignment's rank among its destination's, in token order (a stable counting sort).
    row_of_dest, splits_dest, routing_dest, _ = _permute_plan(dest, P + 1, None)
    pos = row_of_dest.to(torch.int64) - routing_dest.index_select(0, dest.reshape(-1)).view(T, k)
    kept = torch.where((dest < P) & (pos < capacity), dest, P)
    on = _per_destination(kept, P) > 0
    per_dest = min(T, capacity)
    row_send = _rows_by_destination(on, torch.arange(P, device=dev) * per_dest)
    splits = torch.full((P,), per_dest, dtype=torch.int64, device=dev)
    routing = routing_tensor(routing_for_capacity("MoELayer (expert parallel)", P * per_dest, splits,
                                                  stream_of(splits)))
    slots = _slot_table(kept, indices, probs, row_send, P * per_dest, L)
    dropped = (splits_dest[:P] - capacity).clamp_min(0)
    return SendPlan(row_send, splits, routing, P * per_dest, slots, dropped)


class ExpertParallelStep(NamedTuple):
    """What one EP forward made, for breakdowns and tests."""
    send_sizes: Optional[List[int]]  # rows sent to each peer (dropless; None with fixed capacity)
    recv_sizes: Optional[List[int]]  # rows received from each peer (dropless)
    send: SendPlan
    recv_rows: int
    local_splits: Tensor  # [L] int64: rows each local expert computed (on the device)


def expert_parallel_forward(layer, x: Tensor):
    """The EP layer's forward (``MoELayer.forward`` with ``ep_group``): y [T, H] and the step's record."""
    r = layer.route(x)
    row_of_expert = None
    if layer.capacity_factor is not None:  # the layer's own capacity drops come first
        row_of_expert, _, _, _ = _permute_plan(r.indices, layer.num_experts, layer.capacity_factor)
    if layer.ep_capacity_factor is None:
        return _dropless_forward(layer, x, r, row_of_expert)
    return _fixed_capacity_forward(layer, x, r, row_of_expert)


def _local_plan(slots: Tensor, experts_per_rank: int):
    """The received rows' slots [N, 2 k] planned by local expert (a stable counting sort: source
    order within an expert; slots of no local expert, id L, not routed): (probs [N, k] float32,
    row_of [N, k] int32 (-1: not routed), splits [L] int64)."""
    L = experts_per_rank
    k = slots.shape[1] // 2
    probs, ids = slots[:, :k].contiguous(), slots[:, k:].detach().contiguous().view(torch.int32)
    row_of, splits_all, _, _ = _permute_plan(ids, L + 1, None)
    return probs, torch.where(ids < L, row_of, -1), splits_all[:L].contiguous()


def _exchange_and_experts(layer, x_send: Tensor, plan: SendPlan, recv_rows: int, send_sizes, recv_sizes,
                          local_rows: int):
    """The send buffer's rows, then their slots, to their ranks (the large exchange first: on two
    H200s the step measured ~2% faster than slots first); there the slots planned by local expert
    (``_local_plan``), the GroupedMLP and each received row's experts summed (float32, rounded
    once); the rows back; the ranks' partial sums summed. Returns y [T, H] and the local experts'
    row counts."""

    group = layer.ep_group
    x_recv = all_to_all(x_send, recv_rows, send_sizes, recv_sizes, group)
    p_recv, row_local, splits_l = _local_plan(all_to_all(plan.slots, recv_rows, send_sizes, recv_sizes, group),
                                              layer.experts.num_groups)
    routing_l = routing_tensor(routing_for_capacity("MoELayer (expert parallel)", local_rows, splits_l,
                                                    stream_of(splits_l)))
    x_loc, p_loc = _permute(x_recv, p_recv, row_local, splits_l, routing_l, local_rows)
    out_loc = layer.experts(x_loc, splits_l, p_loc)
    y_recv = _unpermute(out_loc, None, row_local, splits_l, routing_l)
    y_sent = all_to_all(y_recv, plan.rows, recv_sizes, send_sizes, group)
    layer.ep_tokens_per_local_expert = splits_l
    return _unpermute(y_sent, None, plan.row_send, plan.splits, plan.routing), splits_l


def _dropless_forward(layer, x: Tensor, r, row_of_expert: Optional[Tensor]):
    """The rows each rank needs and the per-destination counts (rows, assignments), exchanged on the
    device and read once on the host to size the exchange. After the read the GPU waits on the host
    until the experts' first GEMM is queued, so what needs no size runs before it: the send buffer
    and its slots, sized for the most rows a rank can send (T min(P, k); the rows past the sent ones
    are not exchanged)."""

    group, P, L = layer.ep_group, layer.ep_size, layer.experts.num_groups
    T, k = r.indices.shape
    dest = destinations(r.indices, row_of_expert, L, P)
    # assigned[t, d]: token t's experts on rank d; it sends d a row when there is any.
    assigned = _per_destination(dest, P)
    on = assigned > 0
    send_counts = torch.stack([on.sum(0), assigned.sum(0)], 1)  # [P, 2] int64: rows, assignments
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    splits = send_counts[:, 0].contiguous()
    rows = T * min(P, k)
    row_send = _rows_by_destination(on, splits.cumsum(0) - splits)  # destination-major, token order
    routing = routing_tensor(routing_for_capacity("MoELayer (expert parallel)", rows, splits, stream_of(splits)))
    plan = SendPlan(row_send, splits, routing, rows, _slot_table(dest, r.indices, r.probs, row_send, rows, L), None)
    x_send, _ = _permute(x, None, row_send, splits, routing, rows)
    host = torch.cat([splits, recv_counts.reshape(-1)]).tolist()  # the mode's one host read
    send_sizes, recv_sizes = host[:P], host[P::2]
    recv_rows = sum(recv_sizes)
    y, splits_l = _exchange_and_experts(layer, x_send, plan, recv_rows, send_sizes, recv_sizes, sum(host[P + 1::2]))
    return y, ExpertParallelStep(send_sizes, recv_sizes, plan, recv_rows, splits_l)


def _fixed_capacity_forward(layer, x: Tensor, r, row_of_expert: Optional[Tensor]):
    """Static shapes, no host read: per-pair buffers exchanged with equal splits; the receiver's
    expert buffer holds the P pair capacities' assignments."""

    P, L = layer.ep_size, layer.experts.num_groups
    T, k = r.indices.shape
    capacity = pair_capacity(T, k, P, layer.ep_capacity_factor)
    plan = plan_send(r.indices, r.probs, row_of_expert, L, P, capacity)
    layer.ep_dropped.add_(plan.dropped)
    x_send, _ = _permute(x, None, plan.row_send, plan.splits, plan.routing, plan.rows)
    y, splits_l = _exchange_and_experts(layer, x_send, plan, plan.rows, None, None, P * capacity)
    return y, ExpertParallelStep(None, None, plan, plan.rows, splits_l)
