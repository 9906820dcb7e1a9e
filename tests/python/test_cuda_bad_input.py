"""Bad input on CUDA tensors: a clear Python exception (ValueError, TypeError, NotImplementedError,
or moe_engine.DeviceError through check_errors() for what only a kernel can see), never a crash, an
illegal memory access, a silent wrong answer or a write outside the buffers.

1. Bad splits (negative, summing past T, INT64_MAX and sums that saturate, INT32 extremes, the
   wrong length G) through every op that routes: the result is the one of the clamped offsets
   (docs/python.md: negative splits count as 0, the offsets are clamped to T), i.e. the CPU
   backend's result for the sanitized splits; check_errors() names the problem; and, through the
   extension ops given views into larger buffers, nothing past a view is written and no NaN
   placed past an input view reaches a result.
2. Tensors on different devices (CPU / CUDA / meta), non-contiguous, transposed, broadcast and
   misaligned (an odd element offset: no 16-byte TMA alignment) operands, bf16 and FP8: a clear
   error naming the argument, or the result of a contiguous copy (and of the CPU backend).
3. Splits and routing tensors written in place between a forward and its backward: a clear error or
   a recomputation from the current splits, never an illegal access (the routing-tensor case runs
   in a subprocess, so that a crash fails that test only).
4. dtype mixes and dtypes the CUDA backend does not take (float64 where the docs say CPU only).
5. Shapes: T = 0, G = 1, one expert holding every token, more than 256 experts, features off the
   fast path's multiples (the op falls back or refuses clearly; when it runs it matches the CPU).

Everything here needs a GPU: the module skips without one (MOE_TEST_REQUIRE_CUDA=1 makes that an
error, tests/python/conftest.py). The FP8 GEMMs need compute capability 9.0 (needs_fp8_gemm).
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine  # noqa: E402
import moe_engine.torch as me  # noqa: E402
from moe_engine import _C  # noqa: E402
from reference import assert_close, make_splits, needs_fp8_gemm, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a GPU (torch.cuda.is_available() is False)")

ops = torch.ops.moe_engine
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
CPU = torch.device("cpu")
INT64_MAX = 2**63 - 1
POISON_BYTE = 0xA5  # what the guarded buffers hold outside (and inside, before the op) their views
# Expert choices of 6 tokens, top-2 over 3 experts: 4 assignments each (R = 12 sorted rows).
INDICES = [[0, 1], [2, 1], [1, 0], [0, 2], [1, 2], [2, 0]]


@pytest.fixture(autouse=True)
def _fresh_error_record():
    """Every test starts with an empty device error record (a failed test may leave a report)."""
    if torch.cuda.is_available():
        try:
            me.check_errors()
        except moe_engine.DeviceError:
            pass
    yield


# ---- helpers ----


def rand(*shape, dtype=BF16, scale=1.0):
    """CPU values (float64 normal, scaled, rounded to dtype): the same numbers for both backends."""
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)


def leaf(t, device=None):
    """A fresh leaf that requires grad (a copy: layouts are not kept)."""
    t = t.detach().to(device) if device is not None else t.detach()
    return t.clone().requires_grad_(True)


def grad_leaf(t):
    """t itself (a view of a buffer that does not require grad is a leaf) made to require grad, so
    that its layout reaches the op."""
    assert t.is_leaf
    return t.requires_grad_(True)


def round_up(n, m):
    return (n + m - 1) // m * m


def stream_of(dev):
    return torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0


def route(splits, tokens):
    """A routing (_C.Routing) of splits for the rows of tokens, as the ops make it."""
    dev = splits.device
    offsets = torch.empty(splits.shape[0] + 1, dtype=torch.int64, device=dev)
    return _C.route(splits, offsets, tokens, stream_of(dev), "test", "tokens")


def sanitize(values, capacity):
    """What the CUDA group layout makes of bad splits (docs/python.md, GroupLayout::compute): each
    negative split counts as 0 and the offsets are clamped to the capacity; returns the splits of
    those offsets."""
    out, off = [], 0
    for v in values:
        nxt = min(off + max(int(v), 0), capacity)
        out.append(nxt - off)
        off = nxt
    return out


def finite(t):
    return bool(torch.isfinite(t.float()).all())


def expect_reported(fragments, device):
    """check_errors() raises moe_engine.DeviceError whose message has every fragment (regexes), and
    clears the record."""
    torch.cuda.synchronize()
    with pytest.raises(moe_engine.DeviceError) as info:
        me.check_errors(device)
    for fragment in fragments:
        assert re.search(fragment, str(info.value)), f"{fragment!r} not in the report: {info.value}"
    me.check_errors(device)  # read and cleared


def expect_clean(device):
    """No kernel reported anything (accepted inputs must not leave a report behind)."""
    torch.cuda.synchronize()
    me.check_errors(device)


def assert_all_close(got, want, dtype, what):
    assert set(got) == set(want), what
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{what}: {name}"
            continue
        assert got[name].shape == want[name].shape, f"{what}: {name}: {got[name].shape} != {want[name].shape}"
        assert_close(got[name], want[name], dtype, f"{what}: {name}")


def error_or_same(run, reference, match, errors=(ValueError, NotImplementedError), dtype=BF16, what=""):
    """Either run() raises one of `errors` whose message matches `match` (a clear refusal), or it
    returns a dict of results close to reference()'s. Returns the results, or None on a refusal."""
    try:
        got = run()
    except errors as e:
        assert re.search(match, str(e)), f"{what}: {type(e).__name__} whose message does not match {match!r}: {e}"
        return None
    torch.cuda.synchronize()
    assert_all_close(got, reference(), dtype, what)
    return got


class Buffers:
    """Views into larger buffers. An output's buffer holds POISON_BYTE everywhere, and must still hold
    it outside the view after the op; an input's buffer holds NaN outside the view, which must not
    reach a result."""

    def __init__(self, device):
        self.device = device
        self._outputs = []

    def output(self, name, shape, view, dtype):
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        buf.view(torch.uint8).fill_(POISON_BYTE)
        inside = torch.zeros(shape, dtype=torch.bool, device=self.device)
        view(inside).fill_(True)
        self._outputs.append((name, buf, buf.view(torch.uint8).clone(), inside))
        return view(buf)

    def input(self, values, shape, view):
        values = values.to(self.device)
        buf = torch.empty(shape, dtype=values.dtype, device=self.device)
        if values.dtype == E4M3:
            buf.view(torch.uint8).fill_(0x7F)  # E4M3 NaN
        else:
            buf.fill_(float("nan"))
        v = view(buf)
        v.copy_(values)
        return v

    def check(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        for name, buf, before, inside in self._outputs:
            now = buf.view(torch.uint8)
            size = buf.element_size()
            inside_bytes = inside.unsqueeze(-1).expand(*inside.shape, size).reshape(now.shape)
            outside = (now != before) & ~inside_bytes
            assert not outside.any(), f"{name}: {int(outside.sum())} bytes written outside its view"


def rows_of(n):
    return lambda t: t[:n]


def cols_of(n):
    return lambda t: t[:, :n]


def owned_columns(splits, columns):
    """The columns of an FP8 columnwise copy that its experts own: each expert's tokens, zero padded
    to a multiple of 128."""
    mask = torch.zeros(columns, dtype=torch.bool)
    off = 0
    for s in splits:
        n = round_up(s, 128)
        mask[off : off + n] = True
        off += n
    return mask


def as_bytes(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


def assert_same_fp8(got, want, splits, what):
    """Two quantizations of the same values by the same (sanitized) splits hold the same bytes where
    an expert owns them: rows up to sum(splits), each expert's padded column segment, the offsets."""
    total = sum(splits)
    if want.rows is not None:
        assert torch.equal(as_bytes(got.rows.data[:total]), as_bytes(want.rows.data[:total])), f"{what}: rows.data"
        assert torch.equal(as_bytes(got.rows.scales[:, :total]), as_bytes(want.rows.scales[:, :total])), \
            f"{what}: rows.scales"
    if want.columns is not None:
        assert torch.equal(got.columns.offsets.cpu(), want.columns.offsets.cpu()), \
            f"{what}: columns.offsets {got.columns.offsets.tolist()} != {want.columns.offsets.tolist()}"
        mask = owned_columns(splits, want.columns.data.shape[1])
        assert torch.equal(as_bytes(got.columns.data)[:, mask], as_bytes(want.columns.data)[:, mask]), \
            f"{what}: columns.data"
        blocks = mask.view(-1, 128).any(1)
        assert torch.equal(as_bytes(got.columns.scales)[blocks], as_bytes(want.columns.scales)[blocks]), \
            f"{what}: columns.scales"


# ---- 1. bad splits ----


class Bad:
    """Bad splits for G = 3 experts over a buffer of `capacity` rows: their values, the sanitized
    splits the kernels run on, and the fragments check_errors() must name."""

    def __init__(self, name, values, dtype=torch.int64):
        self.name, self.values, self.dtype = name, values, dtype

    def __repr__(self):
        return self.name

    def tensor(self, capacity, device):
        return torch.tensor(self.values(capacity), dtype=self.dtype, device=device)

    def sanitized(self, capacity):
        return sanitize(self.values(capacity), capacity)

    def fragments(self, capacity):
        values = self.values(capacity)
        found = []
        negative = [g for g, v in enumerate(values) if v < 0]
        if negative:
            g = negative[0]
            found.append(rf"splits\[{g}\] = {values[g]} is negative")
        total = min(sum(max(v, 0) for v in values), INT64_MAX)  # the kernel's sum saturates
        if total > capacity:
            found.append(rf"sum\(splits\) = {total} exceeds the buffer capacity T = {capacity}")
        assert found, f"{self.name}: not bad for capacity {capacity}"
        return found


BAD = [
    Bad("negative", lambda c: [c // 2, -2, c // 3]),
    Bad("sum_past_T", lambda c: [c // 2, c // 2, 3]),
    Bad("negative_and_past_T", lambda c: [-1, c, 5]),
    Bad("int64_max", lambda c: [1, INT64_MAX, 1]),
    Bad("sum_overflows_int64", lambda c: [2**62, 2**62, 2**62]),
    Bad("int64_min", lambda c: [-(2**63), 1, 1]),
    Bad("int32_max", lambda c: [1, 2**31 - 1, 1], torch.int32),
    Bad("int32_min", lambda c: [-(2**31), 1, 1], torch.int32),
]


def linear_inputs(T, K, N, G, bias=True, row_scale=True):
    torch.manual_seed(T * 131 + K * 7 + N + G)
    return dict(x=rand(T, K), w=rand(G, N, K, scale=K**-0.5), b=rand(G, N) if bias else None,
                p=torch.rand(T) if row_scale else None, dy=rand(T, N))


def linear_step(x, w, s, b, p, dy):
    """grouped_linear forward and autograd backward (dgrad, wgrad, dbias, dscales)."""
    y = me.grouped_linear(x, w, s, b, p)
    y.backward(dy)
    return {"y": y, "dx": x.grad, "dw": w.grad, "db": None if b is None else b.grad, "dp": None if p is None else p.grad}


def linear_on(inputs, s, device):
    a = {k: (leaf(v, device) if v is not None and k != "dy" else v) for k, v in inputs.items()}
    return linear_step(a["x"], a["w"], s, a["b"], a["p"], inputs["dy"].to(device))


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_splits_grouped_linear_forward_dgrad_wgrad(cuda, bad):
    """Forward and autograd's dgrad / wgrad / dbias / dscales on bad splits: the CPU's result for
    the sanitized splits, zeros past them; check_errors() names the problem (once, and clears it)."""
    T = 10
    inputs = linear_inputs(T, 32, 24, 3)
    got = linear_on(inputs, bad.tensor(T, cuda), cuda)
    want = linear_on(inputs, make_splits(bad.sanitized(T), CPU), CPU)
    assert_all_close(got, want, BF16, bad.name)
    expect_reported(bad.fragments(T), cuda)


def glu_inputs(T, F, gated=True):
    torch.manual_seed(T + F)
    return dict(h=rand(T, 2 * F if gated else F, scale=3.0), p=torch.rand(T), d=rand(T, F))


def glu_step(h, s, p, d, **act):
    out = me.glu(h, s, p, **act)
    out.backward(d)
    return {"out": out, "dh": h.grad, "dp": None if p is None else p.grad}


def glu_on(inputs, s, device, **act):
    return glu_step(leaf(inputs["h"], device), s, leaf(inputs["p"], device), inputs["d"].to(device), **act)


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_splits_glu_forward_and_backward(cuda, bad):
    T = 10
    inputs = glu_inputs(T, 32)
    got = glu_on(inputs, bad.tensor(T, cuda), cuda, layout="pairs")
    want = glu_on(inputs, make_splits(bad.sanitized(T), CPU), CPU, layout="pairs")
    assert_all_close(got, want, BF16, bad.name)
    expect_reported(bad.fragments(T), cuda)


def mlp_inputs(T, H, F, G, gated=True, bias=True):
    torch.manual_seed(T * 3 + H + F + G)
    W = 2 * F if gated else F
    return dict(x=rand(T, H), w1=rand(G, W, H, scale=H**-0.5), w2=rand(G, H, F, scale=F**-0.5),
                b1=rand(G, W, scale=0.5) if bias else None, b2=rand(G, H, scale=0.5) if bias else None,
                p=torch.rand(T), dy=rand(T, H))


def mlp_step(a, s, dy, **opts):
    y = me.expert_mlp(a["x"], a["w1"], a["w2"], s, a["p"], a["b1"], a["b2"], **opts)
    y.backward(dy)
    grads = {"y": y}
    for k in ("x", "w1", "w2", "b1", "b2", "p"):
        grads["d" + k] = None if a[k] is None else a[k].grad
    return grads


def mlp_on(inputs, s, device, **opts):
    a = {k: (leaf(v, device) if v is not None and k != "dy" else v) for k, v in inputs.items()}
    return mlp_step(a, s, inputs["dy"].to(device), **opts)


# (GLU layout, fusion, recompute_fc1): the fused forward epilogue, the unfused path with
# recompute, the fused backward.
MLP_VARIANTS = [("pairs", "forward", False), ("halves", "none", True), ("blocks:32", "all", False)]


@pytest.mark.parametrize("variant", MLP_VARIANTS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_splits_expert_mlp_forward_and_backward(cuda, bad, variant):
    layout, fusion, recompute = variant
    T = 10
    inputs = mlp_inputs(T, 32, 32, 3)
    opts = dict(layout=layout, fusion=fusion, recompute_fc1=recompute)
    got = mlp_on(inputs, bad.tensor(T, cuda), cuda, **opts)
    want = mlp_on(inputs, make_splits(bad.sanitized(T), CPU), CPU, **opts)
    assert_all_close(got, want, BF16, f"{bad.name} {variant}")
    expect_reported(bad.fragments(T), cuda)


def permute_chain(x, p, row_of, splits, routing, rows, dy, dps):
    """permute -> (a differentiable step) -> unpermute through the ops' registered autograd, with
    splits given by the caller (the plan's routing tensor is then not trusted: offsets come from
    splits)."""
    xs, ps = ops.permute(x, p, row_of, splits, routing, rows)
    y = ops.unpermute(xs * 1.5, p, row_of, splits, routing)
    loss = (y.float() * dy.float()).sum() + (ps * dps).sum()
    loss.backward()
    return {"x_sorted": xs, "probs_sorted": ps, "y": y, "dx": x.grad, "dp": p.grad}


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_splits_permute_and_unpermute(cuda, bad):
    """The expert-sorted buffer's splits are bad: rows past the clamped offsets[E] are neither read
    nor written (their row_of entries are skipped and reported), the rest is the CPU's result for
    the sanitized splits with those entries dropped."""
    T, k, E, H = 6, 2, 3, 32
    R = T * k
    torch.manual_seed(5)
    x, p, dy, dps = rand(T, H), torch.rand(T, k), rand(T, H), torch.rand(R)
    indices = torch.tensor(INDICES, device=cuda)
    row_of, _, routing, _ = ops.permute_plan(indices, E, None)
    got = permute_chain(leaf(x, cuda), leaf(p, cuda), row_of, bad.tensor(R, cuda), routing, R, dy.to(cuda),
                        dps.to(cuda))
    sane = bad.sanitized(R)
    row_of_cpu = row_of.cpu()
    row_of_cpu = torch.where(row_of_cpu >= sum(sane), torch.full_like(row_of_cpu, -1), row_of_cpu)
    want = permute_chain(leaf(x), leaf(p), row_of_cpu, make_splits(sane, CPU), routing.cpu(), R, dy, dps)
    assert_all_close(got, want, BF16, bad.name)
    expect_reported(bad.fragments(R), cuda)


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_splits_quantize_fp8(cuda, bad):
    """Rows and columns of the sanitized splits, the bytes of the CPU quantizer's (docs: the CPU and
    CUDA quantizers give the same bytes); the columns' offsets stay inside the copy."""
    T, K = 40, 32
    torch.manual_seed(2)
    x = rand(T, K)
    got = me.quantize_fp8(x.to(cuda), bad.tensor(T, cuda), rowwise=True, columnwise=True)
    sane = bad.sanitized(T)
    want = me.quantize_fp8(x, make_splits(sane, CPU), rowwise=True, columnwise=True)
    assert_same_fp8(got, want, sane, bad.name)
    assert int(got.columns.offsets[-1]) <= got.columns.data.shape[1]
    expect_reported(bad.fragments(T), cuda)


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_splits_fp8_gemms(cuda, bad):
    """quantize_fp8 and the three FP8 GEMMs on bad splits: the CPU's results for the sanitized ones."""
    needs_fp8_gemm(cuda)
    T, K, N, G = 40, 32, 48, 3
    torch.manual_seed(3)
    x, dy, w = rand(T, K), rand(T, N), rand(G, N, K, scale=K**-0.5)

    def run(device, s):
        x8 = me.quantize_fp8(x.to(device), s, columnwise=True)
        dy8 = me.quantize_fp8(dy.to(device), s, columnwise=True)
        w8 = me.quantize_fp8_weight(w.to(device))
        return {"y": me.grouped_linear_fp8(x8, w8, s), "dx": me.grouped_linear_fp8_dgrad(dy8, w8, s),
                "dw": me.grouped_linear_fp8_wgrad(dy8, x8, s, out_dtype=torch.float32)}

    got = run(cuda, bad.tensor(T, cuda))
    want = run(CPU, make_splits(bad.sanitized(T), CPU))
    assert_all_close(got, want, BF16, bad.name)
    expect_reported(bad.fragments(T), cuda)


def test_bad_splits_past_256_experts_name_the_first_negative(cuda):
    """The offsets kernel scans G in chunks of 256: the first negative split is found across chunks,
    and the sum past T is still reported."""
    T, G, K, N = 50, 300, 16, 8
    values = [0] * G
    values[3], values[270], values[290], values[299] = 30, -4, -1, 40
    inputs = linear_inputs(T, K, N, G, bias=False, row_scale=False)
    got = linear_on(inputs, torch.tensor(values, device=cuda), cuda)
    want = linear_on(inputs, make_splits(sanitize(values, T), CPU), CPU)
    assert_all_close(got, want, BF16, "G = 300")
    expect_reported([r"splits\[270\] = -4 is negative", r"sum\(splits\) = 70 exceeds the buffer capacity T = 50"],
                    cuda)


def test_zero_tokens_with_nonzero_splits_is_reported(cuda):
    """T = 0 with splits that route a row: nothing to write, and the report says so."""
    inputs = linear_inputs(0, 16, 8, 3, bias=False, row_scale=False)
    got = linear_on(inputs, make_splits([1, 0, 0], cuda), cuda)
    assert got["y"].shape == (0, 8) and got["dx"].shape == (0, 16)
    assert torch.equal(got["dw"], torch.zeros_like(got["dw"]))
    expect_reported([r"sum\(splits\) = 1 exceeds the buffer capacity T = 0"], cuda)


# Splits of the wrong length (G) for G = 3 experts' weights, with valid values for T = 10 rows.
WRONG_G = {0: [], 2: [4, 5], 4: [4, 0, 5, 1]}


def wrong_g_message(g):
    if g == 0:
        return r"GroupLayout: expected G >= 1 experts, got splits"
    return rf"has G = 3 experts but the group layout has G = {g}"


@pytest.mark.parametrize("g", list(WRONG_G))
@pytest.mark.parametrize("op", ["grouped_linear", "grouped_linear_wgrad", "expert_mlp", "glu", "quantize_fp8",
                                "grouped_linear_fp8", "grouped_linear_fp8_dgrad", "grouped_linear_fp8_wgrad"])
def test_splits_of_the_wrong_length_are_a_clear_error(cuda, op, g):
    """The length of splits is a shape: checked at once on CUDA too, and nothing is reported."""
    T, K, N, G = 10, 32, 32, 3
    s = torch.tensor(WRONG_G[g], dtype=torch.int64, device=cuda)
    x, w, dy = rand(T, K).to(cuda), rand(G, N, K).to(cuda), rand(T, N).to(cuda)
    if op == "glu":
        if g != 0:
            pytest.skip("glu has no experts' weights: any G is valid")
        fn = lambda: me.glu(rand(T, 2 * N).to(cuda), s)  # noqa: E731
    elif op == "quantize_fp8":
        if g != 0:
            pytest.skip("quantize_fp8 has no experts' weights: any G is valid")
        fn = lambda: me.quantize_fp8(x, s)  # noqa: E731
    elif op == "grouped_linear":
        fn = lambda: me.grouped_linear(leaf(x), leaf(w), s)  # noqa: E731
    elif op == "grouped_linear_wgrad":
        fn = lambda: me.grouped_linear_wgrad(dy, x, s, out=torch.zeros(G, N, K, device=cuda), mode="accumulate")  # noqa: E731
    elif op == "expert_mlp":
        fn = lambda: me.expert_mlp(x, rand(G, 2 * N, K).to(cuda), rand(G, K, N).to(cuda), s)  # noqa: E731
    else:
        w8 = me.quantize_fp8_weight(w)
        if g == 0:
            fn = lambda: me.quantize_fp8(x, s)  # noqa: E731  (the operands cannot even be made)
        elif op == "grouped_linear_fp8":
            fn = lambda: me.grouped_linear_fp8(me.quantize_fp8(x, s), w8, s)  # noqa: E731
        elif op == "grouped_linear_fp8_dgrad":
            fn = lambda: me.grouped_linear_fp8_dgrad(me.quantize_fp8(dy, s), w8, s)  # noqa: E731
        else:
            fn = lambda: me.grouped_linear_fp8_wgrad(me.quantize_fp8(dy, s, columnwise=True),  # noqa: E731
                                                     me.quantize_fp8(x, s, columnwise=True), s,
                                                     out=torch.zeros(G, N, K, device=cuda))
    with pytest.raises(ValueError, match=wrong_g_message(g)):
        fn()
    expect_clean(cuda)


# Bad splits through the extension ops directly, every output a view into a larger buffer (its tail,
# and for strided views its gaps, must keep POISON_BYTE) and every input a view whose tail is NaN.
# Each builder takes the device and splits_for(capacity) and returns a Built.


class Built:
    """What an extension op was given and wrote: its outputs (views), their Buffers, the routing's
    capacity, a check against the public op (or None), the outputs whose rows past the routed ones
    must be zeros (fresh token outputs, docs/python.md) and those whose rows past them must be
    untouched (FP8 operands: "not written")."""

    def __init__(self, outputs, buffers, capacity, verify=None, zero_tail=(), untouched_tail=()):
        self.outputs, self.buffers, self.capacity, self.verify = outputs, buffers, capacity, verify
        self.zero_tail, self.untouched_tail = zero_tail, untouched_tail


def c_linear_forward(dev, splits_for):
    T, K, N, G = 10, 32, 24, 3
    s, B = splits_for(T), Buffers(dev)
    x = B.input(rand(T, K), (T + 8, K), rows_of(T))
    p = B.input(torch.rand(T), (T + 8,), rows_of(T))
    w, b = rand(G, N, K, scale=K**-0.5).to(dev), rand(G, N).to(dev)
    y = B.output("y", (T + 8, N), rows_of(T), BF16)
    _C.grouped_linear_forward(x, ([w], None), route(s, x), y, ([b], None), p, stream_of(dev))
    return Built({"y": y}, B, T, lambda: assert_close(y, me.grouped_linear(x.clone(), w, s, b, p.clone()), BF16, "y"),
                 zero_tail=["y"])


def c_linear_dgrad(dev, splits_for):
    T, K, N, G = 10, 32, 24, 3
    s, B = splits_for(T), Buffers(dev)
    dy = B.input(rand(T, N), (T + 8, N), rows_of(T))
    w = rand(G, N, K, scale=K**-0.5).to(dev)
    dx = B.output("dx", (T + 8, K), rows_of(T), BF16)
    _C.grouped_linear_dgrad(dy, ([w], None), route(s, dy), dx, stream_of(dev))
    return Built({"dx": dx}, B, T, lambda: assert_close(dx, me.grouped_linear_dgrad(dy.clone(), w, s), BF16, "dx"),
                 zero_tail=["dx"])


def c_linear_wgrad(dev, splits_for):
    T, K, N, G = 10, 32, 24, 3
    s, B = splits_for(T), Buffers(dev)
    dy = B.input(rand(T, N), (T + 8, N), rows_of(T))
    x = B.input(rand(T, K), (T + 8, K), rows_of(T))
    dw = B.output("dweight", (G + 1, N, K), rows_of(G), BF16)
    _C.grouped_linear_wgrad(dy, x, route(s, dy), ([dw], None), "write", stream_of(dev))
    return Built({"dweight": dw}, B, T,
                 lambda: assert_close(dw, me.grouped_linear_wgrad(dy.clone(), x.clone(), s), BF16, "dweight"))


def c_linear_dbias(dev, splits_for):
    T, N, G = 10, 24, 3
    s, B = splits_for(T), Buffers(dev)
    dy = B.input(rand(T, N), (T + 8, N), rows_of(T))
    p = B.input(torch.rand(T), (T + 8,), rows_of(T))
    db = B.output("dbias", (G + 1, N), rows_of(G), BF16)
    _C.grouped_linear_dbias(dy, route(s, dy), ([db], None), "write", p, stream_of(dev))
    return Built({"dbias": db}, B, T)


def c_linear_dscales(dev, splits_for):
    T, N, G = 10, 24, 3
    s, B = splits_for(T), Buffers(dev)
    dy = B.input(rand(T, N), (T + 8, N), rows_of(T))
    b = rand(G, N).to(dev)
    ds = B.output("dscales", (T + 8,), rows_of(T), torch.float32)
    _C.grouped_linear_dscales(dy, ([b], None), route(s, dy), ds, stream_of(dev))
    return Built({"dscales": ds}, B, T, zero_tail=["dscales"])


def c_glu_forward(dev, splits_for):
    T, F = 10, 32
    s, B = splits_for(T), Buffers(dev)
    h = B.input(rand(T, 2 * F, scale=3.0), (T + 8, 2 * F), rows_of(T))
    p = B.input(torch.rand(T), (T + 8,), rows_of(T))
    out = B.output("out", (T + 8, F), rows_of(T), BF16)
    spec = _C.GluSpec.parse(me.glu_text("swiglu", "pairs"))
    _C.glu_forward(h, p, route(s, h), out, spec, stream_of(dev))
    return Built({"out": out}, B, T, lambda: assert_close(out, me.glu(h.clone(), s, p.clone(), layout="pairs"), BF16,
                                                          "out"), zero_tail=["out"])


def c_glu_backward(dev, splits_for):
    T, F = 10, 32
    s, B = splits_for(T), Buffers(dev)
    h = B.input(rand(T, 2 * F, scale=3.0), (T + 8, 2 * F), rows_of(T))
    p = B.input(torch.rand(T), (T + 8,), rows_of(T))
    d_out = B.input(rand(T, F), (T + 8, F), rows_of(T))
    dh = B.output("dh", (T + 8, 2 * F), rows_of(T), BF16)
    dp = B.output("dprobs", (T + 8,), rows_of(T), torch.float32)
    spec = _C.GluSpec.parse(me.glu_text("swiglu", "pairs"))
    _C.glu_backward(h, p, d_out, route(s, h), dh, dp, spec, stream_of(dev))
    return Built({"dh": dh, "dprobs": dp}, B, T, zero_tail=["dh", "dprobs"])


def mlp_weights(dev, G, H, F):
    return rand(G, 2 * F, H, scale=H**-0.5).to(dev), rand(G, H, F, scale=F**-0.5).to(dev)


def c_mlp_forward(fusion):
    def build(dev, splits_for):
        T, H, F, G = 10, 32, 32, 3
        s, B = splits_for(T), Buffers(dev)
        spec = _C.GluSpec.parse(me.glu_text("swiglu", "pairs"))
        x = B.input(rand(T, H), (T + 8, H), rows_of(T))
        p = B.input(torch.rand(T), (T + 8,), rows_of(T))
        w1, w2 = mlp_weights(dev, G, H, F)
        y = B.output("y", (T + 8, H), rows_of(T), BF16)
        fc1 = B.output("fc1_out", (T + 8, 2 * F), rows_of(T), BF16)
        size = _C.expert_mlp_forward_workspace_size(T, H, F, "bfloat16", True, spec)
        ws = B.output("workspace", (size + 4096,), rows_of(size), torch.uint8) if size else None
        _C.expert_mlp_forward(x, p, ([w1], None), ([], None), ([w2], None), ([], None), route(s, x), y, fc1, spec,
                              fusion, ws, stream_of(dev))

        def verify():
            want = me.expert_mlp(x.clone(), w1, w2, s, p.clone(), layout="pairs", fusion=fusion)
            assert_close(y, want, BF16, "y")

        return Built({"y": y, "fc1_out": fc1}, B, T, verify, zero_tail=["y"])

    return build


def c_mlp_backward(fusion):
    def build(dev, splits_for):
        T, H, F, G = 10, 32, 32, 3
        s, B = splits_for(T), Buffers(dev)
        spec = _C.GluSpec.parse(me.glu_text("swiglu", "pairs"))
        dy = B.input(rand(T, H), (T + 8, H), rows_of(T))
        x = B.input(rand(T, H), (T + 8, H), rows_of(T))
        p = B.input(torch.rand(T), (T + 8,), rows_of(T))
        fc1 = B.input(rand(T, 2 * F), (T + 8, 2 * F), rows_of(T))
        w1, w2 = mlp_weights(dev, G, H, F)
        dx = B.output("dx", (T + 8, H), rows_of(T), BF16)
        dp = B.output("dprobs", (T + 8,), rows_of(T), torch.float32)
        g1 = B.output("fc1_weight_grad", (G + 1, 2 * F, H), rows_of(G), BF16)
        g2 = B.output("fc2_weight_grad", (G + 1, H, F), rows_of(G), BF16)
        size = _C.expert_mlp_backward_workspace_size(T, H, F, "bfloat16", False, spec, fusion, False)
        ws = B.output("workspace", (size + 4096,), rows_of(size), torch.uint8) if size else None
        _C.expert_mlp_backward(dy, x, p, ([w1], None), ([], None), ([w2], None), ([], None), route(s, dy), fc1, dx, dp,
                               ([g1], None), "write", ([], None), ([g2], None), "write", ([], None), None, None, spec,
                               fusion, ws, stream_of(dev))
        return Built({"dx": dx, "dprobs": dp, "fc1_weight_grad": g1, "fc2_weight_grad": g2}, B, T,
                     zero_tail=["dx", "dprobs"])

    return build


def permute_setup(dev):
    T, k, E, H = 6, 2, 3, 32
    row_of = ops.permute_plan(torch.tensor(INDICES, device=dev), E, None)[0]
    return T, k, T * k, H, row_of


def c_permute(dev, splits_for):
    T, k, R, H, row_of = permute_setup(dev)
    s, B = splits_for(R), Buffers(dev)
    x = B.input(rand(T, H), (T + 8, H), rows_of(T))
    p = B.input(torch.rand(T, k), (T + 8, k), rows_of(T))
    xs = B.output("x_sorted", (R + 8, H), rows_of(R), BF16)
    ps = B.output("probs_sorted", (R + 8,), rows_of(R), torch.float32)
    _C.permute(x, p, row_of, route(s, xs), xs, ps, stream_of(dev))
    return Built({"x_sorted": xs, "probs_sorted": ps}, B, R, zero_tail=["x_sorted", "probs_sorted"])


def c_unpermute(dev, splits_for):
    T, k, R, H, row_of = permute_setup(dev)
    s, B = splits_for(R), Buffers(dev)
    out = B.input(rand(R, H), (R + 8, H), rows_of(R))
    p = B.input(torch.rand(T, k), (T + 8, k), rows_of(T))
    y = B.output("y", (T + 8, H), rows_of(T), BF16)
    _C.unpermute(out, p, row_of, route(s, out), y, stream_of(dev))
    return Built({"y": y}, B, R)


def c_permute_backward(dev, splits_for):
    T, k, R, H, row_of = permute_setup(dev)
    s, B = splits_for(R), Buffers(dev)
    d_sorted = B.input(rand(R, H), (R + 8, H), rows_of(R))
    d_ps = B.input(torch.rand(R), (R + 8,), rows_of(R))
    dx = B.output("dx", (T + 8, H), rows_of(T), BF16)
    d_probs = B.output("d_probs", (T + 8, k), rows_of(T), torch.float32)
    _C.permute_backward(d_sorted, d_ps, row_of, route(s, d_sorted), dx, d_probs, stream_of(dev))
    return Built({"dx": dx, "d_probs": d_probs}, B, R)


def c_unpermute_backward(dev, splits_for):
    T, k, R, H, row_of = permute_setup(dev)
    s, B = splits_for(R), Buffers(dev)
    dy = B.input(rand(T, H), (T + 8, H), rows_of(T))
    out = B.input(rand(R, H), (R + 8, H), rows_of(R))
    p = B.input(torch.rand(T, k), (T + 8, k), rows_of(T))
    d_out = B.output("d_out", (R + 8, H), rows_of(R), BF16)
    d_probs = B.output("d_probs", (T + 8, k), rows_of(T), torch.float32)
    _C.unpermute_backward(dy, out, p, row_of, route(s, d_out), d_out, d_probs, stream_of(dev))
    return Built({"d_out": d_out, "d_probs": d_probs}, B, R, zero_tail=["d_out"])


def c_quantize_fp8(dev, splits_for):
    """Both forms into strided outputs: the scales' pitch and the columns' row stride wider than
    the op needs (both allowed by the validator), the gaps poisoned."""
    T, K, G = 40, 32, 3
    s, B = splits_for(T), Buffers(dev)
    S, C = _C.fp8_scales_pitch(T), _C.fp8_columns_capacity(T, G)
    x = B.input(rand(T, K), (T + 8, K), rows_of(T))
    rd = B.output("rows.data", (T + 8, K), rows_of(T), E4M3)
    rs = B.output("rows.scales", (1, S + 4), cols_of(S), torch.float32)
    cd = B.output("columns.data", (K, C + 128), cols_of(C), E4M3)
    cs = B.output("columns.scales", (C // 128 + 1, K), rows_of(C // 128), torch.float32)
    co = B.output("columns.offsets", (G + 3,), rows_of(G + 1), torch.int64)
    _C.quantize_fp8(x, route(s, x), rd, rs, cd, cs, co, False, 0.0, stream_of(dev))

    def verify():
        want = me.quantize_fp8(x.clone(), s, rowwise=True, columnwise=True)
        got = me.Fp8Tensor(me.Fp8Rows(rd, rs), me.Fp8Columns(cd, cs, co), T)
        assert_same_fp8(got, want, sanitize(s.tolist(), T), "quantize_fp8")

    return Built({"rows.data": rd, "rows.scales": rs, "columns.data": cd, "columns.scales": cs}, B, T, verify,
                 untouched_tail=["rows.data"])


def fp8_gemm_operands(dev, splits_for, width):
    """The FP8 forward / dgrad cases' operands: T = 40 tokens of `width` quantized by rows, in
    buffers with poisoned padding (8 more rows, 4 more scale columns), and a [3, 48, 32] weight."""
    T, K, N, G = 40, 32, 48, 3
    s, B = splits_for(T), Buffers(dev)
    S = _C.fp8_scales_pitch(T)
    a8 = me.quantize_fp8(rand(T, width).to(dev), s)
    w8 = me.quantize_fp8_weight(rand(G, N, K, scale=K**-0.5).to(dev))
    data = B.input(a8.rows.data, (T + 8, width), rows_of(T))
    scales = B.input(a8.rows.scales, (1, S + 4), cols_of(S))
    return T, K, N, s, B, a8, w8, data, scales


def c_fp8_forward(dev, splits_for):
    T, K, N, s, B, x8, w8, xd, xs = fp8_gemm_operands(dev, splits_for, 32)
    y = B.output("y", (T + 8, N), rows_of(T), BF16)
    _C.grouped_linear_fp8_forward(xd, xs, w8.data, w8.scales, route(s, xd), y, ([], None), None, stream_of(dev))
    return Built({"y": y}, B, T, lambda: assert_close(y, me.grouped_linear_fp8(x8, w8, s), BF16, "y"), zero_tail=["y"])


def c_fp8_dgrad(dev, splits_for):
    T, K, N, s, B, dy8, w8, dyd, dys = fp8_gemm_operands(dev, splits_for, 48)
    dx = B.output("dx", (T + 8, K), rows_of(T), BF16)
    _C.grouped_linear_fp8_dgrad(dyd, dys, w8.data_t, w8.scales_t, route(s, dyd), dx, stream_of(dev))
    return Built({"dx": dx}, B, T, lambda: assert_close(dx, me.grouped_linear_fp8_dgrad(dy8, w8, s), BF16, "dx"),
                 zero_tail=["dx"])


def c_fp8_wgrad(dev, splits_for):
    T, K, N, G = 40, 32, 48, 3
    s, B = splits_for(T), Buffers(dev)
    C = _C.fp8_columns_capacity(T, G)
    x8 = me.quantize_fp8(rand(T, K).to(dev), s, rowwise=False, columnwise=True)
    dy8 = me.quantize_fp8(rand(T, N).to(dev), s, rowwise=False, columnwise=True)
    xc = B.input(x8.columns.data, (K, C + 128), cols_of(C))
    xs = B.input(x8.columns.scales, (C // 128 + 1, K), rows_of(C // 128))
    dyc = B.input(dy8.columns.data, (N, C + 128), cols_of(C))
    dys = B.input(dy8.columns.scales, (C // 128 + 1, N), rows_of(C // 128))
    dw = B.output("dweight", (G + 1, N, K), rows_of(G), torch.float32)
    r = _C.route_capacity(s, torch.empty(G + 1, dtype=torch.int64, device=dev), T, stream_of(dev), "test")
    _C.grouped_linear_fp8_wgrad(dyc, dys, dy8.columns.offsets, xc, xs, x8.columns.offsets, r, ([dw], None), "write",
                                stream_of(dev))
    return Built({"dweight": dw}, B, T, lambda: assert_close(
        dw, me.grouped_linear_fp8_wgrad(dy8, x8, s, out_dtype=torch.float32), BF16, "dweight"))


# name: (builder, needs the FP8 GEMMs)
C_OPS = {
    "grouped_linear_forward": (c_linear_forward, False),
    "grouped_linear_dgrad": (c_linear_dgrad, False),
    "grouped_linear_wgrad": (c_linear_wgrad, False),
    "grouped_linear_dbias": (c_linear_dbias, False),
    "grouped_linear_dscales": (c_linear_dscales, False),
    "glu_forward": (c_glu_forward, False),
    "glu_backward": (c_glu_backward, False),
    "expert_mlp_forward-fused": (c_mlp_forward("forward"), False),
    "expert_mlp_forward-unfused": (c_mlp_forward("none"), False),
    "expert_mlp_backward-forward": (c_mlp_backward("forward"), False),
    "expert_mlp_backward-all": (c_mlp_backward("all"), False),
    "permute": (c_permute, False),
    "unpermute": (c_unpermute, False),
    "permute_backward": (c_permute_backward, False),
    "unpermute_backward": (c_unpermute_backward, False),
    "quantize_fp8": (c_quantize_fp8, False),
    "grouped_linear_fp8_forward": (c_fp8_forward, True),
    "grouped_linear_fp8_dgrad": (c_fp8_dgrad, True),
    "grouped_linear_fp8_wgrad": (c_fp8_wgrad, True),
}


def check_built(built, routed, what):
    """Bytes outside the output views intact, outputs finite (no NaN read from past an input's
    rows), rows past the `routed` ones zeros or untouched as documented, the public op's result."""
    built.buffers.check()
    for name, t in built.outputs.items():
        assert finite(t), f"{what}: {name} holds a non-finite value (a read past an input's rows?)"
    for name in built.zero_tail:
        assert torch.all(built.outputs[name][routed:] == 0), f"{what}: {name} is not zero past the {routed} routed rows"
    for name in built.untouched_tail:
        assert torch.all(as_bytes(built.outputs[name][routed:]) == POISON_BYTE), \
            f"{what}: {name} was written past the {routed} routed rows (documented as not written)"
    if built.verify is not None:
        built.verify()
    built.buffers.check()


@pytest.mark.parametrize("bad", BAD, ids=repr)
@pytest.mark.parametrize("op", list(C_OPS))
def test_bad_splits_never_touch_memory_past_the_buffers(cuda, op, bad):
    """Outputs are views of larger poisoned buffers, inputs views whose tails are NaN: after the op
    (synchronized) every byte outside an output view is intact, every output is finite, rows past
    the clamped offsets are zeros (fresh outputs) or untouched (FP8 operands), the result is the
    public op's on the same splits, and check_errors() names the problem."""
    build, fp8_gemm = C_OPS[op]
    if fp8_gemm:
        needs_fp8_gemm(cuda)
    torch.manual_seed(11)
    built = build(cuda, lambda c: bad.tensor(c, cuda))
    check_built(built, sum(bad.sanitized(built.capacity)), f"{op} {bad.name}")
    expect_reported(bad.fragments(built.capacity), cuda)


# ---- 2. devices and layouts ----


def linear_args(dev):
    a = linear_inputs(10, 32, 24, 3)
    return dict(x=a["x"].to(dev), w=a["w"].to(dev), s=make_splits([4, 0, 5], dev), b=a["b"].to(dev), p=a["p"].to(dev))


def glu_args(dev):
    a = glu_inputs(10, 32)
    return dict(h=a["h"].to(dev), p=a["p"].to(dev), s=make_splits([4, 0, 5], dev))


def mlp_args(dev):
    a = mlp_inputs(10, 32, 32, 3, bias=False)
    return dict(x=a["x"].to(dev), w1=a["w1"].to(dev), w2=a["w2"].to(dev), p=a["p"].to(dev),
                s=make_splits([4, 0, 5], dev))


def fp8_args(dev):
    a = linear_inputs(10, 32, 32, 3)
    return dict(x=a["x"].to(dev), w=a["w"].to(dev), b=a["b"].to(dev), s=make_splits([4, 0, 5], dev))


def requiring_grad(a, grad):
    return {k: (v.requires_grad_(True) if grad and v.is_floating_point() else v) for k, v in a.items()}


LAYER_DEVICE = r"expected the group layout's device cuda"
# (op, argument moved to the CPU, what the message must say). The splits' device is the group
# layout's: the message then names a tensor on CUDA and "the group layout's device cpu".
CPU_ARGUMENT_CASES = [
    ("grouped_linear", "x", r"grouped_linear_forward: x is on cpu; " + LAYER_DEVICE),
    ("grouped_linear", "w", r"grouped_linear_forward: weight is on cpu; " + LAYER_DEVICE),
    ("grouped_linear", "b", r"grouped_linear_forward: bias is on cpu; " + LAYER_DEVICE),
    ("grouped_linear", "p", r"grouped_linear_forward: row_scale is on cpu; " + LAYER_DEVICE),
    ("grouped_linear", "s", r"grouped_linear_forward: \w+ is on cuda:\d+; expected the group layout's device cpu"),
    ("grouped_linear_wgrad", "out", r"grouped_linear_wgrad: dweight is on cpu; " + LAYER_DEVICE),
    ("glu", "h", r"glu_forward: h is on cpu; " + LAYER_DEVICE),
    ("glu", "p", r"glu_forward: probs is on cpu; " + LAYER_DEVICE),
    ("glu", "s", r"glu_forward: \w+ is on cuda:\d+; expected the group layout's device cpu"),
    ("expert_mlp", "x", r"expert_mlp_forward: x is on cpu; " + LAYER_DEVICE),
    ("expert_mlp", "w1", r"expert_mlp_forward: fc1_weight is on cpu; " + LAYER_DEVICE),
    ("expert_mlp", "w2", r"expert_mlp_forward: fc2_weight is on cpu; " + LAYER_DEVICE),
    ("expert_mlp", "p", r"expert_mlp_forward: probs is on cpu; " + LAYER_DEVICE),
    ("expert_mlp", "s", r"expert_mlp_forward: \w+ is on cuda:\d+; expected the group layout's device cpu"),
    ("dispatch", "x", r"permute: x is on cpu; expected the group layout's device cuda"),
    ("dispatch", "p", r"permute: probs is on cpu; expected the group layout's device cuda"),
    ("dispatch", "indices", r"permute: \w+ is on cuda:\d+; expected the group layout's device cpu"),
    ("quantize_fp8", "s", r"quantize_fp8: x is on cuda:\d+; expected the group layout's device cpu"),
    ("grouped_linear_fp8", "b", r"grouped_linear_forward: bias is on cpu; " + LAYER_DEVICE),
    ("grouped_linear_fp8", "s", r"grouped_linear_forward: [\w.]+ is on cuda:\d+; expected the group layout's device "
                                r"cpu"),
]


def call_with_one_on_cpu(op, arg, cuda, grad):
    def moved(a):
        return {k: (v.cpu() if k == arg else v) for k, v in a.items()}

    if op == "grouped_linear":
        a = moved(requiring_grad(linear_args(cuda), grad))
        return me.grouped_linear(a["x"], a["w"], a["s"], a["b"], a["p"])
    if op == "grouped_linear_wgrad":
        a = linear_args(cuda)
        out = torch.zeros(3, 24, 32, device=CPU)
        return me.grouped_linear_wgrad(rand(10, 24).to(cuda), a["x"], a["s"], out=out, mode="accumulate")
    if op == "glu":
        a = moved(requiring_grad(glu_args(cuda), grad))
        return me.glu(a["h"], a["s"], a["p"])
    if op == "expert_mlp":
        a = moved(requiring_grad(mlp_args(cuda), grad))
        return me.expert_mlp(a["x"], a["w1"], a["w2"], a["s"], a["p"])
    if op == "dispatch":
        a = moved(requiring_grad(dict(x=rand(6, 32).to(cuda), p=torch.rand(6, 2, device=cuda),
                                      indices=torch.tensor(INDICES, device=cuda)), grad))
        return me.dispatch(a["x"], a["p"], a["indices"], 3)
    if op == "quantize_fp8":
        a = moved(fp8_args(cuda))
        return me.quantize_fp8(a["x"], a["s"])
    if op == "grouped_linear_fp8":
        a = fp8_args(cuda)
        x8, w8 = me.quantize_fp8(a["x"], a["s"]), me.quantize_fp8_weight(a["w"])
        if arg == "s":  # the CPU splits are not the ones x was quantized with: the GEMM routes them again
            return me.grouped_linear_fp8(x8, w8, a["s"].cpu())
        return me.grouped_linear_fp8(x8, w8, a["s"], bias=a["b"].cpu())
    raise AssertionError(op)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("op, arg, message", CPU_ARGUMENT_CASES, ids=[f"{o}-{a}" for o, a, _ in CPU_ARGUMENT_CASES])
def test_one_tensor_on_the_cpu_is_named(cuda, op, arg, message, grad):
    """One argument on the CPU, the rest on CUDA: a ValueError that names it (or, for splits, the
    group layout's device), before any kernel runs; with and without autograd (the two call paths)."""
    with torch.set_grad_enabled(grad):
        with pytest.raises(ValueError, match=message):
            call_with_one_on_cpu(op, arg, cuda, grad)
    expect_clean(cuda)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_gpu_are_named(cuda):
    a = linear_args(torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"grouped_linear_forward: weight is on cuda:1; expected the group layout's "
                                         r"device cuda:0"):
        me.grouped_linear(a["x"], a["w"].to("cuda:1"), a["s"], a["b"], a["p"])
    with pytest.raises(ValueError, match=r"x is on cuda:0; expected the group layout's device cuda:1"):
        me.grouped_linear(a["x"], a["w"], a["s"].to("cuda:1"))


META_MESSAGE = r"\w+ is on (meta|cuda:\d+|cpu) but \w+ is on (meta|cuda:\d+|cpu); expected every tensor on one device"


def meta_cases(cuda):
    meta = torch.device("meta")
    a, g, m = linear_args(cuda), glu_args(cuda), mlp_args(cuda)
    dy = rand(10, 24).to(cuda)
    row_of, splits, routing, _ = ops.permute_plan(torch.tensor(INDICES, device=cuda), 3, None)
    w8 = me.quantize_fp8_weight(rand(3, 32, 32).to(cuda))
    x8_meta = me.quantize_fp8(torch.zeros(10, 32, device=meta, dtype=BF16), a["s"].to(meta))
    return {
        "grouped_linear_wgrad out": lambda: me.grouped_linear_wgrad(dy, a["x"], a["s"],
                                                                    out=torch.zeros(3, 24, 32, device=meta)),
        "grouped_linear_dbias row_scale": lambda: me.grouped_linear_dbias(dy, a["s"], a["p"].to(meta)),
        "grouped_linear_dscales bias": lambda: me.grouped_linear_dscales(dy, a["b"].to(meta), a["s"]),
        "glu_backward h": lambda: me.glu_backward(g["h"].to(meta), rand(10, 32).to(cuda), g["s"], g["p"]),
        "expert_mlp fc2_weight": lambda: me.expert_mlp(m["x"], m["w1"], m["w2"].to(meta), m["s"], m["p"]),
        "expert_mlp_backward dy": lambda: me.expert_mlp_backward(torch.zeros(10, 32, device=meta, dtype=BF16), m["x"],
                                                                 m["w1"], m["w2"], m["s"], m["p"]),
        "permute x": lambda: ops.permute(rand(6, 32).to(meta), None, row_of, splits, routing, 12),
        "unpermute out": lambda: ops.unpermute(rand(12, 32).to(meta), None, row_of, splits, routing),
        "quantize_fp8_weight out": lambda: me.quantize_fp8_weight(
            rand(3, 32, 32).to(cuda), out=me.Fp8Weight(w8.data.to(meta), w8.scales.to(meta), w8.data_t, w8.scales_t)),
        "grouped_linear_fp8 x": lambda: me.grouped_linear_fp8(x8_meta, w8, a["s"]),
    }


@pytest.mark.parametrize("case", ["grouped_linear_wgrad out", "grouped_linear_dbias row_scale",
                                  "grouped_linear_dscales bias", "glu_backward h", "expert_mlp fc2_weight",
                                  "expert_mlp_backward dy", "permute x", "unpermute out", "quantize_fp8_weight out",
                                  "grouped_linear_fp8 x"])
def test_a_meta_tensor_among_cuda_ones_is_an_error(cuda, case):
    """The dispatcher runs the fake implementation when any argument is a meta tensor: with CUDA
    tensors beside it that is a ValueError naming both, never a real output of uninitialized memory
    (test_ops.py covers the forward ops; these are the backward pieces, the permute ops and FP8)."""
    fn = meta_cases(cuda)[case]
    with pytest.raises(ValueError, match=META_MESSAGE):
        fn()
    expect_clean(cuda)


def laid_out(t, layout):
    """t's values in another memory layout (the same shape)."""
    T, K = t.shape
    dev = t.device
    if layout == "contiguous":
        return t.clone()
    if layout == "row_strided":  # rows 16-byte aligned (K + 8 bf16), a gap after each
        buf = torch.zeros(T, K + 8, dtype=t.dtype, device=dev)
    elif layout == "row_strided_odd":  # rows off 16 bytes: no TMA
        buf = torch.zeros(T, K + 3, dtype=t.dtype, device=dev)
    elif layout == "odd_offset":  # an odd element offset: the data pointer is 2 bytes off 16
        flat = torch.zeros(T * K + 1, dtype=t.dtype, device=dev)
        v = flat[1:].view(T, K)
        v.copy_(t)
        return v
    elif layout == "transposed":  # column-major: unit row stride
        v = torch.zeros(K, T, dtype=t.dtype, device=dev).t()
        v.copy_(t)
        return v
    elif layout == "broadcast_rows":  # every row the same memory (row stride 0): values of row 0
        return t[:1].clone().expand(T, K)
    else:
        raise AssertionError(layout)
    v = buf[:, :K]
    v.copy_(t)
    return v


LAYOUTS = ["row_strided", "row_strided_odd", "odd_offset", "transposed", "broadcast_rows"]


def layout_message(arg):
    """A refusal must name the argument (the op's name first: 'op: x: ...')."""
    return rf": {re.escape(arg)}[:. ]"


def layout_run(op, t, dev):
    """The op with its token operand t (in whatever layout) on dev; returns named results."""
    if op == "grouped_linear":
        a = linear_inputs(t.shape[0], t.shape[1], 24, 3)
        w, b, p = leaf(a["w"], dev), leaf(a["b"], dev), leaf(a["p"], dev)
        return linear_step(grad_leaf(t), w, make_splits([4, 0, 6], dev), b, p, a["dy"].to(dev))
    if op == "grouped_linear_wgrad":
        dy = rand(t.shape[0], 24).to(dev)
        return {"dw": me.grouped_linear_wgrad(dy, t, make_splits([4, 0, 6], dev))}
    if op == "glu":
        a = glu_inputs(t.shape[0], t.shape[1] // 2)
        return glu_step(grad_leaf(t), make_splits([4, 0, 6], dev), leaf(a["p"], dev), a["d"].to(dev), layout="pairs")
    if op == "glu_backward":
        a = glu_inputs(t.shape[0], t.shape[1] // 2)
        dh, dp = me.glu_backward(t, a["d"].to(dev), make_splits([4, 0, 6], dev), a["p"].to(dev), layout="pairs")
        return {"dh": dh, "dp": dp}
    if op == "expert_mlp":
        a = mlp_inputs(t.shape[0], t.shape[1], 32, 3)
        a = {k: (leaf(v, dev) if v is not None and k not in ("x", "dy") else v) for k, v in a.items()}
        a["x"] = grad_leaf(t)
        return mlp_step(a, make_splits([4, 0, 6], dev), mlp_inputs(t.shape[0], t.shape[1], 32, 3)["dy"].to(dev),
                        layout="pairs")
    if op == "dispatch":
        x = grad_leaf(t)
        p = leaf(torch.rand(t.shape[0], 2), dev)
        d = me.dispatch(x, p, torch.tensor(INDICES[: t.shape[0]], device=dev), 3)
        y = me.combine(d.x * 2, d)
        (y.float().square().sum() + d.probs.square().sum()).backward()
        return {"x_sorted": d.x, "probs_sorted": d.probs, "y": y, "dx": x.grad, "dp": p.grad}
    raise AssertionError(op)


# op: (its token operand's shape, the argument's name in messages)
LAYOUT_OPS = {
    "grouped_linear": ((10, 32), "x"),
    "grouped_linear_wgrad": ((10, 32), "x"),
    "glu": ((10, 64), "h"),
    "glu_backward": ((10, 64), "h"),
    "expert_mlp": ((10, 32), "x"),
    "dispatch": ((6, 32), "x"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", list(LAYOUT_OPS))
def test_token_operands_in_other_layouts(cuda, op, layout):
    """Row-strided (16-byte and odd row strides), misaligned (odd element offset, no TMA), transposed
    and broadcast (overlapping rows) token operands: a ValueError naming the argument, or the
    result of a contiguous copy on CUDA and of the CPU backend."""
    shape, arg = LAYOUT_OPS[op]
    torch.manual_seed(21)
    values = rand(*shape, scale=2.0)
    if layout == "broadcast_rows":
        values = values[:1].expand(*shape).clone()

    def run():
        torch.manual_seed(22)
        return layout_run(op, laid_out(values.to(cuda), layout), cuda)

    def reference():
        torch.manual_seed(22)
        contiguous = layout_run(op, values.to(cuda).clone(), cuda)
        torch.manual_seed(22)
        on_cpu = layout_run(op, values.clone(), CPU)
        assert_all_close(contiguous, on_cpu, BF16, f"{op}: contiguous CUDA against CPU")
        return contiguous

    error_or_same(run, reference, layout_message(arg), errors=(ValueError,), what=f"{op} {layout}")
    expect_clean(cuda)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_fp8_of_x_in_other_layouts(cuda, layout):
    """The quantizers read x with 16-byte loads where its rows allow: other layouts give the same
    bytes as a contiguous copy (the layout-independent rule), or a ValueError naming x."""
    T, K = 40, 32
    torch.manual_seed(23)
    x = rand(T, K, scale=3.0)
    if layout == "broadcast_rows":
        x = x[:1].expand(T, K).clone()
    s = make_splits([7, 0, 33], cuda)
    try:
        got = me.quantize_fp8(laid_out(x.to(cuda), layout), s, columnwise=True)
    except ValueError as e:
        assert re.search(layout_message("x"), str(e)), str(e)
        return
    want = me.quantize_fp8(x.to(cuda), s, columnwise=True)
    assert_same_fp8(got, want, [7, 0, 33], layout)
    assert_same_fp8(got, me.quantize_fp8(x, make_splits([7, 0, 33], CPU), columnwise=True), [7, 0, 33],
                    f"{layout} against the CPU")
    expect_clean(cuda)


def fp8_misaligned(t, byte_offset):
    """t's bytes at byte_offset into a fresh buffer (fp8 elements are bytes: any offset is an element
    offset)."""
    flat = torch.zeros(t.numel() + 64, dtype=t.dtype, device=t.device)
    v = flat[byte_offset : byte_offset + t.numel()].view(t.shape)
    v.copy_(t)
    return v


def fp8_row_strided(t, pad):
    buf = torch.zeros(t.shape[0], t.shape[1] + pad, dtype=t.dtype, device=t.device)
    v = buf[:, : t.shape[1]]
    v.copy_(t)
    return v


FP8_OPERAND_CASES = {
    # name: (how x8's rows data / scales or the weight are rebuilt, the message of a refusal)
    "x.data at an odd byte offset": ("x_data", lambda t: fp8_misaligned(t, 1), r"x\.data: data pointer 0x[0-9a-f]+ is "
                                                                               r"not 16-byte aligned"),
    "x.data 8 bytes off 16": ("x_data", lambda t: fp8_misaligned(t, 8), r"x\.data: data pointer 0x[0-9a-f]+ is not "
                                                                        r"16-byte aligned"),
    "x.data rows strided off 16 bytes": ("x_data", lambda t: fp8_row_strided(t, 8), r"x\.data: row stride"),
    "x.data rows strided by 16 bytes more": ("x_data", lambda t: fp8_row_strided(t, 16), r"x\.data"),
    "x.scales with a wider pitch": ("x_scales", lambda t: fp8_row_strided(t, 4), r"x\.scales"),
    "x.scales at an odd float offset": ("x_scales", lambda t: fp8_misaligned(t, 1), r"x\.scales: (data pointer|row)"),
    "weight.data at an odd byte offset": ("w_data", lambda t: fp8_misaligned(t, 1), r"weight\.data: data pointer "
                                                                                    r"0x[0-9a-f]+ is not 16-byte"),
    "weight.data not contiguous": ("w_data", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
                                   r"weight\.data: expected a contiguous tensor"),
}


@pytest.mark.parametrize("case", list(FP8_OPERAND_CASES))
def test_fp8_operands_in_other_layouts(cuda, case):
    """FP8 operands are read with TMA: a data pointer or row stride off 16 bytes is a ValueError
    naming the operand (never a misaligned access); a layout the validator accepts gives the
    contiguous operand's result."""
    needs_fp8_gemm(cuda)
    part, rebuild, message = FP8_OPERAND_CASES[case]
    a = fp8_args(cuda)
    x8, w8 = me.quantize_fp8(a["x"], a["s"]), me.quantize_fp8_weight(a["w"])
    rows = x8.rows
    if part == "x_data":
        x8_other, w8_other = me.Fp8Tensor(me.Fp8Rows(rebuild(rows.data), rows.scales), None, 10), w8
    elif part == "x_scales":
        x8_other, w8_other = me.Fp8Tensor(me.Fp8Rows(rows.data, rebuild(rows.scales)), None, 10), w8
    else:
        x8_other, w8_other = x8, me.Fp8Weight(rebuild(w8.data), w8.scales, w8.data_t, w8.scales_t)

    def run():
        return {"y": me.grouped_linear_fp8(x8_other, w8_other, a["s"])}

    def reference():
        return {"y": me.grouped_linear_fp8(x8, w8, a["s"])}

    error_or_same(run, reference, message, errors=(ValueError,), what=case)
    expect_clean(cuda)


def per_expert_misaligned(w):
    """G per-expert tensors, each at an odd element offset of its own buffer (no TMA for them)."""
    out = []
    for g in range(w.shape[0]):
        flat = torch.zeros(w[g].numel() + 1, dtype=w.dtype, device=w.device)
        v = flat[1:].view(w[g].shape)
        v.copy_(w[g])
        out.append(v.requires_grad_(True))
    return out


@pytest.mark.parametrize("op", ["grouped_linear", "expert_mlp"])
def test_misaligned_per_expert_weights(cuda, op):
    """Per-expert weights at odd element offsets (TMA needs 16 bytes): a fallback with the packed
    weights' result, or a ValueError naming the weight."""
    torch.manual_seed(31)
    if op == "grouped_linear":
        a = linear_inputs(10, 32, 24, 3)

        def run():
            x = leaf(a["x"], cuda)
            w = per_expert_misaligned(a["w"].to(cuda))
            y = me.grouped_linear(x, w, make_splits([4, 0, 6], cuda))
            y.backward(a["dy"].to(cuda))
            return {"y": y, "dx": x.grad, "dw": torch.stack([t.grad for t in w])}

        def reference():
            out = linear_on(dict(a, b=None, p=None), make_splits([4, 0, 6], cuda), cuda)
            return {"y": out["y"], "dx": out["dx"], "dw": out["dw"]}

        message = r": weight[:. ]|weight"
    else:
        a = mlp_inputs(10, 32, 32, 3, bias=False)

        def run():
            x = leaf(a["x"], cuda)
            w1, w2 = per_expert_misaligned(a["w1"].to(cuda)), per_expert_misaligned(a["w2"].to(cuda))
            y = me.expert_mlp(x, w1, w2, make_splits([4, 0, 6], cuda), layout="pairs")
            y.backward(a["dy"].to(cuda))
            return {"y": y, "dx": x.grad, "dw1": torch.stack([t.grad for t in w1]),
                    "dw2": torch.stack([t.grad for t in w2])}

        def reference():
            x, w1, w2 = leaf(a["x"], cuda), leaf(a["w1"], cuda), leaf(a["w2"], cuda)
            y = me.expert_mlp(x, w1, w2, make_splits([4, 0, 6], cuda), layout="pairs")
            y.backward(a["dy"].to(cuda))
            return {"y": y, "dx": x.grad, "dw1": w1.grad, "dw2": w2.grad}

        message = r"fc[12]_weight"
    error_or_same(run, reference, message, errors=(ValueError,), what=op)
    expect_clean(cuda)


@pytest.mark.parametrize("what", ["packed weight transposed", "per-expert weights transposed", "splits strided"])
def test_non_contiguous_parameters_and_splits_are_named(cuda, what):
    """A packed or per-expert weight that is not contiguous, or strided splits: a ValueError whose
    message names the argument (the weight, or splits)."""
    a = linear_args(cuda)
    if what == "packed weight transposed":
        w = a["w"].transpose(1, 2).contiguous().transpose(1, 2)
        fn, message = (lambda: me.grouped_linear(a["x"], w, a["s"])), r"weight"
    elif what == "per-expert weights transposed":
        w = [t.t().contiguous().t() for t in a["w"].unbind(0)]
        fn, message = (lambda: me.grouped_linear(a["x"], w, a["s"])), r"weight"
    else:
        s = torch.tensor([4, 9, 0, 9, 5, 9], device=cuda)[::2]
        fn, message = (lambda: me.grouped_linear(a["x"], a["w"], s)), r"splits must be contiguous"
    with pytest.raises(ValueError, match=message):
        fn()
    expect_clean(cuda)


# ---- 3. splits and routing tensors written in place ----


def new_values(kind, capacity):
    return {"other": [capacity, 0, 0], "negative": [capacity // 2, -3, capacity // 2],
            "past_T": [capacity // 2] * 3}[kind]


def bits(t):
    return t.detach().contiguous().view(torch.uint8)


@pytest.mark.parametrize("kind", ["other", "negative", "past_T"])
def test_splits_written_in_place_before_a_backward_op_are_routed_again(cuda, kind):
    """The backward ops given their forward's routing tensor after new values were written into the
    splits buffer (splits.copy_: same address, new version): the offsets are computed again from
    the values now in the buffer, the results those of a fresh splits tensor with those values
    (bit for bit), bad values reported."""
    T, G, K, N, F = 10, 3, 32, 24, 32
    torch.manual_seed(41)
    x, w, b, p, dy = rand(T, K).to(cuda), rand(G, N, K).to(cuda), rand(G, N).to(cuda), torch.rand(T, device=cuda), \
        rand(T, N).to(cuda)
    h, d_out = rand(T, 2 * F).to(cuda), rand(T, F).to(cuda)
    w1, w2, dy2 = rand(G, 2 * F, K).to(cuda), rand(G, K, F).to(cuda), rand(T, K).to(cuda)
    glu = me.glu_text("swiglu", "pairs")
    s = make_splits([4, 0, 5], cuda)
    r_linear = ops.grouped_linear_routed(x, [w], s, [b], p)[1]
    r_glu = ops.glu_routed(h, p, s, glu)[1]
    _, fc1, r_mlp = ops.expert_mlp_routed(x, p, [w1], [], [w2], [], s, glu, "forward", True)
    r_quant = ops.quantize_fp8(x, s, True, True, False, 0.0)[5]
    indices = torch.tensor(INDICES, device=cuda)
    row_of, ps, r_plan, _ = ops.permute_plan(indices, 3, None)
    R = len(INDICES) * 2  # the sorted buffer's rows (top-2)
    d_sorted, d_probs_sorted, out_sorted = rand(R, K).to(cuda), torch.rand(R, device=cuda), rand(R, K).to(cuda)
    dy_tokens, probs_tokens = rand(len(INDICES), K).to(cuda), torch.rand(len(INDICES), 2, device=cuda)
    torch.cuda.synchronize()

    with torch.no_grad():
        s.copy_(torch.tensor(new_values(kind, T), device=cuda))
        ps.copy_(torch.tensor(new_values(kind, R), device=cuda))
    fresh = make_splits(new_values(kind, T), cuda)
    fresh_ps = make_splits(new_values(kind, R), cuda)

    def backward_ops(splits, plan_splits, routing):
        out = torch.zeros(G, N, K, dtype=BF16, device=cuda)
        g1, g2 = torch.zeros_like(w1), torch.zeros_like(w2)
        ops.grouped_linear_wgrad_(dy, x, splits, [out], "write", routing["linear"])
        mlp = ops.expert_mlp_backward_(dy2, x, p, [w1], [], [w2], [], splits, fc1, glu, "forward", True, True, False,
                                       False, [g1], "write", [g2], "write", routing["mlp"])
        q = ops.quantize_fp8(x, splits, True, False, False, 0.0, routing["quant"])
        return {
            "dgrad": ops.grouped_linear_dgrad(dy, [w], splits, routing["linear"]),
            "wgrad": out,
            "dbias": ops.grouped_linear_dbias(dy, splits, p, routing["linear"]),
            "dscales": ops.grouped_linear_dscales(dy, [b], splits, routing["linear"]),
            "glu_backward": ops.glu_backward(h, p, d_out, splits, glu, routing["glu"])[0],
            "mlp dx": mlp[0], "mlp dprobs": mlp[1], "mlp dw1": g1, "mlp dw2": g2,
            "quantize rows": q[0][: sum(sanitize(new_values(kind, T), T))],
            "permute_backward": ops.permute_backward(d_sorted, d_probs_sorted, row_of, plan_splits,
                                                     routing["plan"])[0],
            "unpermute_backward": ops.unpermute_backward(dy_tokens, out_sorted, probs_tokens, row_of, plan_splits,
                                                         routing["plan"], R, True)[0],
        }

    got = backward_ops(s, ps, {"linear": r_linear, "glu": r_glu, "mlp": r_mlp, "quant": r_quant, "plan": r_plan})
    want = backward_ops(fresh, fresh_ps, {"linear": None, "glu": None, "mlp": None, "quant": None,
                                          "plan": r_plan.clone()})
    torch.cuda.synchronize()
    for name in want:
        assert torch.equal(bits(got[name]), bits(want[name])), f"{kind}: {name} differs from a fresh splits tensor's"
    if kind == "other":
        expect_clean(cuda)
    else:
        expect_reported([r"is negative" if kind == "negative" else r"exceeds the buffer capacity"], cuda)


INPLACE_SPLITS_OPS = ["grouped_linear", "glu", "expert_mlp", "dispatch"]


@pytest.mark.parametrize("op", INPLACE_SPLITS_OPS)
def test_splits_written_in_place_between_forward_and_autograd_backward(cuda, op):
    """Through autograd: the splits the forward saved were written in place before backward. A
    clear error (autograd's "modified by an inplace operation", as for a weight changed in place,
    docs/python.md) or gradients computed from the current splits; never an illegal access."""
    torch.manual_seed(43)
    new = [10, 0, 0]
    if op == "grouped_linear":
        a = linear_inputs(10, 32, 24, 3)
        x, w, b, p = (leaf(a[k], cuda) for k in ("x", "w", "b", "p"))
        s = make_splits([4, 0, 5], cuda)
        out = me.grouped_linear(x, w, s, b, p)
        dy = a["dy"].to(cuda)
    elif op == "glu":
        a = glu_inputs(10, 32)
        h, p = leaf(a["h"], cuda), leaf(a["p"], cuda)
        s = make_splits([4, 0, 5], cuda)
        out = me.glu(h, s, p)
        dy = a["d"].to(cuda)
    elif op == "expert_mlp":
        a = mlp_inputs(10, 32, 32, 3, bias=False)
        x, w1, w2, p = (leaf(a[k], cuda) for k in ("x", "w1", "w2", "p"))
        s = make_splits([4, 0, 5], cuda)
        out = me.expert_mlp(x, w1, w2, s, p)
        dy = a["dy"].to(cuda)
    else:
        x, p = leaf(rand(6, 32), cuda), leaf(torch.rand(6, 2), cuda)
        d = me.dispatch(x, p, torch.tensor(INDICES, device=cuda), 3)
        s, out, dy = d.splits, d.x, rand(12, 32).to(cuda)
        new = [12, 0, 0]
    with torch.no_grad():
        s.copy_(torch.tensor(new, device=cuda))
    try:
        out.backward(dy)
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e), f"{type(e).__name__}: {e}"
        torch.cuda.synchronize()
        expect_clean(cuda)
        return
    torch.cuda.synchronize()
    fresh = make_splits(new, cuda)
    if op == "grouped_linear":
        want = {"dx": me.grouped_linear_dgrad(dy, w.detach(), fresh),
                "dw": me.grouped_linear_wgrad(dy, x.detach(), fresh),
                "db": me.grouped_linear_dbias(dy, fresh, p.detach()),
                "dp": me.grouped_linear_dscales(dy, b.detach(), fresh)}
        got = {"dx": x.grad, "dw": w.grad, "db": b.grad, "dp": p.grad}
        assert_all_close(got, want, BF16, "grouped_linear backward after splits.copy_")
    elif op == "glu":
        dh, dp = me.glu_backward(h.detach(), dy, fresh, p.detach())
        assert_all_close({"dh": h.grad, "dp": p.grad}, {"dh": dh, "dp": dp}, BF16, "glu backward after splits.copy_")
    else:  # whatever it computed, it is finite and nothing was reported
        assert all(finite(t.grad) for t in ((x, p) if op == "dispatch" else (x, w1, w2, p)))
    expect_clean(cuda)


FORGED_ROUTING_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import moe_engine
    import moe_engine.torch as me

    ops, glu = torch.ops.moe_engine, me.glu_text("swiglu", "pairs")
    dev, bf = torch.device("cuda"), torch.bfloat16
    T, G, H, F = 8, 2, 32, 32
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, bf)

    x, dy, h, d_out = rnd(T, H), rnd(T, H), rnd(T, 2 * F), rnd(T, F)
    p = torch.rand(T, generator=gen).to(dev)
    w, b = rnd(G, H, H, scale=H ** -0.5), rnd(G, H)
    w1, w2 = rnd(G, 2 * F, H, scale=H ** -0.5), rnd(G, H, F, scale=F ** -0.5)
    s = torch.tensor([3, 5], device=dev)
    indices = torch.tensor([[0, 1], [1, 0]] * (T // 2), device=dev)
    pk = torch.rand(T, 2, generator=gen).to(dev)

    def linear_dgrad():
        return ops.grouped_linear_routed(x, [w], s, [], None)[1], lambda r: [ops.grouped_linear_dgrad(dy, [w], s, r)]

    def linear_wgrad():
        def run(r):
            out = torch.zeros(G, H, H, device=dev, dtype=bf)
            ops.grouped_linear_wgrad_(dy, x, s, [out], "write", r)
            return [out]
        return ops.grouped_linear_routed(x, [w], s, [], None)[1], run

    def linear_dbias():
        return ops.grouped_linear_routed(x, [w], s, [b], p)[1], lambda r: [ops.grouped_linear_dbias(dy, s, p, r)]

    def linear_dscales():
        return ops.grouped_linear_routed(x, [w], s, [b], p)[1], lambda r: [ops.grouped_linear_dscales(dy, [b], s, r)]

    def glu_backward():
        return ops.glu_routed(h, p, s, glu)[1], lambda r: list(ops.glu_backward(h, p, d_out, s, glu, r))

    def mlp_backward():
        _, fc1, routing = ops.expert_mlp_routed(x, p, [w1], [], [w2], [], s, glu, "forward", True)
        def run(r):
            g1, g2 = torch.zeros_like(w1), torch.zeros_like(w2)
            out = ops.expert_mlp_backward_(dy, x, p, [w1], [], [w2], [], s, fc1, glu, "forward", True, True, False,
                                           False, [g1], "write", [g2], "write", r)
            return [out[0], out[1], g1, g2]
        return routing, run

    def permute_backward():
        row_of, splits, routing, _ = ops.permute_plan(indices, G, None)
        d_sorted, d_ps = rnd(2 * T, H), torch.rand(2 * T, generator=gen).to(dev)
        return routing, lambda r: list(ops.permute_backward(d_sorted, d_ps, row_of, splits, r))

    def unpermute_backward():
        row_of, splits, routing, _ = ops.permute_plan(indices, G, None)
        out = rnd(2 * T, H)
        return routing, lambda r: list(ops.unpermute_backward(dy, out, pk, row_of, splits, r, 2 * T, True))

    def quantize():
        def run(r):  # what an expert owns: every row (sum(s) = T), columns [0, 256) (3 -> 128, 5 -> 128)
            q = ops.quantize_fp8(x, s, True, True, False, 0.0, r)
            return [q[0], q[1][:, :T], q[2][:, :256], q[3][:2], q[4]]
        return ops.quantize_fp8(x, s, True, True, False, 0.0)[5], run

    def fp8_forward():
        w8, x8 = me.quantize_fp8_weight(w), me.quantize_fp8(x, s)
        return x8.routing, lambda r: [ops.grouped_linear_fp8(x8.rows.data, x8.rows.scales, w8.data, w8.scales, s, [],
                                                             None, bf, r)]

    def bits(t):
        return t.detach().contiguous().view(torch.uint8)

    cases = [linear_dgrad, linear_wgrad, linear_dbias, linear_dscales, glu_backward, mlp_backward, permute_backward,
             unpermute_backward, quantize]
    if torch.cuda.get_device_capability() == (9, 0):
        cases.append(fp8_forward)
    forged = ([0, 100, 200], [0, 4000, 8000], [0, -4, 8])
    print(len(cases) * len(forged), flush=True)
    for case in cases:
        for bad in forged:
            routing, run = case()
            want = [t.clone() for t in run(routing.clone())]  # a copy is never trusted: from splits
            torch.cuda.synchronize()
            try:
                me.check_errors()
            except moe_engine.DeviceError:
                pass
            routing.copy_(torch.tensor(bad, device=dev))
            try:
                got = run(routing)
                torch.cuda.synchronize()
                same = all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))
                outcome = "match" if same else "mismatch"
            except ValueError:
                outcome = "ValueError"
            except NotImplementedError:
                outcome = "NotImplementedError"
            except moe_engine.DeviceError:
                outcome = "DeviceError"
            except RuntimeError as e:  # a CUDA error: the context is gone, nothing after it can run
                print(f"{case.__name__} {bad}: cuda-error {str(e).splitlines()[0]}", flush=True)
                sys.exit(0)
            try:
                me.check_errors()
            except moe_engine.DeviceError:
                outcome += "+reported"
            except RuntimeError as e:
                print(f"{case.__name__} {bad}: cuda-error {str(e).splitlines()[0]}", flush=True)
                sys.exit(0)
            print(f"{case.__name__} {bad}: {outcome}", flush=True)
    """)


def test_offsets_written_into_a_routing_tensor_on_cuda_are_an_error_or_recomputed(cuda):
    """A routing tensor is read-only by contract (docs/python.md); offsets written into it anyway
    (past T, far past T, negative) before a backward op that is given it: a clear error, a
    recomputation from splits (the result of a copy of the routing tensor), or at least a report
    through check_errors(); never an illegal memory access or a silent wrong result. In a subprocess,
    so that a CUDA error (which kills the context) fails this test only."""
    env = dict(os.environ)
    done = subprocess.run([sys.executable, "-c", FORGED_ROUTING_SCRIPT], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-3000:]}\n{done.stdout[-2000:]}"
    lines = done.stdout.splitlines()
    assert lines, done.stderr[-3000:]
    expected = int(lines[0])
    results = lines[1:]
    crashed = [line for line in results if "cuda-error" in line]
    assert not crashed, f"a CUDA error (the offsets were followed out of bounds): {crashed}\n" + "\n".join(results)
    assert len(results) == expected, "\n".join(results)
    wrong = [line for line in results
             if not (line.endswith(": match") or line.endswith(": ValueError") or line.endswith("+reported"))]
    assert not wrong, "silent wrong results (neither an error, a report, nor the recomputed result):\n" + "\n".join(wrong)


# ---- 4. dtypes ----


def dtype_case(name, cuda):
    """(the call, the exception types of a clear refusal, a regex its message must match)."""
    fp16, f64 = torch.float16, torch.float64
    a, g, m = linear_args(cuda), glu_args(cuda), mlp_args(cuda)
    refuse = (ValueError,)
    float64_refusal = (ValueError, NotImplementedError)
    cases = {
        "linear float16 x, bfloat16 weight": (
            lambda: me.grouped_linear(a["x"].half(), a["w"], a["s"]), refuse,
            r"grouped_linear_forward: weight: expected float16 like x, got bfloat16"),
        "linear bfloat16 x, float16 weight": (
            lambda: me.grouped_linear(a["x"], a["w"].half(), a["s"]), refuse,
            r"grouped_linear_forward: weight: expected bfloat16 like x, got float16"),
        "linear float16 dy, bfloat16 weight (dgrad)": (
            lambda: me.grouped_linear_dgrad(rand(10, 24, dtype=fp16).to(cuda), a["w"], a["s"]), refuse,
            r"grouped_linear_dgrad: weight: expected float16 like dy, got bfloat16"),
        "linear float16 x, bfloat16 dy (wgrad)": (
            lambda: me.grouped_linear_wgrad(rand(10, 24).to(cuda), a["x"].half(), a["s"]), refuse,
            r"grouped_linear_wgrad: x: expected bfloat16 like dy, got float16"),
        "linear int32 x": (
            lambda: me.grouped_linear(torch.ones(10, 32, dtype=torch.int32, device=cuda), a["w"], a["s"]), refuse,
            r"grouped_linear_forward: x: expected a float tensor"),
        "linear float64 row_scale (CPU only)": (
            lambda: me.grouped_linear(a["x"], a["w"], a["s"], a["b"], a["p"].to(f64)), refuse,
            r"grouped_linear_forward: row_scale: expected float32, got float64"),
        "linear float64 everything": (
            lambda: me.grouped_linear(a["x"].to(f64), a["w"].to(f64), a["s"], a["b"].to(f64)), float64_refusal,
            r"float64"),
        "mlp float16 x, bfloat16 weights": (
            lambda: me.expert_mlp(m["x"].half(), m["w1"], m["w2"], m["s"]), refuse,
            r"expert_mlp_forward: x: expected bfloat16 like fc2_weight, got float16"),
        "mlp bfloat16 fc1, float16 fc2": (
            lambda: me.expert_mlp(m["x"].half(), m["w1"], m["w2"].half(), m["s"]), refuse,
            r"expert_mlp_forward: fc1_weight: expected float16 like fc2_weight, got bfloat16"),
        "mlp float64 probs (CPU only)": (
            lambda: me.expert_mlp(m["x"], m["w1"], m["w2"], m["s"], m["p"].to(f64)), refuse,
            r"expert_mlp_forward: probs: expected float32, got float64"),
        "mlp float64 everything": (
            lambda: me.expert_mlp(m["x"].to(f64), m["w1"].to(f64), m["w2"].to(f64), m["s"]), float64_refusal,
            r"float64"),
        "glu float16 probs": (
            lambda: me.glu(g["h"], g["s"], g["p"].half()), refuse, r"glu_forward: probs: expected float32"),
        "glu float64 probs (CPU only)": (
            lambda: me.glu(g["h"], g["s"], g["p"].to(f64)), refuse, r"glu_forward: probs: expected float32, got float64"),
        "glu float64 h": (lambda: me.glu(g["h"].to(f64), g["s"]), float64_refusal, r"float64"),
        "dispatch float64 probs (CPU only)": (
            lambda: me.dispatch(rand(6, 32).to(cuda), torch.rand(6, 2, dtype=f64, device=cuda),
                                torch.tensor(INDICES, device=cuda), 3), refuse,
            r"permute: probs(_sorted)?: expected float"),
        "quantize_fp8 float64 x": (
            lambda: me.quantize_fp8(a["x"].to(f64), a["s"]), refuse,
            r"quantize_fp8: x: expected bfloat16, float16 or float32, got float64"),
        "quantize_fp8_weight float64": (
            lambda: me.quantize_fp8_weight(a["w"].to(f64)), refuse,
            r"quantize_fp8_weight: weight: expected bfloat16, float16 or float32, got float64"),
        "splits float32": (
            lambda: me.grouped_linear(a["x"], a["w"], a["s"].float()), refuse,
            r"splits must be an int64 or int32 tensor .*, got torch.float32"),
        "splits uint8": (
            lambda: me.grouped_linear(a["x"], a["w"], a["s"].to(torch.uint8)), refuse,
            r"splits must be an int64 or int32 tensor .*, got torch.uint8"),
    }
    return cases[name]


DTYPE_CASES = ["linear float16 x, bfloat16 weight", "linear bfloat16 x, float16 weight",
               "linear float16 dy, bfloat16 weight (dgrad)", "linear float16 x, bfloat16 dy (wgrad)", "linear int32 x",
               "linear float64 row_scale (CPU only)", "linear float64 everything", "mlp float16 x, bfloat16 weights",
               "mlp bfloat16 fc1, float16 fc2", "mlp float64 probs (CPU only)", "mlp float64 everything",
               "glu float16 probs", "glu float64 probs (CPU only)", "glu float64 h",
               "dispatch float64 probs (CPU only)",
               "quantize_fp8 float64 x", "quantize_fp8_weight float64",
               "splits float32", "splits uint8"]


@pytest.mark.parametrize("name", DTYPE_CASES)
def test_dtype_mixes_and_cpu_only_dtypes_are_clear_errors(cuda, name):
    """Mixed dtypes, integer operands, and float64 where the CUDA backend has no kernel (float64
    probs and row scales are CPU only, docs/python.md): the documented exception, whose message says
    which argument or dtype; nothing reaches a kernel that reports."""
    fn, errors, message = dtype_case(name, cuda)
    with pytest.raises(errors, match=message):
        fn()
    expect_clean(cuda)


# (h or fc1_out's dtype, d_out or dy's dtype): the backward pieces take the activation's input and
# the incoming gradient as separate tensors; the CPU backend reads each in its own dtype.
GRADIENT_DTYPE_MIXES = [(BF16, torch.float16), (BF16, torch.float32), (torch.float32, BF16)]


@pytest.mark.parametrize("h_dtype, d_dtype", GRADIENT_DTYPE_MIXES, ids=lambda d: str(d)[len("torch."):])
def test_glu_backward_with_d_out_of_another_dtype(cuda, h_dtype, d_dtype):
    """glu_backward(h, d_out) with d_out in another dtype than h: a ValueError naming d_out, or the
    CPU's result (which reads each tensor in its own dtype); never d_out's bytes read as h's dtype
    (a wrong answer, or for a wider h a read past d_out)."""
    a = glu_inputs(10, 32)

    def run(dev):
        dh, dp = me.glu_backward(a["h"].to(dev, h_dtype), a["d"].to(dev, d_dtype), make_splits([4, 0, 6], dev),
                                 a["p"].to(dev), layout="pairs")
        return {"dh": dh.float(), "dp": dp}

    error_or_same(lambda: run(cuda), lambda: run(CPU), r"d_out", errors=(ValueError,),
                  what=f"h {h_dtype}, d_out {d_dtype}")
    expect_clean(cuda)


@pytest.mark.parametrize("fc1_dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("fusion", ["forward", "all"])
def test_expert_mlp_backward_with_fc1_out_of_another_dtype(cuda, fc1_dtype, fusion):
    """expert_mlp_backward's fc1_out (the saved pre-activation) in another dtype than dy and the
    weights: a ValueError naming fc1_out, or the CPU's result; never its bytes read as dy's dtype."""
    a = mlp_inputs(10, 32, 32, 3, bias=False)
    torch.manual_seed(51)
    fc1 = rand(10, 64, scale=2.0)

    def run(dev):
        g = me.expert_mlp_backward(a["dy"].to(dev), a["x"].to(dev), a["w1"].to(dev), a["w2"].to(dev),
                                   make_splits([4, 0, 6], dev), a["p"].to(dev), fc1_out=fc1.to(dev, fc1_dtype),
                                   layout="pairs", fusion=fusion)
        return {k: g[k] for k in ("dx", "dprobs", "fc1_weight", "fc2_weight")}

    def as_tensors(d):
        return {k: (torch.stack(list(v)) if isinstance(v, list) else v) for k, v in d.items()}

    error_or_same(lambda: as_tensors(run(cuda)), lambda: as_tensors(run(CPU)), r"fc1_out", errors=(ValueError,),
                  what=f"fc1_out {fc1_dtype} {fusion}")
    expect_clean(cuda)


@pytest.mark.parametrize("op", ["grouped_linear", "glu", "expert_mlp"])
def test_float32_on_cuda_is_refused_clearly_or_matches_the_cpu(cuda, op):
    """float32 activations and weights: the portable kernels take them; either the CPU's result
    (float32 tolerance) or a NotImplementedError / ValueError that says float32."""
    f32 = torch.float32

    def on(dev):
        if op == "grouped_linear":
            a = linear_inputs(10, 32, 24, 3)
            a = {k: (v.to(f32) if v is not None and v.is_floating_point() else v) for k, v in a.items()}
            return linear_on(a, make_splits([4, 0, 6], dev), dev)
        if op == "glu":
            a = {k: v.to(f32) for k, v in glu_inputs(10, 32).items()}
            return glu_on(a, make_splits([4, 0, 6], dev), dev, layout="pairs")
        a = {k: (v.to(f32) if v is not None else v) for k, v in mlp_inputs(10, 32, 32, 3).items()}
        return mlp_on(a, make_splits([4, 0, 6], dev), dev, layout="pairs")

    try:
        got = on(cuda)
    except (ValueError, NotImplementedError) as e:
        assert "float32" in str(e), str(e)
        expect_clean(cuda)
        return
    want = on(CPU)
    for name in want:
        if want[name] is not None:
            err = rel_err(got[name], want[name])
            assert err <= 1e-4, f"{op} float32: {name}: rel. error {err:.3g}"
    expect_clean(cuda)


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32])
def test_a_bias_of_another_dtype_is_refused_clearly_or_matches_the_cpu(cuda, bias_dtype):
    """A bias whose dtype is not x's: the CUDA kernels read it in x's dtype (a NotImplementedError
    naming the bias), or the CPU's result."""
    a = linear_inputs(10, 32, 24, 3, row_scale=False)
    a["b"] = a["b"].to(bias_dtype)
    error_or_same(lambda: linear_on(a, make_splits([4, 0, 6], cuda), cuda),
                  lambda: linear_on(a, make_splits([4, 0, 6], CPU), CPU), r"bias", what=f"bias {bias_dtype}")
    expect_clean(cuda)


@pytest.mark.parametrize("case", ["float16 bias, bfloat16 output", "float16 bias, float32 output",
                                  "float32 row_scale with a float16 bias"])
def test_fp8_gemm_bias_dtypes_are_refused_clearly_or_match_the_cpu(cuda, case):
    """The Hopper FP8 epilogue takes a bfloat16 bias (docs/python.md: a float32 output's bias of
    another dtype is added after the GEMM; anything else a NotImplementedError saying why)."""
    needs_fp8_gemm(cuda)
    a = linear_inputs(10, 32, 32, 3)
    out_dtype = torch.float32 if "float32 output" in case else BF16
    row_scale = "row_scale" in case

    def run(dev):
        s = make_splits([4, 0, 6], dev)
        x8, w8 = me.quantize_fp8(a["x"].to(dev), s), me.quantize_fp8_weight(a["w"].to(dev))
        return {"y": me.grouped_linear_fp8(x8, w8, s, bias=a["b"].half().to(dev),
                                           row_scale=a["p"].to(dev) if row_scale else None, out_dtype=out_dtype)}

    error_or_same(lambda: run(cuda), lambda: run(CPU), r"bias", what=case)
    expect_clean(cuda)


# ---- 5. shapes ----


def zero_token_run(op, dev):
    s = make_splits([0, 0, 0], dev)
    if op == "grouped_linear":
        return linear_on(linear_inputs(0, 32, 24, 3), s, dev)
    if op == "glu":
        return glu_on(glu_inputs(0, 32), s, dev, layout="pairs")
    if op.startswith("expert_mlp"):
        fusion = op.split("-")[1]
        return mlp_on(mlp_inputs(0, 32, 32, 3), s, dev, layout="pairs", fusion=fusion)
    if op == "dispatch":
        x, p = leaf(rand(0, 32), dev), leaf(torch.rand(0, 2), dev)
        d = me.dispatch(x, p, torch.zeros(0, 2, dtype=torch.int64, device=dev), 3)
        y = me.combine(d.x * 2, d)
        (y.float().sum() + d.probs.sum()).backward()
        return {"x_sorted": d.x, "y": y, "dx": x.grad, "dp": p.grad}
    if op == "quantize_fp8":
        q = me.quantize_fp8(rand(0, 32).to(dev), s, columnwise=True)
        return {"rows.data": q.rows.data.float(), "columns.offsets": q.columns.offsets.float()}
    if op == "fp8_gemms":
        x8 = me.quantize_fp8(rand(0, 32).to(dev), s, columnwise=True)
        dy8 = me.quantize_fp8(rand(0, 32).to(dev), s, columnwise=True)
        w8 = me.quantize_fp8_weight(rand(3, 32, 32).to(dev))
        return {"y": me.grouped_linear_fp8(x8, w8, s), "dx": me.grouped_linear_fp8_dgrad(dy8, w8, s),
                "dw": me.grouped_linear_fp8_wgrad(dy8, x8, s, out_dtype=torch.float32)}
    raise AssertionError(op)


@pytest.mark.parametrize("op", ["grouped_linear", "glu", "expert_mlp-forward", "expert_mlp-none", "expert_mlp-all",
                                "dispatch", "quantize_fp8", "fp8_gemms"])
def test_zero_tokens(cuda, op):
    """T = 0 (an expert-parallel rank that got no token): empty outputs and zero weight gradients,
    as on the CPU, or a clear refusal that names T or the token tensor (docs/python.md says
    expert_mlp rejects T = 0)."""
    if op == "fp8_gemms":
        needs_fp8_gemm(cuda)
    error_or_same(lambda: zero_token_run(op, cuda), lambda: zero_token_run(op, CPU),
                  r"\bT\b|token|: (x|h|dy|x\.data|dy\.data)[:. ]", what=f"T = 0 {op}")
    expect_clean(cuda)


ROUTING_EXTREMES = {
    "g1": ([45], 50),
    "one_expert_all": ([0, 77, 0], 77),
    "all_empty": ([0, 0, 0], 9),
    "g300": ([(g * 7) % 3 if g % 5 == 0 else 0 for g in range(300)], 130),
}


@pytest.mark.parametrize("routing", list(ROUTING_EXTREMES))
@pytest.mark.parametrize("op", ["grouped_linear", "glu", "expert_mlp", "fp8_gemms"])
def test_routing_extremes_match_the_cpu(cuda, op, routing):
    """G = 1, one expert holding every token, every expert empty, and more experts than the
    offsets kernel's 256-wide chunk (and the Hopper scheduler's cached offsets)."""
    splits, T = ROUTING_EXTREMES[routing]
    G = len(splits)
    if op == "fp8_gemms":
        needs_fp8_gemm(cuda)

    def run(dev):
        s = make_splits(splits, dev)
        if op == "grouped_linear":
            return linear_on(linear_inputs(T, 32, 16, G), s, dev)
        if op == "glu":
            return glu_on(glu_inputs(T, 32), s, dev, layout="pairs")
        if op == "expert_mlp":
            return mlp_on(mlp_inputs(T, 32, 32, G, bias=False), s, dev, layout="pairs")
        torch.manual_seed(T + G)
        x, dy, w = rand(T, 32), rand(T, 16), rand(G, 16, 32, scale=32**-0.5)
        x8 = me.quantize_fp8(x.to(dev), s, columnwise=True)
        dy8 = me.quantize_fp8(dy.to(dev), s, columnwise=True)
        w8 = me.quantize_fp8_weight(w.to(dev))
        return {"y": me.grouped_linear_fp8(x8, w8, s), "dx": me.grouped_linear_fp8_dgrad(dy8, w8, s),
                "dw": me.grouped_linear_fp8_wgrad(dy8, x8, s, out_dtype=torch.float32)}

    got = run(cuda)
    torch.cuda.synchronize()
    assert_all_close(got, run(CPU), BF16, f"{op} {routing}")
    rows = sum(splits)
    for name in ("y", "out"):
        if name in got:
            assert torch.all(got[name][rows:] == 0), f"{op} {routing}: {name} past sum(splits) is not zero"
    expect_clean(cuda)


# (op, sizes): features off the multiples of 8 / 16 that the Hopper kernels (TMA) need, and off
# 128 (the FP8 tiles).
ODD_FEATURES = [
    ("grouped_linear", dict(K=13, N=7)),
    ("grouped_linear", dict(K=24, N=40)),
    ("grouped_linear", dict(K=1, N=1)),
    ("glu", dict(F=5, layout="halves")),
    ("glu", dict(F=5, layout="pairs")),
    ("glu", dict(F=48, layout="blocks:32")),
    ("glu", dict(F=3, activation="srelu")),
    ("expert_mlp", dict(H=12, F=5, layout="halves")),
    ("expert_mlp", dict(H=24, F=40, layout="pairs")),
    ("expert_mlp", dict(H=20, F=6, activation="gelu_tanh")),
    ("fp8_gemms", dict(K=16, N=48)),
    ("fp8_gemms", dict(K=144, N=16)),
]


def odd_features_run(op, sizes, dev):
    T, s = 10, make_splits([4, 0, 6], dev)
    if op == "grouped_linear":
        return linear_on(linear_inputs(T, sizes["K"], sizes["N"], 3), s, dev)
    if op == "glu":
        act = sizes.get("activation", "swiglu")
        gated = act == "swiglu"
        return glu_on(glu_inputs(T, sizes["F"], gated=gated), s, dev, activation=act,
                      layout=sizes.get("layout", "halves"))
    if op == "expert_mlp":
        act = sizes.get("activation", "swiglu")
        a = mlp_inputs(T, sizes["H"], sizes["F"], 3, gated=act == "swiglu")
        return mlp_on(a, s, dev, activation=act, layout=sizes.get("layout", "halves"))
    K, N = sizes["K"], sizes["N"]
    torch.manual_seed(K + N)
    x, dy, w = rand(T, K), rand(T, N), rand(3, N, K, scale=K**-0.5)
    x8 = me.quantize_fp8(x.to(dev), s, columnwise=True)
    dy8 = me.quantize_fp8(dy.to(dev), s, columnwise=True)
    w8 = me.quantize_fp8_weight(w.to(dev))
    return {"y": me.grouped_linear_fp8(x8, w8, s), "dx": me.grouped_linear_fp8_dgrad(dy8, w8, s),
            "dw": me.grouped_linear_fp8_wgrad(dy8, x8, s, out_dtype=torch.float32)}


@pytest.mark.parametrize("op, sizes", ODD_FEATURES, ids=[f"{o}-" + "-".join(f"{k}{v}" for k, v in s.items())
                                                       for o, s in ODD_FEATURES])
def test_features_off_the_fast_path(cuda, op, sizes):
    """The Hopper kernels need 16-byte rows (K, N multiples of 8 for 16-bit data); other sizes fall
    back to the portable kernels with the CPU's result, or are refused naming the size or layout."""
    if op == "fp8_gemms":
        needs_fp8_gemm(cuda)
    error_or_same(lambda: odd_features_run(op, sizes, cuda), lambda: odd_features_run(op, sizes, CPU),
                  r"\b[KNFH]\b|layout|multiple", what=f"{op} {sizes}")
    expect_clean(cuda)


@pytest.mark.parametrize("K, N", [(8, 16), (16, 24), (40, 32)])
def test_fp8_sizes_off_a_multiple_of_16_are_named(cuda, K, N):
    """FP8 rows are read with TMA in 16-byte units: K or N off a multiple of 16 is a ValueError that
    names the size, from the quantizers (before any GEMM)."""
    s = make_splits([4, 0, 6], cuda)
    x, w = rand(10, K).to(cuda), rand(3, N, K).to(cuda)
    with pytest.raises(ValueError, match=r"(K|N) = \d+ \(.*\) is not a multiple of 16"):
        me.quantize_fp8(x, s)
        me.quantize_fp8_weight(w)
    expect_clean(cuda)
