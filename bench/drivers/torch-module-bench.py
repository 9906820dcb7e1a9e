#!/usr/bin/env python3
"""The PyTorch module against the C++ benchmark, same run, same GPU: for every case of
bench/workloads.json, GroupedMLP forward+backward (autograd, plain gradients: wgrad written, as
`moe-engine bench mlp` does) timed with CUDA events over blocks of back-to-back steps (median), next to the C++ time
of `moe-engine bench mlp` for the same case and options, and (with --anchor) the PyTorch-eager MLP
of the anchor script (torch_anchor.py) from the same run. scripts/gpu python runs it.

--precision both also times the FP8 module (GroupedMLP(..., fp8_recipe=Fp8Recipe()): all six GEMMs
in FP8, weights quantized once and cached) on the same inputs, iteration by iteration alternated with
the bf16 module: per case time_ratio_fp8_vs_bf16, and its geomean over the compute-bound cases (all
but the small batch). Per module (on CUDA) the step's peak memory: the allocator's peak during a
forward+backward above what was allocated before it (parameters, inputs and the FP8 weight copies;
gradients are set to None before each step, so they count), and the FP8 weight copies' bytes.

Without --cli the C++ column is left out (cpp_ms and module_over_cpp are null). --device cpu runs
the modules on the CPU backend, timed with the host clock and without memory numbers: a smoke test
of the script (tests/python/test_bench_scripts.py, with a tiny --workloads file).

Usage: torch-module-bench.py --cli build-gpu/tools/moe-engine [--cases SUBSTR] [--iters 20] [--block 4]
                             [--glu-layout blocks:32] [--precision bf16|both] [--anchor anchor.json]
                             [--device cuda|cpu] [--out results.json]
       torch-module-bench.py --md RESULTS.json    (rewrites the Markdown table of a result)
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

try:  # --md needs neither
    import torch

    import moe_engine
    import moe_engine.torch as me
except ImportError:
    pass

HERE = os.path.dirname(os.path.abspath(__file__))


def compute_bound(name):
    """The cases the FP8 geomean covers: all but the small batch (as bench/results' FP8 MLP table)."""
    return "small-batch" not in name


def time_modules(case, layout, iters, precisions, device, warmup=3, block=4):
    """Median forward+backward ms per precision (the modules alternate iteration by iteration), and
    on CUDA each module's step peak memory and the memory its first step leaves behind (the FP8
    weight copies)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    G, H, F = case["experts"], case["hidden"], case["ffn"]
    T = case.get("capacity", case["tokens"])
    modules = {}
    for prec in precisions:
        torch.manual_seed(0)
        fp8 = {"fp8_recipe": me.Fp8Recipe()} if prec == "fp8" else {}
        modules[prec] = me.GroupedMLP(G, H, F, bias=case["bias"], activation=case["activation"], glu_layout=layout,
                                      device=dev, **fp8)
    splits = torch.tensor(case["tokens_per_expert"], dtype=torch.int64, device=dev)
    torch.manual_seed(0)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=dev, requires_grad=True)
    p = torch.rand(T, device=dev, requires_grad=True)
    dy = torch.randn(T, H, dtype=torch.bfloat16, device=dev)

    def step(m):
        m.zero_grad(set_to_none=True)
        x.grad = p.grad = None
        m(x, splits, p).backward(dy)

    def clear(m):
        m.zero_grad(set_to_none=True)
        x.grad = p.grad = None

    out = {prec: {"ms": None, "peak_memory_bytes": None, "weight_cache_bytes": None} for prec in precisions}
    if cuda:
        for prec, m in modules.items():  # the first step, alone: what it leaves allocated
            clear(m)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            step(m)
            clear(m)
            torch.cuda.synchronize()
            out[prec]["weight_cache_bytes"] = torch.cuda.memory_allocated() - before
    for i in range(warmup):
        for m in modules.values():
            step(m)
    if cuda:
        for prec, m in modules.items():  # one steady-state step each: its peak above what it starts with
            clear(m)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(m)
            torch.cuda.synchronize()
            out[prec]["peak_memory_bytes"] = torch.cuda.max_memory_allocated() - base
            clear(m)
    # A sample is `block` back-to-back steps of one module, as a training loop runs them (and as
    # `moe-engine bench mlp` enqueues its runs): the host enqueues ahead of the GPU. One step per
    # sample, alternating with the other module, would start each sample on an empty queue and
    # count the host's enqueue time of the first kernels where it only hides under the GPU's work.
    times = {prec: [] for prec in precisions}
    for i in range(iters):
        for prec, m in modules.items():
            if cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(block):
                    step(m)
                stop.record()
                times[prec].append((start, stop))
            else:
                t0 = time.perf_counter()
                for _ in range(block):
                    step(m)
                times[prec].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    me.check_errors()
    for prec in precisions:
        ms = sorted(a.elapsed_time(b) / block for a, b in times[prec]) if cuda else sorted(t / block for t in times[prec])
        out[prec]["ms"] = ms[len(ms) // 2]
    modules = x = p = dy = None  # freed before the next case (the closures above read them)
    gc.collect()
    return out


def time_cli(cli, case, layout, iters):
    out = subprocess.run([cli, "bench", "mlp", "--case", case["name"], "--device", "cuda:0", "--no-check",
                          "--glu-layout", layout, "--iters", str(iters), "--warmup", "3", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def mlp_flops(case):
    """moe-engine bench mlp's FLOPs (tools/workloads.cpp): 3 GEMM passes of 2 T (2F H + H F)."""
    return 3.0 * 2.0 * sum(case["tokens_per_expert"]) * (2 * case["ffn"] * case["hidden"] + case["hidden"] * case["ffn"])


def geomean(values):
    return float(torch.tensor(values, dtype=torch.float64).log().mean().exp())


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--md":
        sys.stdout.write(markdown(json.load(open(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default="", help="moe-engine (CUDA build): the C++ time per case; without it no C++ column")
    ap.add_argument("--workloads", default=os.path.join(HERE, "..", "workloads.json"))
    ap.add_argument("--cases", default="")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--block", type=int, default=4, help="back-to-back steps per timed sample (ms = its time / block)")
    ap.add_argument("--glu-layout", default="", help="default: pairs for gpt-oss, else blocks:32 (as scripts/gpu mlp-bench)")
    ap.add_argument("--precision", choices=("bf16", "both"), default="bf16",
                    help="both: also the FP8 module (fp8_recipe=Fp8Recipe()), alternated with the bf16 one")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the CPU backend, host clock, no memory numbers (a smoke test; no --cli)")
    ap.add_argument("--anchor", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.device == "cpu" and a.cli:
        raise SystemExit("torch-module-bench.py: --cli times the CUDA build; leave it out with --device cpu")
    precisions = ["bf16", "fp8"] if a.precision == "both" else ["bf16"]
    if "fp8" in precisions and not hasattr(me, "Fp8Recipe"):
        raise SystemExit("torch-module-bench.py: this moe_engine has no FP8 GroupedMLP (moe_engine.torch.Fp8Recipe)")
    cases = [c for c in json.load(open(a.workloads))["cases"] if a.cases in c["name"]]
    anchor = {}
    if a.anchor:
        for c in json.load(open(a.anchor)).get("cases", []):
            anchor[c["case"]] = c
    rows = []
    fp8_head = f" {'FP8 ms':>9s} {'FP8/bf16':>9s}" if "fp8" in precisions else ""
    print(f"{'case':32s} {'C++ ms':>9s} {'torch ms':>9s} {'torch/C++':>9s} {'eager ms':>9s} {'vs eager':>9s}" + fp8_head)
    for c in cases:
        layout = a.glu_layout or ("pairs" if c["name"].startswith("gpt-oss") else "blocks:32")
        if a.cli:
            cli = time_cli(a.cli, c, layout, a.iters)
            c_ms, flops = cli["time_ms"]["total"]["median"], cli["flops"]
            c["capacity"] = cli["case"]["capacity"]
        else:
            c_ms, flops = None, mlp_flops(c)
        t = time_modules(c, layout, a.iters, precisions, a.device, block=a.block)
        t_ms = t["bf16"]["ms"]
        eager = anchor.get(c["name"], {}).get("mlp_eager_ms")
        row = {"case": c["name"], "glu_layout": layout, "cpp_ms": c_ms, "torch_module_ms": t_ms,
               "module_over_cpp": t_ms / c_ms if c_ms else None,
               "torch_eager_ms": eager, "speedup_vs_torch_eager": (eager / t_ms) if eager else None,
               "flops": flops, "torch_module_tflops": flops / t_ms / 1e9,
               "peak_memory_bytes_bf16": t["bf16"]["peak_memory_bytes"]}
        if "fp8" in precisions:
            f = t["fp8"]
            pb, pf = t["bf16"]["peak_memory_bytes"], f["peak_memory_bytes"]
            row.update({"torch_module_fp8_ms": f["ms"], "time_ratio_fp8_vs_bf16": f["ms"] / t_ms,
                        "torch_module_fp8_tflops": flops / f["ms"] / 1e9, "compute_bound": compute_bound(c["name"]),
                        "peak_memory_bytes_fp8": pf, "peak_memory_ratio_fp8_vs_bf16": pf / pb if pb else None,
                        "fp8_weight_cache_bytes": f["weight_cache_bytes"]})
        rows.append(row)
        e = f"{eager:9.3f} {eager / t_ms:8.2f}x" if eager else f"{'-':>9s} {'-':>9s}"
        cpp = f"{c_ms:9.3f} {t_ms:9.3f} {t_ms / c_ms:8.3f}x" if c_ms else f"{'-':>9s} {t_ms:9.3f} {'-':>9s}"
        fp8_col = f" {row['torch_module_fp8_ms']:9.3f} {row['time_ratio_fp8_vs_bf16']:9.3f}" if "fp8" in precisions else ""
        print(f"{c['name']:32s} {cpp} {e}{fp8_col}", flush=True)
    ratios = [r["module_over_cpp"] for r in rows if r["module_over_cpp"] is not None]
    geo = geomean(ratios) if ratios else None
    summary = {"device": torch.cuda.get_device_name() if a.device == "cuda" else f"cpu ({os.cpu_count()} cores)",
               "torch": torch.__version__, "moe_engine": moe_engine.__version__,
               "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
               "iters": a.iters, "block": a.block, "geomean_module_over_cpp": geo, "max_module_over_cpp": max(ratios) if ratios else None,
               "cases": rows}
    if all(r["speedup_vs_torch_eager"] for r in rows):
        s = [r["speedup_vs_torch_eager"] for r in rows]
        summary["geomean_speedup_vs_torch_eager"] = geomean(s)
        summary["min_speedup_vs_torch_eager"] = min(s)
    if "fp8" in precisions:
        summary["precisions"] = precisions
        cb = [r["time_ratio_fp8_vs_bf16"] for r in rows if r["compute_bound"]]
        summary["geomean_time_ratio_fp8_vs_bf16"] = geomean(cb) if cb else None
        summary["max_time_ratio_fp8_vs_bf16"] = max(cb) if cb else None
        summary["fp8_compute_bound_cases"] = len(cb)
        summary["geomean_time_ratio_fp8_vs_bf16_all_cases"] = geomean([r["time_ratio_fp8_vs_bf16"] for r in rows]) \
            if rows else None
    if geo is not None:
        print(f"module / C++ time: geomean {geo:.3f}, max {max(ratios):.3f}")
    if "fp8" in precisions and summary["geomean_time_ratio_fp8_vs_bf16"] is not None:
        print(f"FP8 / bf16 module time over the {len(cb)} compute-bound cases: geomean "
              f"{summary['geomean_time_ratio_fp8_vs_bf16']:.3f}, max {summary['max_time_ratio_fp8_vs_bf16']:.3f}")
    if a.out:
        json.dump(summary, open(a.out, "w"), indent=2)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(markdown(summary))


def _f(v, spec, scale=1):
    return "-" if v is None else format(v / scale, spec)


def markdown(s):
    """The results as a Markdown table (also: torch-module-bench.py --md RESULTS.json rewrites it)."""
    lines = [f"# GroupedMLP (PyTorch module) vs the C++ benchmark, {s['device']}", "",
             f"`{s['command']}` (torch {s['torch']}, moe_engine {s['moe_engine']}, {s['iters']} timed samples of {s.get('block', 1)} back-to-back steps, median)", ""]
    if s["geomean_module_over_cpp"] is not None:
        lines.append(f"Module / C++ time: geomean **{s['geomean_module_over_cpp']:.3f}**, max {s['max_module_over_cpp']:.3f}.")
    else:
        lines.append("No C++ column (run without --cli).")
    if "geomean_speedup_vs_torch_eager" in s:
        lines.append(f"Module vs the PyTorch-eager MLP (same run): geomean **{s['geomean_speedup_vs_torch_eager']:.2f}x**, "
                     f"min {s['min_speedup_vs_torch_eager']:.2f}x.")
    lines += ["", "| case | GLU layout | C++ ms | module ms | module / C++ | eager ms | speedup vs eager | module TFLOP/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in s["cases"]:
        eager = f"{r['torch_eager_ms']:.3f} | {r['speedup_vs_torch_eager']:.2f}x" if r["torch_eager_ms"] else "- | -"
        lines.append(f"| {r['case']} | {r['glu_layout']} | {_f(r['cpp_ms'], '.3f')} | {r['torch_module_ms']:.3f} | "
                     f"{_f(r['module_over_cpp'], '.3f')} | {eager} | {r['torch_module_tflops']:.0f} |")
    if "geomean_time_ratio_fp8_vs_bf16" in s:
        g = 2**30
        geo = s["geomean_time_ratio_fp8_vs_bf16"]
        lines += ["", "## FP8 module (`GroupedMLP(..., fp8_recipe=Fp8Recipe())`) vs the bf16 module", "",
                  f"Same inputs, the two modules alternated iteration by iteration. FP8 / bf16 time over the "
                  f"{s['fp8_compute_bound_cases']} compute-bound cases (all but the small batch): geomean "
                  f"**{_f(geo, '.3f')}**, max {_f(s['max_time_ratio_fp8_vs_bf16'], '.3f')}; over all cases: geomean "
                  f"{_f(s['geomean_time_ratio_fp8_vs_bf16_all_cases'], '.3f')}.", "",
                  "Step peak: the allocator's peak during one forward+backward above what was allocated before it "
                  "(parameters, inputs and the FP8 weight copies; the gradients count). Weight copies: what the FP8 "
                  "module's first step leaves allocated (its quantized weights, kept across steps).", "",
                  "| case | bf16 ms | FP8 ms | **FP8 / bf16** | FP8 TFLOP/s | step peak GiB bf16 | FP8 | FP8 / bf16 | "
                  "FP8 weight copies GiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in s["cases"]:
            name = r["case"] if r["compute_bound"] else f"{r['case']} (not in the geomean)"
            lines.append(f"| {name} | {r['torch_module_ms']:.3f} | {r['torch_module_fp8_ms']:.3f} | "
                         f"{r['time_ratio_fp8_vs_bf16']:.3f} | {r['torch_module_fp8_tflops']:.0f} | "
                         f"{_f(r['peak_memory_bytes_bf16'], '.2f', g)} | {_f(r['peak_memory_bytes_fp8'], '.2f', g)} | "
                         f"{_f(r['peak_memory_ratio_fp8_vs_bf16'], '.3f')} | {_f(r['fp8_weight_cache_bytes'], '.2f', g)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
