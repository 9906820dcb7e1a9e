"""The expert-parallel tests' worker processes (test_ep.py spawns them; not a test module itself).

Each rank builds the same full MoE layer (all E experts, no expert parallelism) and the EP layer
holding its E / P experts with the same weights, runs the EP layer on its own tokens and compares
every output and gradient with a reference built from the full layer's pieces on each rank's
tokens alone: its router, the drops worked out here in Python (the layer's capacity, then the
fixed-capacity exchange's per-destination capacity, both in token order), the full GroupedMLP on
the kept rows, and the combine as an index_add. The reference shares no code with the EP path's
planning or exchange."""

import math
import os
import traceback

import torch
import torch.distributed as dist

import moe_engine.torch as me

H, F = 64, 32


def init(rank, world, backend, store_file, device_kind):
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world)
    return torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")


def make_layers(opts, device, dtype, group, ep_capacity_factor=None, seed=0):
    torch.manual_seed(seed)
    full = me.MoELayer(H, F, device=device, dtype=dtype, **opts)
    with torch.no_grad():
        full.router.weight.normal_(0, 0.5)  # spread logits: clear choices
        for p in full.experts.parameters():
            p.normal_(0, 0.2)
        if full.router.expert_bias is not None:
            full.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, full.num_experts))
    ep = me.MoELayer(H, F, device=device, dtype=dtype, ep_group=group, ep_capacity_factor=ep_capacity_factor, **opts)
    L = ep.experts.num_groups
    lo = ep.ep_rank * L
    state = {k: (v[lo:lo + L] if k.startswith("experts.") else v) for k, v in full.state_dict().items()}
    ep.load_state_dict(state)
    return full, ep


def tokens_of(rank, counts, device, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(counts[rank], H, generator=gen) * scale
    g = torch.randn(counts[rank], H, generator=gen)
    return x.to(device, dtype), g.to(device, dtype)


def kept_assignments(indices, num_experts, capacity_factor, ranks, pair_capacity):
    """[T, k] bool: the assignments that reach an expert (the layer's capacity in token order, then
    the exchange's per-destination capacity in token order)."""
    T, k = indices.shape
    idx = indices.cpu().tolist()
    keep = [[True] * k for _ in range(T)]
    L = num_experts // ranks
    if capacity_factor is not None:
        cap = min(T * k, math.ceil(T * k / num_experts * capacity_factor))
        n = [0] * num_experts
        for t in range(T):
            for j in range(k):
                e = idx[t][j]
                keep[t][j] = n[e] < cap
                n[e] += 1
    if pair_capacity is not None:
        n = [0] * ranks
        for t in range(T):
            for j in range(k):
                if keep[t][j]:
                    d = idx[t][j] // L
                    keep[t][j] = n[d] < pair_capacity
                    n[d] += 1
    return torch.tensor(keep, dtype=torch.bool).reshape(T, k)


def reference_step(full, x, g, keep):
    """y, aux_loss, dx and the router weight's gradient of (y g).sum() + aux for one rank's tokens, the
    experts' gradients accumulating into full's .grad (summed over the ranks the caller runs)."""
    x = x.detach().clone().requires_grad_()
    full.router.weight.grad = None
    r = full.route(x)
    T, k = r.indices.shape
    flat = r.indices.reshape(-1).cpu().tolist()
    kept = [a for a in range(T * k) if keep.reshape(-1)[a]]
    rows = sorted(kept, key=lambda a: flat[a])  # stable: token order within an expert
    tok = torch.tensor([a // k for a in rows], dtype=torch.int64, device=x.device)
    pos = torch.tensor(rows, dtype=torch.int64, device=x.device)
    splits = torch.bincount(torch.tensor([flat[a] for a in rows], dtype=torch.int64),
                            minlength=full.num_experts).to(x.device)
    out = full.experts(x.index_select(0, tok), splits, r.probs.reshape(-1).index_select(0, pos))
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add(0, tok, out.float())
    loss = (y * g.float()).sum() + r.aux_loss
    loss.backward()
    return y.to(x.dtype), r.aux_loss.detach(), x.grad, full.router.weight.grad.clone()


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(what, a, b, tol):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = rel_err(a, b)
    assert err <= tol or (b.norm() == 0 and a.norm() == 0), f"{what}: rel. error {err:.3g} > {tol:.3g}"


def run_case(rank, world, device, dtype, case):
    """One EP forward + backward against the reference; raises on a mismatch."""
    opts, counts, epf = case["opts"], case["counts"], case.get("ep_capacity_factor")
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    full, ep = make_layers(opts, device, dtype, dist.group.WORLD, epf, seed=case.get("seed", 0))
    data = [tokens_of(s, counts, device, dtype, seed=case.get("seed", 0)) for s in range(world)]
    x, g = data[rank]
    xe = x.clone().requires_grad_()
    y = ep(xe)
    ((y.float() * g.float()).sum() + ep.aux_loss).backward()
    refs = []
    full.zero_grad()
    for s in range(world):
        xs, gs = data[s]
        with torch.no_grad():
            idx = full.router(xs).indices
        ps = None if epf is None else min(counts[s] * ep.topk, math.ceil(counts[s] * ep.topk / world * epf))
        keep = kept_assignments(idx, full.num_experts, full.capacity_factor, world, ps)
        refs.append((reference_step(full, xs, gs, keep), keep))
    (y_ref, aux_ref, dx_ref, dwr_ref), keep = refs[rank]
    name = f"{case['name']} rank {rank}/{world}"
    check(f"{name}: y", y, y_ref, tol)
    check(f"{name}: dx", xe.grad, dx_ref, tol)
    check(f"{name}: aux_loss", ep.aux_loss.detach().reshape(1), aux_ref.reshape(1), tol)
    check(f"{name}: router weight grad", ep.router.weight.grad, dwr_ref, tol)
    L = ep.experts.num_groups
    lo = rank * L
    expert_tol = case.get("expert_grad_tol", tol)
    for mine, ref_mod in ((ep.experts.fc1, full.experts.fc1), (ep.experts.fc2, full.experts.fc2)):
        for pm, pr in zip(mine.parameters(), ref_mod.parameters()):
            check(f"{name}: expert grad {tuple(pm.shape)}", pm.grad, pr.grad[lo:lo + L], expert_tol)
    # What was dropped in the exchange, counted on the device (only this rank's sends).
    if epf is not None:
        before = kept_assignments(full.router(data[rank][0]).indices, full.num_experts, full.capacity_factor, world,
                                  None)
        assert ep.ep_drops() == int(before.sum() - keep.sum()), f"{name}: ep_drops"
    # Dropless: a token travels once to each rank holding any of its kept experts, however many.
    if epf is None:
        from moe_engine.torch.expert_parallel import expert_parallel_forward

        with torch.no_grad():
            _, rec = expert_parallel_forward(ep, x)
        idx = full.router(x).indices.cpu()
        want = [sum(1 for t in range(idx.shape[0]) if any(keep[t, j] and int(idx[t, j]) // ep.experts.num_groups == d
                                                          for j in range(idx.shape[1]))) for d in range(world)]
        assert rec.send_sizes == want, f"{name}: rows sent per rank {rec.send_sizes} != {want}"
    # The local experts' row counts: what reached them from every rank.
    got = ep.ep_tokens_per_local_expert.cpu().tolist()
    want = [0] * L
    for s in range(world):
        idx = full.router(data[s][0]).indices.cpu()
        k_s = refs[s][1]
        for t in range(idx.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                if k_s[t, j] and lo <= e < lo + L:
                    want[e - lo] += 1
    assert got == want, f"{name}: rows per local expert {got} != {want}"


def graph_case(rank, world, device, dtype):
    """Fixed-capacity EP forward + backward captured once, replayed with new inputs (new routings):
    bit-identical to eager, no host sync in a step."""
    opts = dict(num_experts=4 * world, topk=2, aux_loss_coeff=1e-2)
    full, ep = make_layers(opts, device, dtype, dist.group.WORLD, ep_capacity_factor=1.5)
    del full
    T = 96
    static_x = torch.zeros(T, H, dtype=dtype, device=device, requires_grad=True)
    static_g = torch.zeros(T, H, dtype=dtype, device=device)

    def step():
        y = ep(static_x)
        ((y.float() * static_g.float()).sum() + ep.aux_loss).backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            static_x.grad = None
            ep.zero_grad(set_to_none=False)
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        static_x.grad = None
        ep.zero_grad(set_to_none=False)
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    static_x.grad = None
    ep.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    static_dx, static_grads = static_x.grad, [p.grad for p in ep.parameters()]
    for i in range(3):
        x, g = tokens_of(rank, [T] * world, device, dtype, scale=1 + i, seed=10 + i)
        ep.zero_grad(set_to_none=True)
        xe = x.clone().requires_grad_()
        ye = ep(xe)
        ((ye.float() * g.float()).sum() + ep.aux_loss).backward()
        eager = [ye.detach().clone(), xe.grad.clone()] + [p.grad.clone() for p in ep.parameters()]
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        got = [static_y, static_dx] + static_grads
        for n, (a, b) in enumerate(zip(got, eager)):
            assert torch.equal(a, b), f"rank {rank}: replay {i}: tensor {n} differs from eager"
    me.check_errors()


def bad_arguments(world, device):
    """Expert counts the group cannot split, and bad factors, are errors naming the argument."""
    import pytest

    with pytest.raises(ValueError, match="must be a multiple of the expert-parallel group's size"):
        me.MoELayer(H, F, 2 * world + 1, 2, ep_group=dist.group.WORLD, device=device)
    with pytest.raises(ValueError, match="ep_capacity_factor must be a finite number > 0"):
        me.MoELayer(H, F, 2 * world, 2, ep_group=dist.group.WORLD, ep_capacity_factor=0.0, device=device)
    layer = me.MoELayer(H, F, 2 * world, 2, ep_group=dist.group.WORLD, device=device)
    assert list(layer.local_experts) == [2 * dist.get_rank(), 2 * dist.get_rank() + 1]
    assert layer.experts.num_groups == 2 and layer.ep_drops() == 0


def main(rank, world, backend, store_file, device_kind, dtype_name, cases, errors_dir):
    try:
        device = init(rank, world, backend, store_file, device_kind)
        dtype = getattr(torch, dtype_name)
        for case in cases:
            if case == "graph":
                graph_case(rank, world, device, dtype)
            elif case == "bad_arguments":
                bad_arguments(world, device)
            else:
                run_case(rank, world, device, dtype, case)
        dist.barrier()
    except BaseException:
        with open(os.path.join(errors_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
