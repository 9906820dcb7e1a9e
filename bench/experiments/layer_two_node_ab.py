"""The layer's step with the experts' backward in one autograd node against two (FC2's, then
dispatch + FC1's), alternating in one run: GPU time per step (layer-bench's sampling), host time
per step (enqueue only, the GPU kept busy) and peak memory of a steady step. What the performance
log's row on the two-node backward quotes.

    CASES=small-batch,qwen3-30b-a3b/ python bench/experiments/layer_two_node_ab.py
"""
import importlib.util, os, sys, time, json
sys.argv = ["x"]
here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("lb", os.path.join(here, "..", "drivers", "layer-bench.py"))
lb = importlib.util.module_from_spec(spec); spec.loader.exec_module(lb)
import torch
from moe_engine.torch import layer as layer_mod, modules

dev = torch.device("cuda")
wl = json.load(open(os.path.join(here, "..", "workloads.json")))
cases = [c for c in (wl["cases"] if isinstance(wl, dict) else wl) if c["name"].endswith("/balanced")]
wanted = os.environ.get("CASES", "small-batch").split(",")
def use(two: bool):  # the fused step's two-node form at every size, or at none
    layer_mod._TWO_NODE_MIN_BYTES = 0 if two else 1 << 62


for case in cases:
    if not any(w in case["name"] for w in wanted):
        continue
    shape = lb.shape_of(case)
    w, x, g, _ = lb.make_weights_and_inputs(shape, dev)
    x.requires_grad_()
    ours = lb.Ours(shape, "blocks:32", dev)
    ours.load(w)
    del w

    def step_with(two):
        def fn():
            use(two)
            ours.step(x, g)
        return fn

    fns = {"two nodes": step_with(True), "one node": step_with(False)}
    lb.settle_gpu(1.0, dev)
    gpu = lb.run_samples(fns, 30, 3, 2, dev)
    host = {}
    for name, fn in fns.items():  # host time of 10 steps enqueued behind a busy GPU
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e9))
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        host[name] = (time.perf_counter() - t0) / 10 * 1e3
        torch.cuda.synchronize()
    mem = {}
    for name, fn in fns.items():
        fn()
        x.grad = None
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        mem[name] = (torch.cuda.max_memory_allocated() - start) / 2**30
    print(f"{case['name']:36s} " + "  ".join(
        f"{n}: {gpu[n]:.3f} ms GPU, {host[n]:.3f} ms host, +{mem[n]:.2f} GiB peak" for n in fns), flush=True)
    ours = x = g = None
    torch.cuda.empty_cache()
