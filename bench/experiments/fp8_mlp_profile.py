"""Where the FP8 expert MLP's step goes (issue 23): the GPU kernels of a few profiled steps of
moe_engine.torch.GroupedMLP (torch.profiler), per kernel, beside the same module in bf16, in
Megatron's main_grad mode (float32 main_grad accumulated by the module). Cases of
bench/workloads.json whose names contain one of the given substrings.

    python bench/experiments/fp8_mlp_profile.py [CASES] [STEPS]
    e.g. python bench/experiments/fp8_mlp_profile.py mixtral-8x7b/balanced,deepseek-v3-ep8/balanced 3
"""
import collections
import importlib.util
import json
import os
import re
import sys
import time

import torch

import moe_engine.torch as me

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("step_bench", os.path.join(HERE, "..", "drivers", "step-bench.py"))
step_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_bench)  # the step benchmark's inputs, layouts and Megatron DDP hooks


def short_name(name):
    """The kernel's identifier with its first template arguments (enough to tell the instances apart)."""
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    name = re.sub(r"^void ", "", name)
    head = name.split("(")[0]
    return head[:140]


def build(case, device, fp8):
    """step-bench's mode (b): main_grad accumulated by the module under Megatron's DDP hooks."""
    torch.manual_seed(0)
    m = me.GroupedMLP(case["experts"], case["hidden"], case["ffn"], bias=case["bias"], activation=case["activation"],
                      glu_layout=step_bench.glu_layout_of(case, None), accumulate_into_main_grad=True, device=device,
                      dtype=torch.bfloat16, fp8_recipe=me.Fp8Recipe() if fp8 else None)
    step_bench.attach_megatron_ddp(m)
    return m


def step(m, x, splits, probs, dy):
    x.grad = probs.grad = None
    m(x, splits, probs).backward(dy)


def profile(case, fp8, steps, device):
    m = build(case, device, fp8)
    args = step_bench.make_inputs(case, device)
    for _ in range(3):
        step(m, *args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(m, *args)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(m, *args)
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = per[short_name(e.name)]
            k[0] += 1
            k[1] += e.device_time_total / 1e3  # ms
    del m
    torch.cuda.empty_cache()
    return wall, {k: (c / steps, ms / steps) for k, (c, ms) in per.items()}


def main():
    cases_arg = sys.argv[1] if len(sys.argv) > 1 else "mixtral-8x7b/balanced,deepseek-v3-ep8/balanced,qwen3-30b-a3b/balanced"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    device = torch.device("cuda")
    workloads = json.load(open(os.path.join(HERE, "..", "workloads.json")))["cases"]
    wanted = cases_arg.split(",")
    report = {}
    for case in workloads:
        if not any(w in case["name"] for w in wanted):
            continue
        report[case["name"]] = {}
        for fp8 in (False, True):
            wall, kernels = profile(case, fp8, steps, device)
            total = sum(ms for _, ms in kernels.values())
            tag = "fp8" if fp8 else "bf16"
            report[case["name"]][tag] = {"wall_ms": wall, "kernel_ms": total, "kernels": kernels}
            print(f"\n== {case['name']} {tag}: wall {wall:.3f} ms/step, kernels {total:.3f} ms/step")
            for name, (calls, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
                print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{calls:g}  {name}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fp8_mlp_profile.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
