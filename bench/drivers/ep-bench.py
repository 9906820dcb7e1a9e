#!/usr/bin/env python3
"""Expert parallelism, weak scaling (issue 26): the MoE layer forward + backward on 1, 2, 4 ... GPUs
with the experts per GPU and the tokens per GPU fixed, so every GPU does the same expert work at every
size and what grows is the all-to-all. scripts/gpu ep-bench runs it.

Per model shape (bench/workloads.json, --routing, default balanced: experts per GPU L = the case's
experts, H, F, the activation, k = the case's routed rows / 8192 and T = 8192 tokens per GPU) and per
GPU count P (E = L P experts in all):
  baseline   (P = 1 only) moe_engine.torch.MoELayer(H, F, L, k): the layer with no expert parallelism
  dropless   MoELayer(..., ep_group=WORLD): the exchange sized from the counts (one host read a step)
  capacity   MoELayer(..., ep_group=WORLD, ep_capacity_factor=--capacity-factor): fixed per-pair
             buffers, graph safe; its drops are reported
  baseline-graph, capacity-graph (CUDA): the same steps captured once in a CUDA graph and replayed
             (no host time in the step); capacity-graph's efficiency is against baseline-graph
The router weight is random (std 0.02: near-balanced routing, as at the start of training), x and the
output gradient random bf16.

Timed: one step is x.grad and every .grad unset, y = layer(x), y.backward(g); a sample is --block
steps back to back (CUDA events), the sample's time the slowest rank's; ms is the median over
--iters samples. Peak memory: the largest rank's max_memory_allocated over a step, above what was
allocated before the step (the previous step's gradients cleared). weak_scaling_efficiency = the
baseline's step time / the P-GPU step time.

The all-to-all, measured alone in the same run: the token exchange of one dropless forward with that
step's split sizes (dispatch; combine moves the same rows back), against NCCL's all_to_all_single
with equal splits of the same total bytes (the same-run peak for this size) and of 256 MiB per rank.
Bandwidth counts the bytes each rank sends to other ranks, summed over ranks, over the time and the
rank count (GB/s per GPU). The layer's exchanges take 4 such all-to-alls a step (dispatch and combine,
forward and backward): a2a_share is 4 x the dispatch time over the step time.

Usage: ep-bench.py [--gpus 1,2,4] [--models mixtral-8x7b,deepseek-v3-ep8] [--routing balanced]
                   [--capacity-factor 1.25] [--iters 10] [--warmup 3] [--block 2] [--tokens 8192]
                   [--workloads PATH] [--device cuda|cpu] [--out PREFIX.json]
--device cpu is a smoke test (gloo, host clock, tiny --workloads). --out PREFIX.json also writes
PREFIX.md.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--models", default="mixtral-8x7b,deepseek-v3-ep8")
    ap.add_argument("--routing", default="balanced")
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--workloads", default=os.path.join(ROOT, "bench", "workloads.json"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def shapes(args):
    cases = json.load(open(args.workloads))["cases"]
    out = []
    for model in args.models.split(","):
        c = next((c for c in cases if c["model"] == model and c["routing"] == args.routing), None)
        if c is None:
            raise SystemExit(f"ep-bench: no case {model}/{args.routing} in {args.workloads}")
        k = max(1, c["tokens"] // 8192)  # the suite's cases route 8192 tokens
        out.append(dict(model=model, experts_per_gpu=c["experts"], hidden=c["hidden"], ffn=c["ffn"], topk=k,
                        tokens_per_gpu=args.tokens, activation=c["activation"], bias=c["bias"]))
    return out


class Clock:
    """CUDA events on a GPU, the host clock (after a barrier) on the CPU."""

    def __init__(self, cuda):
        self.cuda = cuda

    def start(self):
        if self.cuda:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop(self):
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b)
        return 1e3 * (time.perf_counter() - self.t)


def slowest(ms, device):
    """Per-sample times, each the slowest rank's."""
    t = torch.tensor(ms, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_steps(step, args, clock, device):
    for _ in range(args.warmup):
        step()
    samples = []
    for _ in range(args.iters):
        dist.barrier()
        clock.start()
        for _ in range(args.block):
            step()
        samples.append(clock.stop() / args.block)
    return statistics.median(slowest(samples, device))


def peak_of(step, clear, device):
    """The step's peak allocation above what is allocated before it, the previous step's gradients
    cleared first (they would count in the base and be freed during the step)."""
    if device.type != "cuda":
        return None
    clear()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    t = torch.tensor([torch.cuda.max_memory_allocated() - base], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def make_layer(s, experts, kind, capacity_factor, device, dtype):
    """The layer of shape ``s`` for a mode's kind (baseline, dropless, capacity), seeded, its router
    weight drawn with std 0.02."""
    import moe_engine.torch as me

    torch.manual_seed(7)
    opts = dict(activation=s["activation"], bias=s["bias"], device=device, dtype=dtype)
    if s["activation"] in ("swiglu", "clamped_qgeglu"):
        opts["glu_layout"] = "blocks:32"
    if kind != "baseline":
        opts["ep_group"] = dist.group.WORLD
    if kind == "capacity":
        opts["ep_capacity_factor"] = capacity_factor
    layer = me.MoELayer(s["hidden"], s["ffn"], experts, s["topk"], **opts)
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.02)
    return layer


def captured(step, clear):
    """The step captured once in a CUDA graph (after two warm-up steps on a side stream, gradients
    unset so that capture allocates them); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def bandwidth(once, sent_rows, H, elem, args, clock, device, world):
    """ms of once() and the GB/s per GPU of the rows each rank sends to other ranks (summed over ranks)."""
    ms = time_steps(once, args, clock, device)
    off = torch.tensor([sent_rows * H * elem], dtype=torch.float64, device=device)
    dist.all_reduce(off)
    return ms, (off.item() / world) / (ms * 1e-3) / 1e9 if ms > 0 else 0.0


def equal_a2a(rows, H, dtype, device, args, clock, rank, world):
    """all_to_all_single with equal splits of [rows, H]: NCCL's own rate for these bytes."""
    inp = torch.randn(rows, H, device=device).to(dtype)
    out = torch.empty_like(inp)
    return bandwidth(lambda: dist.all_to_all_single(out, inp), rows // world * (world - 1), H, inp.element_size(),
                     args, clock, device, world)


def worker(rank, world, args, store, out_file):
    from moe_engine.torch.expert_parallel import expert_parallel_forward

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    clock = Clock(cuda)
    results = []
    for s in shapes(args):
        L, H, F, k, T = s["experts_per_gpu"], s["hidden"], s["ffn"], s["topk"], s["tokens_per_gpu"]
        E = L * world
        gen = torch.Generator().manual_seed(1234 + rank)
        x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_()
        g = torch.randn(T, H, generator=gen).to(device, dtype)
        gated = s["activation"] not in ("srelu", "gelu_tanh")
        flops = 3 * 2 * T * k * H * F * (3 if gated else 2)  # the experts' GEMMs, forward + backward, per GPU
        modes = (["baseline"] if world == 1 else []) + ["dropless", "capacity"]
        if cuda:
            modes += (["baseline-graph"] if world == 1 else []) + ["capacity-graph"]
        for mode in modes:
            kind = mode.removesuffix("-graph")
            layer = make_layer(s, E, kind, args.capacity_factor, device, dtype)

            def clear(layer=layer):
                x.grad = None
                for p in layer.parameters():
                    p.grad = None

            def step(layer=layer):
                clear(layer)
                layer(x).backward(g)

            peak = None  # a graph's memory is its pool's, allocated at capture
            if mode.endswith("-graph"):
                ms = time_steps(captured(step, clear), args, clock, device)
            else:
                ms = time_steps(step, args, clock, device)
                peak = peak_of(step, clear, device)
            row = dict(s, gpus=world, mode=mode, experts=E, ms=ms, tflops_per_gpu=flops / (ms * 1e-3) / 1e12,
                       peak_bytes=peak)
            if kind == "capacity":
                row["dropped_assignments"] = layer.ep_drops()
                row["capacity_factor"] = args.capacity_factor
            if mode == "dropless" and world > 1:
                # The dispatch exchange alone, with this step's split sizes (the rows to other ranks).
                with torch.no_grad():
                    _, rec = expert_parallel_forward(layer, x.detach())
                sent, recv = sum(rec.send_sizes), sum(rec.recv_sizes)
                inp = torch.randn(sent, H, device=device).to(dtype)
                out = torch.empty(recv, H, device=device, dtype=dtype)
                off_rank = sent - rec.send_sizes[rank]
                ms_d, bw_d = bandwidth(lambda: dist.all_to_all_single(out, inp, rec.recv_sizes, rec.send_sizes),
                                       off_rank, H, 2, args, clock, device, world)
                total = torch.tensor([sent], device=device)
                dist.all_reduce(total)
                even = int(total.item()) // world // world * world
                ms_e, bw_e = equal_a2a(even, H, dtype, device, args, clock, rank, world)
                big = (256 << 20) // (H * 2) // world * world
                _, bw_b = equal_a2a(big, H, dtype, device, args, clock, rank, world)
                row.update(a2a_dispatch_ms=ms_d, a2a_dispatch_gbps=bw_d, a2a_equal_same_bytes_ms=ms_e,
                           a2a_equal_same_bytes_gbps=bw_e, a2a_peak_256mib_gbps=bw_b,
                           a2a_fraction_of_peak=bw_d / bw_e if bw_e else None,
                           a2a_share_of_step=4 * ms_d / ms)
            results.append(row)
            if rank == 0:
                print(json.dumps({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in row.items()}),
                      flush=True)
            del layer
            if cuda:
                torch.cuda.empty_cache()
    if rank == 0:
        json.dump(results, open(out_file, "w"))
    dist.barrier()
    dist.destroy_process_group()


def markdown(res):
    lines = [f"# Expert parallelism, weak scaling ({res['device']})", "", f"Command: `{res['command']}`", "",
             f"weak_scaling_efficiency_4gpu (dropless, min over shapes): {res.get('weak_scaling_efficiency_4gpu')}; "
             f"2 GPUs: {res.get('weak_scaling_efficiency_2gpu')}; captured in a CUDA graph (fixed capacity, against the "
             f"captured one-GPU layer), 4 / 2 GPUs: {res.get('weak_scaling_efficiency_4gpu_graph')} / "
             f"{res.get('weak_scaling_efficiency_2gpu_graph')}",
             "", "| model | GPUs | mode | ms | TFLOP/s per GPU | efficiency | peak GiB | a2a GB/s per GPU | "
             "of same-run NCCL | a2a share | drops |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["entries"]:
        f = lambda v, d=3: "" if v is None else (f"{v:.{d}f}" if isinstance(v, float) else str(v))  # noqa: E731
        peak = None if r.get("peak_bytes") is None else r["peak_bytes"] / 2**30
        lines.append(f"| {r['model']} | {r['gpus']} | {r['mode']} | {f(r['ms'])} | {f(r['tflops_per_gpu'], 1)} | "
                     f"{f(r.get('weak_scaling_efficiency'))} | {f(peak, 2)} | {f(r.get('a2a_dispatch_gbps'), 1)} | "
                     f"{f(r.get('a2a_fraction_of_peak'))} | {f(r.get('a2a_share_of_step'))} | "
                     f"{f(r.get('dropped_assignments'))} |")
    return "\n".join(lines) + "\n"


def main():
    args = parse()
    entries = []
    for world in [int(p) for p in args.gpus.split(",")]:
        if args.device == "cuda" and torch.cuda.device_count() < world:
            print(f"ep-bench: {world} GPUs asked, {torch.cuda.device_count()} visible: skipped", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "out.json")
            mp.start_processes(worker, args=(world, args, os.path.join(tmp, "store"), out_file), nprocs=world,
                               start_method="spawn")
            entries += json.load(open(out_file))
    base = {(r["model"], r["mode"].endswith("-graph")): r["ms"] for r in entries if r["mode"].startswith("baseline")}
    for r in entries:
        key = (r["model"], r["mode"].endswith("-graph"))
        if key in base and not r["mode"].startswith("baseline"):
            r["weak_scaling_efficiency"] = base[key] / r["ms"]
    eff = lambda mode, n: [r["weak_scaling_efficiency"] for r in entries  # noqa: E731
                           if r["mode"] == mode and r["gpus"] == n and "weak_scaling_efficiency" in r]
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    res = dict(device=device, command="python " + " ".join(sys.argv), date=datetime.date.today().isoformat(),
               torch=torch.__version__, weak_scaling_efficiency_4gpu=min(eff("dropless", 4), default=None),
               weak_scaling_efficiency_4gpu_fixed_capacity=min(eff("capacity", 4), default=None),
               weak_scaling_efficiency_2gpu=min(eff("dropless", 2), default=None),
               weak_scaling_efficiency_4gpu_graph=min(eff("capacity-graph", 4), default=None),
               weak_scaling_efficiency_2gpu_graph=min(eff("capacity-graph", 2), default=None), entries=entries)
    fr = [r["a2a_fraction_of_peak"] for r in entries if r.get("a2a_fraction_of_peak") is not None]
    res["min_a2a_fraction_of_same_run_nccl"] = min(fr, default=None)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)
        open(os.path.splitext(args.out)[0] + ".md", "w").write(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
