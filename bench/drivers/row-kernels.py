"""The MoE layer's non-GEMM kernels on the GPU, per launch, at the suite's model shapes (issue 25):
the router's (logits, top-k, backward, dgrad, wgrad) and the row kernels (permute, unpermute,
unpermute_backward), whose bandwidth is set against a same-run device copy of an [R, H] tensor
(the achievable HBM ceiling) and torch's own kernels for the same data movement (a broadcast copy
[T, H] -> [R, H] and a sum [R, H] -> [T, H]).

    python bench/drivers/row-kernels.py --out results/DATE-row-kernels-h200.json

Every row kernel reads or writes [T, H] once and [R, H] once (R = T k routed rows): its bytes are
(T + R) H times the element size. The router runs forward + backward on the layer's router
(bf16 x and weight); permute, unpermute and their backward on the layer's routing, without probs
(the layer's combine: the experts applied them). CUDA only.
"""
import argparse
import collections
import importlib.util
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("layer_bench", os.path.join(here, "layer-bench.py"))
lb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lb)


def kernels(fn, reps=10):
    """Mean GPU time per launch of each kernel fn launches, us, by name."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = collections.defaultdict(float)
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            out[e.key] += e.self_device_time_total / e.count
    return out


def short(name):
    """A kernel's name without its namespaces, template arguments and parameters."""
    name = name.replace("void ", "").replace("(anonymous namespace)::", "").replace("moe::cuda::", "")
    return name.split("(")[0].split("<")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON path; the Markdown goes beside it")
    ap.add_argument("--cases", default="", help="substrings of the case names to keep (comma-separated)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("row-kernels.py: needs a CUDA GPU (it times kernels with the torch profiler)")
    from moe_engine.torch import routing
    dev = torch.device("cuda")
    wl = json.load(open(os.path.join(here, "..", "workloads.json")))
    cases = [c for c in (wl["cases"] if isinstance(wl, dict) else wl) if c["name"].endswith("/balanced")]
    if args.cases:
        cases = [c for c in cases if any(s in c["name"] for s in args.cases.split(","))]
    rows = []
    for case in cases:
        shape = lb.shape_of(case)
        w, x, g, _ = lb.make_weights_and_inputs(shape, dev)
        layer = lb.Ours(shape, "blocks:32", dev)
        layer.load(w)
        m = layer.module
        xr = x.detach().clone().requires_grad_()

        def router_step():
            xr.grad = None
            m.router.weight.grad = None
            r = m.router(xr)
            torch.autograd.backward([r.probs], [torch.ones_like(r.probs)])

        router = {}
        for key, us in kernels(router_step).items():
            if "at::native" not in key:
                router[short(key)] = router.get(short(key), 0.0) + us
        with torch.no_grad():
            r = m.route(x)
        xd = x.detach().clone().requires_grad_()

        def rows_step():
            xd.grad = None
            d = routing.dispatch(xd, r.probs, r.indices, shape["experts"])
            routing.combine(d.x, d).backward(g)

        R, H, T, k = shape["routed_rows"], shape["hidden"], shape["tokens"], shape["topk"]
        nbytes = (R + T) * H * x.element_size()
        src = torch.empty(R, H, dtype=x.dtype, device=dev)
        dst = torch.empty_like(src)
        xs = torch.empty(T, H, dtype=x.dtype, device=dev)
        ks = kernels(rows_step)
        copy_us = sum(kernels(lambda: dst.copy_(src)).values())
        bcast_us = sum(kernels(lambda: dst.view(T, k, H).copy_(xs.unsqueeze(1).expand(T, k, H))).values())
        sum_us = sum(kernels(lambda: torch.sum(src.view(T, k, H), dim=1, out=xs)).values())
        copy_tbs = 2 * src.numel() * src.element_size() / copy_us / 1e6
        row = {"case": case["name"], "tokens": T, "experts": shape["experts"], "hidden": H, "topk": k,
               "router_us_per_launch": router, "copy_tb_s": copy_tbs,
               "torch_broadcast_tb_s": nbytes / bcast_us / 1e6, "torch_sum_tb_s": nbytes / sum_us / 1e6,
               "row_kernels": {}}
        for key, us in ks.items():
            name = short(key)
            if name in ("permute_kernel", "unpermute_kernel", "unpermute_backward_kernel"):
                tbs = nbytes / us / 1e6
                row["row_kernels"][name] = {"us_per_launch": us, "tb_s": tbs, "fraction_of_copy": tbs / copy_tbs}
        rows.append(row)
        print(json.dumps(row), flush=True)
        layer = m = None  # freed before the next case (the closures above read them)
        torch.cuda.empty_cache()
    fractions = [v["fraction_of_copy"] for r in rows if r["tokens"] >= 4096 for v in r["row_kernels"].values()]
    if not fractions:
        sys.exit("row-kernels.py: found none of the row kernels in the profile")
    out = {"device": torch.cuda.get_device_name(), "command": "python bench/drivers/row-kernels.py " + " ".join(sys.argv[1:]),
           "min_row_kernel_fraction_of_copy": min(fractions) if fractions else None, "cases": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    md = [f"# The layer's router and row kernels per launch, {out['device']}", "",
          f"`{out['command']}`: torch profiler, mean of 10 launches after 3; bytes of a row kernel: (T + R) H x 2 "
          "(it reads or writes [T, H] once and [R, H] once); ceilings measured in the same run. "
          f"Row kernels at >= 4096 tokens: min **{out['min_row_kernel_fraction_of_copy']:.2f}** of the copy.", "",
          "| case | copy TB/s | torch broadcast | torch sum | permute | unpermute | unpermute_backward |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cell = lambda n: (f"{r['row_kernels'][n]['us_per_launch']:.1f} us, {r['row_kernels'][n]['tb_s']:.2f} TB/s "
                          f"({r['row_kernels'][n]['fraction_of_copy']:.2f})") if n in r["row_kernels"] else "-"
        md.append(f"| {r['case']} | {r['copy_tb_s']:.2f} | {r['torch_broadcast_tb_s']:.2f} | {r['torch_sum_tb_s']:.2f} | "
                  f"{cell('permute_kernel')} | {cell('unpermute_kernel')} | {cell('unpermute_backward_kernel')} |")
    md += ["", "Router kernels, us per launch (forward + backward of the router alone):", "",
           "| case | " + " | ".join(["logits", "top-k", "backward", "dgrad", "wgrad", "add slices"]) + " |",
           "|---|" + "---:|" * 6]
    for r in rows:
        def pick(s):
            return next((f"{v:.1f}" for k, v in r["router_us_per_launch"].items() if s in k), "-")
        md.append(f"| {r['case']} | " + " | ".join(pick(s) for s in ["router_logits", "router_forward_kernel",
                                                                       "router_backward_kernel", "router_dgrad",
                                                                       "router_wgrad", "add_slices"]) + " |")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
