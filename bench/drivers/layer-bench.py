#!/usr/bin/env python3
"""The whole MoE layer (router, permute, experts, unpermute) in training, forward + backward:
moe_engine.torch.MoELayer against a torchtitan-style eager layer and Megatron-core's MoELayer, on the
same weights and inputs, for the model shapes of bench/workloads.json (issue 25). scripts/gpu
layer-bench runs it.

The layers (each the same math: float32 router logits, softmax, top-k, the k probabilities
renormalized, SwiGLU experts without biases, the router probability applied to the activation before
FC2, the k expert rows of a token summed):
  ours               moe_engine.torch.MoELayer(H, F, E, k, glu_layout=--glu-layout)
  torchtitan_style   torchtitan_layer.py beside this file: eager PyTorch, torch._grouped_mm with device
                     offsets, index_add_ combine in float32
  megatron_core_*    megatron_layer.py beside this file: Megatron-core's MoELayer on one rank without
                     TransformerEngine, once per token dispatcher of --megatron-dispatchers (alltoall,
                     allgather); its experts GroupedMLP where the grouped_gemm package imports, else
                     SequentialMLP. megatron_core in the ratios is the faster of its dispatchers per
                     shape.
A layer that cannot run here (MoELayer not in this moe_engine, megatron-core not importable, a
Megatron configuration that needs CUDA on the CPU) is reported as missing, with why, and left out of
the ratios.

Shapes: the cases of bench/workloads.json with --routings (default balanced); tokens is the case's
token count / k (the workloads count routed rows, T k). Routing: the router weight is a scaled
orthonormal basis of E directions in the hidden space and x is built so that each token's logits are
a fixed pattern (its k experts at 4.0-5.0 plus up to 0.2 of noise, the others within 1.5 of 0) plus
bf16 rounding: every layer's router picks the same experts, and each expert gets exactly the case's
tokens_per_expert (each token's k experts taken from the case's list in turn, tokens shuffled). The
JSON records each layer's own counts (max / mean) and the fraction of tokens whose k experts match
the torchtitan-style layer's.

What is timed (per layer): forward + backward of the whole layer, x requiring grad (x.grad dropped
before each step), y.backward(g) with a fixed random g, every .grad (router included) unset
before the step, as in a micro-batch's first step. A sample is --block steps back to back (as a training loop runs
them: the host enqueues ahead of the GPU); ms is the median over --iters samples of the sample time /
block. On CUDA: CUDA events, the GPU settled first (settle.py), the layers alternating sample by
sample. The breakdown (ours, and torchtitan-style): each stage's forward + backward alone on detached
inputs that require grad (router: x -> probs; permute: x, probs -> expert-sorted rows and probs;
experts: rows, probs -> rows; unpermute: rows -> y), gradients random, timed the same way; fraction
is the stage's share of the four stages' sum.

Peak memory, on CUDA, each layer alone (as step-bench.py): peak_bytes is the layer's whole footprint at
a steady step's peak (parameters, .grad, inputs, transients) above what was allocated before it was
built; peak_bytes_above_baseline the step's transients.

Before timing, the run's first shape checks every layer against the torchtitan-style one on the same
weights and inputs: y, dx and the four weight gradients after one step (relative Frobenius error at
most 2e-2), and exits 1 on a disagreement (--no-check skips it).

--device cpu is a smoke test (tests/python/test_bench_scripts.py, a tiny --workloads file): host clock,
no memory numbers, the torchtitan-style experts as a per-expert loop where torch._grouped_mm has no CPU
backward, Megatron with its allgather dispatcher and SequentialMLP only.

Usage: layer-bench.py [--cases SUBSTR] [--routings balanced[,mild,heavy]] [--layers ours,torchtitan,megatron]
                      [--iters 20] [--warmup 3] [--block 2] [--no-breakdown] [--no-check]
                      [--megatron-dispatchers alltoall,allgather] [--megatron-experts auto|grouped|sequential]
                      [--workloads PATH] [--device cuda|cpu] [--out PREFIX.json]
       layer-bench.py --md RESULTS.json    (rewrites the Markdown of a result)
--out PREFIX.json also writes PREFIX.md and, where matplotlib imports, PREFIX.png.
"""
import argparse
import dataclasses
import gc
import json
import math
import os
import re
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # settle.py, torchtitan_mlp.py, torchtitan_layer.py, megatron_layer.py
sys.path.insert(0, os.path.join(HERE, "..", "report"))  # layer_report.py, plots.py

import layer_report  # noqa: E402

try:  # --md needs none of these
    import torch

    import megatron_layer
    import moe_engine
    import moe_engine.torch as me
    from torchtitan_layer import TorchtitanMoELayer
    from torchtitan_mlp import glu_block, grouped_mm_works
except ImportError:
    pass

CHECK_TOLERANCE = 2e-2
STAGES = ("router", "permute", "experts", "unpermute")
LAYER_WHAT = {
    "ours": "moe_engine.torch.MoELayer",
    "torchtitan_style": "eager PyTorch, torch._grouped_mm (bench/drivers/torchtitan_layer.py)",
    "megatron_core": "Megatron-core MoELayer without TransformerEngine (bench/drivers/megatron_layer.py)",
}
MEMORY_DEFINITIONS = {
    "peak_bytes": "the layer's whole footprint at a steady step's peak (parameters, .grad, inputs, transients): "
                  "max_memory_allocated() during the step minus what was allocated before the layer was built, "
                  "with nothing else of this script allocated",
    "peak_bytes_above_baseline": "max_memory_allocated() during the step minus memory_allocated() when it began: "
                                 "the step's transients",
}
ROUTING_DESCRIPTION = (
    "router weight = an orthonormal basis of E directions of the hidden space (rows of norm 1, in bf16); x = a "
    "random part orthogonal to them + each token's logit pattern along them: its k experts at 4.0-5.0 (0.5 apart "
    "by slot, +-0.2 noise), the other experts within 1.5 of 0; the k experts of the tokens taken from the case's "
    "tokens_per_expert in turn, tokens shuffled, so every layer's router picks the same experts and the counts are "
    "the case's exactly")


def topk_of(case):
    """k of a case: its `topk` field, else the "x top-K" of its note."""
    if "topk" in case:
        return int(case["topk"])
    m = re.search(r"top-(\d+)", case.get("note", ""))
    if not m:
        raise SystemExit(f"layer-bench.py: case {case['name']} has no topk field and no 'top-K' in its note")
    return int(m.group(1))


def shape_of(case):
    k = topk_of(case)
    routed = sum(case["tokens_per_expert"])
    if routed % k:
        raise SystemExit(f"layer-bench.py: case {case['name']}: {routed} routed rows is not a multiple of top-{k}")
    return {"case": case["name"], "model": case.get("model", case["name"].split("/")[0]),
            "routing": case.get("routing", case["name"].split("/")[-1]), "experts": case["experts"],
            "hidden": case["hidden"], "ffn": case["ffn"], "topk": k, "tokens": routed // k, "routed_rows": routed,
            "tokens_per_expert": case["tokens_per_expert"]}


# ---- weights and inputs ----

def expert_choices(shape, gen):
    """[T, k] expert indices with exactly the shape's tokens_per_expert: the experts listed in order,
    each run of an expert (at most T long) spread over consecutive tokens, so a token never gets an
    expert twice; then the tokens shuffled."""
    T, k = shape["tokens"], shape["topk"]
    counts = torch.tensor(shape["tokens_per_expert"])
    if int(counts.max()) > T:
        raise SystemExit(f"layer-bench.py: {shape['case']}: an expert has more rows than there are tokens")
    seq = torch.repeat_interleave(torch.arange(shape["experts"]), counts)
    choices = seq.view(k, T).t()
    return choices[torch.randperm(T, generator=gen)]


def make_weights_and_inputs(shape, device):
    """The canonical weights (router [E, H], gate / up [E, F, H], down [E, H, F], bf16), x [T, H] and
    g [T, H] (bf16), and the intended [T, k] choices; all from fixed seeds."""
    E, H, F, T, k = shape["experts"], shape["hidden"], shape["ffn"], shape["tokens"], shape["topk"]
    if H < E:
        raise SystemExit(f"layer-bench.py: {shape['case']}: hidden {H} < experts {E}: no orthonormal router basis")
    gen = torch.Generator().manual_seed(0)  # the routing, on the host (small)
    q, _ = torch.linalg.qr(torch.randn(H, E, generator=gen, dtype=torch.float64))
    basis = q.t().float().to(device)  # [E, H], orthonormal rows
    choices = expert_choices(shape, gen)
    logits = (torch.rand(T, E, generator=gen) * 3.0 - 1.5)
    slot = 4.0 + 0.5 * torch.arange(k - 1, -1, -1, dtype=torch.float32)
    logits.scatter_(1, choices, slot + (torch.rand(T, k, generator=gen) * 0.4 - 0.2))
    dgen = torch.Generator(device=device).manual_seed(1)  # the big tensors, on the device
    z = torch.randn(T, H, generator=dgen, device=device)
    z -= (z @ basis.t()) @ basis
    x = (z + logits.to(device) @ basis).to(torch.bfloat16)
    del z

    def uniform(shape_, fan_in):
        bound = 1.0 / math.sqrt(fan_in)
        return ((torch.rand(shape_, generator=dgen, device=device) * 2 - 1) * bound).to(torch.bfloat16)

    w = {"router": basis.to(torch.bfloat16), "gate": uniform((E, F, H), H), "up": uniform((E, F, H), H),
         "down": uniform((E, H, F), F)}
    g = torch.randn(T, H, generator=dgen, device=device, dtype=torch.bfloat16)
    return w, x, g, choices


# ---- the layers behind one interface ----

class Layer:
    """One layer under test: `step` is a training step's forward + backward on (x, g); `load` and
    `grads` move the canonical weights in and the accumulated gradients out; route_indices(x) the
    [T, k] choices (or a [T, E] mask) of its own router; stages (where it has them) the four stage
    methods."""

    name = ""

    def step(self, x, g):
        self.output(x, g)

    def output(self, x, g):
        """One step; y (detached). Every gradient starts unset (a micro-batch's first step: no
        accumulation into earlier .grad, which would time an add of every weight besides the layer)."""
        x.grad = None
        for p in self.module.parameters():
            p.grad = None
        y = self.module(x)
        y.backward(g)
        return y.detach()


class Ours(Layer):
    name = "ours"

    def __init__(self, shape, layout, device):
        self.layout, self.ffn = layout, shape["ffn"]
        self.module = me.MoELayer(shape["hidden"], shape["ffn"], shape["experts"], shape["topk"], score="softmax",
                                  norm_topk_prob=True, glu_layout=layout, bias=False, device=device,
                                  dtype=torch.bfloat16)

    def _fc1_halves(self, fc1):
        """[E, 2F, H] in the layout -> (gate, up) [E, F, H]."""
        s = glu_block(self.layout, self.ffn)
        E, _, H = fc1.shape
        blocks = fc1.reshape(E, self.ffn // s, 2, s, H)
        return blocks[:, :, 0].reshape(E, self.ffn, H), blocks[:, :, 1].reshape(E, self.ffn, H)

    def load(self, w):
        s = glu_block(self.layout, self.ffn)
        E, F, H = w["gate"].shape
        fc1 = torch.stack([w["gate"].view(E, F // s, s, H), w["up"].view(E, F // s, s, H)], dim=2).reshape(E, 2 * F, H)
        with torch.no_grad():
            self.module.router.weight.copy_(w["router"])
            self.module.experts.fc1.weight.copy_(fc1)
            self.module.experts.fc2.weight.copy_(w["down"])

    def grads(self):
        gate, up = self._fc1_halves(self.module.experts.fc1.weight.grad)
        return {"router": self.module.router.weight.grad, "gate": gate, "up": up,
                "down": self.module.experts.fc2.weight.grad}

    def route_indices(self, x):
        with torch.no_grad():
            return self.module.route(x).indices

    def stages(self):
        m = self.module
        return {"route": m.route, "dispatch": m.dispatch, "experts": m.experts, "combine": m.combine}


class Torchtitan(Layer):
    name = "torchtitan_style"

    def __init__(self, shape, use_grouped_mm, device):
        self.module = TorchtitanMoELayer(shape["experts"], shape["hidden"], shape["ffn"], shape["topk"],
                                         use_grouped_mm=use_grouped_mm, device=device)

    def load(self, w):
        with torch.no_grad():
            self.module.router.weight.copy_(w["router"])
            self.module.w1.copy_(torch.cat([w["gate"], w["up"]], dim=1).transpose(1, 2))
            self.module.w2.copy_(w["down"].transpose(1, 2))

    def grads(self):
        F = self.module.ffn
        g1 = self.module.w1.grad.transpose(1, 2)
        return {"router": self.module.router.weight.grad, "gate": g1[:, :F], "up": g1[:, F:],
                "down": self.module.w2.grad.transpose(1, 2)}

    def route_indices(self, x):
        with torch.no_grad():
            return self.module.route(x).indices

    def stages(self):
        m = self.module
        return {"route": m.route, "dispatch": m.dispatch, "experts": m.experts, "combine": m.combine}


class Megatron(Layer):
    def __init__(self, shape, dispatcher, experts, device):
        self.name = f"megatron_core_{dispatcher}"
        self.module = megatron_layer.MegatronLayer(shape["experts"], shape["hidden"], shape["ffn"], shape["topk"],
                                                   dispatcher=dispatcher, experts=experts, device=device)

    def load(self, w):
        self.module.load(w)

    def grads(self):
        return self.module.grads()

    def route_indices(self, x):
        return self.module.routing_counts(x)[1]

    def stages(self):
        return None


# ---- which layers can run ----

def available_layers(a, device):
    """{layer name: builder(shape) or None} and {layer name: status line}."""
    builders, status = {}, {}
    if "ours" in a.layers:
        if hasattr(me, "MoELayer"):
            builders["ours"] = lambda shape: Ours(shape, a.glu_layout, device)
            status["ours"] = "ran"
        else:
            status["ours"] = f"missing: moe_engine {moe_engine.__version__} has no moe_engine.torch.MoELayer"
    if "torchtitan" in a.layers:
        use_gmm = grouped_mm_works(device)
        builders["torchtitan_style"] = lambda shape: Torchtitan(shape, use_gmm, device)
        status["torchtitan_style"] = "ran, experts by " + (
            "torch._grouped_mm" if use_gmm else
            f"a per-expert matmul loop (torch._grouped_mm has no working backward on {device.type} in torch "
            f"{torch.__version__})")
    if "megatron" in a.layers:
        why = megatron_layer.import_error()
        experts = a.megatron_experts
        if experts == "auto":
            experts = "grouped" if megatron_layer.grouped_gemm_available() else "sequential"
        for disp in a.megatron_dispatchers:
            name = f"megatron_core_{disp}"
            if why:
                status[name] = f"missing: megatron-core does not import ({why})"
            elif device.type == "cpu" and (disp == "alltoall" or experts == "grouped"):
                status[name] = f"missing: the {disp} dispatcher / {experts} experts need CUDA (CPU smoke test)"
            else:
                builders[name] = lambda shape, disp=disp: Megatron(shape, disp, experts, device)
                status[name] = "ran"
    return builders, status


# ---- measurements ----

def rel_err(out, ref):
    """||out - ref|| / ||ref|| (Frobenius) in float64, over row blocks (weight gradients may be GBs)."""
    rows = max(1, (1 << 26) // max(1, ref[0].numel()))
    num = den = 0.0
    for o, r in zip(out.detach().split(rows), ref.detach().split(rows)):
        r = r.float()
        num += (o.float() - r).square().sum(dtype=torch.float64).item()
        den += r.square().sum(dtype=torch.float64).item()
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def guarded(name, fn, failures):
    """fn() for a layer; a Megatron layer that raises (a configuration this megatron-core or this
    machine cannot run, memory) is recorded in failures and gives None, so the others still run. Our
    layer and the torchtitan-style one raise as usual."""
    try:
        return fn()
    except Exception as err:
        if family(name) != "megatron_core":
            raise
        failures[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        print(f"{name} failed: {failures[name]}", file=sys.stderr)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def check_layers(shape, builders, device, failures):
    """Every layer against the torchtitan-style one after one step on the same weights and inputs:
    y, dx and the weight gradients. Returns {layer: {what: relative error}}; exits 1 above the limit.
    A Megatron layer that cannot run goes to failures instead."""
    w, x, g, _ = make_weights_and_inputs(shape, device)
    x.requires_grad_()
    ref_layer = builders["torchtitan_style"](shape)
    ref_layer.load(w)
    want = {"y": ref_layer.output(x, g), "dx": x.grad.clone(), **ref_layer.grads()}
    del ref_layer
    errors, failed = {}, []
    for name, build in builders.items():
        if name == "torchtitan_style":
            continue

        def one_step(build=build):
            layer = build(shape)
            layer.load(w)
            return {"y": layer.output(x, g), "dx": x.grad, **layer.grads()}

        got = guarded(name, one_step, failures)
        if got is None:
            continue
        errors[name] = {k: rel_err(got[k], want[k]) for k in want}
        failed += [f"{name} {k}: {e:.3g}" for k, e in errors[name].items() if not e <= CHECK_TOLERANCE]
        del got
        gc.collect()
    if failed:
        sys.exit(f"layer-bench.py: a layer disagrees with the torchtitan-style one on {shape['case']} (relative "
                 f"error above {CHECK_TOLERANCE}): " + "; ".join(failed))
    return errors


def routing_report(layer, x, choices, E):
    """The layer's own counts (max / mean) and the fraction of tokens whose k experts are the intended."""
    got = layer.route_indices(x)
    want = torch.zeros(x.shape[0], E, dtype=torch.bool, device=x.device)
    want.scatter_(1, choices.to(x.device), True)
    if got.dtype == torch.bool:  # a [T, E] mask
        mask = got
    else:
        mask = torch.zeros_like(want).scatter_(1, got, True)
    counts = mask.sum(dim=0).float()
    return {"max_over_mean_count": (counts.max() / counts.mean()).item(),
            "min_count": int(counts.min()), "max_count": int(counts.max()),
            "tokens_routed_as_intended": (mask == want).all(dim=1).float().mean().item()}


def run_samples(fns, iters, warmup, block, device):
    """Median ms per callable, the callables alternating sample by sample; a sample is `block` calls
    back to back (the host enqueues ahead of the GPU), timed with CUDA events (host clock on the CPU).
    On CUDA every sample starts alike: the GPU drained (synchronize), then one untimed call, so the
    timed calls find the callable's own work queued ahead of them rather than whatever the previous
    callable left (a layer that syncs the host, as Megatron-core's dispatchers do, would otherwise
    hand the next one an idle GPU and an empty queue)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
                fn()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(block):
                    fn()
                stop.record()
                times[name].append((start, stop))
            else:
                t0 = time.perf_counter()
                for _ in range(block):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    out = {}
    for name, ts in times.items():
        ms = sorted(a.elapsed_time(b) / block for a, b in ts) if cuda else sorted(t / block for t in ts)
        out[name] = ms[len(ms) // 2]
    return out


def measure_memory(build, shape, device):
    """One layer alone: a warm-up step (it allocates .grad), then a steady step between
    reset_peak_memory_stats() and max_memory_allocated()."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    layer = build(shape)
    w, x, g, _ = make_weights_and_inputs(shape, device)
    layer.load(w)
    del w
    x.requires_grad_()
    layer.step(x, g)
    x.grad = None
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer.step(x, g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del layer, x, g
    gc.collect()
    return {"peak_bytes": peak - before, "peak_bytes_above_baseline": peak - start}


def detached(obj):
    """A copy of a stage's result (a tensor, a dataclass or a named tuple of them) with every float tensor
    detached and requiring grad, the others detached: the next stage's inputs, cut from the graph."""
    def cut(v):
        if not isinstance(v, torch.Tensor):
            return v
        v = v.detach()
        return v.requires_grad_() if v.is_floating_point() else v

    if isinstance(obj, torch.Tensor):
        return cut(obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: cut(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                           if f.init})
    if hasattr(obj, "_replace"):
        return obj._replace(**{k: cut(v) for k, v in obj._asdict().items()})
    raise TypeError(f"cannot detach a {type(obj).__name__}")


def float_tensors(obj):
    """The float tensors of a stage's result that carry gradient (the ones the next stage differentiates)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if dataclasses.is_dataclass(obj):
        vals = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        vals = list(obj._asdict().values())
    return [v for v in vals if isinstance(v, torch.Tensor) and v.requires_grad]


def stage_fns(layer, x):
    """{stage: callable} running each stage's forward + backward alone on detached inputs, with fixed
    random gradients of its outputs."""
    s = layer.stages()
    with torch.no_grad():
        r = s["route"](x)
        d = s["dispatch"](x, r)
        out = s["experts"](d.x, d.splits, d.probs)
    x_in = x.detach().requires_grad_()
    r_in, d_in, out_in = detached(r), detached(d), detached(out)
    gen = torch.Generator(device=x.device).manual_seed(2)

    def grads_for(outputs):
        return [torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in outputs]

    params = list(layer.module.parameters())

    def run(fn, inputs, grads):
        def call():
            for t in (*inputs, *params):
                t.grad = None
            outs = fn()
            torch.autograd.backward(float_tensors(outs), grads)
        return call

    with torch.enable_grad():
        r_out = float_tensors(s["route"](x_in))
        d_out = float_tensors(s["dispatch"](x_in, r_in))
    y_like = out_in.detach()
    return {
        "router": run(lambda: s["route"](x_in), [x_in], grads_for(r_out)),
        "permute": run(lambda: s["dispatch"](x_in, r_in), [x_in] + float_tensors(r_in), grads_for(d_out)),
        "experts": run(lambda: s["experts"](d_in.x, d_in.splits, d_in.probs), float_tensors(d_in),
                       grads_for([y_like])),
        "unpermute": run(lambda: s["combine"](out_in, d_in), [out_in], grads_for([x.detach()])),
    }


def layer_flops(shape):
    """The six expert GEMMs (18 R H F over R routed rows) and the router's three (6 T H E)."""
    R, T, H, F, E = shape["routed_rows"], shape["tokens"], shape["hidden"], shape["ffn"], shape["experts"]
    return 18.0 * R * H * F + 6.0 * T * H * E


def settle_gpu(seconds, device):
    from settle import settle

    settle(seconds, device)


def run_shape(shape, builders, a, device):
    """The entry of one shape: routing, memory (CUDA), the timed steps, the breakdown."""
    cuda = device.type == "cuda"
    entry = {k: v for k, v in shape.items() if k != "tokens_per_expert"}
    entry["flops"] = layer_flops(shape)
    failures = {}
    memory = {name: {"peak_bytes": None, "peak_bytes_above_baseline": None} for name in builders}
    if cuda:
        for name, build in builders.items():
            memory[name] = guarded(name, lambda build=build: measure_memory(build, shape, device), failures)
    w, x, g, choices = make_weights_and_inputs(shape, device)
    x.requires_grad_()
    layers = {}
    for name, build in builders.items():
        if name in failures:
            continue

        def first_step(build=build, w=w, x=x, g=g):
            layer = build(shape)
            layer.load(w)
            layer.step(x, g)  # a first step (warm-up): a Megatron configuration that cannot run fails here
            return layer

        layer = guarded(name, first_step, failures)
        if layer is not None:
            layers[name] = layer
    del w
    x.grad = None
    entry["failed"] = failures
    entry["routing_check"] = {name: routing_report(layer, x, choices, shape["experts"])
                              for name, layer in layers.items()}
    entry["megatron_core_classes"] = {name: layer.module.describe() for name, layer in layers.items()
                                      if isinstance(layer, Megatron)}
    if cuda:
        settle_gpu(a.settle_s, device)
    ms = run_samples({name: (lambda layer=layer, x=x, g=g: layer.step(x, g)) for name, layer in layers.items()},
                     a.iters, a.warmup, a.block, device)
    entry["layers"] = {name: {"ms": ms[name], "tflops": entry["flops"] / ms[name] / 1e9, **memory[name]}
                       for name in layers}
    entry["breakdown"] = {}
    if a.breakdown:
        fns = {}
        for name, layer in layers.items():
            if layer.stages() is not None:
                fns.update({(name, st): fn for st, fn in stage_fns(layer, x.detach()).items()})
        stage_ms = run_samples(fns, a.iters, a.warmup, a.block, device) if fns else {}
        for name in layers:
            per = {st: stage_ms[(name, st)] for st in STAGES if (name, st) in stage_ms}
            if not per:
                continue
            total = sum(per.values())
            entry["breakdown"][name] = {
                **{st: {"ms": v, "fraction": v / total, "fraction_of_layer": v / ms[name]} for st, v in per.items()},
                "sum_ms": total, "layer_ms": ms[name]}
    del layers, x, g
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if "ours" in builders:
        me.check_errors(device)  # raises if a kernel saw bad splits (the run's device: a CPU run never asks CUDA)
    layer_report.add_ratios(entry)
    return entry


def family(name):
    """megatron_core_alltoall -> megatron_core; others as they are."""
    return "megatron_core" if name.startswith("megatron_core_") else name


def megatron_summary(entries):
    """Megatron-core's version, experts class and setup notes, where it ran."""
    classes = {k: v for e in entries for k, v in e.get("megatron_core_classes", {}).items()}
    if not classes:
        return None
    return {"version": megatron_layer.version(),
            "experts_class": sorted({v["experts_class"] for v in classes.values()}),
            "dispatchers": {k: v["dispatcher_class"] for k, v in classes.items()},
            "grouped_gemm_importable": megatron_layer.grouped_gemm_available(),
            "setup": textwrap.dedent(megatron_layer.__doc__.split("What runs, and why:\n")[1]).strip("\n")}


def parse_list(choices, what):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{what}: a comma-separated subset of {','.join(choices)}; got '{text}'")
        return [c for c in choices if c in items]
    return parse


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--md":
        sys.stdout.write(layer_report.markdown(json.load(open(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description="The whole MoE layer, forward + backward: moe_engine's MoELayer vs a "
                                             "torchtitan-style layer and Megatron-core's; see this file's header.")
    ap.add_argument("--workloads", default=os.path.join(HERE, "..", "workloads.json"))
    ap.add_argument("--cases", default="", help="only the cases whose name contains SUBSTR")
    ap.add_argument("--routings", type=parse_list(("balanced", "mild", "heavy"), "--routings"), default="balanced",
                    help="which routings of each model (default balanced)")
    ap.add_argument("--layers", type=parse_list(("ours", "torchtitan", "megatron"), "--layers"),
                    default="ours,torchtitan,megatron")
    ap.add_argument("--megatron-dispatchers", type=parse_list(("alltoall", "allgather"), "--megatron-dispatchers"),
                    default="alltoall,allgather")
    ap.add_argument("--megatron-experts", choices=("auto", "grouped", "sequential"), default="auto",
                    help="GroupedMLP (grouped_gemm package) or SequentialMLP; auto: grouped where it imports")
    ap.add_argument("--glu-layout", default="blocks:32", help="our FC1 row layout (default blocks:32)")
    ap.add_argument("--iters", type=int, default=20, help="timed samples per layer and stage (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each first")
    ap.add_argument("--block", type=int, default=2, help="back-to-back steps per timed sample")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the per-stage timing")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the check against the anchor")
    ap.add_argument("--settle-s", type=float, default=1.0, help="dense GEMMs this long before each shape's timing")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke test (host clock, no memory numbers)")
    ap.add_argument("--out", default="", help="PREFIX.json: also PREFIX.md and PREFIX.png")
    a = ap.parse_args()
    if a.iters < 1 or a.block < 1 or a.warmup < 0:
        ap.error("--iters and --block must be at least 1, --warmup at least 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("layer-bench.py: no CUDA device here (--device cpu runs the smoke test)")
    device = torch.device(a.device)
    if a.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # an index: Megatron's set_device needs one
    cases = [c for c in json.load(open(a.workloads))["cases"]
             if a.cases in c["name"] and c.get("routing", c["name"].split("/")[-1]) in a.routings]
    if not cases:
        raise SystemExit(f"layer-bench.py: no case of {a.workloads} matches '{a.cases}' with routings {a.routings}")
    shapes = [shape_of(c) for c in cases]
    builders, status = available_layers(a, device)
    for name, line in status.items():
        print(f"{name}: {line}")
    if "torchtitan_style" not in builders:
        raise SystemExit("layer-bench.py: the torchtitan-style layer is the reference: --layers must include torchtitan")

    check = None
    if a.check and len(builders) > 1:
        failures = {}
        check = {"case": shapes[0]["case"], "tolerance": CHECK_TOLERANCE,
                 "relative_errors": check_layers(shapes[0], builders, device, failures)}
        for name, why in failures.items():  # not timed then
            del builders[name]
            status[name] = f"failed on {shapes[0]['case']}: {why}"
        errors = [e for errs in check["relative_errors"].values() for e in errs.values()]
        if errors:
            print(f"correctness on {shapes[0]['case']}: every layer within {max(errors):.2g} of the "
                  f"torchtitan-style one (limit {CHECK_TOLERANCE})")
        else:  # every other layer failed: the torchtitan-style one is timed alone
            print(f"correctness on {shapes[0]['case']}: no other layer ran; the torchtitan-style one alone")
        gc.collect()

    entries = []
    for shape in shapes:
        e = run_shape(shape, builders, a, device)
        entries.append(e)
        print(layer_report.progress_line(e), flush=True)

    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "torch_version": torch.__version__, "moe_engine_version": moe_engine.__version__,
        "layers": {name: {"what": LAYER_WHAT[family(name)], "status": line} for name, line in status.items()},
        "megatron_core": megatron_summary(entries),
        "glu_layout": a.glu_layout,
        "routing": ROUTING_DESCRIPTION,
        "iters": a.iters, "warmup": a.warmup, "block": a.block,
        "timing": f"median over {a.iters} samples of {a.block} back-to-back steps (forward + backward of the whole "
                  "layer, y.backward(g), every .grad unset before the step), layers alternated sample by sample; the "
                  "breakdown's stages timed the same way, each alone on detached inputs"
                  + ("; CUDA events, GPU settled first; each sample after a synchronize and one untimed step of "
                     "the same layer (no layer inherits another's idle GPU or queue)" if device.type == "cuda"
                     else "; host clock"),
        "memory": MEMORY_DEFINITIONS if device.type == "cuda" else "not measured on the CPU",
        "correctness_check": check,
        **layer_report.summarize(entries),
        "plot": None,
        "entries": entries,
    }
    print(layer_report.summary_line(summary))
    if a.out:
        prefix = os.path.splitext(a.out)[0]
        summary["plot"] = layer_report.plot(summary, prefix + ".png")
        json.dump(summary, open(a.out, "w"), indent=2)
        with open(prefix + ".md", "w") as f:
            f.write(layer_report.markdown(summary))


if __name__ == "__main__":
    main()
