"""The custom ops and the functional API against float64 PyTorch references, on the CPU backend
and (where a GPU is visible) on CUDA; fake implementations (opcheck, torch.compile); errors."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine
import moe_engine.torch as me
from reference import ROUTINGS, assert_close, expert_mlp_ref, glu_ref, grouped_linear_ref, make_splits

DTYPES = {"cpu": [torch.float32, torch.bfloat16], "cuda": [torch.bfloat16, torch.float16]}


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def weights(G, shape, dtype, device, packed, scale):
    w = rand(G, *shape, dtype=dtype, device=device, scale=scale)
    return leaf(w) if packed else [leaf(w[g]) for g in range(G)]


def grads_of(w):
    return w.grad if isinstance(w, torch.Tensor) else torch.stack([t.grad for t in w])


def as64(w):
    return leaf(w.double()) if isinstance(w, torch.Tensor) else [leaf(t.double()) for t in w]


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("bias_mode", ["none", "bias", "scale_bias"])
def test_grouped_linear_forward_and_backward(device, routing, packed, bias_mode):
    torch.manual_seed(hash((routing, packed, bias_mode)) % 1000)
    splits_list, T = ROUTINGS[routing]
    G, K, N = len(splits_list), 40, 24
    for dtype in DTYPES[device.type]:
        x = leaf(rand(T, K, dtype=dtype, device=device))
        w = weights(G, (N, K), dtype, device, packed, K**-0.5)
        b = weights(G, (N,), dtype, device, packed, 1.0) if bias_mode != "none" else None
        p = leaf(torch.rand(T, device=device)) if bias_mode == "scale_bias" else None
        splits = make_splits(splits_list, device)
        y = me.grouped_linear(x, w, splits, b, p)
        dy = rand(T, N, dtype=dtype, device=device)
        y.backward(dy)

        x64, w64 = leaf(x.double()), as64(w)
        b64 = as64(b) if b is not None else None
        p64 = leaf(p.double()) if p is not None else None
        ref = grouped_linear_ref(x64, w64, splits_list, b64, p64)
        ref.backward(dy.double())
        rows = sum(splits_list)
        if rows:
            assert_close(y[:rows], ref[:rows], dtype, "y")
            assert_close(x.grad[:rows], x64.grad[:rows], dtype, "dx")
            assert_close(grads_of(w), grads_of(w64), dtype, "dW")
            if b is not None:
                assert_close(grads_of(b), grads_of(b64), dtype, "db")
            if p is not None:
                assert_close(p.grad[:rows], p64.grad[:rows], torch.float32 if dtype == torch.float32 else dtype, "dp")
        # Rows no expert owns are zeros in every fresh output; empty experts get zero gradients.
        assert torch.all(y[rows:] == 0) and torch.all(x.grad[rows:] == 0)
        if p is not None:
            assert torch.all(p.grad[rows:] == 0)
        for g, s in enumerate(splits_list):
            if s == 0:
                assert torch.all(grads_of(w)[g] == 0)


GATED = {"swiglu": True, "clamped_qgeglu": True, "srelu": False, "gelu_tanh": False}
# Every GLU in every layout; the non-gated activations in the default layout (they have no other).
ACTIVATION_LAYOUTS = [(a, layout) for a in ("swiglu", "clamped_qgeglu") for layout in ("halves", "pairs", "blocks:8")]
ACTIVATION_LAYOUTS += [("srelu", "halves"), ("gelu_tanh", "halves")]


@pytest.mark.parametrize("activation,layout", ACTIVATION_LAYOUTS)
def test_glu_forward_and_backward(device, activation, layout):
    torch.manual_seed(3)
    splits_list, T = ROUTINGS["mixed"]
    F = 32
    W = 2 * F if GATED[activation] else F
    for dtype in DTYPES[device.type]:
        # Values well past the clamp limit on both sides, so the clamps' zero gradients show.
        h = leaf(rand(T, W, dtype=dtype, device=device, scale=5.0))
        p = leaf(torch.rand(T, device=device))
        splits = make_splits(splits_list, device)
        out = me.glu(h, splits, p, activation=activation, layout=layout)
        d = rand(T, F, dtype=dtype, device=device)
        out.backward(d)
        h64, p64 = leaf(h.double()), leaf(p.double())
        ref = glu_ref(h64, layout, activation) * p64[:, None]
        rows = sum(splits_list)
        ref[:rows].backward(d[:rows].double())
        assert_close(out[:rows], ref[:rows], dtype, "out")
        assert_close(h.grad[:rows], h64.grad[:rows], dtype, "dh")
        assert_close(p.grad[:rows], p64.grad[:rows], dtype, "dprobs")
        assert torch.all(out[rows:] == 0) and torch.all(h.grad[rows:] == 0) and torch.all(p.grad[rows:] == 0)


MLP_CASES = [
    # (activation, layout, bias, probs, recompute, fusion, packed)
    ("swiglu", "halves", False, True, False, "forward", True),
    ("swiglu", "blocks:32", True, True, False, "forward", True),
    ("clamped_qgeglu", "pairs", True, True, False, "all", True),
    ("clamped_qgeglu", "pairs", True, False, True, "none", True),
    ("swiglu", "blocks:8", True, True, True, "forward", False),
    ("srelu", "halves", True, True, False, "forward", True),
    ("srelu", "halves", False, True, True, "all", False),
    ("gelu_tanh", "halves", True, True, False, "all", True),
    ("gelu_tanh", "halves", True, False, True, "none", False),
]


@pytest.mark.parametrize("case", MLP_CASES, ids=lambda c: "-".join(str(v) for v in c))
@pytest.mark.parametrize("routing", ["mixed", "one_expert_all", "g1"])
def test_expert_mlp_forward_and_backward(device, case, routing):
    activation, layout, bias, with_probs, recompute, fusion, packed = case
    torch.manual_seed(7)
    splits_list, T = ROUTINGS[routing]
    G, H, F = len(splits_list), 64, 64
    for dtype in DTYPES[device.type]:
        x = leaf(rand(T, H, dtype=dtype, device=device))
        W = 2 * F if GATED[activation] else F  # FC1's rows
        w1 = weights(G, (W, H), dtype, device, packed, H**-0.5 * 3)  # pre-activations past the clamp too
        w2 = weights(G, (H, F), dtype, device, packed, F**-0.5)
        b1 = weights(G, (W,), dtype, device, packed, 1.0) if bias else None
        b2 = weights(G, (H,), dtype, device, packed, 1.0) if bias else None
        p = leaf(torch.rand(T, device=device)) if with_probs else None
        splits = make_splits(splits_list, device)
        y = me.expert_mlp(x, w1, w2, splits, p, b1, b2, activation=activation, layout=layout, fusion=fusion,
                          recompute_fc1=recompute)
        dy = rand(T, H, dtype=dtype, device=device)
        y.backward(dy)

        x64, w164, w264 = leaf(x.double()), as64(w1), as64(w2)
        b164 = as64(b1) if bias else None
        b264 = as64(b2) if bias else None
        p64 = leaf(p.double()) if with_probs else None
        ref = expert_mlp_ref(x64, w164, w264, splits_list, p64, b164, b264, layout, activation, storage=dtype)
        ref.backward(dy.double())
        rows = sum(splits_list)
        assert_close(y[:rows], ref[:rows], dtype, "y")
        assert_close(x.grad[:rows], x64.grad[:rows], dtype, "dx")
        assert_close(grads_of(w1), grads_of(w164), dtype, "dW1")
        assert_close(grads_of(w2), grads_of(w264), dtype, "dW2")
        if bias:
            assert_close(grads_of(b1), grads_of(b164), dtype, "db1")
            assert_close(grads_of(b2), grads_of(b264), dtype, "db2")
        if with_probs:
            assert_close(p.grad[:rows], p64.grad[:rows], dtype, "dprobs")
            assert torch.all(p.grad[rows:] == 0)
        assert torch.all(y[rows:] == 0) and torch.all(x.grad[rows:] == 0)


@pytest.mark.parametrize("activation", ["srelu", "gelu_tanh"])
def test_non_gated_mlp_and_activation_pass_gradcheck_in_float64(activation):
    """torch.autograd.gradcheck (float64 finite differences) of the activation op and of the whole
    expert MLP, every input and parameter, on the CPU backend (which computes in float64)."""
    torch.manual_seed(5)
    splits_list, T = [2, 0, 3], 6
    G, H, F = 3, 5, 4
    splits = make_splits(splits_list, torch.device("cpu"))

    def away_from_zero(t):  # srelu's kink at 0: keep the pre-activations off it
        return torch.where(t.abs() < 0.05, t + 0.1, t)

    h = away_from_zero(torch.randn(T, F, dtype=torch.float64)).requires_grad_(True)
    p = torch.rand(T, dtype=torch.float64).add(0.1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h, p: me.glu(h, splits, p, activation=activation), (h, p))
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w1 = (torch.randn(G, F, H, dtype=torch.float64) * 0.5).requires_grad_(True)
    w2 = (torch.randn(G, H, F, dtype=torch.float64) * 0.5).requires_grad_(True)
    b1 = (torch.randn(G, F, dtype=torch.float64) * 0.5).requires_grad_(True)
    b2 = (torch.randn(G, H, dtype=torch.float64) * 0.5).requires_grad_(True)
    with torch.no_grad():  # FC1's pre-activations stay off srelu's kink too
        pre = torch.cat([x[a:b] @ w1[g].T + b1[g] for g, (a, b) in enumerate([(0, 2), (2, 2), (2, 5)])])
    assert pre.abs().min() > 1e-3, "resample: a pre-activation sits on srelu's kink at 0"
    for recompute in (False, True):
        assert torch.autograd.gradcheck(
            lambda x, p, w1, b1, w2, b2: me.expert_mlp(x, w1, w2, splits, p, b1, b2, activation=activation,
                                                       recompute_fc1=recompute),
            (x, p, w1, b1, w2, b2))


def test_non_gated_fc1_must_have_f_rows(device):
    """A non-gated activation's FC1 has F rows: a GLU-sized one is named with the shape expected,
    and a GLU layout is refused."""
    dtype = DTYPES[device.type][0]
    s = make_splits([4, 0, 5], device)
    x = torch.zeros(9, 8, dtype=dtype, device=device)
    w2 = torch.zeros(3, 8, 4, dtype=dtype, device=device)
    with pytest.raises(ValueError, match=r"expert_mlp_forward: fc1_weight: expected G x \[F, H\] = 3 x \[4, 8\]"):
        me.expert_mlp(x, torch.zeros(3, 8, 8, dtype=dtype, device=device), w2, s, activation="srelu")
    with pytest.raises(ValueError, match=r"GLU layout pairs given for gelu_tanh, which is not gated"):
        me.expert_mlp(x, torch.zeros(3, 4, 8, dtype=dtype, device=device), w2, s, activation="gelu_tanh",
                      layout="pairs")
    y = me.expert_mlp(x, torch.zeros(3, 4, 8, dtype=dtype, device=device), w2, s, activation="gelu_tanh")
    assert y.shape == (9, 8)


def test_int32_splits_and_determinism(device):
    torch.manual_seed(1)
    dtype = DTYPES[device.type][0]
    x = rand(60, 32, dtype=dtype, device=device)
    w = rand(3, 16, 32, dtype=dtype, device=device)
    s64 = make_splits([20, 0, 33], device)
    s32 = make_splits([20, 0, 33], device, torch.int32)
    a = me.grouped_linear(x, w, s64)
    assert torch.equal(a, me.grouped_linear(x, w, s32))
    assert torch.equal(a, me.grouped_linear(x, w, s64))  # bit-identical run to run


def test_opcheck_of_every_op():
    """Schemas, fake implementations and autograd registration agree with the real ops."""
    torch.manual_seed(2)
    x, w = torch.randn(12, 8), torch.randn(3, 6, 8)
    b, s = torch.randn(3, 6), torch.tensor([4, 0, 5])
    dy, p = torch.randn(12, 6), torch.rand(12)
    h = torch.randn(12, 16)
    w1, w2 = torch.randn(3, 16, 8), torch.randn(3, 8, 8)
    ops = torch.ops.moe_engine
    pairs = me.glu_text("swiglu", "pairs")
    routing = ops.grouped_linear_routed(x, [w], s, [], None)[1]  # a live routing of (s, 12 rows)
    cases = [
        (ops.grouped_linear, (x, [w], s, [b], p)),
        (ops.grouped_linear, (x, list(w.unbind(0)), s, [], None)),
        (ops.grouped_linear_routed, (x, [w], s, [b], p)),
        (ops.grouped_linear_dgrad, (dy, [w], s)),
        (ops.grouped_linear_dgrad, (dy, [w], s, routing)),
        (ops.grouped_linear_wgrad_, (dy, x, s, [torch.empty(3, 6, 8)], "write")),
        (ops.grouped_linear_wgrad_, (dy, x, s, [torch.empty(3, 6, 8)], "write", routing)),
        (ops.grouped_linear_dbias, (dy, s, p)),
        (ops.grouped_linear_dscales, (dy, [b], s)),
        (ops.glu, (h, p, s, pairs)),
        (ops.glu_routed, (h, p, s, pairs)),
        (ops.glu_backward, (h, p, torch.randn(12, 8), s, pairs)),
        (ops.glu_backward, (h, p, torch.randn(12, 8), s, pairs, routing)),
        (ops.expert_mlp, (x, p, [w1], [], [w2], [], s, me.glu_text(), "forward", True)),
        (ops.expert_mlp_routed, (x, p, [w1], [], [w2], [], s, me.glu_text(), "forward", False)),
        (ops.expert_mlp_backward_, (torch.randn(12, 8), x, p, [w1], [], [w2], [], s, None, me.glu_text(), "none", True,
                                    True, False, False, [torch.zeros(3, 16, 8)], "accumulate", [], "write")),
    ]
    # A non-gated activation: h and FC1's rows [.., F] (the fake implementations read the spec).
    srelu, w1f = me.glu_text("srelu"), torch.randn(3, 8, 8)
    cases += [
        (ops.glu_routed, (h[:, :8].contiguous(), p, s, srelu)),
        (ops.glu_backward, (h[:, :8].contiguous(), p, torch.randn(12, 8), s, srelu)),
        (ops.expert_mlp_routed, (x, p, [w1f], [torch.randn(3, 8)], [w2], [], s, srelu, "forward", True)),
        (ops.expert_mlp_backward_, (torch.randn(12, 8), x, p, [w1f], [torch.randn(3, 8)], [w2], [torch.randn(3, 8)], s,
                                    torch.randn(12, 8), srelu, "none", True, True, True, True, [torch.zeros(3, 8, 8)],
                                    "write", [], "write")),
        # FC2's half with dL/d(fc1_out) and FC2's input written out (the two-node and delayed paths).
        (ops.expert_mlp_backward_, (torch.randn(12, 8), None, p, [w1], [], [w2], [], s, torch.randn(12, 16),
                                    me.glu_text(), "none", False, True, False, False, [], "write", [], "write", None,
                                    True, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_autograd_registration_passes_opcheck():
    x, w, s = torch.randn(12, 8, requires_grad=True), torch.randn(3, 6, 8, requires_grad=True), torch.tensor([4, 0, 5])
    for op in (torch.ops.moe_engine.grouped_linear_routed, torch.ops.moe_engine.grouped_linear):
        torch.library.opcheck(op, (x, [w], s, [], None), test_utils=("test_autograd_registration",))


def test_functional_api_compiles_fullgraph(device):
    """The ops trace into one graph (fake impls), forward and backward; results match eager."""
    torch.manual_seed(4)
    dtype = DTYPES[device.type][0]
    splits = make_splits([7, 0, 19], device)
    x = leaf(rand(30, 32, dtype=dtype, device=device))
    w1 = leaf(rand(3, 64, 32, dtype=dtype, device=device, scale=0.2))
    w2 = leaf(rand(3, 32, 32, dtype=dtype, device=device, scale=0.2))
    p = leaf(torch.rand(30, device=device))

    def block(x, w1, w2, p, splits):
        return me.expert_mlp(x, w1, w2, splits, p, layout="pairs").float().square().sum()

    eager = block(x, w1, w2, p, splits)
    eager.backward()
    grads = [t.grad.clone() for t in (x, w1, w2, p)]
    for t in (x, w1, w2, p):
        t.grad = None
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, w1, w2, p, splits)
    compiled.backward()
    assert torch.equal(compiled, eager)
    for g, t in zip(grads, (x, w1, w2, p)):
        assert torch.equal(g, t.grad)


def test_bad_inputs_are_clear_errors(device):
    dtype = DTYPES[device.type][0]
    x = torch.zeros(10, 8, dtype=dtype, device=device)
    w = torch.zeros(3, 6, 8, dtype=dtype, device=device)
    s = make_splits([4, 0, 5], device)
    with pytest.raises(ValueError, match="x"):
        me.grouped_linear(torch.zeros(10, 7, dtype=dtype, device=device), w, s)  # K mismatch
    with pytest.raises(ValueError, match="dtype|bfloat16|float"):
        me.grouped_linear(x.to(torch.float64 if device.type == "cuda" else torch.float16), w, s)
    with pytest.raises(ValueError):
        me.grouped_linear(x, w, make_splits([4, 5], device))  # G mismatch
    with pytest.raises(ValueError, match="unsupported dtype"):
        me.grouped_linear(x.to(torch.complex64), w, s)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="negative"):
            me.grouped_linear(x, w, make_splits([4, -1, 5], device))
        with pytest.raises(ValueError, match="exceeds the buffer capacity"):
            me.grouped_linear(x, w, make_splits([4, 4, 5], device))


def test_messages_name_the_argument_that_is_wrong(device):
    """Each mistake is blamed on the argument that made it, with what was expected."""
    dtype = DTYPES[device.type][0]
    w = torch.zeros(3, 6, 8, dtype=dtype, device=device)
    s = make_splits([4, 0, 5], device)
    # A [B, S, H] batch is not read as T = B rows that the splits overflow.
    with pytest.raises(ValueError, match=r"grouped_linear_forward: x: expected a 2-D \[T, \.\.\.\] token tensor"):
        me.grouped_linear(torch.zeros(2, 5, 8, dtype=dtype, device=device), w, s)
    with pytest.raises(ValueError, match=r"expert_mlp_forward: x: expected a 2-D"):
        me.expert_mlp(torch.zeros(2, 5, 8, dtype=dtype, device=device), torch.zeros(3, 8, 8, dtype=dtype, device=device),
                      torch.zeros(3, 8, 4, dtype=dtype, device=device), s)
    # The weight sets K: an x of another width is the one named.
    with pytest.raises(ValueError, match=r"grouped_linear_forward: x: expected \[T, K\] = \[9, 8\], got"):
        me.grouped_linear(torch.zeros(9, 7, dtype=dtype, device=device), w, s)
    # splits: the accepted dtypes are the integer ones.
    with pytest.raises(ValueError, match=r"splits must be an int64 or int32 tensor .*, got torch.int16"):
        me.grouped_linear(torch.zeros(9, 8, dtype=dtype, device=device), w, s.to(torch.int16))
    with pytest.raises(ValueError, match=r"splits must be an int64 or int32 tensor .*, got torch.float32"):
        me.grouped_linear(torch.zeros(9, 8, dtype=dtype, device=device), w, s.float())
    with pytest.raises(ValueError, match=r"splits must be 1-D \[G\]"):
        me.grouped_linear(torch.zeros(9, 8, dtype=dtype, device=device), w, s.reshape(1, 3))


def test_more_messages_name_the_argument_that_is_wrong(device):
    dtype = DTYPES[device.type][0]
    x = torch.zeros(9, 8, dtype=dtype, device=device)
    w = torch.zeros(3, 6, 8, dtype=dtype, device=device)
    s = make_splits([4, 0, 5], device)
    # A 0-dim x is named as the 2-D token tensor it should be (not an IndexError).
    with pytest.raises(ValueError, match=r"grouped_linear_forward: x: expected a 2-D \[T, \.\.\.\] token tensor"):
        me.grouped_linear(torch.tensor(1.0, dtype=dtype, device=device), w, s)
    with pytest.raises(ValueError, match=r"glu_forward: h: expected a 2-D \[T, \.\.\.\] token tensor"):
        me.glu(torch.tensor(1.0, dtype=dtype, device=device), s)
    # An empty weight list.
    with pytest.raises(ValueError, match=r"grouped_linear_forward: weight: expected a packed \[G, \.\.\.\] tensor or G "
                                         r"per-expert tensors, got an empty list"):
        me.grouped_linear(x, [], s)
    w2 = torch.zeros(3, 8, 4, dtype=dtype, device=device)
    with pytest.raises(ValueError, match=r"expert_mlp_forward: fc1_weight: .* got an empty list"):
        me.expert_mlp(x, [], w2, s)
    # FC2's weight sets H in the C++ op: an FC2 of another H is named, not FC1.
    with pytest.raises(ValueError, match=r"expert_mlp_forward: fc2_weight: expected G x \[H, F\] with H = 8"):
        me.expert_mlp(x, torch.zeros(3, 8, 8, dtype=dtype, device=device), torch.zeros(3, 9, 4, dtype=dtype, device=device),
                      s)
    # The activation's input h, not its output, is the integer tensor; d_out, not h, has the wrong F.
    with pytest.raises(ValueError, match=r"glu_forward: h: expected a floating-point tensor, got int32"):
        me.glu(torch.ones(9, 16, dtype=torch.int32, device=device), s)
    with pytest.raises(ValueError, match=r"glu_backward: d_out: expected \[T, F\] = \[9, 8\] for h \[9, 16\]"):
        me.glu_backward(torch.zeros(9, 16, dtype=dtype, device=device), torch.zeros(9, 9, dtype=dtype, device=device), s)
    # The activation's parameters: numbers, limit > 0 (inf: no clamp), alpha and offset finite.
    with pytest.raises(TypeError, match=r"glu_text: limit must be a number, got str 'seven'"):
        me.glu_text("clamped_qgeglu", "halves", "seven")
    with pytest.raises(TypeError, match=r"glu_text: activation and layout must be strings"):
        me.glu_text(None)
    for kwargs in (dict(limit=float("nan")), dict(limit=-5.0), dict(alpha=float("nan")), dict(offset=float("inf"))):
        with pytest.raises(ValueError, match=r"glu_text: (limit must be > 0|alpha and offset must be finite)"):
            me.glu(torch.zeros(9, 16, dtype=dtype, device=device), s, activation="clamped_qgeglu", **kwargs)
        with pytest.raises(ValueError, match=r"limit must be > 0|alpha and offset must be finite"):
            me.GroupedMLP(3, 8, 8, device=device, dtype=dtype, **kwargs)  # swiglu ignores them: still a mistake
    me.glu_text("clamped_qgeglu", limit=float("inf"))  # no clamp


def test_meta_tensors_among_real_ones_are_an_error(device):
    """The dispatcher runs an op's fake implementation when any argument is a meta tensor: with
    real tensors beside it the result would be a real tensor of uninitialized memory. Every path
    (autograd, no grad, the modules) raises instead; all-meta arguments still give meta shapes."""
    dtype = DTYPES[device.type][0]
    x, w, s = torch.randn(9, 8, dtype=dtype, device=device), torch.randn(3, 6, 8, dtype=dtype, device=device), \
        make_splits([4, 0, 5], device)
    p, h = torch.rand(9, device=device), torch.randn(9, 16, dtype=dtype, device=device)
    w1, w2 = torch.randn(3, 16, 8, dtype=dtype, device=device), torch.randn(3, 8, 8, dtype=dtype, device=device)
    meta = torch.device("meta")
    cases = {
        "grouped_linear splits": lambda: me.grouped_linear(x, w, s.to(meta)),
        "grouped_linear weight": lambda: me.grouped_linear(x, w.to(meta), s),
        "grouped_linear x": lambda: me.grouped_linear(x.to(meta), w, s),
        "glu probs": lambda: me.glu(h, s, p.to(meta)),
        "glu_backward d_out": lambda: me.glu_backward(h, torch.zeros(9, 8, dtype=dtype, device=meta), s),
        "expert_mlp splits": lambda: me.expert_mlp(x, w1, w2, s.to(meta), p),
        "grouped_linear_dgrad splits": lambda: me.grouped_linear_dgrad(torch.randn(9, 6, dtype=dtype, device=device), w,
                                                                       s.to(meta)),
        "quantize_fp8 splits": lambda: me.quantize_fp8(torch.randn(9, 32, device=device), s.to(meta)),
        "GroupedLinear splits": lambda: me.GroupedLinear(3, 8, 6, device=device, dtype=dtype)(x, s.to(meta)),
        "GroupedMLP splits": lambda: me.GroupedMLP(3, 8, 8, device=device, dtype=dtype)(x, s.to(meta), p),
        "dispatch x": lambda: me.dispatch(x.to(meta), None, torch.zeros(9, 2, dtype=torch.int64, device=device), 3),
    }
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for name, fn in cases.items():
                with pytest.raises(ValueError, match=r"is on (meta|cpu|cuda:0) but .* is on (meta|cpu|cuda:0); expected "
                                                     r"every tensor on one device"):
                    fn()
                    pytest.fail(f"{name}, grad {grad}: no error")
            y = me.grouped_linear(x.to(meta), w.to(meta), s.to(meta))
            assert y.device == meta and y.shape == (9, 6)


def test_output_buffers_that_require_grad_are_refused_under_grad_mode(device):
    """The gradient buffers an op writes in place are written outside autograd: a parameter (or any
    tensor that requires grad) passed as one is refused while grad mode is on, as torch refuses
    in-place operations on such leaves; under torch.no_grad() it is written, as torch's are."""
    dtype = DTYPES[device.type][0]
    g = torch.Generator().manual_seed(5)
    s = make_splits([4, 0, 5], device)
    dy, x = (torch.randn(9, 6, generator=g).to(device, dtype), torch.randn(9, 8, generator=g).to(device, dtype))
    w1, w2 = (torch.randn(3, 16, 8, generator=g).to(device, dtype), torch.randn(3, 8, 8, generator=g).to(device, dtype))
    dy2 = torch.randn(9, 8, generator=g).to(device, dtype)
    targets = {
        "grouped_linear_wgrad out": (lambda t: me.grouped_linear_wgrad(dy, x, s, t), (3, 6, 8), r"out requires grad"),
        "grouped_linear_wgrad out (per expert)": (lambda t: me.grouped_linear_wgrad(dy, x, s, list(t.unbind(0))),
                                                  (3, 6, 8), r"out requires grad"),
        "expert_mlp_backward fc1_weight_grad": (
            lambda t: me.expert_mlp_backward(dy2, x, w1, w2, s, fc1_weight_grad=t, fc2_weight_grad=[]),
            (3, 16, 8), r"fc1_weight_grad requires grad"),
        "expert_mlp_backward fc2_weight_grad": (
            lambda t: me.expert_mlp_backward(dy2, x, w1, w2, s, fc1_weight_grad=[], fc2_weight_grad=t),
            (3, 8, 8), r"fc2_weight_grad requires grad"),
    }
    for name, (run, shape, message) in targets.items():
        for make in (lambda: torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)),
                     lambda: torch.zeros(shape, dtype=dtype, device=device, requires_grad=True) * 1):  # not a leaf
            target = make()
            before = target.detach().clone()
            with pytest.raises(ValueError, match=message + r" \(a parameter\?\) and would be written in place"):
                run(target)
                pytest.fail(f"{name}: no error")
            assert torch.equal(target.detach(), before), f"{name}: written although refused"
        target = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        with torch.no_grad():
            run(target)
        assert target.detach().abs().sum() > 0, f"{name}: not written under no_grad"


def test_bad_splits_on_the_gpu_are_reported_and_never_write_out_of_bounds(cuda):
    x = torch.randn(10, 8, dtype=torch.bfloat16, device=cuda)
    w = torch.randn(3, 6, 8, dtype=torch.bfloat16, device=cuda)
    me.check_errors()
    y = me.grouped_linear(x, w, make_splits([4, 4, 5], cuda))  # sum 13 > T = 10: clamped
    assert torch.isfinite(y.float()).all()
    with pytest.raises(moe_engine.DeviceError, match="exceeds the buffer capacity"):
        me.check_errors()
    me.check_errors()  # cleared
    me.grouped_linear(x, w, make_splits([4, -2, 5], cuda))
    with pytest.raises(moe_engine.DeviceError, match="negative"):
        me.check_errors(cuda)


def test_backward_pieces_match_autograd(device):
    """The functional backward pieces give what autograd gives, and wgrad accumulates into a
    float32 main_grad buffer (an empty expert's slice untouched)."""
    torch.manual_seed(8)
    dtype = DTYPES[device.type][0]
    splits_list, T = ROUTINGS["mixed"]
    G, K, N = len(splits_list), 32, 24
    splits = make_splits(splits_list, device)
    x = leaf(rand(T, K, dtype=dtype, device=device))
    w = leaf(rand(G, N, K, dtype=dtype, device=device, scale=K**-0.5))
    b = leaf(rand(G, N, dtype=dtype, device=device))
    p = leaf(torch.rand(T, device=device))
    dy = rand(T, N, dtype=dtype, device=device)
    me.grouped_linear(x, w, splits, b, p).backward(dy)
    assert torch.equal(me.grouped_linear_dgrad(dy, w.detach(), splits), x.grad)
    assert torch.equal(me.grouped_linear_wgrad(dy, x.detach(), splits), w.grad)
    assert torch.equal(me.grouped_linear_dbias(dy, splits, p.detach()), b.grad)
    assert torch.equal(me.grouped_linear_dscales(dy, b.detach(), splits), p.grad)
    main = torch.full((G, N, K), 2.0, device=device)
    me.grouped_linear_wgrad(dy, x.detach(), splits, main, "accumulate")
    assert_close(main - 2.0, w.grad.float(), dtype, "accumulate")
    assert torch.all(main[1] == 2.0) and torch.all(main[4] == 2.0)  # empty experts untouched

    F = 32
    w1 = leaf(rand(G, 2 * F, K, dtype=dtype, device=device, scale=K**-0.5))
    w2 = leaf(rand(G, K, F, dtype=dtype, device=device, scale=F**-0.5))
    y = me.expert_mlp(x, w1, w2, splits, p, layout="pairs", recompute_fc1=True)
    for t in (x, p):
        t.grad = None
    dy2 = rand(T, K, dtype=dtype, device=device)
    y.backward(dy2)
    g = me.expert_mlp_backward(dy2, x.detach(), w1.detach(), w2.detach(), splits, p.detach(), layout="pairs")
    assert torch.equal(g["dx"], x.grad) and torch.equal(g["dprobs"], p.grad)
    assert torch.equal(g["fc1_weight"][0], w1.grad) and torch.equal(g["fc2_weight"][0], w2.grad)
    h = leaf(rand(T, 2 * F, dtype=dtype, device=device))
    me.glu(h, splits, p.detach(), layout="pairs").backward(dy2[:, :F].contiguous())
    dh, dprobs = me.glu_backward(h.detach(), dy2[:, :F], splits, p.detach(), layout="pairs")
    assert torch.equal(dh, h.grad) and dprobs.shape == (T,)
