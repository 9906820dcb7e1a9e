#!/usr/bin/env python3
"""GroupedMLP in a training loop against a torchtitan-style MLP (issue 24): for every case of
bench/workloads.json, the step time, TFLOP/s and peak memory of moe_engine.torch.GroupedMLP in three
training modes and of the anchor, and their ratios. scripts/gpu step-bench runs it.

The anchor (torchtitan_mlp.py beside this file): packed bf16 parameters, FC1 and FC2 through
torch._grouped_mm with device offsets, the GLU and the router probs in eager PyTorch on the module's
FC1 row layout (the same math), autograd backward, weight gradients accumulating in .grad.

The modes of GroupedMLP:
  a  grad                     plain autograd: weight gradients accumulate in .grad (bf16)
  b  main_grad                Megatron-LM's contract: accumulate_into_main_grad=True, a float32
                              main_grad and the grad_added_to_main_grad attribute on every parameter,
                              and Megatron DDP's post-accumulation hook (adds a returned .grad into
                              main_grad unless the flag says the module did, then drops .grad)
  c  main_grad_delayed_wgrad  (b) with delay_wgrad_compute=True: backward_dw() after each
                              micro-batch's backward (the hook of the delayed weights runs from it)
Every mode is compared with the same anchor step.

What is timed: a step of --micro-batches k micro-batches (default 2) back to back, each forward +
backward (+ backward_dw), on the case's inputs. Gradient buffers (.grad, main_grad) exist before
timing and are never zeroed or freed, so every micro-batch takes the accumulate path of a training
loop; x.grad and probs.grad (what would flow to the router and the layer below) are dropped before
each micro-batch. A timed sample is --block steps (default 2) of one variant back to back, as a
training loop runs them: the host enqueues ahead of the GPU (a sample that starts on an empty
queue would count the host's enqueue time of its first kernels). ms is the median over --iters
samples of the sample time / (block x k): one micro-batch; TFLOP/s counts its six GEMMs
(18 T H F). On CUDA samples are timed with CUDA events; the GPU is settled first (settle.py) and
the variants (anchor and modes) alternate sample by sample, so clock drift falls on all of them
alike.

Peak memory, on CUDA, measured for each variant alone (nothing else of this script allocated):
  peak_bytes                 the variant's whole footprint at the step's peak: parameters,
                             .grad or main_grad (and the contract's dummy gradients), inputs and the
                             step's transients. torch.cuda.max_memory_allocated() during a steady
                             step minus what was allocated before the variant was built.
  peak_bytes_above_baseline  max_memory_allocated() during the step minus memory_allocated() when
                             the step began: the step's transients alone.
peak_memory_ratio_vs_anchor compares peak_bytes like with like: (a) against the anchor, (b) and (c)
against the anchor under Megatron's DDP (float32 main_grad, the hook adding each .grad into it),
so that both sides keep the same gradient buffers; peak_above_baseline_ratio_vs_anchor compares
the transients.

Before timing, the first case of the run checks every mode against the anchor on the same weights
and inputs: the output, dx, dprobs and each parameter's accumulated gradient after one step, within
a relative Frobenius error of 2e-2 (bf16 rounding). The script exits 1 if any disagrees.

--device cpu runs the modules on the CPU backend, timed with the host clock and without memory
numbers: a smoke test of the script (tests/python/test_bench_scripts.py, with a tiny --workloads
file). Where torch._grouped_mm has no working backward on the CPU, the anchor runs FC1 and FC2 as a
per-expert loop of matmuls there (the JSON's anchor_fc says which ran); on CUDA it always uses
torch._grouped_mm.

Usage: step-bench.py [--cases SUBSTR] [--modes a,b,c] [--iters 20] [--block 2] [--micro-batches 2]
                     [--workloads PATH] [--device cuda|cpu] [--out PREFIX.json]
       step-bench.py --md RESULTS.json    (rewrites the Markdown of a result)
--out PREFIX.json also writes PREFIX.md and, where matplotlib imports, PREFIX.png.
"""
import argparse
import gc
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # settle.py and torchtitan_mlp.py
sys.path.insert(0, os.path.join(HERE, "..", "report"))  # plots.py

import plots  # noqa: E402

try:  # --md needs neither
    import torch

    import moe_engine
    import moe_engine.torch as me
    from torchtitan_mlp import TorchtitanGroupedMLP, grouped_mm_works
except ImportError:
    pass

MODES = {
    "a": ("grad", "plain autograd: weight gradients accumulate in .grad (bf16)"),
    "b": ("main_grad", "Megatron: accumulate_into_main_grad=True, float32 main_grad + grad_added_to_main_grad, "
                       "DDP's post-accumulation hook"),
    "c": ("main_grad_delayed_wgrad", "(b) + delay_wgrad_compute=True, backward_dw() after each micro-batch's backward"),
}
CHECK_TOLERANCE = 2e-2
MEMORY_DEFINITIONS = {
    "peak_bytes": "the variant's whole footprint at the step's peak (parameters, .grad or main_grad and dummy "
                  "gradients, inputs, step transients): max_memory_allocated() during a steady step minus what was "
                  "allocated before the variant was built, measured with nothing else of this script allocated",
    "peak_bytes_above_baseline": "max_memory_allocated() during the step minus memory_allocated() when it began: "
                                 "the step's transients",
    "memory_anchor": "the anchor the memory ratios use: 'anchor' (plain autograd, bf16 .grad) for (a); "
                     "'anchor_main_grad' (the same MLP under Megatron's DDP: float32 main_grad, the hook adding "
                     "each .grad into it and dropping it) for (b) and (c), so both sides keep the same gradient "
                     "buffers. Times are always against the plain anchor",
    "peak_memory_ratio_vs_anchor": "peak_bytes / the memory anchor's peak_bytes",
    "peak_above_baseline_ratio_vs_anchor": "peak_bytes_above_baseline / the anchor's",
}


class Variant:
    """One MLP under test with its training-loop conventions: `step` runs micro-batches as the loop
    would, `gradients` reads where the parameters' gradients accumulate."""

    def __init__(self, name, module, main_grad=False, delayed=False):
        self.name, self.module, self.main_grad, self.delayed = name, module, main_grad, delayed

    def micro_batch(self, inputs, keep_output=False):
        x, splits, probs, dy = inputs
        x.grad = probs.grad = None
        y = self.module(x, splits, probs)
        y.backward(dy)
        out = y.detach() if keep_output else None
        del y  # a training loop holds no layer output through backward_dw
        if self.delayed:
            self.module.backward_dw()
        return out

    def step(self, inputs, micro_batches):
        for _ in range(micro_batches):
            self.micro_batch(inputs)

    def gradients(self):
        return {name: p.main_grad if self.main_grad else p.grad for name, p in mlp_parameters(self.module).items()}


def mlp_parameters(module):
    """The parameters under the anchor's names (w1, b1, w2, b2; biases only where present)."""
    if isinstance(module, TorchtitanGroupedMLP):
        named = {"w1": module.w1, "b1": module.b1, "w2": module.w2, "b2": module.b2}
    else:
        named = {"w1": module.fc1.weight, "b1": getattr(module.fc1, "bias", None),
                 "w2": module.fc2.weight, "b2": getattr(module.fc2, "bias", None)}
    return {k: p for k, p in named.items() if p is not None}


def megatron_post_hook(p):
    """Megatron DDP's gradient hook: a returned .grad goes into main_grad unless the module says it
    accumulated there itself; .grad is dropped."""
    if p.grad is not None and not p.grad_added_to_main_grad:
        p.main_grad.add_(p.grad)
    p.grad = None


def attach_megatron_ddp(module):
    """What Megatron-LM's DDP does to every parameter (as tests/python/test_modules.py's attach_ddp):
    a float32 main_grad, grad_added_to_main_grad = False, and the backward post-hook that adds a
    returned .grad into main_grad unless the flag says the module accumulated there itself, then
    drops .grad. Weights marked skip_backward_post_hook (delayed wgrad) get the hook through
    register_wgrad_accumulation_and_reduce_hooks instead: it runs after backward_dw."""
    delayed = []
    for p in module.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False

        if getattr(p, "skip_backward_post_hook", False):
            delayed.append(lambda p=p: megatron_post_hook(p))
        else:
            # The parameter comes as the argument: a closure over it would make a cycle through
            # the tensor's C++ hook list, which the garbage collector cannot see (the module and
            # its buffers would never be freed).
            p.register_post_accumulate_grad_hook(megatron_post_hook)
    if delayed:
        module.register_wgrad_accumulation_and_reduce_hooks(lambda: [h() for h in delayed])


def glu_layout_of(case, requested):
    """As scripts/gpu mlp-bench and torch-module-bench.py: pairs for GPT-OSS (its checkpoints'
    layout), blocks:32 otherwise (Megatron's moe_mlp_glu_interleave_size)."""
    return requested or ("pairs" if case["name"].startswith("gpt-oss") else "blocks:32")


def build_anchor(case, layout, device, use_grouped_mm, main_grad=False):
    """The torchtitan-style MLP; with main_grad, under Megatron's DDP as (b) is (float32 main_grad,
    the post-accumulation hook adding each .grad into it): the like-for-like memory partner of (b)
    and (c)."""
    torch.manual_seed(0)
    m = TorchtitanGroupedMLP(case["experts"], case["hidden"], case["ffn"], bias=case["bias"],
                             activation=case["activation"], glu_layout=layout, use_grouped_mm=use_grouped_mm,
                             device=device)
    if main_grad:
        attach_megatron_ddp(m)
    return Variant("anchor_main_grad" if main_grad else "anchor", m, main_grad=main_grad)


def build_ours(mode, case, layout, device, weights=None):
    """GroupedMLP in `mode`; with `weights` (name -> tensor, the anchor's) their values copied in."""
    torch.manual_seed(0)
    m = me.GroupedMLP(case["experts"], case["hidden"], case["ffn"], bias=case["bias"], activation=case["activation"],
                      glu_layout=layout, accumulate_into_main_grad=mode in "bc", delay_wgrad_compute=mode == "c",
                      device=device, dtype=torch.bfloat16)
    if weights is not None:
        with torch.no_grad():
            for name, p in mlp_parameters(m).items():
                p.copy_(weights[name])
    if mode in "bc":
        attach_megatron_ddp(m)
    return Variant(MODES[mode][0], m, main_grad=mode in "bc", delayed=mode == "c")


def make_inputs(case, device):
    """x [T, H] bf16 sorted by expert, splits [G] int64 on the device, probs [T] float32, dy [T, H];
    T = sum(tokens_per_expert): the anchor's grouped GEMMs cover exactly the routed rows."""
    T, H = sum(case["tokens_per_expert"]), case["hidden"]
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(T, H, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()
    probs = torch.rand(T, generator=gen, device=device).requires_grad_()
    dy = torch.randn(T, H, generator=gen, device=device, dtype=torch.bfloat16)
    splits = torch.tensor(case["tokens_per_expert"], dtype=torch.int64, device=device)
    return x, splits, probs, dy


def rel_err(out, ref):
    """||out - ref|| / ||ref|| (Frobenius), summed in float64 over row blocks: weight gradients may
    be GBs."""
    rows = max(1, (1 << 26) // max(1, ref[0].numel()))
    num = den = 0.0
    for o, r in zip(out.detach().split(rows), ref.detach().split(rows)):
        r = r.float()
        num += (o.float() - r).square().sum(dtype=torch.float64).item()
        den += r.square().sum(dtype=torch.float64).item()
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def check_against_anchor(case, layout, modes, micro_batches, device, use_grouped_mm):
    """Each mode against the anchor on the anchor's weights and the same inputs, after one step:
    the last micro-batch's output, dx and dprobs, and every accumulated parameter gradient.
    Returns {mode name: {what: relative error}}; exits 1 if one is above CHECK_TOLERANCE."""
    inputs = make_inputs(case, device)
    x, _, probs, _ = inputs
    anchor = build_anchor(case, layout, device, use_grouped_mm)
    for _ in range(micro_batches - 1):
        anchor.micro_batch(inputs)
    want = {"y": anchor.micro_batch(inputs, keep_output=True), "dx": x.grad, "dprobs": probs.grad,
            **anchor.gradients()}
    weights = {k: p.detach() for k, p in mlp_parameters(anchor.module).items()}
    errors, failed = {}, []
    for mode in modes:
        ours = build_ours(mode, case, layout, device, weights)
        for _ in range(micro_batches - 1):
            ours.micro_batch(inputs)
        got = {"y": ours.micro_batch(inputs, keep_output=True), "dx": x.grad, "dprobs": probs.grad, **ours.gradients()}
        errors[ours.name] = {k: rel_err(got[k], want[k]) for k in want}
        failed += [f"({mode}) {ours.name} {k}: {e:.3g}" for k, e in errors[ours.name].items()
                   if not e <= CHECK_TOLERANCE]
        del ours, got
        gc.collect()
    if failed:
        sys.exit(f"step-bench.py: GroupedMLP disagrees with the anchor on {case['name']} (relative error above "
                 f"{CHECK_TOLERANCE}): " + "; ".join(failed))
    return errors


def measure_memory(build, case, device, micro_batches):
    """One variant alone: a warm-up step (it allocates .grad and the contract's dummies), then a
    steady step between reset_peak_memory_stats() and max_memory_allocated()."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before_variant = torch.cuda.memory_allocated()
    variant = build()
    inputs = make_inputs(case, device)
    variant.step(inputs, micro_batches)
    inputs[0].grad = inputs[2].grad = None
    torch.cuda.synchronize()
    step_start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    variant.step(inputs, micro_batches)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del variant, inputs
    gc.collect()
    return {"peak_bytes": peak - before_variant, "peak_bytes_above_baseline": peak - step_start}


def time_steps(variants, inputs, iters, warmup, micro_batches, device, block=1):
    """Median step time (ms) per variant, the variants alternating sample by sample; a sample is
    `block` back-to-back steps of one variant (a training loop's consecutive steps: the host
    enqueues ahead of the GPU, as it cannot when each sample starts on an empty queue)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        for v in variants:
            v.step(inputs, micro_batches)
    times = {v.name: [] for v in variants}
    for _ in range(iters):
        for v in variants:
            if cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(block):
                    v.step(inputs, micro_batches)
                stop.record()
                times[v.name].append((start, stop))
            else:
                t0 = time.perf_counter()
                for _ in range(block):
                    v.step(inputs, micro_batches)
                times[v.name].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    me.check_errors()
    out = {}
    for name, ts in times.items():
        ms = sorted(a.elapsed_time(b) / block for a, b in ts) if cuda else sorted(t / block for t in ts)
        out[name] = ms[len(ms) // 2]
    return out


def step_flops(case):
    """One micro-batch's six GEMMs: FC1 (2F x H) and FC2 (H x F), forward, dgrad and wgrad."""
    T, H, F = sum(case["tokens_per_expert"]), case["hidden"], case["ffn"]
    return 3 * (2.0 * T * (2 * F) * H + 2.0 * T * H * F)


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def ratio(num, den):
    return num / den if num is not None and den else None


def run_case(case, layout, modes, a, device, use_grouped_mm):
    """The entries of one case: memory (each variant alone, CUDA), then the timed steps."""
    cuda = device.type == "cuda"
    builders = {"anchor": lambda: build_anchor(case, layout, device, use_grouped_mm)}
    if any(mode in "bc" for mode in modes):
        builders["anchor_main_grad"] = lambda: build_anchor(case, layout, device, use_grouped_mm, main_grad=True)
    for mode in modes:
        builders[mode] = lambda mode=mode: build_ours(mode, case, layout, device)
    memory = {k: {"peak_bytes": None, "peak_bytes_above_baseline": None} for k in builders}
    if cuda:
        for k, build in builders.items():
            memory[k] = measure_memory(build, case, device, a.micro_batches)
        settle_gpu(a.settle_s, device)
    anchor = builders["anchor"]()
    weights = {k: p.detach() for k, p in mlp_parameters(anchor.module).items()}
    variants = [anchor] + [build_ours(mode, case, layout, device, weights) for mode in modes]
    step_ms = time_steps(variants, make_inputs(case, device), a.iters, a.warmup, a.micro_batches, device, a.block)
    del anchor, weights, variants
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    flops = step_flops(case)
    anchor_ms = step_ms["anchor"] / a.micro_batches
    entries = []
    for mode in modes:
        name = MODES[mode][0]
        ms = step_ms[name] / a.micro_batches
        memory_anchor = "anchor_main_grad" if mode in "bc" else "anchor"
        mem, amem = memory[mode], memory[memory_anchor]
        entries.append({
            "case": case["name"], "mode": mode, "mode_name": name, "glu_layout": layout,
            "activation": case["activation"], "bias": case["bias"], "experts": case["experts"],
            "hidden": case["hidden"], "ffn": case["ffn"], "tokens": sum(case["tokens_per_expert"]), "flops": flops,
            "ms": ms, "step_ms": step_ms[name], "tflops": flops / ms / 1e9,
            "peak_bytes": mem["peak_bytes"], "peak_bytes_above_baseline": mem["peak_bytes_above_baseline"],
            "anchor_ms": anchor_ms, "anchor_step_ms": step_ms["anchor"], "anchor_tflops": flops / anchor_ms / 1e9,
            "memory_anchor": memory_anchor,
            "anchor_peak_bytes": amem["peak_bytes"], "anchor_peak_bytes_above_baseline": amem["peak_bytes_above_baseline"],
            "speedup_vs_anchor": anchor_ms / ms,
            "peak_memory_ratio_vs_anchor": ratio(mem["peak_bytes"], amem["peak_bytes"]),
            "peak_above_baseline_ratio_vs_anchor": ratio(mem["peak_bytes_above_baseline"],
                                                         amem["peak_bytes_above_baseline"]),
        })
    return entries


def settle_gpu(seconds, device):
    from settle import settle  # imports torch: not needed by --md

    settle(seconds, device)


def parse_modes(text):
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are a comma-separated subset of a,b,c; got '{text}'")
    return [m for m in MODES if m in modes]


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--md":
        sys.stdout.write(markdown(json.load(open(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description="GroupedMLP training steps (three modes) vs a torchtitan-style MLP; "
                                             "see the header of this file for what is measured.")
    ap.add_argument("--workloads", default=os.path.join(HERE, "..", "workloads.json"))
    ap.add_argument("--cases", default="", help="only the cases whose name contains SUBSTR")
    ap.add_argument("--modes", type=parse_modes, default="a,b,c",
                    help="a: .grad, b: Megatron main_grad, c: b + delayed wgrad (default a,b,c)")
    ap.add_argument("--iters", type=int, default=20, help="timed steps per variant (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    ap.add_argument("--block", type=int, default=2, help="back-to-back steps per timed sample (step ms = its time / block)")
    ap.add_argument("--micro-batches", type=int, default=2,
                    help="micro-batches per timed step, gradients accumulating (ms is per micro-batch)")
    ap.add_argument("--glu-layout", default="", help="default: pairs for gpt-oss, else blocks:32")
    ap.add_argument("--settle-s", type=float, default=1.0, help="dense GEMMs this long before each case's timing (CUDA)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the CPU backend, host clock, no memory numbers (a smoke test)")
    ap.add_argument("--out", default="", help="PREFIX.json: also PREFIX.md and PREFIX.png")
    a = ap.parse_args()
    if a.iters < 1 or a.micro_batches < 1 or a.block < 1 or a.warmup < 0:
        ap.error("--iters, --block and --micro-batches must be at least 1, --warmup at least 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("step-bench.py: no CUDA device here (--device cpu runs the smoke test)")
    device = torch.device(a.device)
    cases = [c for c in json.load(open(a.workloads))["cases"] if a.cases in c["name"]]
    if not cases:
        raise SystemExit(f"step-bench.py: no case of {a.workloads} matches '{a.cases}'")
    use_grouped_mm = grouped_mm_works(device)
    anchor_fc = "torch._grouped_mm" if use_grouped_mm else \
        f"per-expert matmul loop (torch._grouped_mm has no working backward on {a.device} in torch {torch.__version__})"

    first = cases[0]
    check = check_against_anchor(first, glu_layout_of(first, a.glu_layout), a.modes, a.micro_batches, device,
                                 use_grouped_mm)
    worst = max(e for errs in check.values() for e in errs.values())
    print(f"correctness on {first['name']}: every mode within {worst:.2g} of the anchor (limit {CHECK_TOLERANCE})")
    gc.collect()

    entries = []
    print(f"{'case':36s} {'mode':28s} {'ms':>9s} {'TFLOP/s':>8s} {'anchor ms':>9s} {'speedup':>8s} {'peak GiB':>9s} "
          f"{'mem ratio':>9s}")
    for c in cases:
        for e in run_case(c, glu_layout_of(c, a.glu_layout), a.modes, a, device, use_grouped_mm):
            entries.append(e)
            peak = "-" if e["peak_bytes"] is None else f"{e['peak_bytes'] / 2**30:.2f}"
            mem = "-" if e["peak_memory_ratio_vs_anchor"] is None else f"{e['peak_memory_ratio_vs_anchor']:.3f}"
            print(f"{e['case']:36s} ({e['mode']}) {e['mode_name']:24s} {e['ms']:9.3f} {e['tflops']:8.1f} "
                  f"{e['anchor_ms']:9.3f} {e['speedup_vs_anchor']:7.3f}x {peak:>9s} {mem:>9s}", flush=True)

    main_grad = [e["speedup_vs_anchor"] for e in entries if e["mode"] == "b"]
    mem_ratios = [e["peak_memory_ratio_vs_anchor"] for e in entries if e["peak_memory_ratio_vs_anchor"] is not None]
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "torch_version": torch.__version__, "moe_engine_version": moe_engine.__version__,
        "modes": {m: {"name": MODES[m][0], "what": MODES[m][1]} for m in a.modes},
        "anchor": "torchtitan-style eager MLP (bench/drivers/torchtitan_mlp.py), .grad accumulation",
        "anchor_fc": anchor_fc,
        "iters": a.iters, "warmup": a.warmup, "micro_batches": a.micro_batches,
        "timing": f"median over {a.iters} samples of {a.block} back-to-back steps of {a.micro_batches} micro-batches "
                  "(forward + backward [+ backward_dw]), variants alternated sample by sample; ms = step time / micro-batches"
                  + ("; CUDA events, GPU settled first" if device.type == "cuda" else "; host clock"),
        "memory": MEMORY_DEFINITIONS if device.type == "cuda" else "not measured on the CPU",
        "correctness_check": {"case": first["name"], "tolerance": CHECK_TOLERANCE,
                              "relative_errors": check},
        "geomean_speedup_vs_anchor_main_grad": geomean(main_grad),
        "min_speedup_vs_anchor_main_grad": min(main_grad) if main_grad else None,
        "max_peak_memory_ratio_vs_anchor": max(mem_ratios) if mem_ratios else None,
        "geomean_speedup_vs_anchor": {MODES[m][0]: geomean([e["speedup_vs_anchor"] for e in entries if e["mode"] == m])
                                      for m in a.modes},
        "plot": None,
        "entries": entries,
    }
    if main_grad:
        print(f"speedup vs the anchor, main_grad mode: geomean {summary['geomean_speedup_vs_anchor_main_grad']:.3f}, "
              f"min {summary['min_speedup_vs_anchor_main_grad']:.3f}")
    if mem_ratios:
        print(f"peak memory / the anchor's, max over cases and modes: {summary['max_peak_memory_ratio_vs_anchor']:.3f}")
    if a.out:
        prefix = os.path.splitext(a.out)[0]
        summary["plot"] = plot(summary, prefix + ".png")
        json.dump(summary, open(a.out, "w"), indent=2)
        with open(prefix + ".md", "w") as f:
            f.write(markdown(summary))


def plot(s, path):
    """Speedup and peak-memory ratio per case and mode; returns the file's name, or why there is none."""
    plt = plots.pyplot()
    if plt is None:
        return None
    entries = s["entries"]
    cases = list(dict.fromkeys(e["case"] for e in entries))
    modes = list(s["modes"])
    has_memory = s["max_peak_memory_ratio_vs_anchor"] is not None
    fig, axes = plt.subplots(2 if has_memory else 1, 1, figsize=(12, 8 if has_memory else 4.5), sharex=True,
                             squeeze=False)
    panels = [("speedup_vs_anchor", "speedup vs anchor (anchor ms / ours)")]
    if has_memory:
        panels.append(("peak_memory_ratio_vs_anchor", "peak memory / anchor's"))
    for ax, (key, label) in zip(axes[:, 0], panels):
        series = []
        for m in modes:
            by_case = {e["case"]: e[key] for e in entries if e["mode"] == m}
            series.append((f"({m}) {s['modes'][m]['name']}", [by_case.get(c) for c in cases]))
        plots.grouped_bars(ax, cases, series, label)
    plots.case_ticks(axes[-1, 0], cases)
    axes[0, 0].set_title(f"GroupedMLP training step vs a torchtitan-style MLP, {s['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return os.path.basename(path)


def _f(v, spec, scale=1):
    return "-" if v is None else format(v / scale, spec)


def markdown(s):
    """The results as Markdown (also: step-bench.py --md RESULTS.json rewrites it)."""
    gib = 2**30
    geo, low, mem = (s["geomean_speedup_vs_anchor_main_grad"], s["min_speedup_vs_anchor_main_grad"],
                     s["max_peak_memory_ratio_vs_anchor"])
    lines = [f"# GroupedMLP training step vs a torchtitan-style MLP, {s['device']}", "",
             f"`{s['command']}` (torch {s['torch_version']}, moe_engine {s['moe_engine_version']}). {s['timing']}.", ""]
    if geo is not None:
        lines.append(f"Speedup vs the anchor (anchor ms / ours), Megatron main_grad mode (b): geomean **{geo:.3f}x**, "
                     f"min {low:.3f}x.")
    others = ", ".join(f"({m}) {v['name']} {_f(s['geomean_speedup_vs_anchor'][v['name']], '.3f')}x"
                       for m, v in s["modes"].items())
    lines.append(f"Geomean speedup per mode: {others}.")
    if mem is not None:
        lines.append(f"Peak memory / the anchor's (whole footprints, `peak_bytes`; (b) and (c) against the anchor "
                     f"under Megatron's DDP, with the same float32 main_grad), max over cases and modes: **{mem:.3f}**.")
    lines += ["", "Modes (each against the same anchor step):", ""]
    lines += [f"- ({m}) `{v['name']}`: {v['what']}" for m, v in s["modes"].items()]
    lines += ["", f"Anchor: {s['anchor']}; FC1 and FC2 by {s['anchor_fc']}.", ""]
    if isinstance(s["memory"], dict):
        lines += ["Memory (measured for each variant alone):", ""]
        lines += [f"- `{k}`: {v}" for k, v in s["memory"].items()]
    else:
        lines.append(f"Memory: {s['memory']}.")
    chk = s["correctness_check"]
    worst = {name: max(errs.values()) for name, errs in chk["relative_errors"].items()}
    lines += ["", f"Correctness on {chk['case']} (same weights and inputs, output, dx, dprobs and the accumulated "
                  f"gradients, relative Frobenius error, limit {chk['tolerance']}): "
              + ", ".join(f"{name} {e:.2g}" for name, e in worst.items()) + ".", ""]
    lines.append(f"Plot: `{s['plot']}`." if s["plot"] else "No plot (matplotlib was not importable).")
    lines += ["", "ms: one micro-batch (forward + backward [+ backward_dw]); peak: `peak_bytes`, above baseline: "
                  "`peak_bytes_above_baseline` (GiB).", "",
              "| case | mode | ms | TFLOP/s | anchor ms | anchor TFLOP/s | **speedup** | peak GiB | memory anchor | "
              "its peak GiB | **peak ratio** | above baseline GiB | anchor above baseline GiB | above-baseline ratio |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for e in s["entries"]:
        lines.append(f"| {e['case']} | ({e['mode']}) {e['mode_name']} | {e['ms']:.3f} | {e['tflops']:.1f} | "
                     f"{e['anchor_ms']:.3f} | {e['anchor_tflops']:.1f} | {e['speedup_vs_anchor']:.3f}x | "
                     f"{_f(e['peak_bytes'], '.2f', gib)} | {e.get('memory_anchor', 'anchor')} | "
                     f"{_f(e['anchor_peak_bytes'], '.2f', gib)} | "
                     f"{_f(e['peak_memory_ratio_vs_anchor'], '.3f')} | {_f(e['peak_bytes_above_baseline'], '.2f', gib)} | "
                     f"{_f(e['anchor_peak_bytes_above_baseline'], '.2f', gib)} | "
                     f"{_f(e['peak_above_baseline_ratio_vs_anchor'], '.3f')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
