"""Where the expert-parallel layer's step goes: rank 0's GPU kernels over a few profiled steps
(torch.profiler), per kernel family, for the one-GPU layer (P = 1 only) and the dropless EP layer,
with each step's wall time and the time no kernel ran on rank 0's GPU (the host sync's bubble and
launch gaps). bench/drivers/ep-bench.py's shapes (bench/workloads.json, balanced routing).

    python bench/experiments/ep_step_profile.py [GPUS,...] [MODELS] [MODES]   (MODES: baseline, dropless,
                                                                              capacity (factor 1.25))
    e.g. python bench/experiments/ep_step_profile.py 1,2 deepseek-v3-ep8 baseline,dropless
"""
import collections
import importlib.util
import os
import sys
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("ep_bench", os.path.join(HERE, "..", "drivers", "ep-bench.py"))
ep_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ep_bench)

FAMILIES = [("gemm", ("grouped_gemm", "gemm", "wgmma", "sm90")), ("nccl", ("nccl",)),
            ("permute/unpermute", ("permute", "unpermute", "gather_rows", "scatter_rows")),
            ("router", ("router", "topk", "logits")), ("plan", ("plan", "offsets", "route", "layout")),
            ("glu/act", ("glu", "swiglu", "act")), ("copy/fill", ("copy", "fill", "memset", "zero", "Memcpy",
                                                                 "Memset")),
            ("sort/scan/index", ("sort", "scan", "cumsum", "index", "scatter", "gather", "radix"))]


def family(name):
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "other elementwise"


def worker(rank, world, models, modes, store, steps=3):
    torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    shape_args = type("A", (), dict(models=models, routing="balanced", tokens=8192,
                                    workloads=os.path.join(HERE, "..", "workloads.json")))
    for s in ep_bench.shapes(shape_args):
        L, H, T = s["experts_per_gpu"], s["hidden"], s["tokens_per_gpu"]
        gen = torch.Generator().manual_seed(1234 + rank)
        x = torch.randn(T, H, generator=gen).to(device, torch.bfloat16).requires_grad_()
        g = torch.randn(T, H, generator=gen).to(device, torch.bfloat16)
        for mode in modes:
            if mode == "baseline" and world > 1:
                continue
            layer = ep_bench.make_layer(s, L * world, mode, 1.25, device, torch.bfloat16)

            def step(layer=layer):
                x.grad = None
                for p in layer.parameters():
                    p.grad = None
                layer(x).backward(g)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            # Host time from the dropless host read to the experts' call (the GPU has nothing queued then).
            marks = []
            tolist = torch.Tensor.tolist

            def timed_tolist(t, *a, **kw):
                out = tolist(t, *a, **kw)
                marks.append(("read", time.perf_counter()))
                return out

            hook = layer.experts.register_forward_pre_hook(lambda *_: marks.append(("experts", time.perf_counter())))
            torch.Tensor.tolist = timed_tolist
            try:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            finally:
                torch.Tensor.tolist = tolist
                hook.remove()
            post = [b[1] - a[1] for a, b in zip(marks, marks[1:]) if a[0] == "read" and b[0] == "experts"]
            if rank == 0 and post:
                print(f"\n{s['model']} P={world} {mode}: host read -> experts' call {1e3 * statistics.median(post):.3f} ms",
                      flush=True)
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                a.record()
                for _ in range(steps):
                    step()
                b.record()
                torch.cuda.synchronize()
            wall = a.elapsed_time(b) / steps
            if rank == 0:
                kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                by = collections.defaultdict(float)
                names = collections.defaultdict(float)
                spans = []
                for e in kernels:
                    us = e.device_time if hasattr(e, "device_time") else e.cuda_time
                    by[family(e.name)] += us / steps
                    names[e.name[:90]] += us / steps
                    spans.append((e.time_range.start, e.time_range.end))
                spans.sort()
                named = sorted(((e.time_range.start, e.time_range.end, e.name) for e in kernels))
                gaps = []
                for (a0, a1, an), (b0, b1, bn) in zip(named, named[1:]):
                    if b0 - a1 > 30:
                        gaps.append((b0 - a1, an[:60], bn[:60]))
                busy, end = 0.0, None
                for s0, s1 in spans:  # the union of kernel intervals
                    if end is None or s0 > end:
                        busy += s1 - s0
                        end = s1
                    elif s1 > end:
                        busy += s1 - end
                        end = s1
                busy /= steps
                print(f"\n## {s['model']} P={world} {mode}: step {wall:.3f} ms, GPU busy {busy / 1e3:.3f} ms, "
                      f"idle {wall - busy / 1e3:.3f} ms", flush=True)
                for fam, us in sorted(by.items(), key=lambda kv: -kv[1]):
                    print(f"  {fam:20s} {us / 1e3:8.3f} ms")
                print(f"  gaps > 30 us: {len(gaps) / steps:.1f} a step, {sum(gp[0] for gp in gaps) / steps / 1e3:.3f} ms a step;"
                      " the largest (us, after, before):")
                for gap in sorted(gaps, reverse=True)[:12]:
                    print(f"    {gap[0]:8.1f}  {gap[1]}  ->  {gap[2]}")
                print("  top kernels:")
                for n, us in sorted(names.items(), key=lambda kv: -kv[1])[:14]:
                    print(f"    {us / 1e3:8.3f} ms  {n}")
            del layer
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


def main():
    gpus = [int(p) for p in (sys.argv[1] if len(sys.argv) > 1 else "1,2").split(",")]
    models = sys.argv[2] if len(sys.argv) > 2 else "mixtral-8x7b,deepseek-v3-ep8"
    modes = (sys.argv[3] if len(sys.argv) > 3 else "baseline,dropless").split(",")
    for world in gpus:
        if torch.cuda.device_count() < world:
            print(f"{world} GPUs asked, {torch.cuda.device_count()} visible: skipped")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(world, models, modes, os.path.join(tmp, "store")), nprocs=world,
                               start_method="spawn")


if __name__ == "__main__":
    main()
