"""The router's forward + backward (moe_engine.torch.Router) at the suite's router shapes, timed
with CUDA events, and its kernels per step (torch.profiler; the grouped GEMM's instances named by
form). For A/B runs of two builds or settings in one device call.

    python bench/experiments/router_logits_ab.py [LABEL]
"""
import collections
import re
import sys

import torch

import moe_engine.torch as me

# (name, tokens T, hidden H, experts E, topk): the suite's layers (bench/workloads.json's router
# shapes) and deepseek's expert-parallel router at 2 and 4 GPUs (E grows with P).
SHAPES = [("mixtral", 8192, 4096, 8, 2), ("deepseek-v3", 8192, 7168, 256, 8), ("qwen3", 8192, 2048, 128, 8),
          ("gpt-oss", 8192, 2880, 128, 4), ("qwen3-small-batch", 512, 2048, 128, 8),
          ("deepseek-ep-P2", 8192, 7168, 64, 8), ("deepseek-ep-P4", 8192, 7168, 128, 8)]


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    dev = torch.device("cuda")
    for name, T, H, E, k in SHAPES:
        torch.manual_seed(0)
        router = me.Router(H, E, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16).requires_grad_()
        g = torch.randn(T, k, device=dev)

        def step():
            x.grad = None
            router.weight.grad = None
            r = router(x)
            (r.probs * g).sum().backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            start.record()
            for _ in range(10):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 10)
        times.sort()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        per = collections.defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                n = e.name.replace("(anonymous namespace)::", "")
                form = re.search(r"grouped_gemm_kernel<\(moe::cuda::Form\)(\d)", n)
                if form:  # the router's GEMMs apart: forward (logits), dgrad (dx), wgrad (weight)
                    n = "grouped_gemm " + ("forward", "dgrad", "wgrad")[int(form.group(1))]
                else:
                    n = n.split("(")[0].replace("void ", "").replace("moe::cuda::", "")[:60]
                per[n] += e.device_time_total / 1e3 / 5
        top = ", ".join(f"{n} {ms * 1e3:.0f} us" for n, ms in sorted(per.items(), key=lambda kv: -kv[1])[:7])
        print(f"{label} {name}: T {T} H {H} E {E}: step {times[len(times) // 2]:.3f} ms (min {times[0]:.3f}); {top}")


if __name__ == "__main__":
    main()
