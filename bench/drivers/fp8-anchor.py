#!/usr/bin/env python3
"""FP8 anchors for `moe-engine bench gemm --dtype fp8 --anchor FILE`, measured with PyTorch on one
CUDA GPU in the same device run, on the cases of bench/workloads.json with the same group sizes.

Per case and per FC layer (FC1 [T,H] x [G,2F,H]^T, FC2 [T,F] x [G,H,F]^T), for forward, dgrad and
wgrad, GEMM time only (operands quantized beforehand, untimed):
  scaled_grouped_mm  torch._scaled_grouped_mm with rowwise FP8 (one scale per row of A and per
                     column of B, int32 device offsets). wgrad is its 2d-2d form (groups along the
                     contraction axis, scales per expert and channel).
  loop               a per-expert loop of cuBLAS block-scaled FP8 GEMMs (torch's scaled_mm, 1x128
                     activation/gradient scales, 128x128 weight scales; wgrad 1x128 x 1x128) over
                     host-side split sizes, each writing its slice of one output: the shape of
                     TransformerEngine's released Hopper path. Timed on 1 stream and on several
                     (--loop-streams); the best is the entry.
  dense_fp8          one dense FP8 GEMM with the same M, N, K totals (torch._scaled_mm tensorwise and
                     rowwise; the better is the entry): the same-run FP8 ceiling of each GEMM.
  dense_fp8_blockwise  the same dense GEMM with the recipe's block scales (cuBLAS through
                     F.scaled_mm: 1x128 x 128x128, wgrad 1x128 x 1x128), every dimension rounded up
                     to a multiple of 128 (TFLOP/s counted on the unpadded FLOPs): the same-run
                     ceiling of block-scaled FP8, whose promotion every 128 of K costs what
                     tensorwise scaling does not pay.
Once per run: dense 8192^3 in bf16 (dense_8192_tflops, as torch_anchor.py) and in FP8.

Timing: triton.testing.do_bench, median, 10 ms warm-up and 100 ms of runs, 256 MB of L2 flush
before each run (what torch_anchor.py uses). Each result is checked against a bf16 torch GEMM of
the unquantized inputs (its relative Frobenius error is `..._rel_err`); a layout that torch rejects
or whose result is wrong is retried in the next candidate layout (`..._note` says which ran).

Keys of a case entry: `{fc}_{path}_{gemm}_ms` and `_tflops` (FLOPs 2*T*N*K of the unpadded problem),
`_rel_err`, `_note`; a measurement that could not run has `{fc}_{path}_{gemm}_ms: {"error": "..."}`
and no `_tflops`. Inputs are randn (weights scaled by K^-0.5), quantized with amax scaling.

Robustness: a CUDA error that poisons the context (a device-side assert, an illegal address) is
recorded for its entry; the script then saves what it has and restarts itself to go on with the
rest (at most 3 times).

Usage: fp8-anchor.py [--workloads PATH] [--cases SUBSTRING] [--out FILE] [--loop-streams 1,4]
       fp8-anchor.py --dry-run   (no GPU: checks the argument layouts on the CPU and on 'meta')
"""
import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
FORMAT = "moe-engine fp8 anchor 1"
GEMMS = ("fwd", "dgrad", "wgrad")
FP8_MAX = 448.0  # largest finite E4M3 value
TINY = 1e-12  # amax floor: an all-zero block (padding) gets a finite scale
# A result further than this from the bf16 GEMM of the unquantized inputs is a wrong layout, not
# FP8 rounding (E4M3 with amax scaling gives ~0.03-0.06 on randn inputs).
MAX_REL_ERR = 0.25
# Errors after which the CUDA context is unusable: the process must restart to measure more.
FATAL_CUDA = ("device-side assert", "illegal memory access", "unspecified launch failure",
              "misaligned address", "illegal instruction", "CUDA error: an illegal")

torch = None  # imported in main(), so that --help works without PyTorch
F = None


def ceil_div(a, b):
    return -(-a // b)


def round_up(a, b):
    return ceil_div(a, b) * b


# ---------------------------------------------------------------------------------------------
# Quantizers (amax scaling; the returned scales are what the GEMMs multiply by, i.e. amax / 448)

def q_rows(t):
    """One scale per row (amax over the last dim): t [..., R, C] -> q, s [..., R]."""
    tf = t.float()
    s = tf.abs().amax(dim=-1).clamp(min=TINY) / FP8_MAX
    return (tf / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s


def q_1x128(t):
    """One scale per 1x128 block along the last dim: t [R, C] -> q [R, C], s [R, ceil(C/128)]."""
    R, C = t.shape
    cb = ceil_div(C, 128)
    tf = F.pad(t.float(), (0, cb * 128 - C)).view(R, cb, 128)
    s = tf.abs().amax(dim=-1).clamp(min=TINY) / FP8_MAX
    q = (tf / s.unsqueeze(-1)).view(R, cb * 128)[:, :C].to(torch.float8_e4m3fn).contiguous()
    return q, s


def q_128x128(w):
    """One scale per 128x128 block: w [E, R, C] -> q [E, R, C], s [E, ceil(R/128), ceil(C/128)]."""
    E, R, C = w.shape
    rb, cb = ceil_div(R, 128), ceil_div(C, 128)
    wf = F.pad(w.float(), (0, cb * 128 - C, 0, rb * 128 - R)).view(E, rb, 128, cb, 128)
    s = wf.abs().amax(dim=(2, 4)).clamp(min=TINY) / FP8_MAX
    q = (wf / s[:, :, None, :, None]).view(E, rb * 128, cb * 128)[:, :R, :C]
    return q.to(torch.float8_e4m3fn).contiguous(), s


# ---------------------------------------------------------------------------------------------
# Token layouts: per-expert row counts, optionally padded (zero rows) for an API's alignment rule

def padded_counts(counts, align, min_rows=0):
    return [max(round_up(c, align), min_rows) for c in counts]


def starts(counts):
    out, s = [], 0
    for c in counts:
        out.append(s)
        s += c
    return out


def pad_rows(t, counts, pcounts):
    """Rows of each expert moved to the padded layout; the padding rows are zero."""
    if list(counts) == list(pcounts):
        return t
    out = t.new_zeros((sum(pcounts),) + tuple(t.shape[1:]))
    for s, ps, c in zip(starts(counts), starts(pcounts), counts):
        if c:
            out[ps:ps + c] = t[s:s + c]
    return out


def unpad_rows(t, counts, pcounts):
    if list(counts) == list(pcounts):
        return t
    return torch.cat([t[ps:ps + c] for ps, c in zip(starts(pcounts), counts)])


def pad_last(t, multiple):
    extra = round_up(t.shape[-1], multiple) - t.shape[-1]
    return F.pad(t, (0, extra)) if extra else t


# ---------------------------------------------------------------------------------------------
# One FC layer of one case: the bf16 operands and, lazily, the GEMMs of each path

class Layer:
    def __init__(self, counts, N, K, device, seed, cpu_float=False):
        self.counts, self.N, self.K, self.device = list(counts), N, K, device
        self.E, self.T = len(counts), sum(counts)
        self.flops = 2.0 * self.T * N * K
        dt = torch.float32 if cpu_float else torch.bfloat16
        if device == "meta":
            self.x = torch.empty(self.T, K, device=device, dtype=dt)
            self.w = torch.empty(self.E, N, K, device=device, dtype=dt)
            self.dy = torch.empty(self.T, N, device=device, dtype=dt)
        else:
            g = torch.Generator(device=device).manual_seed(seed)
            self.x = torch.randn(self.T, K, device=device, dtype=dt, generator=g)
            self.w = torch.randn(self.E, N, K, device=device, dtype=dt, generator=g) * K ** -0.5
            self.dy = torch.randn(self.T, N, device=device, dtype=dt, generator=g)
        self.offs = torch.tensor(starts(self.counts)[1:] + [self.T], dtype=torch.int32).to(device)
        self._ref = {}

    # The bf16 result each FP8 path is compared with (per-expert matmuls: any torch has them).
    def reference(self, gemm):
        if gemm not in self._ref:
            x, w, dy = self.x, self.w, self.dy
            parts = []
            for e, (s, c) in enumerate(zip(starts(self.counts), self.counts)):
                if gemm == "fwd":
                    parts.append(x[s:s + c] @ w[e].t())
                elif gemm == "dgrad":
                    parts.append(dy[s:s + c] @ w[e])
                else:
                    parts.append((dy[s:s + c].t() @ x[s:s + c]).unsqueeze(0))
            self._ref[gemm] = torch.cat(parts)
        return self._ref[gemm]

    def rel_err(self, gemm, y):
        ref = self.reference(gemm).float()
        return float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))

    # ---- torch._scaled_grouped_mm, rowwise ----
    def scaled_grouped_mm(self, gemm):
        """The rowwise grouped GEMM's arguments: a Plan whose args are (mat_a, mat_b, scale_a, scale_b)."""
        note = "rowwise scales"
        counts = pcounts = self.counts
        offs = self.offs
        if gemm == "fwd":
            a, sa = q_rows(self.x)  # [T, K], [T]
            b, sb = q_rows(self.w)  # [E, N, K], [E, N]
            args = (a, b.transpose(-2, -1), sa, sb)  # B column-major: [E, K, N] with strides (NK, 1, K)
        elif gemm == "dgrad":
            a, sa = q_rows(self.dy)  # [T, N]
            b, sb = q_rows(self.w.transpose(1, 2).contiguous())  # W^T [E, K, N], [E, K]
            args = (a, b.transpose(-2, -1), sa, sb)
        else:
            # 2d-2d: groups along the contraction (token) axis. Its kernel asserts on the device that
            # every group is non-empty and a multiple of 16 tokens (16-byte TMA rows of FP8): pad the
            # groups with zero tokens rather than let the assert kill the process.
            pcounts = padded_counts(counts, 16, min_rows=16)
            dyp, xp = pad_rows(self.dy, counts, pcounts), pad_rows(self.x, counts, pcounts)
            qa, sa, qb, sb = [], [], [], []
            for ps, pc in zip(starts(pcounts), pcounts):
                # per expert, one scale per channel over its tokens
                q, s = q_rows(dyp[ps:ps + pc].t())  # [N, pc], [N]
                qa.append(q)
                sa.append(s)
                q, s = q_rows(xp[ps:ps + pc].t())  # [K, pc], [K]
                qb.append(q)
                sb.append(s)
            a = torch.cat(qa, dim=1).contiguous()  # dy^T [N, Tp], row-major
            b = torch.cat(qb, dim=1).contiguous()  # x^T [K, Tp]: passed as x [Tp, K] column-major
            # scales group-major: expert g's channel c at g * channels + c
            args = (a, b.t(), torch.cat(sa), torch.cat(sb))
            offs = torch.tensor(starts(pcounts)[1:] + [sum(pcounts)], dtype=torch.int32).to(self.device)
            if pcounts != counts:
                note += (f"; groups padded with zero tokens to multiples of 16 (at least 16): "
                         f"{sum(pcounts)} rows for {sum(counts)}")
        return Plan(gemm, args, offs, counts, pcounts, note)

    # ---- per-expert loop of block-scaled scaled_mm ----
    def loop(self, gemm, layout):
        """The per-expert calls in one of two layouts. 0: tokens per expert padded with zeros to a
        multiple of 4 (cuBLAS reads the 1x128 scales token-major with ld = tokens: 16-byte columns) or,
        for wgrad, of 16 (the contraction must be a multiple of 16); the other dimensions as they are,
        partial blocks counted by ceil(n / 128) as ATen's CUDA checks do. 1: tokens padded to 16 (wgrad,
        where they are the contraction: 128), the contraction and the weights' output rows to
        multiples of 128, so that no block is partial (for a torch whose checks count whole blocks
        only, as 2.11's meta functions do).
        A Plan whose calls are (a, b, scale_a, recipe_a, scale_b, recipe_b, out)."""
        E, N, K, dev = self.E, self.N, self.K, self.device
        counts = self.counts
        R = F.ScalingType
        calls = []
        if gemm in ("fwd", "dgrad"):
            align = 4 if layout == 0 else 16
            pcounts = padded_counts(counts, align)
            if gemm == "fwd":
                src, w, n_out = self.x, self.w, N  # y = x W^T: contraction K
            else:
                src, w, n_out = self.dy, self.w.transpose(1, 2).contiguous(), K  # dx = dy W: contraction N
            if layout == 1:  # zero rows and columns: whole 128-blocks only
                src, w = pad_last(src, 128), pad_last(w, 128)
                w = F.pad(w, (0, 0, 0, round_up(n_out, 128) - n_out))
            a, sa = q_1x128(pad_rows(src, counts, pcounts))  # [Tp, Kc], [Tp, kcb]
            b, sb = q_128x128(w)  # [E, n_out, Kc], [E, nb, kcb]
            kcb = sb.shape[2]
            L4 = round_up(kcb, 4)  # ATen: B's 128x128 scales as [L4, nb] with strides (1, L4)
            sbuf = torch.zeros(E, sb.shape[1], L4, device=dev)
            sbuf[:, :, :kcb] = sb
            y = torch.empty(sum(pcounts), w.shape[1], device=dev, dtype=torch.bfloat16)
            for e, (ps, pc) in enumerate(zip(starts(pcounts), pcounts)):
                if pc == 0:
                    continue  # an empty expert: no call
                sa_e = sa[ps:ps + pc].t().contiguous().t()  # [pc, kcb] with strides (1, pc): token-major
                calls.append((a[ps:ps + pc], b[e].t(), sa_e, R.BlockWise1x128, sbuf[e].t(), R.BlockWise128x128,
                              y[ps:ps + pc]))
            note = "1x128 x 128x128"
            if layout == 1:
                note += "; contraction and output columns padded with zeros to multiples of 128"
        else:
            # dW_e = dy_e^T x_e: both operands 1x128 along the tokens (the contraction): columnwise copies
            align = 16 if layout == 0 else 128
            pcounts = padded_counts(counts, align)
            dyp, xp = pad_rows(self.dy, counts, pcounts), pad_rows(self.x, counts, pcounts)
            y = torch.zeros(E, N, K, device=dev, dtype=torch.bfloat16)  # an empty expert's dW stays 0
            for e, (ps, pc) in enumerate(zip(starts(pcounts), pcounts)):
                if pc == 0:
                    continue
                qa, sa = q_1x128(dyp[ps:ps + pc].t().contiguous())  # dy_e^T [N, pc], [N, pcb]
                qb, sb = q_1x128(xp[ps:ps + pc].t().contiguous())  # x_e^T [K, pc], [K, pcb]
                calls.append((qa, qb.t(), sa.t().contiguous().t(), R.BlockWise1x128, sb.t().contiguous().t(),
                              R.BlockWise1x128, y[e]))
            note = "1x128 x 1x128"
        if pcounts != counts:
            note += f"; tokens per expert padded with zeros to multiples of {align}"
        return Plan(gemm, calls, None, counts, pcounts, note, y=y, cols=N if gemm == "fwd" else K)


class Plan:
    """One path's prepared GEMM: `args` (grouped) or the per-expert `calls` (loop), its layout, and
    how to read its result back in the unpadded layout."""

    def __init__(self, gemm, args, offs, counts, pcounts, note, y=None, cols=None):
        self.gemm, self.args, self.offs, self.counts, self.pcounts, self.note, self.y = \
            gemm, args, offs, counts, pcounts, note, y
        self.cols = cols  # fwd/dgrad: the output's width without padding columns
        self.last = None

    # torch._scaled_grouped_mm
    def grouped_runner(self, fast_accum):
        def run():
            self.last = torch._scaled_grouped_mm(*self.args, offs=self.offs, out_dtype=torch.bfloat16,
                                                 use_fast_accum=fast_accum)
        return run

    # the per-expert loop; with_out: each call writes its slice of y (as TransformerEngine's grouped
    # GEMM does); else F.scaled_mm's outputs are joined by torch.cat / torch.stack after the loop
    def loop_runner(self, streams, with_out):
        calls = self.args

        def one(c):
            return scaled_mm_call(c, with_out)

        def join(outs):
            if not with_out:
                self.last = torch.stack(outs) if self.gemm == "wgrad" else torch.cat(outs)
        if streams <= 1:
            def run():
                join([one(c) for c in calls])
            return run
        side = [torch.cuda.Stream() for _ in range(streams)]

        def run():
            # round robin over the streams, joined at the end (TransformerEngine's multi-stream cuBLAS)
            cur = torch.cuda.current_stream()
            for s in side:
                s.wait_stream(cur)
            outs = []
            for i, c in enumerate(calls):
                with torch.cuda.stream(side[i % streams]):
                    outs.append(one(c))
            for s in side:
                cur.wait_stream(s)
            join(outs)
        return run

    def result(self, with_out=True):
        """The output of the last run, unpadded: [T, n] (fwd, dgrad) or [E, N, K] (wgrad)."""
        if self.y is None:  # grouped
            y = self.last
        elif with_out:
            y = self.y
        elif self.gemm == "wgrad":  # stacked outputs of the non-empty experts only
            y = torch.zeros_like(self.y)
            y[[e for e, c in enumerate(self.pcounts) if c]] = self.last
        else:
            y = self.last  # the padded layout without its empty experts: the same rows
        if self.gemm == "wgrad":
            return y
        y = unpad_rows(y, self.counts, self.pcounts)
        return y[:, :self.cols] if self.cols is not None and self.cols < y.shape[1] else y


def scaled_mm_call(call, with_out=True):
    a, b, sa, ra, sb, rb, out = call
    if with_out:
        # the op under F.scaled_mm, with out=
        return torch._scaled_mm_v2(a, b, [sa], [ra.value], [], [sb], [rb.value], [], None, torch.bfloat16,
                                   [], False, out=out)
    return F.scaled_mm(a, b, sa, ra, sb, rb, output_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Dense FP8 of one GEMM's M, N, K

def dense_shape(gemm, T, N, K):
    """(M, Nout, Kc) of the GEMM: fwd [T,K]x[K,N], dgrad [T,N]x[N,K], wgrad [N,T]x[T,K]."""
    return {"fwd": (T, N, K), "dgrad": (T, K, N), "wgrad": (N, K, T)}[gemm]


def dense_operands(M, Nout, Kc, device, seed):
    if str(device) == "meta":  # shapes only (--dry-run)
        return (torch.empty(M, Kc, device=device, dtype=torch.float8_e4m3fn),
                torch.empty(Nout, Kc, device=device, dtype=torch.float8_e4m3fn).t())
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(M, Kc, device=device, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(Nout, Kc, device=device, generator=g).to(torch.float8_e4m3fn).t()  # column-major
    return a, b


def dense_runner(a, b, scaling, fast_accum):
    dev = a.device
    if scaling == "tensorwise":
        sa, sb = torch.ones((), device=dev), torch.ones((), device=dev)
    else:
        sa, sb = torch.ones(a.shape[0], 1, device=dev), torch.ones(1, b.shape[1], device=dev)

    def run():
        torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return run


def dense_blockwise_call(gemm, M, Nout, Kc, device, seed):
    """The call (scaled_mm_call's tuple) and its note of the dense GEMM [M, Kc] x [Kc, Nout] with block
    scales (all ones: the time does not depend on their values): A 1x128 along Kc (M-major, strides
    (1, M)); B 128x128 (fwd, dgrad: a weight) or 1x128 along Kc (wgrad: a columnwise activation
    copy), laid out as the per-expert loop's calls. Dimensions rounded up to multiples of 128."""
    M, Nout, Kc = (round_up(v, 128) for v in (M, Nout, Kc))
    a, b = dense_operands(M, Nout, Kc, device, seed)
    R = F.ScalingType
    kb = Kc // 128
    sa = torch.ones(kb, M, device=device).t()
    if gemm == "wgrad":
        sb, rb = torch.ones(kb, Nout, device=device).t(), R.BlockWise1x128
    else:
        sb, rb = torch.ones(Nout // 128, round_up(kb, 4), device=device).t(), R.BlockWise128x128
    call = (a, b, sa, R.BlockWise1x128, sb, rb, torch.empty(M, Nout, device=device, dtype=torch.bfloat16))
    return call, f"F.scaled_mm {'1x128 x 1x128' if gemm == 'wgrad' else '1x128 x 128x128'}, [{M},{Kc}] x [{Kc},{Nout}]"


# ---------------------------------------------------------------------------------------------
# Timing

def make_timer(rep_ms):
    try:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
        return bench, f"triton.testing.do_bench (median; warmup 10 ms, rep {rep_ms} ms; 256 MB L2 flush before each run)"
    except ImportError:
        pass

    # The same method without triton: CUDA events, median, the same flush.
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            flush.zero_()
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / 5, 1e-3)
        for _ in range(max(1, int(10 / estimate))):
            fn()
        n = max(1, int(rep_ms / estimate))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in events:
            flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in events)
        return times[len(times) // 2]
    return bench, f"CUDA events (triton missing), median over {rep_ms} ms of runs, 256 MB zeroed before each"


class FatalCuda(Exception):
    pass


def error_text(e):
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first[:500]


def is_fatal(e):
    return any(s in str(e) for s in FATAL_CUDA)


# ---------------------------------------------------------------------------------------------
# The run

class Run:
    def __init__(self, args, device="cuda", timer=None, dense_size=8192):
        self.args, self.device, self.dense_size = args, device, dense_size
        self.bench, self.timing = timer or make_timer(args.rep_ms)
        self.streams = [int(s) for s in args.loop_streams.split(",")]
        self.results = None

    def save(self, path, partial):
        if partial:
            self.results["partial"] = True
        else:
            self.results.pop("partial", None)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1)
        os.replace(tmp, path)

    def record(self, entry, key, fn):
        """entry[key + suffix] = the fields fn() returns, or entry[key + "_ms"] = {"error": ...};
        a key already there (a restarted run) is not measured again."""
        if key + "_ms" in entry:
            return
        try:
            fields = fn()
            torch.cuda.synchronize()
        except Exception as e:  # an unsupported API or layout must not end the run
            entry[key + "_ms"] = {"error": error_text(e)}
            print(f"  {key}: {error_text(e)}", flush=True)
            if is_fatal(e):
                raise FatalCuda(str(e))
            return
        entry.update({key + k: v for k, v in fields.items()})
        print(f"  {key}: {fields['_ms']:.4f} ms, {fields['_tflops']:.1f} TFLOP/s"
              + (f", rel err {fields['_rel_err']:.3f}" if "_rel_err" in fields else ""), flush=True)

    def checked(self, layer, plan, run, with_out=True):
        """Runs once and compares with the bf16 GEMM: a wrong layout must fail, not be timed."""
        run()
        torch.cuda.synchronize()
        err = layer.rel_err(plan.gemm, plan.result(with_out))
        if not err <= MAX_REL_ERR:  # NaN too
            raise RuntimeError(f"result differs from the bf16 GEMM: relative error {err:.3g} > {MAX_REL_ERR}")
        return err

    def timed(self, layer, ms, **extra):
        return dict({"_ms": ms, "_tflops": layer.flops / ms / 1e9}, **extra)

    def measure_layer(self, entry, fc, layer, seed):
        a = self.args
        T, N, K = layer.T, layer.N, layer.K
        for gemm in GEMMS:
            def sgmm():
                plan = layer.scaled_grouped_mm(gemm)
                run = plan.grouped_runner(a.fast_accum)
                err = self.checked(layer, plan, run)
                return self.timed(layer, self.bench(run), _rel_err=err, _note=plan.note)
            self.record(entry, f"{fc}_scaled_grouped_mm_{gemm}", sgmm)
            torch.cuda.empty_cache()

            def loop():
                # the first layout that this torch accepts and that computes the right result; out= the
                # expert's slice where this torch has _scaled_mm_v2.out, else torch.cat after the loop
                failures = []
                for layout in (0, 1):
                    try:
                        plan = layer.loop(gemm, layout)
                    except Exception as e:
                        if is_fatal(e):
                            raise
                        failures.append(f"layout {layout}: {error_text(e)}")
                        continue
                    for with_out in (True, False):
                        try:
                            err = self.checked(layer, plan, plan.loop_runner(1, with_out), with_out)
                            by_streams = {str(n): self.bench(plan.loop_runner(n, with_out)) for n in self.streams}
                            best = min(by_streams, key=by_streams.get)
                            note = (f"layout {layout}: {plan.note}; {len(plan.args)} calls; outputs "
                                    + ("written in place (out=)" if with_out else "joined by torch.cat/stack"))
                            if failures:
                                note += "; tried before: " + " | ".join(failures)
                            return self.timed(layer, by_streams[best], _rel_err=err, _streams=int(best),
                                              _ms_by_streams=by_streams, _note=note)
                        except Exception as e:
                            if is_fatal(e):
                                raise
                            failures.append(f"layout {layout}{'' if with_out else ' without out='}: {error_text(e)}")
                    plan = None
                    torch.cuda.empty_cache()
                raise RuntimeError(" | ".join(failures))
            self.record(entry, f"{fc}_loop_{gemm}", loop)
            layer._ref.pop(gemm, None)  # the bf16 result: both checks of this GEMM are done
            torch.cuda.empty_cache()

            # dense FP8 of the same M, N, K: tensorwise and rowwise, the faster is the ceiling
            M, Nout, Kc = dense_shape(gemm, T, N, K)
            for scaling in ("tensorwise", "rowwise"):
                def dense():
                    da, db = dense_operands(M, Nout, Kc, self.device, seed)
                    ms = self.bench(dense_runner(da, db, scaling, a.fast_accum))
                    return self.timed(layer, ms, _note=f"torch._scaled_mm {scaling}, [{M},{Kc}] x [{Kc},{Nout}]")
                self.record(entry, f"{fc}_dense_fp8_{scaling}_{gemm}", dense)
            key = f"{fc}_dense_fp8_{gemm}"
            timed = {s: entry.get(f"{fc}_dense_fp8_{s}_{gemm}_ms") for s in ("tensorwise", "rowwise")}
            timed = {s: v for s, v in timed.items() if isinstance(v, float)}
            if timed:
                best = min(timed, key=timed.get)
                entry.update({key + "_ms": timed[best], key + "_tflops": layer.flops / timed[best] / 1e9,
                              key + "_note": f"the faster of tensorwise and rowwise: {best}"})
            else:
                entry[key + "_ms"] = {"error": "neither the tensorwise nor the rowwise dense FP8 GEMM ran"}
            torch.cuda.empty_cache()

            def dense_blockwise():
                call, note = dense_blockwise_call(gemm, M, Nout, Kc, self.device, seed)
                return self.timed(layer, self.bench(lambda: scaled_mm_call(call)), _note=note)
            self.record(entry, f"{fc}_dense_fp8_blockwise_{gemm}", dense_blockwise)
            torch.cuda.empty_cache()

    def dense_8192(self):
        """Dense n^3 GEMMs, n = 8192: bf16 (torch_anchor.py's dense_8192_tflops) and FP8, tensorwise and
        rowwise, with and without fast accumulation."""
        r = self.results
        n = self.dense_size

        def tflops(key, fn):
            if key in r:
                return
            try:
                r[key] = 2 * n ** 3 / self.bench(fn) / 1e9
            except Exception as e:
                r[key] = {"error": error_text(e)}
                if is_fatal(e):
                    raise FatalCuda(str(e))
        def bf16_matmul():
            x = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
            y = torch.randn_like(x)
            return lambda: x @ y
        tflops("dense_8192_tflops", bf16_matmul())
        a, b = dense_operands(n, n, n, self.device, 0)
        for fast in (self.args.fast_accum, not self.args.fast_accum):
            for scaling in ("tensorwise", "rowwise"):
                tflops(f"dense_fp8_8192_{scaling}" + ("_fast_accum" if fast else "") + "_tflops",
                       dense_runner(a, b, scaling, fast))
        suffix = "_fast_accum" if self.args.fast_accum else ""
        timed = [r[f"dense_fp8_8192_{s}{suffix}_tflops"] for s in ("tensorwise", "rowwise")]
        timed = [v for v in timed if isinstance(v, float)]
        r["dense_fp8_8192_tflops"] = max(timed) if timed else {"error": "no dense FP8 GEMM ran"}
        del a, b
        torch.cuda.empty_cache()

    def settle(self, seconds):
        """The GPU's steady power state before timing (settle.py beside this file; imported here,
        like torch, so that --help and --dry-run need no GPU)."""
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from settle import settle

        settle(seconds, self.device)

    def main(self, cases, resume):
        a = self.args
        if resume:
            self.results = resume
        else:
            self.results = {
                "format": FORMAT, "script": "bench/drivers/fp8-anchor.py",
                "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "cublaslt": _cublaslt_version(),
                "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "timing": self.timing, "fast_accum": a.fast_accum, "loop_streams": self.streams,
                "max_rel_err": MAX_REL_ERR, "restarts": 0,
                "paths": {
                    "scaled_grouped_mm": "torch._scaled_grouped_mm, rowwise FP8 scales, int32 device offsets",
                    "loop": "per-expert loop of cuBLAS block-scaled FP8 GEMMs (torch._scaled_mm_v2 = F.scaled_mm, "
                            "out= the expert's slice), host split sizes; best over loop_streams",
                    "dense_fp8": "one dense FP8 GEMM of the same M, N, K (torch._scaled_mm), "
                                 "the faster of tensorwise and rowwise",
                    "dense_fp8_blockwise": "the same dense GEMM with block scales (F.scaled_mm: 1x128 x 128x128, "
                                           "wgrad 1x128 x 1x128), dimensions rounded up to multiples of 128",
                },
                "cases": [],
            }
        self.settle(a.settle_s)
        self.dense_8192()
        done = {c["case"]: c for c in self.results["cases"]}
        for c in cases:
            entry = done.get(c["name"])
            if entry is None:
                entry = {"case": c["name"]}
                self.results["cases"].append(entry)
            if entry.get("complete"):
                continue
            E, H, Fd = c["experts"], c["hidden"], c["ffn"]
            counts = c["tokens_per_expert"]
            entry.update({"experts": E, "tokens": sum(counts)})
            print(f"{c['name']}", flush=True)
            for i, (fc, N, K) in enumerate((("fc1", 2 * Fd, H), ("fc2", H, Fd))):
                layer = Layer(counts, N, K, self.device, seed=1 + i)
                self.measure_layer(entry, fc, layer, seed=3 + i)
                del layer
                torch.cuda.empty_cache()
            entry["complete"] = True
            if a.out:
                self.save(a.out, partial=True)
        self.results.pop("partial", None)
        return self.results


def _cublaslt_version():
    try:
        import ctypes
        lib = ctypes.CDLL("libcublasLt.so" + (f".{torch.version.cuda.split('.')[0]}" if torch.version.cuda else ""))
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        return int(lib.cublasLtGetVersion())
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# --dry-run: no GPU needed

def emulate_block(call):
    """What a block-scaled call computes, reading its scale tensors as ATen's checks define them
    (float64 on the CPU): that the layouts passed carry each block's own scale."""
    a, b, sa, ra, sb, rb, _ = call
    A, B = a.double(), b.double()  # [M, Kc], [Kc, Nout]
    Kc, Nout = B.shape
    k = torch.arange(Kc)
    A = A * sa.double()[:, k // 128]  # 1x128 of a: sa[m, kb]
    if rb == F.ScalingType.BlockWise128x128:
        B = B * sb.double()[k // 128][:, torch.arange(Nout) // 128]  # sb [L4, nb]: sb[kb, nb]
    else:
        B = B * sb.double()[:, k // 128].t()  # 1x128 of b: sb[n, kb]
    return A @ B


def emulate_grouped(plan):
    """What torch._scaled_grouped_mm computes from the rowwise arguments (float64 on the CPU), with
    the scale indexing of ATen's CUDA kernel (2d-3d: scale_a per row, scale_b [E, n]; 2d-2d: both
    scales group-major, expert g's channel c at g * channels + c)."""
    a, b, sa, sb = (t.double() for t in plan.args)
    ends = plan.offs.tolist()
    begins = [0] + ends[:-1]
    if plan.gemm == "wgrad":
        N, K = a.shape[0], b.shape[1]
        return torch.stack([(a[:, s:e] * sa[g * N:(g + 1) * N, None]) @ (b[s:e] * sb[None, g * K:(g + 1) * K])
                            for g, (s, e) in enumerate(zip(begins, ends))])
    return torch.cat([(a[s:e] * sa[s:e, None]) @ (b[g] * sb[g][None, :]) for g, (s, e) in enumerate(zip(begins, ends))])


def block_call_failures(call, what):
    """What ATen's CUDA checks of a block-scaled call would reject: the scale tensors' shapes and
    strides, the operands' majorness and alignment, the output's shape."""
    a, b, sa, ra, sb, rb, out = call
    M, Kc, Nout = a.shape[0], a.shape[1], b.shape[1]
    want = [((M, ceil_div(Kc, 128)), (1, M))]
    if rb == F.ScalingType.BlockWise128x128:
        L4 = round_up(ceil_div(Kc, 128), 4)
        want.append(((L4, ceil_div(Nout, 128)), (1, L4)))
    else:
        want.append(((Nout, ceil_div(Kc, 128)), (1, Nout)))
    got = [(tuple(t.shape), t.stride()) for t in (sa, sb)]
    # a size-1 dimension's stride is free (ATen checks it only where the size is > 1)
    same = all(gs == ws and all(g == w for g, w, n in zip(gst, wst, gs) if n > 1)
               for (gs, gst), (ws, wst) in zip(got, want))
    failures = []
    if not same:
        failures.append(f"{what}: scale layouts {got}, ATen wants {want}")
    if a.stride(1) != 1 or b.stride(0) != 1 or Kc % 16 or Nout % 16:
        failures.append(f"{what}: a {tuple(a.shape)} {a.stride()} must be row-major, b {tuple(b.shape)} "
                        f"{b.stride()} column-major, both multiples of 16")
    if out.shape != (M, Nout) or not out.is_contiguous():
        failures.append(f"{what}: out {tuple(out.shape)} for [{M}, {Nout}]")
    return failures


def dry_run(args, cases):
    """Checks the arguments the GPU run would pass. (1) On the CPU with small shapes (unaligned and
    empty experts, sizes not multiples of 128): an emulated GEMM that reads every scale tensor as
    ATen defines it matches the float GEMM to FP8 accuracy, for both loop layouts and the rowwise
    grouped GEMM, and the scale tensors have the shapes and strides ATen's CUDA checks demand.
    (2) On the 'meta' device with the real shapes of the selected cases: torch's own checks, where
    this torch has meta functions for the op (reported, not failed: 2.11's meta functions count
    whole 128-blocks only, its CUDA checks partial ones too, which layout 1 covers).
    Returns the exit code: 1 if (1) fails."""
    failures = []

    def check(what, err, limit=0.1):
        ok = err <= limit
        print(f"  cpu {what}: rel err {err:.4f} {'ok' if ok else 'FAILED'}")
        if not ok:
            failures.append(f"{what}: relative error {err:.3g} > {limit}")

    counts = [37, 0, 130, 93, 5]
    for fc, N, K in (("fc1", 2 * 320, 256), ("fc2", 256, 320)):
        layer = Layer(counts, N, K, "cpu", seed=5, cpu_float=True)
        for gemm in GEMMS:
            ref = layer.reference(gemm).double()
            for layout in (0, 1):
                plan = layer.loop(gemm, layout)
                for c in plan.args:
                    c[6].copy_(emulate_block(c).to(c[6].dtype))
                out = plan.result().double()
                check(f"{fc} loop {gemm} layout {layout} ({len(plan.args)} calls; {plan.note})",
                      float((out - ref).norm() / ref.norm()))
                for call in plan.args:
                    failures += block_call_failures(call, f"{fc} loop {gemm} layout {layout}")
            plan = layer.scaled_grouped_mm(gemm)
            plan.last = emulate_grouped(plan).to(torch.bfloat16)
            check(f"{fc} scaled_grouped_mm {gemm} ({plan.note})",
                  float((plan.result().double() - ref).norm() / ref.norm()))
            if gemm == "wgrad":
                sizes = [e - s for s, e in zip([0] + plan.offs.tolist()[:-1], plan.offs.tolist())]
                if any(n <= 0 or n % 16 for n in sizes):
                    failures.append(f"{fc} scaled_grouped_mm wgrad: group sizes {sizes}: the kernel asserts > 0 and % 16")

    for gemm in GEMMS:  # the dense block-scaled ceiling: odd sizes, rounded up to 128
        call, note = dense_blockwise_call(gemm, 200, 300, 130, "cpu", 0)
        failures += block_call_failures(call, f"dense blockwise {gemm}")
        a, b = call[0].double(), call[1].double()
        check(f"dense blockwise {gemm} ({note})", float((emulate_block(call) - a @ b).norm() / (a @ b).norm()), 0.0)

    for c in cases:
        for fc, N, K in (("fc1", 2 * c["ffn"], c["hidden"]), ("fc2", c["hidden"], c["ffn"])):
            layer = Layer(c["tokens_per_expert"], N, K, "meta", seed=0)
            for gemm in GEMMS:
                msgs = []
                try:
                    layer.scaled_grouped_mm(gemm).grouped_runner(False)()
                    msgs.append("scaled_grouped_mm ok")
                except Exception as e:
                    msgs.append(f"scaled_grouped_mm: {error_text(e)[:160]}")
                for layout in (0, 1):
                    try:
                        plan = layer.loop(gemm, layout)
                        for call in plan.args:
                            scaled_mm_call(call, with_out=False)  # 2.11 has no meta function for out=
                        msgs.append(f"loop layout {layout} ok")
                    except Exception as e:
                        msgs.append(f"loop layout {layout}: {error_text(e)[:200]}")
                M, Nout, Kc = dense_shape(gemm, layer.T, N, K)
                try:
                    da = torch.empty(M, Kc, device="meta", dtype=torch.float8_e4m3fn)
                    db = torch.empty(Nout, Kc, device="meta", dtype=torch.float8_e4m3fn).t()
                    torch._scaled_mm(da, db, torch.ones((), device="meta"), torch.ones((), device="meta"),
                                     out_dtype=torch.bfloat16)
                    torch._scaled_mm(da, db, torch.ones(M, 1, device="meta"), torch.ones(1, Nout, device="meta"),
                                     out_dtype=torch.bfloat16)
                    msgs.append("dense ok")
                except Exception as e:
                    msgs.append(f"dense: {error_text(e)[:160]}")
                try:
                    scaled_mm_call(dense_blockwise_call(gemm, M, Nout, Kc, "meta", 0)[0], with_out=False)
                    msgs.append("dense blockwise ok")
                except Exception as e:
                    msgs.append(f"dense blockwise: {error_text(e)[:160]}")
                print(f"  meta {c['name']} {fc} {gemm}: " + "; ".join(msgs))
    failures += emulated_run(args)
    if failures:
        print("dry run FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("dry run passed: the CPU checks of every layout and the emulated run (the meta lines report "
          "torch's own checks)")
    return 0


class _Stream:
    def wait_stream(self, other):
        pass


def emulated_run(args):
    """(3) The whole measurement flow on the CPU: the CUDA ops replaced by float64 emulations that
    read the arguments as ATen does, a timer that returns 1 ms, two tiny cases. The emulated torch is
    strict where a real one may be (no partial 128-blocks, no _scaled_mm_v2.out for wgrad) and one
    call fails with a context-killing CUDA error, so that the layout fallback, the out= fallback and
    the restart with --resume all run. Writes the JSON to --out when given. Returns failures."""
    import contextlib
    R = F.ScalingType
    recipes = {r.value: r for r in (R.BlockWise1x128, R.BlockWise128x128)}
    state = {"fatal": 1}

    def mm_v2(a, b, sa, ra, swa, sb, rb, swb, bias, out_dtype, contraction_dim=(), use_fast_accum=False, out=None):
        ra, rb = recipes[ra[0]], recipes[rb[0]]
        if rb == R.BlockWise128x128 and (a.shape[1] % 128 or b.shape[1] % 128):
            raise RuntimeError("emulated: partial 128-blocks refused")
        if rb == R.BlockWise1x128 and out is not None:
            if state["fatal"]:
                state["fatal"] -= 1
                raise RuntimeError("CUDA error: an illegal memory access was encountered (emulated)")
            raise NotImplementedError("emulated: no _scaled_mm_v2.out")
        y = emulate_block((a, b, sa[0], ra, sb[0], rb, None)).to(torch.bfloat16)
        return out.copy_(y) if out is not None else y

    def sgmm(a, b, sa, sb, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        gemm = "wgrad" if a.dim() == 2 and b.dim() == 2 else "fwd"
        return emulate_grouped(Plan(gemm, (a, b, sa, sb), offs, None, None, "")).to(torch.bfloat16)

    def scaled_mm(a, b, sa, sb, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        return ((a.double() * sa.double()) @ (b.double() * sb.double())).to(torch.bfloat16)

    def functional_scaled_mm(a, b, sa, ra, sb, rb, swizzle_a=None, swizzle_b=None, bias=None,
                             output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False):
        return mm_v2(a, b, [sa], [ra.value], [], [sb], [rb.value], [], bias, output_dtype)

    patches = {(torch, "_scaled_mm_v2"): mm_v2, (torch, "_scaled_grouped_mm"): sgmm, (F, "scaled_mm"): functional_scaled_mm,
               (torch, "_scaled_mm"): scaled_mm, (torch.cuda, "synchronize"): lambda: None,
               (torch.cuda, "empty_cache"): lambda: None, (torch.cuda, "Stream"): _Stream,
               (torch.cuda, "current_stream"): _Stream, (torch.cuda, "stream"): lambda s: contextlib.nullcontext(),
               (torch.cuda, "get_device_name"): lambda: "emulated on the CPU"}
    saved = {k: getattr(*k) for k in patches}
    failures = []
    cases = [{"name": "emulated/unaligned", "experts": 3, "hidden": 256, "ffn": 160, "tokens_per_expert": [40, 0, 90]},
             {"name": "emulated/aligned", "experts": 2, "hidden": 128, "ffn": 128, "tokens_per_expert": [64, 128]}]
    args.settle_s = 0

    def one_ms(fn):
        fn()
        return 1.0
    try:
        for (obj, name), fn in patches.items():
            setattr(obj, name, fn)
        run = Run(args, device="cpu", timer=(one_ms, "emulated: 1 ms each"), dense_size=256)
        try:
            run.main(cases, None)
            failures.append("emulated run: the injected fatal CUDA error did not stop the run")
        except FatalCuda:
            partial = json.loads(json.dumps(run.results))  # what the restart reads back
            partial["restarts"] = 1
            run = Run(args, device="cpu", timer=(one_ms, "emulated: 1 ms each"), dense_size=256)
            results = run.main(cases, partial)
            for c in results["cases"]:
                for fc in ("fc1", "fc2"):
                    for gemm in GEMMS:
                        for path in ("scaled_grouped_mm", "loop", "dense_fp8"):
                            key = f"{fc}_{path}_{gemm}_ms"
                            v = c.get(key)
                            fatal_entry = isinstance(v, dict) and "illegal memory access" in v.get("error", "")
                            if not isinstance(v, float) and not fatal_entry:
                                failures.append(f"emulated run: {c['case']} {key} = {v}")
                            print(f"  emulated {c['case']} {key}: {v}"
                                  + (f"  [{c.get(key[:-3] + '_note', '')}]" if path == "loop" else ""))
            if args.out:
                run.save(args.out, partial=False)
                print(f"  emulated run written to {args.out}")
    finally:
        for (obj, name), fn in saved.items():
            setattr(obj, name, fn)
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=os.path.normpath(os.path.join(HERE, "..", "workloads.json")))
    ap.add_argument("--cases", default="", help="only cases whose name contains this")
    ap.add_argument("--out", default="", help="write the JSON here (also the partial results after each case)")
    ap.add_argument("--rep-ms", type=float, default=100.0, help="do_bench's rep: time of runs per measurement")
    ap.add_argument("--loop-streams", default="1,4", help="stream counts for the per-expert loop (best is kept)")
    ap.add_argument("--fast-accum", action="store_true",
                    help="use_fast_accum for scaled_grouped_mm and dense (not the block-scaled loop: cuBLAS refuses)")
    ap.add_argument("--settle-s", type=float, default=2.0, help="dense bf16 GEMMs this long first (steady clocks)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: check the argument layouts (CPU and meta)")
    ap.add_argument("--resume", default="", help=argparse.SUPPRESS)  # the restart after a fatal CUDA error
    args = ap.parse_args()

    global torch, F
    try:
        import torch as _torch
        import torch.nn.functional as _F
    except ImportError:
        sys.exit("fp8-anchor.py: PyTorch is not installed (pip install torch)")
    torch, F = _torch, _F
    for name in ("_scaled_mm", "_scaled_grouped_mm"):
        if not hasattr(torch, name):
            print(f"fp8-anchor.py: this torch ({torch.__version__}) has no torch.{name}: its entries will record the error")
    if not hasattr(F, "ScalingType"):
        sys.exit(f"fp8-anchor.py: torch {torch.__version__} has no torch.nn.functional.ScalingType "
                 "(block-scaled scaled_mm); torch >= 2.10 expected")

    try:
        suite = json.load(open(args.workloads))
        cases = [c for c in suite["cases"] if args.cases in c["name"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"fp8-anchor.py: cannot read the cases of '{args.workloads}': {e}")
    if not cases:
        sys.exit(f"fp8-anchor.py: no case of '{args.workloads}' contains '{args.cases}'")
    for c in cases:
        missing = [k for k in ("name", "experts", "hidden", "ffn", "tokens_per_expert") if k not in c]
        if missing or len(c["tokens_per_expert"]) != c["experts"]:
            sys.exit(f"fp8-anchor.py: case {c.get('name', '?')} of '{args.workloads}': missing {missing} or "
                     f"tokens_per_expert of length {len(c.get('tokens_per_expert', []))} for {c.get('experts')} experts")
    try:
        streams = [int(s) for s in args.loop_streams.split(",")]
    except ValueError:
        streams = []
    if not streams or min(streams) < 1:
        sys.exit(f"fp8-anchor.py: --loop-streams '{args.loop_streams}': expected stream counts >= 1, "
                 "comma-separated (e.g. 1,4)")

    if args.dry_run:
        sys.exit(dry_run(args, cases))
    if not torch.cuda.is_available():
        sys.exit("fp8-anchor.py: no CUDA device visible to torch (--dry-run checks the layouts without one)")
    if args.out:
        d = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(d):
            sys.exit(f"fp8-anchor.py: --out {args.out}: the directory '{d}' does not exist")

    resume = None
    if args.resume:
        resume = json.load(open(args.resume))
        resume["restarts"] = resume.get("restarts", 0) + 1
    run = Run(args)
    try:
        results = run.main(cases, resume)
    except FatalCuda as e:
        # The context is gone: save, then go on in a fresh process (entries done are skipped).
        path = args.out or os.path.join(os.getcwd(), "fp8-anchor.partial.json")
        run.save(path, partial=True)
        if run.results.get("restarts", 0) >= 3:
            sys.exit(f"fp8-anchor.py: a fatal CUDA error again after 3 restarts ({e}); partial results in {path}")
        print(f"fp8-anchor.py: fatal CUDA error ({str(e)[:200]}): restarting from {path}", flush=True)
        argv = [a for a in sys.argv[1:]]
        if "--resume" in argv:
            i = argv.index("--resume")
            del argv[i:i + 2]
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + argv + ["--resume", path])
    print(f'dense 8192^3: bf16 {_fmt(results.get("dense_8192_tflops"))}, FP8 {_fmt(results.get("dense_fp8_8192_tflops"))} '
          f'TFLOP/s on {results["device"]}, torch {results["torch"]}', flush=True)
    if args.out:
        run.save(args.out, partial=False)


def _fmt(v):
    return f"{v:.1f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit:
        raise
    except Exception:
        traceback.print_exc()
        sys.exit("fp8-anchor.py: internal error (traceback above)")
