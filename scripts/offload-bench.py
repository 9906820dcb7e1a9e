#!/usr/bin/env python3
"""Activation offload benchmark (issue 7): a stack of 8 GroupedMLP layers of a suite case
(bf16, main_grad accumulation), forward + backward per step, with offload off and on (all layers
but the last offloaded). Reports the host link (pinned copies each way, same run), peak activation
memory (peak allocated during the step above what the weights and main_grad buffers hold), step
time, and step_time_ratio = step time with offload / max(step time without, offloaded bytes /
host-link bandwidth), the link being the slower direction.

Usage: offload-bench.py [--cases qwen3-30b-a3b/balanced,mixtral-8x7b/balanced] [--layers 8]
                        [--steps 5] [--out results.json]   (also writes results.md)
"""
import argparse
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


def build(case, layers):
    torch.manual_seed(0)
    stack = [me.GroupedMLP(case["experts"], case["hidden"], case["ffn"], bias=case["bias"],
                           activation=case["activation"], glu_layout="blocks:32", accumulate_into_main_grad=True,
                           device="cuda") for _ in range(layers)]
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
    T, H = case["tokens"], case["hidden"]
    splits = torch.tensor(case["tokens_per_expert"], dtype=torch.int64, device="cuda")
    x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    probs = torch.rand(T, device="cuda")
    dy = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    run_step(stack, x, splits, probs, dy, offload)  # warm-up (pinned buffers on the first offload step)
    torch.cuda.synchronize()
    times, peaks = [], []
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
    return statistics.median(times), max(peaks), held[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=os.path.join(HERE, "..", "bench", "workloads.json"))
    ap.add_argument("--cases", default="qwen3-30b-a3b/balanced,mixtral-8x7b/balanced")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    link = host_link()
    link_GBps = min(link["d2h"], link["h2d"])
    print(f"host link: D2H {link['d2h']:.1f} GB/s, H2D {link['h2d']:.1f} GB/s (pinned, 1 GiB)")
    all_cases = {c["name"]: c for c in json.load(open(a.workloads))["cases"]}
    rows = []
    for name in a.cases.split(","):
        case = all_cases[name]
        stack = build(case, a.layers)
        t_off, peak_off, held_off = measure(stack, case, None, a.steps)
        offload = me.ActivationOffload(a.layers)
        t_on, peak_on, held_on = measure(stack, case, offload, a.steps)
        moved = offload.offloaded_bytes
        link_ms = moved / (link_GBps * 1e9) * 1e3
        two_way_ms = (moved / (link["d2h"] * 1e9) + moved / (link["h2d"] * 1e9)) * 1e3
        row = {"case": name, "layers": a.layers, "offloaded_layers": offload.offload_layers,
               "step_ms_offload_off": t_off, "step_ms_offload_on": t_on,
               "peak_activation_bytes_off": peak_off, "peak_activation_bytes_on": peak_on,
               "peak_memory_ratio": peak_on / peak_off, "activation_bytes_after_forward_off": held_off,
               "activation_bytes_after_forward_on": held_on, "after_forward_memory_ratio": held_on / held_off,
               "offloaded_bytes": moved,
               "link_time_ms": link_ms, "two_way_link_time_ms": two_way_ms,
               "step_time_ratio": t_on / max(t_off, link_ms),
               "copy_time_hidden_fraction": max(0.0, min(1.0, 1 - (t_on - t_off) / two_way_ms)) if moved else None,
               "pinned_bytes": offload.pinned_bytes()}
        rows.append(row)
        print(f"{name}: step {t_off:.1f} -> {t_on:.1f} ms, peak activations {peak_off / 2**30:.2f} -> "
              f"{peak_on / 2**30:.2f} GiB ({row['peak_memory_ratio']:.3f}), after forward {held_off / 2**30:.2f} -> "
              f"{held_on / 2**30:.2f} GiB ({row['after_forward_memory_ratio']:.3f}), offloaded {moved / 2**30:.2f} GiB "
              f"(link {link_ms:.1f} ms one way, {two_way_ms:.1f} ms both), step_time_ratio {row['step_time_ratio']:.3f}",
              flush=True)
        del stack, offload
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
             "", "Peak: the step's peak allocation above the weights and main_grad buffers (saved activations "
             "plus each layer's transient buffers). After forward: what the forward leaves on the device for "
             "backward, once its copies have settled.", "",
             "| case | layers (offloaded) | step ms off | step ms on | peak GiB off | on | peak_memory_ratio | "
             "after fwd GiB off | on | ratio | offloaded GiB | link ms (one way / both) | step_time_ratio | "
             "copy time hidden |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        hidden = f"{c['copy_time_hidden_fraction']:.2f}" if c["copy_time_hidden_fraction"] is not None else "-"
        lines.append(f"| {c['case']} | {c['layers']} ({c['offloaded_layers']}) | {c['step_ms_offload_off']:.1f} | "
                     f"{c['step_ms_offload_on']:.1f} | {c['peak_activation_bytes_off'] / 2**30:.2f} | "
                     f"{c['peak_activation_bytes_on'] / 2**30:.2f} | {c['peak_memory_ratio']:.3f} | "
                     f"{c['activation_bytes_after_forward_off'] / 2**30:.2f} | "
                     f"{c['activation_bytes_after_forward_on'] / 2**30:.2f} | {c['after_forward_memory_ratio']:.3f} | "
                     f"{c['offloaded_bytes'] / 2**30:.2f} | {c['link_time_ms']:.1f} / {c['two_way_link_time_ms']:.1f} | "
                     f"{c['step_time_ratio']:.3f} | {hidden} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
