#!/usr/bin/env python3
"""Activation offload benchmark: a stack of 8 GroupedMLP layers of a suite case
(bf16, main_grad accumulation), forward + backward per step, with offload off and on (all layers
but the last offloaded). Reports, in the same run:
- the host link: pinned copies each way;
- peak activation memory: the high-water mark of the device memory held by the step's saved
  activations (ActivationOffload's accounting; without offload, an ActivationOffload with
  offload_layers=0 counts the same tensors and moves nothing) -> peak_memory_ratio;
- peak allocated memory: the step's allocator peak above what the weights and main_grad buffers
  hold, so also each layer's transient buffers (dy, dx, the backward's scratch) and the stack's
  output -> peak_allocated_ratio;
- step time and step_time_ratio = step time with offload / max(step time without, offloaded bytes /
  host-link bandwidth), the link being the slower direction; and the same against the copies this
  schedule makes at the link's speed, both directions (offloaded bytes out + reloaded bytes back).

Usage: offload-bench.py [--cases qwen3-30b-a3b/balanced,mixtral-8x7b/balanced] [--layers 8]
                        [--steps 5] [--out results.json]   (also writes results.md)
(OFFLOAD=1 scripts/gpu python runs it.)
"""
import argparse
import gc
import json
import os
import statistics
import sys

import torch

import moe_engine
import moe_engine.torch as me

HERE = os.path.dirname(os.path.abspath(__file__))


def host_link(nbytes=1 << 30, reps=5):
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        out[name] = nbytes / (statistics.median(times) * 1e-3) / 1e9
    return out


def build(case, layers, recompute_fc1):
    torch.manual_seed(0)
    stack = [me.GroupedMLP(case["experts"], case["hidden"], case["ffn"], bias=case["bias"],
                           activation=case["activation"], glu_layout="blocks:32", accumulate_into_main_grad=True,
                           recompute_fc1=recompute_fc1, device="cuda") for _ in range(layers)]
    for m in stack:
        for p in m.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
    return stack


def run_step(stack, x, splits, probs, dy, offload, after_forward=None):
    h = x
    for i, m in enumerate(stack):
        if offload is None:
            h = m(h, splits, probs)
        else:
            with offload.layer(i) as scope:
                h = scope.output(m(h, splits, probs))
    if after_forward:
        after_forward()
    h.backward(dy)


def measure(stack, case, offload, steps):
    """Median step time, allocator peak above the start of the step, what the forward leaves
    allocated for backward (after its copies settle), and the offload's saved-activation peak."""
    T, H = case["tokens"], case["hidden"]
    splits = torch.tensor(case["tokens_per_expert"], dtype=torch.int64, device="cuda")
    x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    probs = torch.rand(T, device="cuda")
    dy = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    run_step(stack, x, splits, probs, dy, offload)  # warm-up (pinned buffers on the first offload step)
    torch.cuda.synchronize()
    times, peaks, saved_peaks = [], [], []
    for _ in range(steps):
        x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run_step(stack, x, splits, probs, dy, offload)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        peaks.append(torch.cuda.max_memory_allocated() - base)
        if offload is not None:
            saved_peaks.append(offload.peak_saved_bytes)
    # One more step, untimed: what the forward leaves on the device for backward (the saved
    # activations; with offload, those still in flight or not offloaded), after its copies settle.
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    held = []

    def after_forward():
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - base)

    run_step(stack, x, splits, probs, dy, offload, after_forward)
    me.check_errors()
    return statistics.median(times), max(peaks), held[0], max(saved_peaks) if saved_peaks else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=os.path.join(HERE, "..", "workloads.json"))
    ap.add_argument("--cases", default="qwen3-30b-a3b/balanced,mixtral-8x7b/balanced")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--saves", default="pre-activation,x-only",
                    help="what each layer keeps for backward: pre-activation (x and FC1's output) and/or x-only "
                         "(recompute_fc1: FC1 runs again in backward)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    link = host_link()
    link_GBps = min(link["d2h"], link["h2d"])
    print(f"host link: D2H {link['d2h']:.1f} GB/s, H2D {link['h2d']:.1f} GB/s (pinned, 1 GiB)")
    all_cases = {c["name"]: c for c in json.load(open(a.workloads))["cases"]}
    rows = []
    for name, saves in [(n, v) for n in a.cases.split(",") for v in a.saves.split(",")]:
        case = all_cases[name]
        if saves not in ("pre-activation", "x-only"):
            raise SystemExit(f"--saves: expected pre-activation or x-only, got {saves}")
        stack = build(case, a.layers, recompute_fc1=saves == "x-only")
        t_off, alloc_off, held_off, _ = measure(stack, case, None, a.steps)
        meter = me.ActivationOffload(a.layers, offload_layers=0)  # counts, moves nothing
        t_meter, alloc_meter, _, saved_off = measure(stack, case, meter, a.steps)
        offload = me.ActivationOffload(a.layers)
        t_on, alloc_on, held_on, saved_on = measure(stack, case, offload, a.steps)
        moved, back = offload.offloaded_bytes, offload.reloaded_bytes
        link_ms = moved / (link_GBps * 1e9) * 1e3
        bound_ms = (moved / (link["d2h"] * 1e9) + back / (link["h2d"] * 1e9)) * 1e3
        row = {"case": name, "saves": saves, "layers": a.layers, "offloaded_layers": offload.offload_layers,
               "step_ms_offload_off": t_off, "step_ms_offload_on": t_on, "step_ms_accounting_only": t_meter,
               "peak_saved_activation_bytes_off": saved_off, "peak_saved_activation_bytes_on": saved_on,
               "peak_memory_ratio": saved_on / saved_off,
               "peak_allocated_bytes_off": alloc_off, "peak_allocated_bytes_accounting_only": alloc_meter,
               "peak_allocated_bytes_on": alloc_on, "peak_allocated_ratio": alloc_on / alloc_off,
               "activation_bytes_after_forward_off": held_off, "activation_bytes_after_forward_on": held_on,
               "after_forward_memory_ratio": held_on / held_off,
               "offloaded_bytes": moved, "reloaded_bytes": back,
               "link_time_ms": link_ms, "copies_at_link_speed_ms": bound_ms,
               "step_time_ratio": t_on / max(t_off, link_ms),
               "step_time_vs_copies_at_link_speed": t_on / max(t_off, bound_ms),
               "copy_time_hidden_fraction": max(0.0, min(1.0, 1 - (t_on - t_off) / bound_ms)) if moved else None,
               "pinned_bytes": offload.pinned_bytes()}
        rows.append(row)
        print(f"{name} ({saves}): step {t_off:.1f} -> {t_on:.1f} ms (accounting only {t_meter:.1f}), peak saved activations "
              f"{saved_off / 2**30:.2f} -> {saved_on / 2**30:.2f} GiB ({row['peak_memory_ratio']:.3f}), peak allocated "
              f"{alloc_off / 2**30:.2f} -> {alloc_on / 2**30:.2f} GiB ({row['peak_allocated_ratio']:.3f}), offloaded "
              f"{moved / 2**30:.2f} GiB, reloaded {back / 2**30:.2f} GiB (link {link_ms:.1f} ms one way; copies at "
              f"link speed {bound_ms:.1f} ms), step_time_ratio {row['step_time_ratio']:.3f}, vs copies "
              f"{row['step_time_vs_copies_at_link_speed']:.3f}", flush=True)
        del stack, offload, meter
        gc.collect()  # modules and their autograd records can sit in reference cycles
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "moe_engine": moe_engine.__version__,
              "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), "host_link_GBps": link_GBps,
              "host_link_d2h_GBps": link["d2h"], "host_link_h2d_GBps": link["h2d"], "cases": rows}
    if a.out:
        json.dump(result, open(a.out, "w"), indent=2)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(markdown(result))


def markdown(r):
    lines = [f"# Activation offload, {r['device']}", "", f"`{r['command']}` (torch {r['torch']})", "",
             f"Host link (pinned, 1 GiB): D2H {r['host_link_d2h_GBps']:.1f} GB/s, H2D {r['host_link_h2d_GBps']:.1f} GB/s.",
             "",
             "- Peak saved: the high-water mark of the device memory held by the step's saved activations "
             "(`ActivationOffload.peak_saved_bytes`; without offload, counted by one with `offload_layers=0`, "
             "which moves nothing). Its ratio is `peak_memory_ratio`.",
             "- Peak allocated: the step's allocator peak above the weights and main_grad buffers, so also the "
             "backward's transient buffers (dy, dx, the MLP backward's scratch) and the stack's output.",
             "- Layer keeps: `pre-activation` = x and FC1's output [T, 2F] (the default); `x-only` = "
             "`recompute_fc1=True` (FC1 runs again in backward; 2H + 4 instead of 2(H + 2F) + 4 bytes per row).",
             "- Link ms: offloaded bytes / the slower direction (step_time_ratio's denominator); copies ms: what this "
             "schedule moves at the link's speed, out and back (offloaded + reloaded bytes).", "",
             "| case | layer keeps | layers (offloaded) | step ms off | on | peak saved GiB off | on | **peak_memory_ratio** | "
             "peak allocated GiB off | on | ratio | offloaded / reloaded GiB | link ms | copies ms | "
             "**step_time_ratio** | step / max(off, copies) | copy time hidden |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        hidden = f"{c['copy_time_hidden_fraction']:.2f}" if c["copy_time_hidden_fraction"] is not None else "-"
        g = 2**30
        lines.append(f"| {c['case']} | {c['saves']} | {c['layers']} ({c['offloaded_layers']}) | {c['step_ms_offload_off']:.1f} | "
                     f"{c['step_ms_offload_on']:.1f} | {c['peak_saved_activation_bytes_off'] / g:.2f} | "
                     f"{c['peak_saved_activation_bytes_on'] / g:.2f} | {c['peak_memory_ratio']:.3f} | "
                     f"{c['peak_allocated_bytes_off'] / g:.2f} | {c['peak_allocated_bytes_on'] / g:.2f} | "
                     f"{c['peak_allocated_ratio']:.3f} | {c['offloaded_bytes'] / g:.2f} / {c['reloaded_bytes'] / g:.2f} | "
                     f"{c['link_time_ms']:.1f} | {c['copies_at_link_speed_ms']:.1f} | {c['step_time_ratio']:.3f} | "
                     f"{c['step_time_vs_copies_at_link_speed']:.3f} | {hidden} |")
    lines += ["", "Accounting only (an ActivationOffload with offload_layers=0) vs plain: step "
              + ", ".join(f"{c['step_ms_accounting_only']:.1f} vs {c['step_ms_offload_off']:.1f} ms" for c in r["cases"])
              + "; peak allocated "
              + ", ".join(f"{c['peak_allocated_bytes_accounting_only'] / 2**30:.2f} vs "
                          f"{c['peak_allocated_bytes_off'] / 2**30:.2f} GiB" for c in r["cases"]) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
