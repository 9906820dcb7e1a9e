#!/usr/bin/env python3
"""Combines rounds of `moe-engine bench gemm` (each run right after its own anchor run) into one
result: per GEMM the median time over rounds, for us and for the anchors, then the ratios.
bf16 rounds (`bench gemm --anchor`, torch_anchor.py): vs torch._grouped_mm (scripts/gpu bench).
FP8 rounds (`bench gemm --dtype fp8 --anchor`, bench/drivers/fp8-anchor.py): vs our bf16 GEMMs,
torch._scaled_grouped_mm, the per-expert block-scaled cuBLAS loop and the dense FP8 GEMM, and end
to end with quantization (scripts/gpu bench-fp8).
Writes OUT_PREFIX.json (the combined result, rounds included), OUT_PREFIX.md and OUT_PREFIX.png.
Usage: bench/report/gemm-report.py OUT_PREFIX ROUND1.json [ROUND2.json ...]"""
import importlib
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gemm_report_fp8.py beside this file


def combine(rounds):
    first = rounds[0]
    out = {k: first[k] for k in ("device", "dtype", "iters", "geomean_over")}
    out["command"] = first["command"]
    out["rounds"] = len(rounds)
    out["ceilings"] = dict(first["ceilings"])
    out["ceilings"]["bf16_tflops"] = statistics.median(r["ceilings"]["bf16_tflops"] for r in rounds)
    out["ceilings"]["bf16_source"] = "median over rounds of the anchor's dense_8192_tflops, same run"
    entries = []
    for i, e in enumerate(first["entries"]):
        c = dict(e)
        c["ms"] = statistics.median(r["entries"][i]["ms"] for r in rounds)
        c["ms_rounds"] = [r["entries"][i]["ms"] for r in rounds]
        c["tflops"] = e["flops"] / (c["ms"] * 1e9)
        floor_ms = max(e["flops"] / (out["ceilings"]["bf16_tflops"] * 1e9), e["bytes"] / (first["ceilings"]["hbm_TBps"] * 1e9))
        c["roofline_fraction"] = floor_ms / c["ms"]
        for key, ratio in (("torch_grouped_mm_ms", "speedup_vs_torch"), ("cublas_loop_ms", "speedup_vs_cublas_loop")):
            if key in e:
                c[key] = statistics.median(r["entries"][i][key] for r in rounds)
                c[key.replace("_ms", "_ms_rounds")] = [r["entries"][i][key] for r in rounds]
                c[ratio] = c[key] / c["ms"]
        entries.append(c)
    out["entries"] = entries
    speedups = [e["speedup_vs_torch"] for e in entries if e["in_geomean"] and "speedup_vs_torch" in e]
    out["geomean_speedup_vs_torch"] = math.exp(sum(map(math.log, speedups)) / len(speedups)) if speedups else None
    out["min_speedup_vs_torch"] = min(speedups) if speedups else None
    return out


def write_markdown(r, path):
    lines = [f"# Grouped GEMM benchmark: {r['device']}", "",
             f"Command (each of {r['rounds']} rounds, after its own `torch_anchor.py` run): `{r['command']}`", "",
             f"Ceilings: bf16 {r['ceilings']['bf16_tflops']:.1f} TFLOP/s ({r['ceilings']['bf16_source']}), "
             f"HBM {r['ceilings']['hbm_TBps']} TB/s. Per GEMM: median over rounds of the per-round medians.", ""]
    if r.get("geomean_speedup_vs_torch") is not None:
        lines += [f"**Geomean speedup vs torch._grouped_mm (same run): {r['geomean_speedup_vs_torch']:.3f}**, "
                  f"min {r['min_speedup_vs_torch']:.3f}; over {r['geomean_over']}.", ""]
    lines += ["| case | fc | GEMM | ms | TFLOP/s | roofline | torch ms | speedup vs torch | vs cuBLAS loop |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in r["entries"]:
        sp = f"{e['speedup_vs_torch']:.3f}" if "speedup_vs_torch" in e else ""
        tm = f"{e['torch_grouped_mm_ms']:.4f}" if "torch_grouped_mm_ms" in e else ""
        lp = f"{e['speedup_vs_cublas_loop']:.3f}" if "speedup_vs_cublas_loop" in e else ""
        lines.append(f"| {e['case']} | {e['fc']} | {e['gemm']} | {e['ms']:.4f} | {e['tflops']:.1f} | "
                     f"{e['roofline_fraction']:.3f} | {tm} | {sp} | {lp} |")
    open(path, "w").write("\n".join(lines) + "\n")


def write_plot(r, path):
    fp8 = importlib.import_module("gemm_report_fp8")  # the plotting helpers both reports share
    plt = fp8.pyplot()
    if plt is None:
        return
    ents, labels = fp8.plotted(r)
    ours = [e["tflops"] for e in ents]
    torch = [e["flops"] / (e["torch_grouped_mm_ms"] * 1e9) if "torch_grouped_mm_ms" in e else 0 for e in ents]
    # The anchor times the per-expert cuBLAS loop for the forward GEMMs only.
    loop = [e["flops"] / (e["cublas_loop_ms"] * 1e9) if "cublas_loop_ms" in e else 0 for e in ents]
    fig, ax = plt.subplots(figsize=(12, 0.3 * len(ents) + 1.5))
    y = range(len(ents))
    ax.barh([i - 0.27 for i in y], ours, height=0.27, label="moe-engine")
    ax.barh([i for i in y], torch, height=0.27, label="torch._grouped_mm")
    ax.barh([i + 0.27 for i in y], loop, height=0.27, label="per-expert cuBLAS loop (forward only)")
    ax.axvline(r["ceilings"]["bf16_tflops"], color="gray", linestyle="--", label="dense bf16 (same run)")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("TFLOP/s")
    ax.set_title(f"Grouped GEMMs on {r['device']}: geomean speedup {r.get('geomean_speedup_vs_torch') or 0:.3f}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: gemm-report.py OUT_PREFIX ROUND1.json [ROUND2.json ...]")
    prefix, files = sys.argv[1], sys.argv[2:]
    rounds = []
    for f in files:
        try:
            rounds.append(json.load(open(f)))
        except (OSError, ValueError) as e:
            sys.exit(f"gemm-report.py: cannot read the round '{f}': {e}")
    dtypes = {r.get("dtype") for r in rounds}
    if len(dtypes) != 1:
        sys.exit(f"gemm-report.py: the rounds mix dtypes {sorted(map(str, dtypes))}: combine FP8 and bf16 rounds apart")
    if dtypes == {"fp8"}:
        fp8 = importlib.import_module("gemm_report_fp8")
        combined = fp8.combine(rounds, files)
        json.dump(combined, open(prefix + ".json", "w"), indent=1)
        fp8.write_markdown(combined, prefix + ".md")
        fp8.write_plot(combined, prefix + ".png")
        fp8.print_summary(combined)
        return
    combined = combine(rounds)
    json.dump(combined, open(prefix + ".json", "w"), indent=1)
    write_markdown(combined, prefix + ".md")
    write_plot(combined, prefix + ".png")
    if combined.get("geomean_speedup_vs_torch") is not None:
        print(f"combined over {len(files)} rounds: geomean {combined['geomean_speedup_vs_torch']:.3f}, "
              f"min {combined['min_speedup_vs_torch']:.3f}")


if __name__ == "__main__":
    main()
