#!/usr/bin/env python3
"""Runs one torch._grouped_mm GEMM of a workloads.json case back to back for a few seconds (no
cache flush between calls) and prints its median time: the sustained-clock counterpart of
`moe-engine bench gemm --min-time-ms` (scripts/gpu power-probe runs both). Inputs as in
torch_anchor.py (randn)."""
import argparse, json, time
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--workloads", required=True)
ap.add_argument("--case", required=True)
ap.add_argument("--gemm", default="fc2/wgrad")
ap.add_argument("--seconds", type=float, default=3.0)
a = ap.parse_args()
c = next(c for c in json.load(open(a.workloads))["cases"] if a.case in c["name"])
E, H, Fd, T = c["experts"], c["hidden"], c["ffn"], c["tokens"]
fc, form = a.gemm.split("/")
N, K = (2 * Fd, H) if fc == "fc1" else (H, Fd)
dev, bf = "cuda", torch.bfloat16
offs = torch.cumsum(torch.tensor(c["tokens_per_expert"]), 0).to(torch.int32).to(dev)
x = torch.randn(T, K, device=dev, dtype=bf)
w = torch.randn(E, N, K, device=dev, dtype=bf) * K ** -0.5
dy = torch.randn(T, N, device=dev, dtype=bf)
fn = {"fwd": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
      "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
      "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs)}[form]
for _ in range(3):
    fn()
torch.cuda.synchronize()
times, t_end = [], time.time() + a.seconds
while time.time() < t_end:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); fn(); e.record(); e.synchronize()
    times.append(s.elapsed_time(e))
times.sort()
flops = 2.0 * T * N * K
print(f"torch sustained {c['name']} {a.gemm}: median {times[len(times)//2]:.4f} ms over {len(times)} runs, "
      f"{flops / times[len(times)//2] / 1e9:.1f} TFLOP/s")
