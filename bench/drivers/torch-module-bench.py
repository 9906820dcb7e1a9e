#!/usr/bin/env python3
"""The PyTorch module against the C++ benchmark, same run, same GPU: for every case of
bench/workloads.json, GroupedMLP forward+backward (autograd, plain gradients: wgrad written, as
`moe-engine bench mlp` does) timed with CUDA events per iteration (median), next to the C++ time
of `moe-engine bench mlp` for the same case and options, and (with --anchor) the PyTorch-eager MLP
of the anchor script (torch_anchor.py) from the same run. scripts/gpu python runs it.

Usage: torch-module-bench.py --cli build-gpu/tools/moe-engine [--cases SUBSTR] [--iters 20]
                             [--glu-layout blocks:32] [--anchor anchor.json] [--out results.json]
       torch-module-bench.py --md RESULTS.json    (rewrites the Markdown table of a result)
"""
import argparse
import json
import os
import subprocess
import sys

try:  # --md needs neither
    import torch

    import moe_engine
    import moe_engine.torch as me
except ImportError:
    pass

HERE = os.path.dirname(os.path.abspath(__file__))


def time_module(case, layout, iters, warmup=3):
    dev = torch.device("cuda")
    G, H, F = case["experts"], case["hidden"], case["ffn"]
    T = case.get("capacity", case["tokens"])
    torch.manual_seed(0)
    m = me.GroupedMLP(G, H, F, bias=case["bias"], activation=case["activation"], glu_layout=layout, device=dev)
    splits = torch.tensor(case["tokens_per_expert"], dtype=torch.int64, device=dev)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=dev, requires_grad=True)
    p = torch.rand(T, device=dev, requires_grad=True)
    dy = torch.randn(T, H, dtype=torch.bfloat16, device=dev)
    times = []
    for i in range(warmup + iters):
        m.zero_grad(set_to_none=True)
        x.grad = p.grad = None
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        m(x, splits, p).backward(dy)
        stop.record()
        if i >= warmup:
            times.append((start, stop))
    torch.cuda.synchronize()
    me.check_errors()
    ms = sorted(a.elapsed_time(b) for a, b in times)
    return ms[len(ms) // 2]


def time_cli(cli, case, layout, iters):
    out = subprocess.run([cli, "bench", "mlp", "--case", case["name"], "--device", "cuda:0", "--no-check",
                          "--glu-layout", layout, "--iters", str(iters), "--warmup", "3", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--md":
        sys.stdout.write(markdown(json.load(open(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--workloads", default=os.path.join(HERE, "..", "workloads.json"))
    ap.add_argument("--cases", default="")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--glu-layout", default="", help="default: pairs for gpt-oss, else blocks:32 (as scripts/gpu mlp-bench)")
    ap.add_argument("--anchor", default="")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cases = [c for c in json.load(open(a.workloads))["cases"] if a.cases in c["name"]]
    anchor = {}
    if a.anchor:
        for c in json.load(open(a.anchor)).get("cases", []):
            anchor[c["case"]] = c
    rows = []
    print(f"{'case':32s} {'C++ ms':>9s} {'torch ms':>9s} {'torch/C++':>9s} {'eager ms':>9s} {'vs eager':>9s}")
    for c in cases:
        layout = a.glu_layout or ("pairs" if c["name"].startswith("gpt-oss") else "blocks:32")
        cli = time_cli(a.cli, c, layout, a.iters)
        c_ms = cli["time_ms"]["total"]["median"]
        c["capacity"] = cli["case"]["capacity"]
        t_ms = time_module(c, layout, a.iters)
        eager = anchor.get(c["name"], {}).get("mlp_eager_ms")
        row = {"case": c["name"], "glu_layout": layout, "cpp_ms": c_ms, "torch_module_ms": t_ms, "module_over_cpp": t_ms / c_ms,
               "torch_eager_ms": eager, "speedup_vs_torch_eager": (eager / t_ms) if eager else None,
               "flops": cli["flops"], "torch_module_tflops": cli["flops"] / t_ms / 1e9}
        rows.append(row)
        e = f"{eager:9.3f} {eager / t_ms:8.2f}x" if eager else f"{'-':>9s} {'-':>9s}"
        print(f"{c['name']:32s} {c_ms:9.3f} {t_ms:9.3f} {t_ms / c_ms:8.3f}x {e}", flush=True)
    ratios = [r["module_over_cpp"] for r in rows]
    geo = float(torch.tensor(ratios).log().mean().exp())
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "moe_engine": moe_engine.__version__,
               "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), 
               "iters": a.iters, "geomean_module_over_cpp": geo, "max_module_over_cpp": max(ratios), "cases": rows}
    if all(r["speedup_vs_torch_eager"] for r in rows):
        s = [r["speedup_vs_torch_eager"] for r in rows]
        summary["geomean_speedup_vs_torch_eager"] = float(torch.tensor(s).log().mean().exp())
        summary["min_speedup_vs_torch_eager"] = min(s)
    print(f"module / C++ time: geomean {geo:.3f}, max {max(ratios):.3f}")
    if a.out:
        json.dump(summary, open(a.out, "w"), indent=2)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(markdown(summary))


def markdown(s):
    """The results as a Markdown table (also: torch-module-bench.py --md RESULTS.json rewrites it)."""
    lines = [f"# GroupedMLP (PyTorch module) vs the C++ benchmark, {s['device']}", "",
             f"`{s['command']}` (torch {s['torch']}, moe_engine {s['moe_engine']}, {s['iters']} timed runs, median)", "",
             f"Module / C++ time: geomean **{s['geomean_module_over_cpp']:.3f}**, max {s['max_module_over_cpp']:.3f}."]
    if "geomean_speedup_vs_torch_eager" in s:
        lines.append(f"Module vs the PyTorch-eager MLP (same run): geomean **{s['geomean_speedup_vs_torch_eager']:.2f}x**, "
                     f"min {s['min_speedup_vs_torch_eager']:.2f}x.")
    lines += ["", "| case | GLU layout | C++ ms | module ms | module / C++ | eager ms | speedup vs eager | module TFLOP/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in s["cases"]:
        eager = f"{r['torch_eager_ms']:.3f} | {r['speedup_vs_torch_eager']:.2f}x" if r["torch_eager_ms"] else "- | -"
        lines.append(f"| {r['case']} | {r['glu_layout']} | {r['cpp_ms']:.3f} | {r['torch_module_ms']:.3f} | "
                     f"{r['module_over_cpp']:.3f} | {eager} | {r['torch_module_tflops']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
