#!/usr/bin/env python3
"""Host time of a module training step (step-bench.py's variants), with the GPU kept busy: a long
`torch.cuda._sleep` kernel is queued first, so every launch of the timed steps returns at once and
the wall time of the loop is the host's own work (Python, autograd, the custom ops, the launches).
Where the host needs as long as the GPU for a micro-batch, the GPU idles at the points where the
host's work between two launches is longest; this says how far each variant is from that.

    python3 bench/experiments/step_host_time.py --cases small-batch/balanced --variants anchor,b
    --profile b   also prints the host step's hottest functions (cProfile, by own time)
    --ops b       also prints the host step's operators (torch.profiler, CPU, by self time)
"""
import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("step_bench", os.path.join(HERE, "..", "drivers", "step-bench.py"))
step_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_bench)


def host_time(variant, inputs, steps, micro_batches, sleep_cycles, profiler=None):
    """Seconds of host time per micro-batch over `steps` steps queued behind a sleeping GPU."""
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    for _ in range(steps):
        variant.step(inputs, micro_batches)
    if profiler:
        profiler.disable()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    if t2 - t1 < 1e-3:
        print("  warning: the GPU caught up with the host before the loop ended (sleep too short)")
    return (t1 - t0) / (steps * micro_batches)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=os.path.join(HERE, "..", "workloads.json"))
    ap.add_argument("--cases", default="small-batch/balanced")
    ap.add_argument("--variants", default="anchor,b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sleep-ms", type=float, default=300.0, help="GPU sleep queued before each timed loop")
    ap.add_argument("--profile", default="", help="variants whose host step to profile with cProfile")
    ap.add_argument("--ops", default="", help="variants whose host step's operators to list (torch.profiler)")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    with open(a.workloads) as f:
        cases = json.load(f)["cases"]
    device = torch.device("cuda")
    cycles = int(a.sleep_ms * 2e6)  # ~2 GHz: an H100 / H200 at its boost clock
    for case in cases:
        if not any(w in case["name"] for w in a.cases.split(",") if w):
            continue
        layout = step_bench.glu_layout_of(case, "")
        for v in a.variants.split(","):
            variant = (step_bench.build_anchor(case, layout, device, True) if v == "anchor"
                       else step_bench.build_ours(v, case, layout, device))
            inputs = step_bench.make_inputs(case, device)
            for _ in range(3):
                variant.step(inputs, a.micro_batches)
            times = sorted(host_time(variant, inputs, a.steps, a.micro_batches, cycles) for _ in range(a.repeats))
            print(f"== {case['name']} {v} ({variant.name}): host time per micro-batch, median of {a.repeats}: "
                  f"{times[len(times) // 2] * 1e6:.1f} us (min {times[0] * 1e6:.1f}, max {times[-1] * 1e6:.1f})")
            if v in a.profile.split(","):
                prof = cProfile.Profile()
                host_time(variant, inputs, a.steps, a.micro_batches, cycles, prof)
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
                n = a.steps * a.micro_batches
                print(f"  cProfile over {n} micro-batches (times are totals; divide by {n}):")
                print("\n".join("  " + line for line in s.getvalue().splitlines() if line.strip()))
            if v in a.ops.split(","):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    host_time(variant, inputs, a.steps, a.micro_batches, cycles)
                n = a.steps * a.micro_batches
                print(f"  operators over {n} micro-batches (totals; divide by {n}):")
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=70)
                print("\n".join("  " + line for line in table.splitlines()))
            del variant, inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
