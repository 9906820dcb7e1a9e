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
  schedule makes at the link's speed, both directions (offloaded bytes out + reloaded bytes back);
- bit_exact: one step from zeroed main_grad buffers with offload gives the same output, input
  gradient and main_grad bits as one without (main_grads compared by digests of their bits).

--precision fp8 (or both) measures the same with FP8 modules (GroupedMLP(..., fp8_recipe=
Fp8Recipe()): all six GEMMs in FP8, backward keeps FP8 activations, which the offload moves as
bytes). FP8 has no recompute_fc1, so it runs the pre-activation layers only; each such row gets an
`fp8` object with the same keys, its offloaded bytes against bf16's, and the top-level
`step_time_ratio_fp8` (and `_bf16`) per case sit side by side.

--device cpu runs the whole flow on the CPU backend with an emulated offload (copies made in the
saved-tensor hooks, no streams, no pinned memory, no allocator statistics): a smoke test of the
script (tests/python/test_bench_scripts.py, with a tiny --workloads file); its numbers mean nothing.

Usage: offload-bench.py [--cases qwen3-30b-a3b/balanced,mixtral-8x7b/balanced] [--layers 8]
                        [--steps 5] [--saves pre-activation,x-only] [--precision bf16|fp8|both]
                        [--no-check] [--out results.json]   (also writes results.md)
(OFFLOAD=1 scripts/gpu python runs it with --precision both.)
"""
import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import weakref

import torch

import moe_engine
import moe_engine.torch as me

HERE = os.path.dirname(os.path.abspath(__file__))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_link(device, nbytes=1 << 30, reps=5):
    if device.type != "cuda":  # the emulation's "link": a CPU memcpy
        nbytes = 1 << 24
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append((time.perf_counter() - t0) * 1e3)
        out[name] = nbytes / (statistics.median(times) * 1e-3) / 1e9
    return out


class _Kept:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


class EmulatedOffload:
    """--device cpu: ActivationOffload's interface and schedule without streams (it needs CUDA).
    Tensors saved inside an offloaded layer (at least min_bytes, not weights) are copied as bytes
    to a second tensor when saved; the original is dropped when layer i + 2 starts, and backward
    uses the copy (a layer still held then, the last offloaded one, uses its original and counts
    no reload). saved_bytes / peak_saved_bytes count as ActivationOffload does."""

    def __init__(self, num_layers, offload_layers=None, *, min_bytes=1 << 20):
        self.num_layers = num_layers
        self.offload_layers = num_layers - 1 if offload_layers is None else offload_layers
        self.min_bytes = min_bytes
        self._held = [[] for _ in range(num_layers)]
        self._storages = {}
        self.saved_bytes = self.peak_saved_bytes = self.offloaded_bytes = self.reloaded_bytes = 0

    @contextlib.contextmanager
    def layer(self, index):
        if index == 0:
            for i in range(self.num_layers):
                self._release(i)
            self.peak_saved_bytes = self.saved_bytes
            self.offloaded_bytes = self.reloaded_bytes = 0
        if index >= 2:
            self._release(index - 2)

        def pack(t):
            if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad) or getattr(t, "_moe_weight", False):
                return t
            n = t.numel() * t.element_size()
            if index >= self.offload_layers or n < self.min_bytes or not t.is_contiguous():
                holder = _Kept(t)
                weakref.finalize(holder, self._unhold, self._hold(t))
                return holder
            copy = torch.empty_like(t)
            _bytes(copy).copy_(_bytes(t))
            self._hold(t)
            rec = {"copy": copy, "source": t}
            self._held[index].append(rec)
            self.offloaded_bytes += n
            return rec

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield self

    def output(self, y):
        return y

    def _release(self, index):
        for rec in self._held[index]:
            self._unhold(rec["source"].untyped_storage().data_ptr())
            rec["source"] = None
        self._held[index] = []

    def _unpack(self, rec):
        if isinstance(rec, _Kept):
            return rec.tensor
        if not isinstance(rec, dict):
            return rec
        if rec["source"] is not None:
            return rec["source"]
        if not rec.get("reloaded"):
            rec["reloaded"] = True
            self.reloaded_bytes += rec["copy"].numel() * rec["copy"].element_size()
        return rec["copy"]

    # The accounting is ActivationOffload's own (same _storages / saved_bytes / peak_saved_bytes
    # fields), so the emulation counts exactly as the real offload does.
    _hold = me.ActivationOffload._hold
    _unhold = me.ActivationOffload._unhold

    def pinned_bytes(self):
        return 0


def make_offload(device, num_layers, offload_layers=None, min_bytes=1 << 20):
    if device.type == "cuda":
        return me.ActivationOffload(num_layers, offload_layers, min_bytes=min_bytes)
    return EmulatedOffload(num_layers, offload_layers, min_bytes=min_bytes)


def build(case, layers, recompute_fc1, device, fp8_recipe=None):
    torch.manual_seed(0)
    fp8 = {} if fp8_recipe is None else {"fp8_recipe": fp8_recipe}
    stack = [me.GroupedMLP(case["experts"], case["hidden"], case["ffn"], bias=case["bias"],
                           activation=case["activation"], glu_layout="blocks:32", accumulate_into_main_grad=True,
                           recompute_fc1=recompute_fc1, device=device, **fp8) for _ in range(layers)]
    for m in stack:
        for p in m.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    return stack


def make_inputs(case, device, seed=1):
    T, H = case["tokens"], case["hidden"]
    g = torch.Generator(device=device).manual_seed(seed)
    splits = torch.tensor(case["tokens_per_expert"], dtype=torch.int64, device=device)
    x = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    probs = torch.rand(T, generator=g, device=device)
    dy = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)
    return x, splits, probs, dy


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
    return h


def measure(stack, inputs, offload, steps, device):
    """Median step time, allocator peak above the start of the step, what the forward leaves
    allocated for backward (after its copies settle), and the offload's saved-activation peak
    (allocator numbers None on the CPU)."""
    x, splits, probs, dy = inputs
    cuda = device.type == "cuda"
    run_step(stack, x, splits, probs, dy, offload)  # warm-up (pinned buffers on the first offload step)
    sync(device)
    times, peaks, saved_peaks = [], [], []
    for _ in range(steps):
        x.grad = None
        sync(device)
        if cuda:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run_step(stack, x, splits, probs, dy, offload)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
            peaks.append(torch.cuda.max_memory_allocated() - base)
        else:
            t0 = time.perf_counter()
            run_step(stack, x, splits, probs, dy, offload)
            times.append((time.perf_counter() - t0) * 1e3)
        if offload is not None:
            saved_peaks.append(offload.peak_saved_bytes)
    held = [None]
    if cuda:
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
    return (statistics.median(times), max(peaks) if peaks else None, held[0],
            max(saved_peaks) if saved_peaks else None)


def bits_digest(t, block=1 << 24, row=1 << 16):
    """A digest of t's bits (float32): per row of `row` elements, the sum of the bits as integers and
    their sum weighted by position (exact int64 sums). Two tensors that differ in any bit give the
    same digest only if their differences cancel in both sums of a row. Works in blocks, so the
    temporaries stay small beside the main_grad buffers."""
    b = t.detach().reshape(-1).view(torch.int32)
    w = torch.arange(row, device=b.device, dtype=torch.int64) % 1021 + 1
    out = []
    for c in b.split(block):
        c = c.to(torch.int64)
        if c.numel() % row:
            c = torch.nn.functional.pad(c, (0, row - c.numel() % row))
        c = c.view(-1, row)
        out.append(torch.stack((c.sum(1), (c * w).sum(1))))
    return torch.cat(out, 1)


def check_step(stack, inputs, offload):
    """One step from zeroed main_grads: the stack's output, x's gradient and the main_grads' digests."""
    x, splits, probs, dy = inputs
    for m in stack:
        for p in m.parameters():
            p.main_grad.zero_()
    x.grad = None
    h = run_step(stack, x, splits, probs, dy, offload).detach()
    grads = [bits_digest(p.main_grad) for m in stack for p in m.parameters()]
    return h, x.grad, grads


def same_bits(a, b):
    ha, ga, da = a
    hb, gb, db = b
    return (torch.equal(ha.view(torch.int16), hb.view(torch.int16)) and torch.equal(ga.view(torch.int16), gb.view(torch.int16))
            and all(torch.equal(u, v) for u, v in zip(da, db)))


def run_case(case, saves, layers, steps, link, link_GBps, device, min_bytes, check, fp8_recipe=None):
    """One row: the stack of `layers` GroupedMLPs with offload off, accounting only and on."""
    stack = build(case, layers, saves == "x-only", device, fp8_recipe)
    inputs = make_inputs(case, device)
    t_off, alloc_off, held_off, _ = measure(stack, inputs, None, steps, device)
    meter = make_offload(device, layers, 0, min_bytes)  # counts, moves nothing
    t_meter, alloc_meter, _, saved_off = measure(stack, inputs, meter, steps, device)
    offload = make_offload(device, layers, None, min_bytes)
    t_on, alloc_on, held_on, saved_on = measure(stack, inputs, offload, steps, device)
    moved, back = offload.offloaded_bytes, offload.reloaded_bytes
    exact = None
    if check:
        exact = same_bits(check_step(stack, inputs, None), check_step(stack, inputs, offload))
    link_ms = moved / (link_GBps * 1e9) * 1e3
    bound_ms = (moved / (link["d2h"] * 1e9) + back / (link["h2d"] * 1e9)) * 1e3

    def ratio(a, b):
        return a / b if a is not None and b else None

    row = {"offloaded_layers": offload.offload_layers,
           "step_ms_offload_off": t_off, "step_ms_offload_on": t_on, "step_ms_accounting_only": t_meter,
           "peak_saved_activation_bytes_off": saved_off, "peak_saved_activation_bytes_on": saved_on,
           "peak_memory_ratio": ratio(saved_on, saved_off),
           "peak_allocated_bytes_off": alloc_off, "peak_allocated_bytes_accounting_only": alloc_meter,
           "peak_allocated_bytes_on": alloc_on, "peak_allocated_ratio": ratio(alloc_on, alloc_off),
           "activation_bytes_after_forward_off": held_off, "activation_bytes_after_forward_on": held_on,
           "after_forward_memory_ratio": ratio(held_on, held_off),
           "offloaded_bytes": moved, "reloaded_bytes": back,
           "link_time_ms": link_ms, "copies_at_link_speed_ms": bound_ms,
           "step_time_ratio": t_on / max(t_off, link_ms),
           "step_time_vs_copies_at_link_speed": t_on / max(t_off, bound_ms),
           "copy_time_hidden_fraction": max(0.0, min(1.0, 1 - (t_on - t_off) / bound_ms)) if moved and bound_ms else None,
           "pinned_bytes": offload.pinned_bytes(), "bit_exact": exact}
    del stack, offload, meter, inputs
    gc.collect()  # modules and their autograd records can sit in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def describe(name, saves, precision, r):
    g = 2**30
    alloc = (f", peak allocated {r['peak_allocated_bytes_off'] / g:.2f} -> {r['peak_allocated_bytes_on'] / g:.2f} GiB "
             f"({r['peak_allocated_ratio']:.3f})" if r["peak_allocated_bytes_off"] is not None else "")
    exact = {None: "", True: ", bit-exact", False: ", NOT BIT-EXACT"}[r["bit_exact"]]
    return (f"{name} ({saves}, {precision}): step {r['step_ms_offload_off']:.1f} -> {r['step_ms_offload_on']:.1f} ms "
            f"(accounting only {r['step_ms_accounting_only']:.1f}), peak saved activations "
            f"{r['peak_saved_activation_bytes_off'] / g:.2f} -> {r['peak_saved_activation_bytes_on'] / g:.2f} GiB "
            f"({r['peak_memory_ratio']:.3f}){alloc}, offloaded {r['offloaded_bytes'] / g:.2f} GiB, reloaded "
            f"{r['reloaded_bytes'] / g:.2f} GiB (link {r['link_time_ms']:.1f} ms one way; copies at link speed "
            f"{r['copies_at_link_speed_ms']:.1f} ms), step_time_ratio {r['step_time_ratio']:.3f}, vs copies "
            f"{r['step_time_vs_copies_at_link_speed']:.3f}{exact}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=os.path.join(HERE, "..", "workloads.json"))
    ap.add_argument("--cases", default="qwen3-30b-a3b/balanced,mixtral-8x7b/balanced")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--saves", default="pre-activation,x-only",
                    help="what each layer keeps for backward: pre-activation (x and FC1's output) and/or x-only "
                         "(recompute_fc1: FC1 runs again in backward; bf16 only)")
    ap.add_argument("--precision", choices=("bf16", "fp8", "both"), default="bf16",
                    help="bf16 modules, FP8 modules (GroupedMLP(fp8_recipe=Fp8Recipe()); pre-activation layers "
                         "only), or both, each FP8 row beside its bf16 row")
    ap.add_argument("--min-bytes", type=int, default=1 << 20,
                    help="ActivationOffload's min_bytes: smaller saved tensors stay on the device")
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exactness check (one step each way)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the CPU backend with an emulated offload (a smoke test; the numbers mean nothing)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    device = torch.device(a.device)
    precisions = ["bf16", "fp8"] if a.precision == "both" else [a.precision]
    if "fp8" in precisions and not hasattr(me, "Fp8Recipe"):
        raise SystemExit("offload-bench.py: this moe_engine has no FP8 GroupedMLP (moe_engine.torch.Fp8Recipe)")
    link = host_link(device)
    link_GBps = min(link["d2h"], link["h2d"])
    print(f"host link: D2H {link['d2h']:.1f} GB/s, H2D {link['h2d']:.1f} GB/s "
          + ("(pinned, 1 GiB)" if device.type == "cuda" else "(emulated: a CPU memcpy)"))
    all_cases = {c["name"]: c for c in json.load(open(a.workloads))["cases"]}
    rows = []
    for name, saves in [(n, v) for n in a.cases.split(",") for v in a.saves.split(",")]:
        case = all_cases[name]
        if saves not in ("pre-activation", "x-only"):
            raise SystemExit(f"--saves: expected pre-activation or x-only, got {saves}")
        if precisions == ["fp8"] and saves == "x-only":
            continue  # the FP8 GroupedMLP has no recompute_fc1
        row = {"case": name, "saves": saves, "layers": a.layers}
        if "bf16" in precisions:
            row.update(run_case(case, saves, a.layers, a.steps, link, link_GBps, device, a.min_bytes, not a.no_check))
            print(describe(name, saves, "bf16", row), flush=True)
        if "fp8" in precisions:
            if saves == "x-only":
                row["fp8"] = None  # no recompute_fc1 with an FP8 recipe
            else:
                f = run_case(case, saves, a.layers, a.steps, link, link_GBps, device, a.min_bytes, not a.no_check,
                             me.Fp8Recipe())
                if "bf16" in precisions:
                    f["offloaded_bytes_ratio_vs_bf16"] = f["offloaded_bytes"] / row["offloaded_bytes"] \
                        if row["offloaded_bytes"] else None
                    f["peak_saved_activation_bytes_off_ratio_vs_bf16"] = (
                        f["peak_saved_activation_bytes_off"] / row["peak_saved_activation_bytes_off"]
                        if row["peak_saved_activation_bytes_off"] else None)
                    f["step_ms_offload_on_ratio_vs_bf16"] = f["step_ms_offload_on"] / row["step_ms_offload_on"]
                row["fp8"] = f
                print(describe(name, saves, "fp8", f), flush=True)
        rows.append(row)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
              "torch": torch.__version__, "moe_engine": moe_engine.__version__,
              "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), "host_link_GBps": link_GBps,
              "host_link_d2h_GBps": link["d2h"], "host_link_h2d_GBps": link["h2d"], "cases": rows}
    if device.type != "cuda":
        result["emulated_offload"] = True
    if "fp8" in precisions:
        result["precisions"] = precisions
        fp8_rows = [r for r in rows if r.get("fp8")]
        result["step_time_ratio_fp8"] = {r["case"]: r["fp8"]["step_time_ratio"] for r in fp8_rows}
        if "bf16" in precisions:
            result["step_time_ratio_bf16"] = {r["case"]: r["step_time_ratio"] for r in fp8_rows}
            result["offloaded_bytes_ratio_fp8_vs_bf16"] = {r["case"]: r["fp8"]["offloaded_bytes_ratio_vs_bf16"]
                                                          for r in fp8_rows}
    checks = [r["bit_exact"] for r in rows if "bit_exact" in r] + [r["fp8"]["bit_exact"] for r in rows if r.get("fp8")]
    result["bit_exact"] = None if a.no_check else all(checks)
    if a.out:
        json.dump(result, open(a.out, "w"), indent=2)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(markdown(result))
    if result["bit_exact"] is False:
        sys.exit("offload-bench.py: a step with offload differs from the step without (see bit_exact per case)")


def _f(v, spec, scale=1):
    return "-" if v is None else format(v / scale, spec)


def markdown(r):
    g = 2**30
    lines = [f"# Activation offload, {r['device']}", "", f"`{r['command']}` (torch {r['torch']})", ""]
    if r.get("emulated_offload"):
        lines += ["**Emulated offload on the CPU (a smoke test of the script): the numbers mean nothing.**", ""]
    lines += [f"Host link (pinned, 1 GiB): D2H {r['host_link_d2h_GBps']:.1f} GB/s, H2D {r['host_link_h2d_GBps']:.1f} GB/s.",
              "",
              "- Peak saved: the high-water mark of the device memory held by the step's saved activations "
              "(`ActivationOffload.peak_saved_bytes`; without offload, counted by one with `offload_layers=0`, "
              "which moves nothing). Its ratio is `peak_memory_ratio`.",
              "- Peak allocated: the step's allocator peak above the weights and main_grad buffers, so also the "
              "backward's transient buffers (dy, dx, the MLP backward's scratch) and the stack's output.",
              "- Layer keeps: `pre-activation` = x and FC1's output [T, 2F] (the default); `x-only` = "
              "`recompute_fc1=True` (FC1 runs again in backward; 2H + 4 instead of 2(H + 2F) + 4 bytes per row).",
              "- Link ms: offloaded bytes / the slower direction (step_time_ratio's denominator); copies ms: what this "
              "schedule moves at the link's speed, out and back (offloaded + reloaded bytes)."]
    if any(c.get("fp8") for c in r["cases"]):
        lines.append("- fp8: the same stack with `GroupedMLP(..., fp8_recipe=Fp8Recipe())` (backward keeps x's "
                     "columns and the pre-activation in E4M3 with their scales: H + H/32 + 2F + F/16 bytes per row); "
                     "pre-activation layers only (no `recompute_fc1` in FP8).")
    if r.get("bit_exact") is not None:
        lines.append("- Bit-exact: one step from zeroed main_grads with offload against one without: the output, "
                     "x's gradient and every main_grad (digests of their bits) equal"
                     + (" in every row." if r["bit_exact"] else ": **NOT in every row** (the `exact` column)."))
    lines += ["",
              "| case | layer keeps | precision | layers (offloaded) | step ms off | on | peak saved GiB off | on | "
              "**peak_memory_ratio** | peak allocated GiB off | on | ratio | offloaded / reloaded GiB | link ms | "
              "copies ms | **step_time_ratio** | step / max(off, copies) | copy time hidden | exact |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        entries = ([("bf16", c)] if "step_time_ratio" in c else []) + ([("fp8", c["fp8"])] if c.get("fp8") else [])
        for prec, e in entries:
            exact = {None: "-", True: "yes", False: "**no**"}[e.get("bit_exact")]
            lines.append(f"| {c['case']} | {c['saves']} | {prec} | {c['layers']} ({e['offloaded_layers']}) | "
                         f"{e['step_ms_offload_off']:.1f} | {e['step_ms_offload_on']:.1f} | "
                         f"{_f(e['peak_saved_activation_bytes_off'], '.2f', g)} | "
                         f"{_f(e['peak_saved_activation_bytes_on'], '.2f', g)} | {_f(e['peak_memory_ratio'], '.3f')} | "
                         f"{_f(e['peak_allocated_bytes_off'], '.2f', g)} | {_f(e['peak_allocated_bytes_on'], '.2f', g)} | "
                         f"{_f(e['peak_allocated_ratio'], '.3f')} | {e['offloaded_bytes'] / g:.2f} / "
                         f"{e['reloaded_bytes'] / g:.2f} | {e['link_time_ms']:.1f} | {e['copies_at_link_speed_ms']:.1f} | "
                         f"{e['step_time_ratio']:.3f} | {e['step_time_vs_copies_at_link_speed']:.3f} | "
                         f"{_f(e['copy_time_hidden_fraction'], '.2f')} | {exact} |")
    fp8_rows = [c for c in r["cases"] if c.get("fp8") and "step_time_ratio" in c]
    if fp8_rows:
        lines += ["", "FP8 against bf16 (pre-activation layers, same run):", "",
                  "| case | step_time_ratio bf16 | fp8 | offloaded GiB per step bf16 | fp8 | fp8 / bf16 | "
                  "peak saved GiB without offload bf16 | fp8 | step ms with offload bf16 | fp8 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in fp8_rows:
            f = c["fp8"]
            lines.append(f"| {c['case']} | {c['step_time_ratio']:.3f} | **{f['step_time_ratio']:.3f}** | "
                         f"{c['offloaded_bytes'] / g:.2f} | {f['offloaded_bytes'] / g:.2f} | "
                         f"{_f(f['offloaded_bytes_ratio_vs_bf16'], '.3f')} | "
                         f"{_f(c['peak_saved_activation_bytes_off'], '.2f', g)} | "
                         f"{_f(f['peak_saved_activation_bytes_off'], '.2f', g)} | {c['step_ms_offload_on']:.1f} | "
                         f"{f['step_ms_offload_on']:.1f} |")
    bf16_rows = [c for c in r["cases"] if "step_time_ratio" in c]
    if bf16_rows and bf16_rows[0]["peak_allocated_bytes_accounting_only"] is not None:
        lines += ["", "Accounting only (an ActivationOffload with offload_layers=0) vs plain: step "
                  + ", ".join(f"{c['step_ms_accounting_only']:.1f} vs {c['step_ms_offload_off']:.1f} ms" for c in bf16_rows)
                  + "; peak allocated "
                  + ", ".join(f"{c['peak_allocated_bytes_accounting_only'] / 2**30:.2f} vs "
                              f"{c['peak_allocated_bytes_off'] / 2**30:.2f} GiB" for c in bf16_rows) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
