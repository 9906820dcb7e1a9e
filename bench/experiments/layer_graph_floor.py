"""The MoE layer's step with the host out of the way: the step (forward + backward, grads unset)
captured once in a CUDA graph and replayed, beside eager steps, for ours and the torchtitan-style
layer. The graph replay's time is the step's GPU work alone; where eager is slower, the host bounds
it. What the performance log's "Issue 25" section quotes for the small batch.

    python bench/experiments/layer_graph_floor.py
"""
import os
import importlib.util, sys, json, torch
sys.argv = ["x"]
spec = importlib.util.spec_from_file_location("lb", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "drivers", "layer-bench.py"))
lb = importlib.util.module_from_spec(spec); spec.loader.exec_module(lb)
dev = torch.device("cuda")
wl = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workloads.json"))); cases = {c["name"]: c for c in (wl["cases"] if isinstance(wl, dict) else wl)}
for name in ["qwen3-30b-a3b-small-batch/balanced", "qwen3-30b-a3b/balanced"]:
    shape = lb.shape_of(cases[name])
    w, x, g, _ = lb.make_weights_and_inputs(shape, dev)
    x.requires_grad_()
    for kind in ("ours", "tt"):
        layer = lb.Ours(shape, "blocks:32", dev) if kind == "ours" else lb.Torchtitan(shape, True, dev)
        layer.load(w)
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3): layer.step(x, g)
        torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
        def timed(fn, n=20):
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            fn(); torch.cuda.synchronize(); a.record()
            for _ in range(n): fn()
            b.record(); torch.cuda.synchronize(); return a.elapsed_time(b) / n
        eager = timed(lambda: layer.step(x, g))
        try:
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                layer.step(x, g)
            graph = timed(gr.replay)
        except Exception as e:
            graph = float("nan"); print("capture failed", kind, repr(e)[:200])
        print(f"{name} {kind}: eager {eager:.3f} ms, graph replay {graph:.3f} ms", flush=True)
        layer = None; torch.cuda.empty_cache()
