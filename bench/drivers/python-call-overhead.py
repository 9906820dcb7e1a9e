#!/usr/bin/env python3
"""The Python -> C++ call overhead of the PyTorch layer: microseconds per call of a tiny CPU problem
(G = 2 experts, T = 8 rows, K = N = 16), where the C++ work is a few hundred nanoseconds and the
rest is the call path (argument conversion, routing, torch's dispatcher). Best of --repeat runs of
--number calls each, in CPU time of this process (time.process_time: time on a shared machine
while other work has the core does not count). Run it with OMP_NUM_THREADS=1 (and, on a busy
machine, pinned to a core with taskset) for steady numbers.

    OMP_NUM_THREADS=1 .venv/bin/python bench/drivers/python-call-overhead.py [--number 20000] [--repeat 7]

Rows: the extension call alone (`_C`, routing computed per call, as an op does it), the custom op
through torch.ops, the functional API, and the modules' forward (no grad) and forward + backward.

Times on a shared machine vary by several percent; instruction counts do not. With --callgrind N
each row runs N times inside one functools.reduce call (and prints its name), for callgrind to
count those calls only, one profile dump per row:

    OMP_NUM_THREADS=1 PYTHONHASHSEED=0 valgrind --tool=callgrind --collect-atstart=no \
        --toggle-collect=functools_reduce --dump-after=functools_reduce --callgrind-out-file=cg.out \
        .venv/bin/python bench/drivers/python-call-overhead.py --callgrind 100
    # instructions per call of row i: the "summary:" of cg.out.<i+1>, divided by 100
"""

import argparse
import functools
import time
import timeit

import torch

import moe_engine.torch as me
from moe_engine import _C


def extension_call(x, w, s, y):
    """One `_C.grouped_linear_forward` call with the routing computed for it, in this version's API."""
    if hasattr(_C, "route"):
        def call():
            routing = _C.route(s, torch.empty(3, dtype=torch.int64), x, 0, "grouped_linear_forward", "x")
            _C.grouped_linear_forward(x, ([w], None), routing, y, ([], None), None, 0)

        routing = _C.route(s, torch.empty(3, dtype=torch.int64), x, 0, "grouped_linear_forward", "x")

        def call_routed():
            _C.grouped_linear_forward(x, ([w], None), routing, y, ([], None), None, 0)

        return call, call_routed
    from moe_engine.torch._bridge import desc, grouped, offsets_for  # descriptor tuples (older versions)

    def call():
        offsets = offsets_for(s)
        _C.grouped_linear_forward(desc(x), grouped([w], 2), desc(s), desc(offsets), desc(y), grouped([], 1),
                                  desc(None), [desc(y)], 0)

    return call, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--callgrind", type=int, default=0, metavar="N",
                    help="run each row N times inside functools.reduce, for callgrind (see the docstring)")
    args = ap.parse_args()
    torch.manual_seed(0)
    G, T, K, N = 2, 8, 16, 16
    x, w, s, y = torch.randn(T, K), torch.randn(G, N, K), torch.tensor([3, 5]), torch.empty(T, N)
    linear = me.GroupedLinear(G, K, N, device="cpu", dtype=torch.float32)
    mlp = me.GroupedMLP(G, K, N, device="cpu", dtype=torch.float32)
    xg = x.clone().requires_grad_()

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    def train(module):
        def run():
            module(xg, s).sum().backward()
        return run

    call, call_routed = extension_call(x, w, s, y)
    rows = [("_C.grouped_linear_forward, routing per call", call)]
    if call_routed is not None:
        rows.append(("_C.grouped_linear_forward, routing given", call_routed))
    rows += [
        ("torch.ops.moe_engine.grouped_linear", no_grad(lambda: torch.ops.moe_engine.grouped_linear(x, [w], s, [], None))),
        ("me.grouped_linear (no grad)", no_grad(lambda: me.grouped_linear(x, w, s))),
        ("GroupedLinear forward (no grad)", no_grad(lambda: linear(x, s))),
        ("GroupedMLP forward (no grad)", no_grad(lambda: mlp(x, s))),
        ("GroupedLinear forward + backward", train(linear)),
        ("GroupedMLP forward + backward", train(mlp)),
    ]
    if args.callgrind:
        for name, fn in rows:
            for _ in range(30):
                fn()
            print(name, flush=True)
            functools.reduce(lambda acc, _: fn(), range(args.callgrind), None)
        return
    print(f"torch {torch.__version__}; best of {args.repeat} x {args.number} calls, CPU time")
    for name, fn in rows:
        number = args.number if "backward" not in name else max(args.number // 10, 1)
        fn()
        best = min(timeit.Timer(fn, timer=time.process_time).repeat(number=number, repeat=args.repeat)) / number
        print(f"{name:48s} {best * 1e6:8.2f} us")


if __name__ == "__main__":
    main()
