#!/usr/bin/env python3
"""Combines per-case `moe-engine bench mlp --dtype fp8 --vs-bf16 --json` results with the
torch_anchor.py JSON of the same device run into OUT_PREFIX.{json,md,png} (the PNG only where
matplotlib exists). Run by scripts/gpu fp8-mlp-bench.
Usage: bench/report/fp8-mlp-report.py OUT_PREFIX ANCHOR.json FP8_MLP_CASE.json [...]

The acceptance ratios are over the suite's compute-bound cases (mixtral, deepseek, qwen3, gpt-oss:
every case but the small batch); the small batch is reported beside them."""
import json
import math
import sys

import plots

COMPUTE_BOUND = ("mixtral", "deepseek", "qwen3-30b-a3b/", "gpt-oss")


def geo(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main():
    prefix, anchor_path, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    anchor = json.load(open(anchor_path))
    by_case = {c["case"]: c for c in anchor["cases"]}
    entries = []
    for p in paths:
        r = json.load(open(p))
        name = r["case"]["name"]
        a = by_case[name]
        e = {
            "case": name,
            "glu": r["glu"],
            "flops": r["flops"],
            "fp8_ms": r["time_ms"]["total"]["median"],
            "fp8_forward_ms": r["time_ms"]["forward"]["median"],
            "fp8_backward_ms": r["time_ms"]["backward"]["median"],
            "bf16_ms": r["bf16_time_ms"]["total"]["median"],
            "bf16_forward_ms": r["bf16_time_ms"]["forward"]["median"],
            "bf16_backward_ms": r["bf16_time_ms"]["backward"]["median"],
            "torch_eager_ms": a["mlp_eager_ms"],
            "saved_bytes_per_token": r["saved_bytes_per_token"],
            "bf16_saved_bytes_per_token": r["bf16_saved_bytes_per_token"],
            "saved_bytes_ratio_fp8_vs_bf16": r["saved_bytes_ratio_fp8_vs_bf16"],
            "command": r["command"],
            "fusion_requested": r.get("fusion_requested", "forward"),
            "compute_bound": any(k in name for k in COMPUTE_BOUND),
        }
        e["time_ratio_fp8_vs_bf16"] = e["fp8_ms"] / e["bf16_ms"]
        e["tflops"] = e["flops"] / (e["fp8_ms"] * 1e9)
        e["speedup_vs_torch_eager"] = e["torch_eager_ms"] / e["fp8_ms"]
        entries.append(e)
    order = [c["case"] for c in anchor["cases"]]
    entries.sort(key=lambda e: order.index(e["case"]))
    bound = [e for e in entries if e["compute_bound"]] or entries
    out = {
        "device": anchor["device"],
        "torch": anchor["torch"],
        "command": "scripts/gpu fp8-mlp-bench (per case: " + entries[0]["command"].split(" --case")[0] +
                   " --case CASE --device cuda:0 --dtype fp8 --vs-bf16 --no-check --json --glu-layout LAYOUT"
                   " --iters N --fusion " + entries[0]["fusion_requested"] + ")",
        "cases_in_ratios": [e["case"] for e in bound],
        "geomean_time_ratio_fp8_vs_bf16": geo([e["time_ratio_fp8_vs_bf16"] for e in bound]),
        "max_time_ratio_fp8_vs_bf16": max(e["time_ratio_fp8_vs_bf16"] for e in bound),
        "geomean_speedup_vs_torch_eager": geo([e["speedup_vs_torch_eager"] for e in bound]),
        "saved_bytes_ratio_fp8_vs_bf16": max(e["saved_bytes_ratio_fp8_vs_bf16"] for e in bound),
        "cases": entries,
    }
    json.dump(out, open(prefix + ".json", "w"), indent=1)
    lines = [
        f"# FP8 expert MLP forward + backward: {out['device']}",
        "",
        f"Command: `{out['command']}`; the PyTorch-eager bf16 MLP anchor (`torch_anchor.py`, torch {out['torch']})",
        "in the same device call. Times are medians; the FP8 MLP (quantization included, weights quantized once",
        "outside the timed steps as a module does once per optimizer step) alternates run by run with our bf16",
        "fused MLP. Ratios over the compute-bound cases (all but the small batch).",
        "",
        f"**FP8 / bf16 time: geomean {out['geomean_time_ratio_fp8_vs_bf16']:.3f}, max {out['max_time_ratio_fp8_vs_bf16']:.3f}; "
        f"speedup vs PyTorch eager bf16: geomean {out['geomean_speedup_vs_torch_eager']:.3f}; "
        f"saved bytes FP8 / bf16: max {out['saved_bytes_ratio_fp8_vs_bf16']:.3f}.**",
        "",
        "| case | layout | FP8 ms | fwd | bwd | TFLOP/s | bf16 ms | FP8 / bf16 | torch eager ms | vs eager | saved B/token | bf16 B/token | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        lines.append(
            f"| {e['case']} | {e['glu'].split(', ')[-1]} | {e['fp8_ms']:.3f} | {e['fp8_forward_ms']:.3f} | "
            f"{e['fp8_backward_ms']:.3f} | {e['tflops']:.1f} | {e['bf16_ms']:.3f} | {e['time_ratio_fp8_vs_bf16']:.3f} | "
            f"{e['torch_eager_ms']:.3f} | {e['speedup_vs_torch_eager']:.3f} | {e['saved_bytes_per_token']} | "
            f"{e['bf16_saved_bytes_per_token']} | {e['saved_bytes_ratio_fp8_vs_bf16']:.3f} |")
    open(prefix + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = plots.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(12, 5))
    cases = [e["case"] for e in entries]
    series = [
        ("moe-engine FP8", [e["tflops"] for e in entries]),
        ("moe-engine bf16 fused", [e["flops"] / (e["bf16_ms"] * 1e9) for e in entries]),
        ("PyTorch eager bf16", [e["flops"] / (e["torch_eager_ms"] * 1e9) for e in entries]),
    ]
    plots.grouped_bars(ax, cases, series, "TFLOP/s (forward + backward)", reference=None)
    plots.case_ticks(ax, cases)
    ax.set_title(f"Expert MLP forward + backward, FP8 vs bf16, {out['device']}")
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=120)


if __name__ == "__main__":
    main()
