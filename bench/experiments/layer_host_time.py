"""Host time of the MoE layer's eager step, split by function: every moe_engine._C call, torch's
allocators (empty, zeros, empty_like, zeros_like) and the forward / backward of the layer's four
autograd Functions are wrapped with a timer (nested: a Function's time includes its _C calls).
What the performance log's "Issue 25" section quotes for the small batch.

    CASE=qwen3-30b-a3b-small-batch/balanced N=100 python bench/experiments/layer_host_time.py
    ONE_NODE=1 ...   the experts' backward (and so the layer's fused step) as one autograd node

DEV=cpu runs it on the CPU (the C++ calls then include the CPU backend's compute).
"""
import importlib.util, sys, time, json, os, functools, collections
sys.argv = ["x"]
spec = importlib.util.spec_from_file_location("lb", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "drivers", "layer-bench.py"))
lb = importlib.util.module_from_spec(spec); spec.loader.exec_module(lb)
import torch
import moe_engine._C as C
from moe_engine.torch import routing, _autograd, ops
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(name, f):
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t; cnt[name] += 1
    return g
for n in dir(C):
    f = getattr(C, n)
    if callable(f) and not isinstance(f, type) and not n.startswith("_"):
        setattr(C, n, wrap("_C." + n, f))
for n in ("empty", "zeros", "empty_like", "zeros_like"):
    setattr(torch, n, wrap("torch." + n, getattr(torch, n)))
from moe_engine.torch import layer as layer_mod
fns = {"router": routing._RouterFunction, "mlp": _autograd._GroupedMLPFunction,
       "mlp_fc1": _autograd._GroupedMLPFc1Function, "mlp_fc2": _autograd._GroupedMLPFc2Function,
       "layer_one_node": layer_mod._DispatchExpertsCombine, "layer_dispatch_fc1": layer_mod._DispatchFc1,
       "layer_fc2_combine": layer_mod._Fc2Combine,
       "permute": routing._permute._function, "unpermute": routing._unpermute._function}
if os.environ.get("ONE_NODE"):  # the experts' backward as one node (the layer then runs as one node too)
    layer_mod._mlp_two_nodes = lambda *a: False
for k, cls in fns.items():
    for m in ("forward", "backward"):
        setattr(cls, m, staticmethod(wrap(f"{k}.{m}", getattr(cls, m))))
dev = torch.device(os.environ.get("DEV", "cuda"))
wl = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workloads.json"))); cases = {c["name"]: c for c in (wl["cases"] if isinstance(wl, dict) else wl)}
shape = lb.shape_of(cases[os.environ.get("CASE", "qwen3-30b-a3b-small-batch/balanced")])
w, x, g, _ = lb.make_weights_and_inputs(shape, dev)
x.requires_grad_()
layer = lb.Ours(shape, "blocks:32", dev); layer.load(w); m = layer.module
def step():
    x.grad = None
    for p in m.parameters(): p.grad = None
    t0 = time.perf_counter(); y = m(x); t1 = time.perf_counter(); y.backward(g); t2 = time.perf_counter()
    acc["STEP forward"] += t1 - t0; acc["STEP backward"] += t2 - t1; cnt["STEP forward"] += 1; cnt["STEP backward"] += 1
for _ in range(10): step()
(torch.cuda.synchronize() if dev.type == "cuda" else None); acc.clear(); cnt.clear()
n = int(os.environ.get("N", 200))
for _ in range(n): step()
(torch.cuda.synchronize() if dev.type == "cuda" else None)
for k in sorted(acc, key=lambda k: -acc[k]):
    print(f"{k:45s} {1e6*acc[k]/n:8.1f} us/step  {cnt[k]/n:5.1f} calls/step  {1e6*acc[k]/max(cnt[k],1):7.1f} us/call")
