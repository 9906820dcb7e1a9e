"""The FP8 half of gemm-report.py: combines rounds of `moe-engine bench gemm --dtype fp8 --anchor`
(each right after its own bench/drivers/fp8-anchor.py run). Per entry the median over rounds of
every time (ours in FP8 and bf16, the anchors', the quantizers', end to end); the ratios and the
summary figures are recomputed from those medians with the definitions of tools/bench_gemm.cpp."""
import math
import statistics
import sys

# Times per entry, each combined by its median over the rounds that have it.
TIMES = ("ms", "bf16_ms", "torch_scaled_grouped_mm_ms", "per_expert_loop_ms", "dense_fp8_ms",
         "dense_fp8_blockwise_ms", "e2e_ms")
COMPUTE_BOUND = ("mixtral", "deepseek", "gpt-oss")  # tools/bench_gemm.cpp: compute_bound_case


def compute_bound(case):
    return case.startswith(COMPUTE_BOUND)


def fail(msg):
    sys.exit(f"gemm-report.py (fp8): {msg}")


def combine(rounds, files):
    first = rounds[0]
    for key in ("device", "command", "entries", "ceilings"):
        if key not in first:
            fail(f"the round '{files[0]}' has no \"{key}\": not the JSON of `moe-engine bench gemm --dtype fp8 --json-out`")
    names = [(e["case"], e["fc"], e["gemm"]) for e in first["entries"]]
    for f, r in zip(files[1:], rounds[1:]):
        other = [(e["case"], e["fc"], e["gemm"]) for e in r.get("entries", [])]
        if other != names:
            fail(f"the round '{f}' timed other GEMMs than '{files[0]}' ({len(other)} entries for {len(names)}): "
                 "combine rounds of the same command only")
    out = {k: first[k] for k in ("device", "dtype", "iters", "geomean_over", "timing") if k in first}
    out["command"] = first["command"]
    out["rounds"] = len(rounds)
    out["anchor"] = first.get("anchor")
    if out["anchor"]:
        out["anchor"]["file"] = "each round's own anchor file (the rounds archive)"
    for key in ("e2e_includes", "compute_bound_cases"):
        if key in first:
            out[key] = first[key]
    ceilings = dict(first["ceilings"])
    for key in ("bf16_tflops", "fp8_tflops", "roofline_tflops"):
        values = [r["ceilings"][key] for r in rounds if key in r.get("ceilings", {})]
        if values:
            ceilings[key] = statistics.median(values)
    if ceilings.get("fp8_source", "").startswith("anchor"):
        ceilings["fp8_source"] = "median over rounds of the FP8 anchor's dense_fp8_8192_tflops, same run"
    out["ceilings"] = ceilings
    hbm = ceilings.get("hbm_TBps", 4.27)
    peak = ceilings.get("roofline_tflops", ceilings.get("fp8_tflops"))

    entries = []
    for i, e in enumerate(first["entries"]):
        c = {k: v for k, v in e.items() if k not in TIMES and not k.startswith(("speedup_", "time_ratio_", "fraction_"))}
        for key in TIMES:
            values = [r["entries"][i][key] for r in rounds if key in r["entries"][i]]
            if values:
                c[key] = statistics.median(values)
                c[key + "_rounds"] = values
        errors = {}
        for r in rounds:
            errors.update(r["entries"][i].get("anchor_errors", {}))
        if errors:
            c["anchor_errors"] = errors
        ms = c["ms"]
        c["tflops"] = e["flops"] / (ms * 1e9) if e.get("flops") else 0.0
        if peak:
            floor_ms = max(e.get("flops", 0) / (peak * 1e9), e.get("bytes", 0) / (hbm * 1e9))
            c["roofline_fraction"] = floor_ms / ms
        if "bf16_ms" in c:
            c["time_ratio_fp8_vs_bf16"] = ms / c["bf16_ms"]
        if "torch_scaled_grouped_mm_ms" in c:
            c["speedup_vs_torch_scaled_grouped_mm"] = c["torch_scaled_grouped_mm_ms"] / ms
        if "per_expert_loop_ms" in c:
            c["speedup_vs_per_expert_loop"] = c["per_expert_loop_ms"] / ms
        if "dense_fp8_ms" in c:
            c["dense_fp8_tflops"] = e["flops"] / (c["dense_fp8_ms"] * 1e9)
            c["fraction_of_dense_fp8"] = c["dense_fp8_ms"] / ms
        if "dense_fp8_blockwise_ms" in c:
            c["dense_fp8_blockwise_tflops"] = e["flops"] / (c["dense_fp8_blockwise_ms"] * 1e9)
            c["fraction_of_dense_fp8_blockwise"] = c["dense_fp8_blockwise_ms"] / ms
        if "e2e_ms" in c and "bf16_ms" in c:
            c["time_ratio_e2e_vs_bf16"] = c["e2e_ms"] / c["bf16_ms"]
        entries.append(c)
    out["entries"] = entries
    out.update(summary(entries))
    return out


def _geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summary(entries):
    """The top-level figures of tools/bench_gemm.cpp, over the entries of the geomean."""
    g = [e for e in entries if e.get("in_geomean")]
    cb = [e for e in g if compute_bound(e["case"])]
    fwd_dgrad = [e for e in cb if e["gemm"] in ("fwd", "dgrad")]

    def values(es, key):
        return [e[key] for e in es if key in e]
    ratio = values(g, "time_ratio_fp8_vs_bf16")
    sgmm, loop = values(g, "speedup_vs_torch_scaled_grouped_mm"), values(g, "speedup_vs_per_expert_loop")
    e2e, e2e_cb = values(g, "time_ratio_e2e_vs_bf16"), values(cb, "time_ratio_e2e_vs_bf16")
    dense = values(fwd_dgrad, "fraction_of_dense_fp8")
    blockwise = values(fwd_dgrad, "fraction_of_dense_fp8_blockwise")
    blockwise_wgrad = values([e for e in cb if e["gemm"] == "wgrad"], "fraction_of_dense_fp8_blockwise")
    wgrad = [e["tflops"] for e in cb if e["gemm"] == "wgrad"]
    return {
        "geomean_time_ratio_fp8_vs_bf16": _geomean(ratio),
        "max_time_ratio_fp8_vs_bf16": max(ratio) if ratio else None,
        "min_fp8_tflops_compute_bound": min((e["tflops"] for e in fwd_dgrad), default=None),
        "min_fp8_tflops_wgrad_compute_bound": min(wgrad) if wgrad else None,
        "min_fraction_of_dense_fp8_compute_bound": min(dense) if dense else None,
        "min_fraction_of_dense_fp8_blockwise_compute_bound": min(blockwise) if blockwise else None,
        "min_fraction_of_dense_fp8_blockwise_wgrad_compute_bound": min(blockwise_wgrad) if blockwise_wgrad else None,
        "geomean_speedup_vs_torch_scaled_grouped_mm": _geomean(sgmm),
        "min_speedup_vs_torch_scaled_grouped_mm": min(sgmm) if sgmm else None,
        "geomean_speedup_vs_per_expert_loop": _geomean(loop),
        "min_speedup_vs_per_expert_loop": min(loop) if loop else None,
        "geomean_time_ratio_e2e_vs_bf16": _geomean(e2e),
        "max_time_ratio_e2e_vs_bf16_compute_bound": max(e2e_cb) if e2e_cb else None,
    }


def _f(v, digits=3):
    return "" if v is None else f"{v:.{digits}f}"


def write_markdown(r, path):
    c = r["ceilings"]
    lines = [f"# FP8 grouped GEMM benchmark: {r['device']}", "",
             f"Command (each of {r['rounds']} rounds, after its own `bench/drivers/fp8-anchor.py` run): `{r['command']}`", "",
             f"Ceilings: dense FP8 {_f(c.get('fp8_tflops'), 1)} TFLOP/s ({c.get('fp8_source', '')}); "
             f"dense bf16 {_f(c.get('bf16_tflops'), 1)} TFLOP/s; HBM {c.get('hbm_TBps')} TB/s. "
             "Per entry: median over rounds of the per-round medians.", ""]
    if r.get("anchor"):
        a = r["anchor"]
        lines += [f"Anchors: torch {a.get('torch', '')} on {a.get('device', '')}; "
                  f"{a.get('timing', '')}.", ""]
        for name, what in (a.get("paths") or {}).items():
            lines.append(f"- `{name}`: {what}")
        lines.append("")
    facts = [
        ("FP8 / bf16 time, geomean (max)", f"{_f(r['geomean_time_ratio_fp8_vs_bf16'])} ({_f(r['max_time_ratio_fp8_vs_bf16'])})"),
        ("min FP8 TFLOP/s, compute-bound forward/dgrad", _f(r["min_fp8_tflops_compute_bound"], 1)),
        ("min FP8 TFLOP/s, compute-bound wgrad", _f(r["min_fp8_tflops_wgrad_compute_bound"], 1)),
        ("min fraction of the same-run dense FP8 GEMM, compute-bound forward/dgrad",
         _f(r["min_fraction_of_dense_fp8_compute_bound"])),
        ("min fraction of the same-run dense block-scaled FP8 GEMM, compute-bound forward/dgrad; wgrad",
         f"{_f(r.get('min_fraction_of_dense_fp8_blockwise_compute_bound'))}; "
         f"{_f(r.get('min_fraction_of_dense_fp8_blockwise_wgrad_compute_bound'))}"),
        ("speedup vs torch._scaled_grouped_mm (rowwise), geomean (min)",
         f"{_f(r['geomean_speedup_vs_torch_scaled_grouped_mm'])} ({_f(r['min_speedup_vs_torch_scaled_grouped_mm'])})"),
        ("speedup vs the per-expert block-scaled cuBLAS loop, geomean (min)",
         f"{_f(r['geomean_speedup_vs_per_expert_loop'])} ({_f(r['min_speedup_vs_per_expert_loop'])})"),
        ("end to end (quantization + GEMM) / bf16, geomean; max on compute-bound cases",
         f"{_f(r['geomean_time_ratio_e2e_vs_bf16'])}; {_f(r['max_time_ratio_e2e_vs_bf16_compute_bound'])}"),
    ]
    lines += ["| figure | value |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in facts] + [""]
    lines += [f"Over {r.get('geomean_over', 'fc1/fc2 x fwd/dgrad/wgrad')}. Compute-bound: "
              f"{r.get('compute_bound_cases', 'mixtral, deepseek, gpt-oss')}.", ""]
    if r.get("e2e_includes"):
        lines += [f"End to end: {r['e2e_includes']}.", ""]
    lines += ["| case | fc | GEMM | fp8 ms | TFLOP/s | bf16 ms | fp8/bf16 | vs scaled_grouped_mm | vs loop "
              "| of dense FP8 | of dense block-scaled | e2e ms | e2e/bf16 |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    quant = {}
    errors = []
    for e in r["entries"]:
        if e["gemm"].startswith("quant"):
            quant.setdefault((e["case"], e["fc"]), {})[e["gemm"]] = e["ms"]
            continue
        lines.append(f"| {e['case']} | {e['fc']} | {e['gemm']} | {e['ms']:.4f} | {e['tflops']:.1f} | "
                     f"{_f(e.get('bf16_ms'), 4)} | {_f(e.get('time_ratio_fp8_vs_bf16'))} | "
                     f"{_f(e.get('speedup_vs_torch_scaled_grouped_mm'))} | {_f(e.get('speedup_vs_per_expert_loop'))} | "
                     f"{_f(e.get('fraction_of_dense_fp8'))} | {_f(e.get('fraction_of_dense_fp8_blockwise'))} | "
                     f"{_f(e.get('e2e_ms'), 4)} | "
                     f"{_f(e.get('time_ratio_e2e_vs_bf16'))} |")
        for key, why in e.get("anchor_errors", {}).items():
            errors.append(f"- {e['case']} {e['fc']} {e['gemm']}: `{key}`: {why}")
    if quant:
        lines += ["", "Quantizers (bf16 in; FP8 rows and columns with their scales out; weights: both copies), ms:", "",
                  "| case | fc | quant_x | quant_dy | quant_w |", "|---|---|---:|---:|---:|"]
        for (case, fc), q in quant.items():
            lines.append(f"| {case} | {fc} | {_f(q.get('quant_x'), 4)} | {_f(q.get('quant_dy'), 4)} | "
                         f"{_f(q.get('quant_w'), 4)} |")
    if errors:
        lines += ["", "Anchor measurements that could not run (their ratios are left out):", ""] + errors
    open(path, "w").write("\n".join(lines) + "\n")


def pyplot():
    """matplotlib's pyplot on the file backend, or None (saying so) where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


def plotted(r):
    """The geomean's entries and their bar labels."""
    ents = [e for e in r["entries"] if e.get("in_geomean")]
    return ents, [f"{e['case'].replace('/', ' ')} {e['fc']} {e['gemm']}" for e in ents]


def write_plot(r, path):
    plt = pyplot()
    if plt is None:
        return
    ents, labels = plotted(r)

    def tflops(e, key):
        return e["flops"] / (e[key] * 1e9) if e.get(key) else 0

    series = [("moe-engine FP8", [e["tflops"] for e in ents]),
              ("moe-engine bf16", [tflops(e, "bf16_ms") for e in ents]),
              ("torch._scaled_grouped_mm (rowwise)", [tflops(e, "torch_scaled_grouped_mm_ms") for e in ents]),
              ("per-expert cuBLAS loop (1x128/128x128)", [tflops(e, "per_expert_loop_ms") for e in ents])]
    h = 0.2
    fig, ax = plt.subplots(figsize=(12, 0.4 * len(ents) + 1.5))
    for k, (name, xs) in enumerate(series):
        ax.barh([i + (k - 1.5) * h for i in range(len(ents))], xs, height=h, label=name)
    dense = [tflops(e, "dense_fp8_ms") for e in ents]
    ax.scatter(dense, range(len(ents)), marker="|", s=120, color="black", label="dense FP8 GEMM, same size", zorder=3)
    blockwise = [tflops(e, "dense_fp8_blockwise_ms") for e in ents]
    if any(blockwise):
        ax.scatter(blockwise, range(len(ents)), marker="x", s=30, color="red",
                   label="dense block-scaled FP8 GEMM, same size", zorder=3)
    if r["ceilings"].get("fp8_tflops"):
        ax.axvline(r["ceilings"]["fp8_tflops"], color="gray", linestyle="--", label="dense FP8 8192^3 (same run)")
    ax.set_yticks(list(range(len(ents))))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("TFLOP/s")
    ax.set_title(f"FP8 grouped GEMMs on {r['device']}: FP8/bf16 time {_f(r['geomean_time_ratio_fp8_vs_bf16'])} (geomean), "
                 f"vs torch._scaled_grouped_mm {_f(r['geomean_speedup_vs_torch_scaled_grouped_mm'])}")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_summary(r):
    print(f"combined over {r['rounds']} rounds: FP8/bf16 time geomean {_f(r['geomean_time_ratio_fp8_vs_bf16'])} "
          f"(max {_f(r['max_time_ratio_fp8_vs_bf16'])}); min TFLOP/s compute-bound fwd/dgrad "
          f"{_f(r['min_fp8_tflops_compute_bound'], 1)}, wgrad {_f(r['min_fp8_tflops_wgrad_compute_bound'], 1)}; "
          f"vs torch._scaled_grouped_mm {_f(r['geomean_speedup_vs_torch_scaled_grouped_mm'])} "
          f"(min {_f(r['min_speedup_vs_torch_scaled_grouped_mm'])}); vs loop "
          f"{_f(r['geomean_speedup_vs_per_expert_loop'])} (min {_f(r['min_speedup_vs_per_expert_loop'])}); "
          f"e2e/bf16 max compute-bound {_f(r['max_time_ratio_e2e_vs_bf16_compute_bound'])}")
