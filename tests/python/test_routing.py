"""Routing computed once per layer per step, never trusted when it is not the live routing of the
same splits; tensors across the extension (dtypes, strides, devices, 0-size) and the errors that
name the op and the argument."""

import gc
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine.torch as me
from moe_engine import _C
from reference import make_splits, needs_fp8_gemm

DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
ops = torch.ops.moe_engine


class Computations:
    """How many times GroupLayout::compute ran inside the block."""

    def __enter__(self):
        self.start = _C.group_layout_computations()
        return self

    def __exit__(self, *exc):
        self.count = _C.group_layout_computations() - self.start


def stack(kind, device, layers, **options):
    torch.manual_seed(3)
    dt = DTYPE[device.type]
    if kind == "linear":  # bias with row scales: forward, dgrad, wgrad, dbias and dscales all need the routing
        return [me.GroupedLinear(4, 32, 32, bias=True, scale_bias=True, device=device, dtype=dt, **options)
                for _ in range(layers)]
    return [me.GroupedMLP(4, 32, 16, bias=True, glu_layout="pairs", device=device, dtype=dt, **options)
            for _ in range(layers)]


def step(modules, device, seed):
    """One training step through the stack, each layer with its own routing; returns what it
    computed (output, input gradient, the parameters' gradients)."""
    g = torch.Generator().manual_seed(seed)
    T = 40
    x = torch.randn(T, 32, generator=g).to(device, DTYPE[device.type]).requires_grad_()
    h = x
    for i, m in enumerate(modules):
        splits = make_splits([[9, 0, 1, 23], [0, 40, 0, 0], [10, 10, 10, 5]][i % 3], device)
        probs = torch.rand(T, generator=g).to(device).requires_grad_()
        h = m(h, splits, probs)
    h.backward(torch.randn(h.shape, generator=g).to(device, h.dtype))
    for m in modules:
        m.backward_dw()
    return [h.detach(), x.grad] + [p.grad for m in modules for p in m.parameters()]


@pytest.mark.parametrize("kind, options", [
    ("linear", {}), ("linear", {"delay_wgrad_compute": True}),
    ("mlp", {}), ("mlp", {"delay_wgrad_compute": True}), ("mlp", {"recompute_fc1": True}),
], ids=["linear", "linear-delayed", "mlp", "mlp-delayed", "mlp-recompute"])
def test_modules_compute_the_routing_once_per_layer_per_step(device, kind, options):
    modules = stack(kind, device, 3, **options)
    for seed in (1, 2):
        with Computations() as c:
            step(modules, device, seed)
        assert c.count == 3, f"step {seed}: {c.count} GroupLayout computations for 3 layers"


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_reuse_changes_nothing_and_a_copied_routing_is_recomputed(device, kind):
    """Saved-tensor hooks that copy every saved tensor (as an offload would) hand backward a copy of
    the routing tensor: it is not trusted, the offsets are computed again, and the results are
    bit-identical to the run that reused the routing."""
    reused = step(stack(kind, device, 2), device, 5)
    with Computations() as c:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            copied = step(stack(kind, device, 2), device, 5)
    assert c.count > 2
    for a, b in zip(reused, copied):
        assert torch.equal(a, b)


def test_functional_ops_compute_the_routing_once(device):
    dt = DTYPE[device.type]
    torch.manual_seed(4)
    s = make_splits([7, 0, 19], device)
    x = torch.randn(30, 32, dtype=dt, device=device, requires_grad=True)
    w = torch.randn(3, 24, 32, dtype=dt, device=device, requires_grad=True)
    b = torch.randn(3, 24, dtype=dt, device=device, requires_grad=True)
    p = torch.rand(30, device=device, requires_grad=True)
    w1 = (torch.randn(3, 64, 32, dtype=dt, device=device) * 0.2).requires_grad_()
    w2 = (torch.randn(3, 32, 32, dtype=dt, device=device) * 0.2).requires_grad_()
    h = torch.randn(30, 64, dtype=dt, device=device, requires_grad=True)
    cases = {
        "grouped_linear": lambda: me.grouped_linear(x, w, s, b, p),
        "glu": lambda: me.glu(h, s, p, layout="pairs"),
        "expert_mlp": lambda: me.expert_mlp(x, w1, w2, s, p, layout="pairs"),
        "expert_mlp recompute": lambda: me.expert_mlp(x, w1, w2, s, p, layout="pairs", recompute_fc1=True),
        "torch.ops grouped_linear": lambda: ops.grouped_linear(x, [w], s, [b], p),
    }
    for name, fn in cases.items():
        with Computations() as c:
            fn().float().square().sum().backward()
        assert c.count == 1, name

    def block(x, w1, w2, p, s):
        return me.expert_mlp(x, w1, w2, s, p, layout="pairs").float().square().sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    compiled(x, w1, w2, p, s).backward()  # traces (fake tensors: no computation counted or not)
    with Computations() as c:
        compiled(x, w1, w2, p, s).backward()
    assert c.count == 1, "torch.compile: the backward graph reuses the forward's routing"


def test_a_routing_tensor_is_trusted_only_when_it_is_the_live_routing_of_these_splits(device):
    dt = DTYPE[device.type]
    torch.manual_seed(6)
    x, w = torch.randn(12, 8, dtype=dt, device=device), torch.randn(3, 6, 8, dtype=dt, device=device)
    dy = torch.randn(12, 6, dtype=dt, device=device)
    s = make_splits([4, 0, 5], device)
    other = make_splits([1, 2, 3], device)
    _, routing = ops.grouped_linear_routed(x, [w], s, [], None)
    _, other_routing = ops.grouped_linear_routed(x, [w], other, [], None)
    _, short_routing = ops.grouped_linear_routed(x[:10], [w], s, [], None)  # 10 rows, not 12
    want = ops.grouped_linear_dgrad(dy, [w], s)

    found = _C.find_routing(routing, s, 12)
    assert found is not None and found is _C.find_routing(routing.view(-1), s, 12)
    assert (found.num_groups, found.capacity, found.device) == (3, 12, str(device).replace("cuda", "cuda:0")
                                                                 if device.type == "cuda" else "cpu")
    offsets_out_of_bounds = torch.tensor([0, 1000, 2000, 3000], device=device)
    for name, candidate, reused in [
        ("the routing", routing, True),
        ("a view of it", routing.view(-1), True),
        ("a copy", routing.clone(), False),
        ("a slice", routing[1:], False),
        ("forged offsets", offsets_out_of_bounds, False),
        ("the routing of other splits", other_routing, False),
        ("a routing of fewer rows", short_routing, False),
        ("another dtype", routing.to(torch.int32), False),
    ]:
        with Computations() as c:
            got = ops.grouped_linear_dgrad(dy, [w], s, candidate)
        assert c.count == (0 if reused else 1), name
        assert torch.equal(got, want), name
    assert _C.find_routing(routing, other, 12) is None
    assert _C.find_routing(routing, s, 10) is None
    assert _C.find_routing(offsets_out_of_bounds, s, 12) is None


def test_a_routing_of_splits_written_in_place_is_not_reused(device):
    """find_routing matches a routing by its splits buffer; new values copied into that buffer keep
    the address, but move its version counter: a backward op given the old routing computes the
    offsets again from the values it is given, as without a routing."""
    dt = DTYPE[device.type]
    torch.manual_seed(8)
    T, G = 12, 3
    x, w = torch.randn(T, 8, dtype=dt, device=device), torch.randn(G, 6, 8, dtype=dt, device=device)
    b = torch.randn(G, 6, dtype=dt, device=device)
    dy = torch.randn(T, 6, dtype=dt, device=device)
    h, d_out = torch.randn(T, 32, dtype=dt, device=device), torch.randn(T, 16, dtype=dt, device=device)
    p = torch.rand(T, device=device)
    glu = me.glu_text()
    for new in ([12, 0, 0], [4, 0, 5]):  # other values, then the same ones written again
        s = make_splits([4, 0, 5], device)
        _, routing = ops.grouped_linear_routed(x, [w], s, [], None)
        _, glu_routing = ops.glu_routed(h, p, s, glu)
        with torch.no_grad():
            s.copy_(make_splits(new, device))
        fresh = make_splits(new, device)
        out = torch.zeros(G, 6, 8, dtype=dt, device=device)
        want_out = torch.zeros(G, 6, 8, dtype=dt, device=device)
        with Computations() as c:
            got = [ops.grouped_linear_dgrad(dy, [w], s, routing), ops.grouped_linear_dbias(dy, s, p, routing),
                   ops.grouped_linear_dscales(dy, [b], s, routing), *ops.glu_backward(h, p, d_out, s, glu, glu_routing)]
            ops.grouped_linear_wgrad_(dy, x, s, [out], "write", routing)
        assert c.count == 5, f"splits {new}: {c.count} computations for 5 ops given the routing of the old values"
        want = [ops.grouped_linear_dgrad(dy, [w], fresh), ops.grouped_linear_dbias(dy, fresh, p),
                ops.grouped_linear_dscales(dy, [b], fresh), *ops.glu_backward(h, p, d_out, fresh, glu)]
        ops.grouped_linear_wgrad_(dy, x, fresh, [want_out], "write")
        for i, (a, e) in enumerate(zip(got + [out], want + [want_out])):
            assert torch.equal(a, e), f"splits {new}: result {i}"
    # The routing is still reused while the buffer is not written.
    s = make_splits([4, 0, 5], device)
    _, routing = ops.grouped_linear_routed(x, [w], s, [], None)
    with Computations() as c:
        ops.grouped_linear_dgrad(dy, [w], s, routing)
    assert c.count == 0


@pytest.mark.parametrize("kind, fp8", [("linear", False), ("mlp", False), ("linear", True), ("mlp", True)],
                         ids=["linear", "mlp", "linear-fp8", "mlp-fp8"])
def test_delayed_wgrads_keep_their_forwards_routing_when_the_splits_buffer_is_reused(device, kind, fp8):
    """Megatron reuses one splits buffer across micro-batches: the weight gradients queued for
    backward_dw belong to the forward that made them (its operands are laid out by its offsets), so
    they keep its routing, and a step computes one routing per micro-batch."""
    dt = DTYPE[device.type]
    counts = ([9, 0, 1, 23], [40, 0, 0, 0])

    def run(modules, reuse):
        g = torch.Generator().manual_seed(11)
        s = make_splits(counts[0], device)
        for i, c in enumerate(counts):
            x = torch.randn(40, 32, generator=g).to(device, dt).requires_grad_()
            probs = torch.rand(40, generator=g).to(device).requires_grad_()
            if reuse:
                with torch.no_grad():
                    s.copy_(make_splits(c, device))
            splits = s if reuse else make_splits(c, device)
            modules[0](x, splits, probs).backward(torch.randn(40, 32, generator=g).to(device, dt))
        modules[0].backward_dw()
        return [p.grad for p in modules[0].parameters()]

    if fp8:
        needs_fp8_gemm(device)
    options = dict(delay_wgrad_compute=True, fp8_recipe=me.Fp8Recipe() if fp8 else None)
    separate = run(stack(kind, device, 1, **options), False)
    with Computations() as c:
        reused = run(stack(kind, device, 1, **options), True)
    assert c.count == len(counts)
    for a, b in zip(reused, separate):
        assert torch.equal(a, b)


def test_writing_into_a_routing_tensor_is_refused_or_routed_again():
    """A routing tensor is read-only by contract; offsets written into it anyway (out of bounds, or
    negative) are never followed (once a segfault, heap corruption or a hang): its version counter
    moved, so the op routes the splits again and gives the result of a fresh routing, or, where its
    operands are laid out by the routing (the FP8 backward), refuses with a ValueError. In a
    subprocess, so that a crash fails this test only."""
    script = textwrap.dedent("""
        import torch, moe_engine.torch as me
        ops, glu = torch.ops.moe_engine, me.glu_text()
        torch.manual_seed(0)
        T, G, H, F = 8, 2, 32, 32
        x, s, p = torch.randn(T, H), torch.tensor([3, 5]), torch.rand(T)
        w = torch.randn(G, H, H)
        w1, w2 = torch.randn(G, 2 * F, H), torch.randn(G, H, F)
        dy, h, d_out = torch.randn(T, H), torch.randn(T, 2 * F), torch.randn(T, F)

        def routed(r, bad):
            if bad is not None:
                r.copy_(torch.tensor(bad))
            return r

        def linear(bad):
            _, r = ops.grouped_linear_routed(x, [w], s, [], None)
            return [ops.grouped_linear_dgrad(dy, [w], s, routed(r, bad))]

        def wgrad(bad):
            _, r = ops.grouped_linear_routed(x, [w], s, [], None)
            dw = torch.zeros(G, H, H)
            ops.grouped_linear_wgrad_(dy, x, s, [dw], "write", routed(r, bad))
            return [dw]

        def glu_backward(bad):
            _, r = ops.glu_routed(h, None, s, glu)
            return list(ops.glu_backward(h, None, d_out, s, glu, routed(r, bad)))

        def mlp(bad):
            _, fc1, r = ops.expert_mlp_routed(x, p, [w1], [], [w2], [], s, glu, "forward", True)
            dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
            out = ops.expert_mlp_backward_(dy, x, p, [w1], [], [w2], [], s, fc1, glu, "forward", True, True,
                                           False, False, [dw1], "write", [dw2], "write", routed(r, bad))
            return [t for t in out if isinstance(t, torch.Tensor)] + [dw1, dw2]

        def fp8_mlp(bad):
            a, b = me.quantize_fp8_weight(w1), me.quantize_fp8_weight(w2)
            out = ops.expert_mlp_fp8(x, None, a.data, a.scales, b.data, b.scales, [], [], s, glu, "forward", "columns",
                                     True, False, 0.0)
            dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
            ops.expert_mlp_fp8_backward_(dy, out[1], out[2], out[3], None, None, out[6], out[7], None,
                                         a.data, a.scales, a.data_t, a.scales_t, b.data, b.scales, b.data_t,
                                         b.scales_t, [], [], s, glu, "forward", False, 0.0, True, False, False,
                                         [dw1], "write", [dw2], "write", routed(out[-1], bad))
            return [dw1, dw2]

        for fn in (linear, wgrad, glu_backward, mlp, fp8_mlp):
            fresh = fn(None)
            for bad in ([0, 100, 200], [0, 4000, 8000], [0, -4, 8]):
                try:
                    got = fn(bad)
                    same = len(got) == len(fresh) and all(torch.equal(a, b) for a, b in zip(got, fresh))
                    print(fn.__name__, bad, "routed again" if same else "DIFFERENT")
                except Exception as e:
                    print(fn.__name__, bad, type(e).__name__)
        """)
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one thread: where the audit saw a hang
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert len(lines) == 15, done.stdout
    for line in lines:
        assert line.endswith("ValueError" if line.startswith("fp8_mlp") else "routed again"), done.stdout


def test_a_routing_lives_as_long_as_its_tensor(device):
    gc.collect()
    base = _C.live_routings()
    dt = DTYPE[device.type]
    x, w, s = torch.randn(12, 8, dtype=dt, device=device), torch.randn(3, 6, 8, dtype=dt, device=device), \
        make_splits([4, 0, 5], device)
    y, routing = ops.grouped_linear_routed(x, [w], s, [], None)
    assert _C.live_routings() == base + 1
    alias = routing.view(-1)
    del routing
    assert _C.live_routings() == base + 1, "a view shares the storage that owns the routing"
    del alias, y
    assert _C.live_routings() == base

    modules = stack("mlp", device, 2, delay_wgrad_compute=True)
    xs = torch.randn(40, 32, dtype=dt, device=device, requires_grad=True)
    h = xs
    for m in modules:
        h = m(h, make_splits([9, 0, 1, 23], device), torch.rand(40, device=device))
    assert _C.live_routings() == base + 2
    h.sum().backward()
    del h
    gc.collect()
    assert _C.live_routings() == base + 2, "the queued weight gradients keep their routings"
    for m in modules:
        m.backward_dw()
    gc.collect()
    assert _C.live_routings() == base


def test_extension_ops_name_the_argument_that_is_wrong(device):
    dt = DTYPE[device.type]
    x, w = torch.randn(12, 8, dtype=dt, device=device), torch.randn(3, 6, 8, dtype=dt, device=device)
    y, dy = torch.empty(12, 6, dtype=dt, device=device), torch.randn(12, 6, dtype=dt, device=device)
    s = make_splits([4, 0, 5], device)
    stream = torch.cuda.current_stream().cuda_stream if device.type == "cuda" else 0
    routing = _C.route(s, torch.empty(4, dtype=torch.int64, device=device), x, stream, "test", "x")
    _C.grouped_linear_forward(x, ([w], None), routing, y, ([], None), None, stream)
    assert torch.equal(y, ops.grouped_linear(x, [w], s, [], None))
    with pytest.raises(TypeError, match="grouped_linear_forward"):
        _C.grouped_linear_forward("x", ([w], None), routing, y, ([], None), None, stream)
    with pytest.raises(TypeError, match="grouped_linear_forward"):
        _C.grouped_linear_forward(x, ([w], None), None, y, ([], None), None, stream)  # no routing
    with pytest.raises(TypeError, match="grouped_linear_forward"):
        _C.grouped_linear_forward(x, ([w], None), s, y, ([], None), None, stream)  # a tensor is no routing
    with pytest.raises(ValueError, match=r"grouped_linear_forward: x: unsupported dtype complex64; expected one of"):
        _C.grouped_linear_forward(x.to(torch.complex64), ([w], None), routing, y, ([], None), None, stream)
    with pytest.raises(ValueError, match=r"grouped_linear_forward: bias: unsupported dtype bool"):
        _C.grouped_linear_forward(x, ([w], None), routing, y, ([torch.zeros(3, 6, dtype=torch.bool)], None), None,
                                  stream)
    # A routing of 12 rows with a dy of 10: the op names dy and the rows it expected.
    with pytest.raises(ValueError, match=r"grouped_linear_dgrad: dy: expected \[T, N\] = \[12, 6\], got"):
        _C.grouped_linear_dgrad(dy[:10], ([w], None), routing, torch.empty(10, 8, dtype=dt, device=device), stream)
    with pytest.raises(ValueError, match=r"grouped_linear_forward: x: expected unit column stride"):
        _C.grouped_linear_forward(torch.randn(8, 12, dtype=dt, device=device).t(), ([w], None), routing, y,
                                  ([], None), None, stream)
    # route() itself: a token tensor that is not 2-D, an offsets buffer of the wrong size.
    with pytest.raises(ValueError, match=r"test: x: expected a 2-D \[T, \.\.\.\] token tensor"):
        _C.route(s, torch.empty(4, dtype=torch.int64, device=device), x[None], stream, "test", "x")
    with pytest.raises(ValueError, match=r"offsets: expected a 1-D \[G\+1\] = \[4\] tensor"):
        _C.route(s, torch.empty(3, dtype=torch.int64, device=device), x, stream, "test", "x")
    with pytest.raises(ValueError, match=r"glu_forward: glu: unsupported|GluSpec: unknown item 'colour'"):
        ops.glu(torch.randn(12, 16, dtype=dt, device=device), None, s, "activation=swiglu,colour=red")


@pytest.mark.parametrize("dtype, name", [
    (torch.float64, "float64"), (torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
    (torch.int64, "int64"), (torch.int32, "int32"), (torch.uint8, "uint8"),
    (getattr(torch, "float8_e4m3fn", None), "float8_e4m3"), (getattr(torch, "float8_e5m2", None), "float8_e5m2"),
])
def test_tensors_cross_with_their_dtype(device, dtype, name):
    if dtype is None:
        pytest.skip("this torch has no such dtype")
    t = torch.zeros(2, 3, device=device).to(dtype)
    try:
        torch.utils.dlpack.to_dlpack(t)
    except Exception as e:  # float8 crosses DLPack only in recent torch releases
        pytest.skip(f"this torch does not export {dtype} through DLPack: {e}")
    info = _C.tensor_info(t)
    assert (info["dtype"], info["shape"], info["strides"]) == (name, [2, 3], [3, 1])
    assert info["device"] == ("cpu" if device.type == "cpu" else f"cuda:{t.get_device()}")
    assert info["data"] == t.data_ptr()


def test_tensors_cross_with_their_strides_offsets_and_sizes(device):
    base = torch.arange(24, dtype=torch.float32, device=device).reshape(4, 6)
    for t, shape, strides in [
        (base[:, ::2], [4, 3], [6, 2]),
        (base.t(), [6, 4], [1, 6]),
        (base[1:], [3, 6], [6, 1]),
        (torch.zeros(0, 5, device=device), [0, 5], [5, 1]),
        (torch.zeros(3, 0, device=device).t(), [0, 3], [3, 1]),  # no elements: any strides address nothing
        (torch.zeros(4, 1, device=device).expand(4, 1).as_strided((4, 1), (1, 7)), [4, 1], [1, 1]),  # extent 1
        (torch.tensor(3.0, device=device), [], []),
        (torch.nn.Parameter(base.clone()), [4, 6], [6, 1]),  # requires grad: still a plain export
    ]:
        info = _C.tensor_info(t)
        assert (info["shape"], info["strides"], info["data"]) == (shape, strides, t.data_ptr()), (shape, strides)
    for bad, words in [(torch.zeros(2, dtype=torch.complex64, device=device), "unsupported dtype complex64"),
                       (torch.zeros(2, dtype=torch.bool, device=device), "unsupported dtype bool"),
                       (torch.zeros(2, dtype=torch.int16, device=device), "unsupported dtype int16"),
                       (torch.zeros([1] * 7, device=device), "expected at most 6 dimensions, got 7")]:
        with pytest.raises(ValueError, match=f"tensor_info: t: {words}"):
            _C.tensor_info(bad)


def test_an_empty_token_buffer_runs_forward_and_backward():
    """T = 0: the gradient of the sum arrives with strides [0, 0], which address nothing (CPU
    backend; the CUDA kernels are not run on empty buffers here)."""
    w = torch.randn(3, 6, 8, requires_grad=True)
    x = torch.zeros(0, 8, requires_grad=True)
    y = me.grouped_linear(x, w, make_splits([0, 0, 0], "cpu"))
    assert y.shape == (0, 6)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_a_routing_of_another_device_is_an_error(cuda):
    x = torch.randn(12, 8, dtype=torch.bfloat16)
    w = torch.randn(3, 6, 8, dtype=torch.bfloat16)
    s = make_splits([4, 0, 5], cuda)
    xc = x.to(cuda)
    stream = torch.cuda.current_stream().cuda_stream
    routing = _C.route(s, torch.empty(4, dtype=torch.int64, device=cuda), xc, stream, "test", "x")
    assert routing.device == f"cuda:{cuda.index or 0}"
    with pytest.raises(ValueError, match=r"grouped_linear_forward: .*is on cpu; expected the group layout's device cuda"):
        _C.grouped_linear_forward(x, ([w], None), routing, torch.empty(12, 6, dtype=torch.bfloat16), ([], None), None,
                                  stream)
    _, gpu_routing = ops.grouped_linear_routed(xc, [w.to(cuda)], s, [], None)
    assert _C.find_routing(gpu_routing, s.cpu(), 12) is None
    assert _C.find_routing(gpu_routing.cpu(), s, 12) is None
