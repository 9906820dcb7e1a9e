#!/usr/bin/env python3
"""Combines per-case `moe-engine bench mlp --vs-unfused --json` results with the torch_anchor.py
JSON of the same device run into OUT_PREFIX.{json,md,png} (the PNG only where matplotlib exists).
Run by scripts/gpu mlp-bench. Usage: bench/report/mlp-report.py OUT_PREFIX ANCHOR.json MLP_CASE.json [...]"""
import json
import math
import sys

import plots


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
            "fused_ms": r["time_ms"]["total"]["median"],
            "fused_forward_ms": r["time_ms"]["forward"]["median"],
            "fused_backward_ms": r["time_ms"]["backward"]["median"],
            "unfused_ms": r["unfused_time_ms"]["total"]["median"],
            "torch_eager_ms": a["mlp_eager_ms"],
            "torch_graph_ms": a["mlp_graph_ms"],
            "saved_bytes_per_token": r["saved_bytes_per_token"],
            "torch_eager_saved_bytes_per_token": a["mlp_saved_bytes_per_token"],
            "command": r["command"],
            # What ran (bench's "fusion") and what was asked ("fusion_requested"; older results
            # had only "fusion", the request).
            "fusion": r.get("fusion", "forward"),
            "fusion_requested": r.get("fusion_requested", r.get("fusion", "forward")),
            "recompute": r.get("recompute", False),
        }
        e["tflops"] = e["flops"] / (e["fused_ms"] * 1e9)
        e["speedup_vs_torch_eager"] = e["torch_eager_ms"] / e["fused_ms"]
        e["speedup_vs_unfused"] = e["unfused_ms"] / e["fused_ms"]
        e["unfused_speedup_vs_torch_eager"] = e["torch_eager_ms"] / e["unfused_ms"]
        # torch_anchor.py counts memory newly allocated by forward: x, which the caller holds anyway,
        # is not in it. Like for like: what we keep beyond x.
        x_bytes = r["case"]["hidden"] * (4 if r["dtype"] == "float32" else 2)
        e["saved_bytes_per_token_beyond_x"] = e["saved_bytes_per_token"] - x_bytes
        e["saved_bytes_vs_torch_eager"] = e["saved_bytes_per_token_beyond_x"] / e["torch_eager_saved_bytes_per_token"]
        entries.append(e)
    order = [c["case"] for c in anchor["cases"]]
    entries.sort(key=lambda e: order.index(e["case"]))
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
    sp = [e["speedup_vs_torch_eager"] for e in entries]
    out = {
        "device": anchor["device"],
        "torch": anchor["torch"],
        "command": "scripts/gpu mlp-bench (per case: " + entries[0]["command"].split(" --case")[0] +
                   " --case CASE --device cuda:0 --no-check --json --vs-unfused --glu-layout LAYOUT --iters N"
                   " --fusion " + entries[0]["fusion_requested"] + (" --recompute" if entries[0]["recompute"] else "") + ")",
        "geomean_speedup_vs_torch_eager": geo(sp),
        "min_speedup_vs_torch_eager": min(sp),
        "geomean_speedup_vs_unfused": geo([e["speedup_vs_unfused"] for e in entries]),
        "min_speedup_vs_unfused": min(e["speedup_vs_unfused"] for e in entries),
        "cases": entries,
    }
    json.dump(out, open(prefix + ".json", "w"), indent=1)
    lines = [
        f"# Fused expert MLP forward + backward: {out['device']}",
        "",
        f"Command: `{out['command']}`; the PyTorch-eager anchor (`torch_anchor.py`, torch {out['torch']}) in the same device call.",
        "Times are medians; the unfused path (grouped GEMMs + GLU kernels) alternates run by run with the fused one.",
        "Saved bytes per token: what forward keeps for backward (x, the pre-activation, the prob); \"beyond x\" leaves",
        "out the input, which the caller holds anyway and which torch_anchor.py's allocation count does not see.",
        "",
        f"**Geomean speedup vs PyTorch eager: {out['geomean_speedup_vs_torch_eager']:.3f}**, min {out['min_speedup_vs_torch_eager']:.3f}; "
        f"vs our unfused path: geomean {out['geomean_speedup_vs_unfused']:.3f}, min {out['min_speedup_vs_unfused']:.3f}.",
        "",
        "| case | layout | fused ms | TFLOP/s | unfused ms | torch eager ms | vs eager | vs unfused | saved B/token | beyond x | torch B/token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        lines.append(
            f"| {e['case']} | {e['glu'].split(', ')[-1]} | {e['fused_ms']:.3f} | {e['tflops']:.1f} | {e['unfused_ms']:.3f} | "
            f"{e['torch_eager_ms']:.3f} | {e['speedup_vs_torch_eager']:.3f} | {e['speedup_vs_unfused']:.3f} | "
            f"{e['saved_bytes_per_token']} | {e['saved_bytes_per_token_beyond_x']} | {e['torch_eager_saved_bytes_per_token']:.0f} |")
    open(prefix + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = plots.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(12, 5))
    cases = [e["case"] for e in entries]
    series = [
        ("moe-engine fused", [e["tflops"] for e in entries]),
        ("moe-engine unfused", [e["flops"] / (e["unfused_ms"] * 1e9) for e in entries]),
        ("PyTorch eager", [e["flops"] / (e["torch_eager_ms"] * 1e9) for e in entries]),
    ]
    plots.grouped_bars(ax, cases, series, "TFLOP/s (forward + backward)", reference=None)
    plots.case_ticks(ax, cases)
    ax.set_title(f"Expert MLP forward + backward, {out['device']}")
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=120)


if __name__ == "__main__":
    main()
