"""The report of bench/drivers/layer-bench.py: per-shape ratios, the summary keys, Markdown and the PNG.
Imported by the driver (which also rewrites the Markdown of a result: layer-bench.py --md RESULTS.json)."""
import math
import os

import plots

STAGES = ("router", "permute", "experts", "unpermute")
STAGE_WHAT = {"router": "route: logits, softmax, top-k, counts", "permute": "dispatch: rows sorted by expert",
              "experts": "the expert MLP (FC1, SwiGLU x prob, FC2)", "unpermute": "combine: the k rows of each token summed"}


def _ratio(num, den):
    return num / den if num is not None and den else None


def _geomean(values):
    values = [v for v in values if v is not None]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _min(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def add_ratios(e):
    """Speedups (their ms / ours) and peak-memory ratios (ours / theirs) of one entry; megatron_core is the
    faster of the Megatron variants that ran on this shape."""
    layers = e["layers"]
    ours, tt = layers.get("ours"), layers.get("torchtitan_style")
    megs = [n for n in layers if n.startswith("megatron_core_")]
    best = min(megs, key=lambda n: layers[n]["ms"]) if megs else None
    meg = layers[best] if best else None
    e["megatron_core_best"] = best
    e["speedup_vs_torchtitan_style"] = _ratio(tt and tt["ms"], ours and ours["ms"])
    e["speedup_vs_megatron_core"] = _ratio(meg and meg["ms"], ours and ours["ms"])
    e["torchtitan_style_speedup_vs_megatron_core"] = _ratio(meg and meg["ms"], tt and tt["ms"])
    e["peak_memory_ratio_vs_torchtitan_style"] = _ratio(ours and ours["peak_bytes"], tt and tt["peak_bytes"])
    e["peak_memory_ratio_vs_megatron_core"] = _ratio(ours and ours["peak_bytes"], meg and meg["peak_bytes"])
    return e


def summarize(entries):
    """The top-level keys over all shapes (None where a layer did not run)."""
    tt = [e["speedup_vs_torchtitan_style"] for e in entries]
    meg = [e["speedup_vs_megatron_core"] for e in entries]
    return {
        "geomean_speedup_vs_torchtitan_style": _geomean(tt),
        "min_speedup_vs_torchtitan_style": _min(tt),
        "geomean_speedup_vs_megatron_core": _geomean(meg),
        "min_speedup_vs_megatron_core": _min(meg),
        "geomean_torchtitan_style_speedup_vs_megatron_core":
            _geomean([e["torchtitan_style_speedup_vs_megatron_core"] for e in entries]),
        "max_peak_memory_ratio_vs_torchtitan_style": _max([e["peak_memory_ratio_vs_torchtitan_style"] for e in entries]),
        "max_peak_memory_ratio_vs_megatron_core": _max([e["peak_memory_ratio_vs_megatron_core"] for e in entries]),
    }


def _f(v, spec, scale=1):
    return "-" if v is None else format(v / scale, spec)


def _x(v):
    return "-" if v is None else f"{v:.3f}x"


def progress_line(e):
    times = ", ".join(f"{n} {v['ms']:.3f} ms" for n, v in e["layers"].items())
    return (f"{e['case']:36s} {times}; vs torchtitan-style {_x(e['speedup_vs_torchtitan_style'])}, "
            f"vs megatron-core {_x(e['speedup_vs_megatron_core'])}")


def summary_line(s):
    return (f"speedup vs torchtitan-style: geomean {_x(s['geomean_speedup_vs_torchtitan_style'])}, min "
            f"{_x(s['min_speedup_vs_torchtitan_style'])}; vs megatron-core: geomean "
            f"{_x(s['geomean_speedup_vs_megatron_core'])}, min {_x(s['min_speedup_vs_megatron_core'])}")


def layer_names(s):
    """The layers in the result, in the driver's order (those that ran somewhere)."""
    return [n for n in s["layers"] if any(n in e["layers"] for e in s["entries"])]


def markdown(s):
    """The results as Markdown."""
    gib = 2**30
    names = layer_names(s)
    lines = [f"# The MoE layer, forward + backward: MoELayer vs torchtitan-style and Megatron-core, {s['device']}", "",
             f"`{s['command']}` (torch {s['torch_version']}, moe_engine {s['moe_engine_version']}"
             + (f", megatron-core {s['megatron_core']['version']}" if s.get("megatron_core") else "") + "). "
             f"{s['timing']}.", "",
             f"Speedup (their ms / ours) vs the torchtitan-style layer: geomean "
             f"**{_x(s['geomean_speedup_vs_torchtitan_style'])}**, min {_x(s['min_speedup_vs_torchtitan_style'])}; "
             f"vs Megatron-core (its faster dispatcher per shape): geomean "
             f"**{_x(s['geomean_speedup_vs_megatron_core'])}**, min {_x(s['min_speedup_vs_megatron_core'])}. "
             f"Torchtitan-style vs Megatron-core: geomean {_x(s['geomean_torchtitan_style_speedup_vs_megatron_core'])}.",
             ""]
    if s.get("max_peak_memory_ratio_vs_torchtitan_style") is not None:
        lines += [f"Peak memory / theirs (`peak_bytes`), max over shapes: "
                  f"{_f(s['max_peak_memory_ratio_vs_torchtitan_style'], '.3f')} (torchtitan-style), "
                  f"{_f(s['max_peak_memory_ratio_vs_megatron_core'], '.3f')} (Megatron-core).", ""]
    lines += ["Layers:", ""]
    lines += [f"- `{n}`: {v['what']}; {v['status']}" for n, v in s["layers"].items()]
    if s.get("megatron_core"):
        m = s["megatron_core"]
        lines += ["", f"Megatron-core {m['version']}: experts {', '.join(m['experts_class'])} (grouped_gemm "
                      f"{'imports' if m['grouped_gemm_importable'] else 'does not import'}); dispatchers "
                      + ", ".join(f"`{k}` ({v})" for k, v in m["dispatchers"].items()) + ".", "",
                  "```", m["setup"], "```"]
    failed = [f"{e['case']}: `{n}` {why}" for e in s["entries"] for n, why in e.get("failed", {}).items()]
    if failed:
        lines += ["", "Failed (not timed there): " + "; ".join(failed) + "."]
    lines += ["", f"Routing: {s['routing']}.", "", f"Our FC1 layout: {s['glu_layout']}.", ""]
    if isinstance(s["memory"], dict):
        lines += ["Memory (each layer alone):", ""] + [f"- `{k}`: {v}" for k, v in s["memory"].items()] + [""]
    else:
        lines += [f"Memory: {s['memory']}.", ""]
    chk = s.get("correctness_check")
    if chk:
        worst = {n: max(errs.values()) for n, errs in chk["relative_errors"].items()}
        lines += [f"Correctness on {chk['case']} against the torchtitan-style layer (same weights and inputs; y, dx and "
                  f"the weight gradients after one step; relative Frobenius error, limit {chk['tolerance']}): "
                  + (", ".join(f"{n} {e:.2g}" for n, e in worst.items()) or "nothing to compare") + ".", ""]
    else:
        lines += ["No correctness check in this run.", ""]
    lines.append(f"Plot: `{s['plot']}`." if s["plot"] else "No plot (matplotlib was not importable).")
    lines += ["", "ms: one forward + backward of the layer. Speedups: their ms / ours; megatron-core: the faster "
                  "of its dispatchers on that shape. peak: `peak_bytes` (GiB).", ""]
    head = "| shape | tokens | E | H | F | k | " + " | ".join(f"{n} ms" for n in names) + \
           " | **vs torchtitan-style** | **vs megatron-core** | " + " | ".join(f"{n} peak" for n in names) + \
           " | peak / torchtitan-style | peak / megatron-core | max/mean count |"
    lines += [head, "|" + "---|" * 6 + "---:|" * (2 * len(names) + 5)]
    for e in s["entries"]:
        L = e["layers"]
        imbalance = max(r["max_over_mean_count"] for r in e["routing_check"].values())
        lines.append(f"| {e['case']} | {e['tokens']} | {e['experts']} | {e['hidden']} | {e['ffn']} | {e['topk']} | "
                     + " | ".join(_f(L[n]["ms"], ".3f") if n in L else "-" for n in names)
                     + f" | {_x(e['speedup_vs_torchtitan_style'])} | {_x(e['speedup_vs_megatron_core'])} | "
                     + " | ".join(_f(L[n]["peak_bytes"], ".2f", gib) if n in L else "-" for n in names)
                     + f" | {_f(e['peak_memory_ratio_vs_torchtitan_style'], '.3f')} | "
                     f"{_f(e['peak_memory_ratio_vs_megatron_core'], '.3f')} | {imbalance:.3f} |")
    lines += ["", "Routing as each layer's own router chose it: the fraction of tokens routed to the intended k "
                  "experts (1: every layer saw the same routing) and max / mean tokens per expert.", "",
              "| shape | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for e in s["entries"]:
        rc = e["routing_check"]
        lines.append(f"| {e['case']} | " + " | ".join(
            f"{rc[n]['tokens_routed_as_intended']:.4f}, {rc[n]['max_over_mean_count']:.3f}" if n in rc else "-"
            for n in names) + " |")
    if any(e["breakdown"] for e in s["entries"]):
        lines += ["", "Breakdown: each stage's forward + backward alone on detached inputs, ms (share of the four "
                      "stages' sum). " + "; ".join(f"{st}: {w}" for st, w in STAGE_WHAT.items()) + ".", "",
                  "| shape | layer | " + " | ".join(STAGES) + " | sum ms | layer ms |", "|---|---|" + "---:|" * 6]
        for e in s["entries"]:
            for n, b in e["breakdown"].items():
                lines.append(f"| {e['case']} | {n} | " + " | ".join(
                    f"{b[st]['ms']:.3f} ({b[st]['fraction']:.2f})" if st in b else "-" for st in STAGES)
                    + f" | {b['sum_ms']:.3f} | {b['layer_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(s, path):
    """Speedups per shape, the breakdown of ours and the torchtitan-style layer (stage ms over the
    torchtitan-style layer's ms) and, on CUDA, the peak-memory ratios; returns the file's name or None."""
    plt = plots.pyplot()
    if plt is None:
        return None
    entries = s["entries"]
    cases = [e["case"] for e in entries]
    has_breakdown = any(e["breakdown"] for e in entries)
    has_memory = s.get("max_peak_memory_ratio_vs_torchtitan_style") is not None
    panels = 1 + has_breakdown + has_memory
    fig, axes = plt.subplots(panels, 1, figsize=(12, 3.8 * panels + 1), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    ax = axes.pop(0)
    plots.grouped_bars(ax, cases, [("vs torchtitan-style", [e["speedup_vs_torchtitan_style"] for e in entries]),
                                   ("vs megatron-core", [e["speedup_vs_megatron_core"] for e in entries])],
                       "speedup (their ms / ours)")
    ax.set_title(f"MoE layer forward + backward, {s['device']}")
    if has_breakdown:
        ax = axes.pop(0)
        who = [n for n in ("ours", "torchtitan_style") if any(n in e["breakdown"] for e in entries)]
        width = 0.8 / len(who)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, n in enumerate(who):
            xs = [j + (i - (len(who) - 1) / 2) * width for j in range(len(entries))]
            bottom = [0.0] * len(entries)
            for c, st in enumerate(STAGES):
                hs = []
                for e in entries:
                    b, tt = e["breakdown"].get(n), e["layers"].get("torchtitan_style")
                    hs.append(b[st]["ms"] / tt["ms"] if b and st in b and tt else 0)
                ax.bar(xs, hs, width, bottom=bottom, color=colors[c % len(colors)], edgecolor="black",
                       linewidth=0.3, hatch="" if n == "ours" else "//", label=f"{n}: {st}")
                bottom = [a + h for a, h in zip(bottom, hs)]
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_ylabel("stage ms / torchtitan-style layer ms")
        ax.legend(fontsize=7, ncol=2)
    if has_memory:
        ax = axes.pop(0)
        plots.grouped_bars(ax, cases, [("ours / torchtitan-style", [e["peak_memory_ratio_vs_torchtitan_style"]
                                                                     for e in entries]),
                                       ("ours / megatron-core", [e["peak_memory_ratio_vs_megatron_core"]
                                                                 for e in entries])], "peak memory ratio")
    plots.case_ticks(fig.axes[panels - 1], cases)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return os.path.basename(path)
