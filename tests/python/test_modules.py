"""GroupedLinear / GroupedMLP: numerics against plain PyTorch, every row of the gradient contract
through a real backward with Megatron-DDP-style hooks, delayed wgrad, FSDP main_grad, state_dict
round trips across layouts (and GLU layouts), torch.compile of a module forward."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine.torch as me
from reference import ROUTINGS, assert_close, attach_ddp, expert_mlp_ref, grouped_linear_ref, make_splits

DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}


def weight_params(m):
    if isinstance(m, me.GroupedMLP):
        return m.fc1.weights() + m.fc2.weights()
    return m.weights()


def build(kind, device, **opt):
    torch.manual_seed(11)
    if kind == "linear":
        return me.GroupedLinear(4, 32, 48, bias=True, device=device, dtype=DTYPE[device.type], **opt)
    return me.GroupedMLP(4, 32, 16, bias=True, activation="clamped_qgeglu", glu_layout="pairs", device=device,
                         dtype=DTYPE[device.type], **opt)


def run(m, device, seed=5):
    torch.manual_seed(seed)
    splits_list, T = [9, 0, 1, 23], 40
    x = torch.randn(T, 32, dtype=DTYPE[device.type], device=device, requires_grad=True)
    splits = make_splits(splits_list, device)
    probs = torch.rand(T, device=device)
    y = m(x, splits) if isinstance(m, me.GroupedLinear) else m(x, splits, probs)
    y.backward(torch.randn_like(y))
    return x


def plain_wgrads(kind, device, layout):
    m = build(kind, device, layout=layout)
    run(m, device)
    return [p.grad.float().clone() for p in weight_params(m)]


# The rows of docs/design.md section 6, shared with the C++ module tests (tests/data/grad_contract.json).
ROWS = json.loads((Path(__file__).resolve().parent.parent / "data" / "grad_contract.json").read_text())["rows"]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("layout", ["packed", "per-expert"])
@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_every_row_of_the_gradient_contract(device, kind, layout, row):
    expected = plain_wgrads(kind, device, layout)
    into_main, delayed = row["main_grad"], row["delay"]
    m = build(kind, device, layout=layout, accumulate_into_main_grad=into_main, delay_wgrad_compute=delayed,
              overwrite_main_grad=row["overwrite"])
    weights = weight_params(m)
    ddp_log = attach_ddp(m, with_flag=row["flag"], zero_out=row["zero_out"]) if into_main else []
    if into_main:
        for p in weights:
            p.main_grad.fill_(1.0)  # accumulate adds to it; overwrite replaces it
    fired = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append(True))
    seen = {}
    for p in weights:  # what autograd received for each weight
        p.register_hook(lambda g, p=p: seen.__setitem__(id(p), g))
    run(m, device)

    if delayed:
        for p in weights:
            assert getattr(p, "skip_backward_post_hook", False)
    for p, ref in zip(weights, expected):
        got = seen.get(id(p))
        if row["handed_back"] == "grad":
            assert got is not None and torch.equal(got.float(), ref)
        elif row["handed_back"] == "none":
            assert got is None  # nothing handed back: no grad += behind our back
        else:  # the dummy: all zeros (so zero_out_wgrad holds), no entries, no memory
            assert got is not None and got.shape == p.shape and got.is_sparse and got._nnz() == 0
    for p in weights:
        assert hasattr(p, "grad_added_to_main_grad") == row["flag"]
        if row["flag"]:
            assert p.grad_added_to_main_grad == row["flag_after_backward"]
    assert m.backward_dw() is None
    assert len(fired) == (1 if delayed else 0)
    m.backward_dw()  # nothing queued: no-op, hooks do not fire again
    assert len(fired) == (1 if delayed else 0)
    if into_main:  # Megatron's reduce hook ran once for every parameter
        assert len(ddp_log) == len(list(m.parameters()))
    for p, ref in zip(weights, expected):
        if row["flag"]:
            assert p.grad_added_to_main_grad == row["flag_after_dw"]
        if into_main:
            base = 0.0 if row["mode"] == "overwrite" else 1.0
            assert_close(p.main_grad - base, ref, DTYPE[device.type], f"main_grad {row['name']}")
        elif delayed:
            assert torch.equal(p.grad.float(), ref)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_the_main_grad_dummy_takes_no_memory_and_megatron_hooks_accept_it(device, kind):
    """With grad_added_to_main_grad, backward hands back an empty sparse gradient: Megatron's hook
    sees a .grad (so DDP's reduce fires), adding it adds nothing (zero_out_wgrad's meaning), and
    neither the module nor autograd keeps a weight-sized dummy alive."""
    m = build(kind, device, accumulate_into_main_grad=True)
    seen = []
    for p in weight_params(m):  # before Megatron's hook, which drops .grad
        p.register_post_accumulate_grad_hook(lambda p: seen.append((p.grad.is_sparse, p.grad._nnz(), p.grad.shape == p.shape)))
    log = attach_ddp(m, with_flag=True, zero_out=True)  # zero_out: the hook adds .grad into main_grad
    run(m, device)
    assert seen and all(s == (True, 0, True) for s in seen)
    assert len(log) == len(list(m.parameters()))
    expected = plain_wgrads(kind, device, "packed")
    for p, ref in zip(weight_params(m), expected):
        assert p.grad is None
        assert_close(p.main_grad, ref, DTYPE[device.type], "main_grad")
    # Without a hook the dummy stays as .grad and later ones add to it: still nothing.
    m2 = build(kind, device, accumulate_into_main_grad=True)
    for p in m2.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
    run(m2, device)
    run(m2, device)
    for p in weight_params(m2):
        assert p.grad.is_sparse and p.grad._nnz() == 0


def test_fsdp_parameters_get_their_main_grad_from_get_main_grad(device):
    m = build("linear", device, accumulate_into_main_grad=True)
    buckets = {}
    for p in m.parameters():
        p.__fsdp_param__ = True
        buckets[id(p)] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.get_main_grad = lambda p=p: buckets[id(p)]
    run(m, device)
    assert buckets[id(m.weight)].abs().sum() > 0


def test_missing_or_bad_main_grad_is_a_clear_error(device):
    m = build("linear", device, accumulate_into_main_grad=True)
    with pytest.raises(RuntimeError, match="has no main_grad"):
        run(m, device)
    m.weight.main_grad = torch.zeros(m.weight.shape, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="float32"):
        run(m, device)
    m.weight.main_grad = torch.zeros(m.weight.shape[::-1], dtype=torch.float32, device=device).transpose(0, 2)
    with pytest.raises(ValueError, match="contiguous"):
        run(m, device)


def test_delayed_wgrads_accumulate_across_microbatches(device):
    m = build("mlp", device, delay_wgrad_compute=True)
    run(m, device, seed=1)
    run(m, device, seed=2)
    m.backward_dw()
    ref = build("mlp", device)
    run(ref, device, seed=1)
    run(ref, device, seed=2)
    for p, q in zip(weight_params(m), weight_params(ref)):
        assert_close(p.grad, q.grad, DTYPE[device.type], "two microbatches")


@pytest.mark.parametrize("layout", ["packed", "per-expert"])
def test_modules_match_plain_pytorch(device, layout):
    dtype = DTYPE[device.type]
    splits_list, T = ROUTINGS["mixed"]
    G = len(splits_list)
    torch.manual_seed(0)
    mlp = me.GroupedMLP(G, 32, 32, bias=True, glu_layout="blocks:16", layout=layout, device=device, dtype=dtype)
    x = torch.randn(T, 32, dtype=dtype, device=device)
    p = torch.rand(T, device=device)
    y = mlp(x, make_splits(splits_list, device), p)

    def stacked(ps):
        return torch.stack(ps) if len(ps) > 1 else ps[0]

    ref = expert_mlp_ref(x.double(), stacked(mlp.fc1.weights()).double(), stacked(mlp.fc2.weights()).double(),
                         splits_list, p.double(), stacked(mlp.fc1.biases()).double(),
                         stacked(mlp.fc2.biases()).double(), "blocks:16", "swiglu", storage=dtype)
    rows = sum(splits_list)
    assert_close(y[:rows], ref[:rows], dtype, "GroupedMLP")
    lin = me.GroupedLinear(G, 32, 8, bias=True, scale_bias=True, layout=layout, device=device, dtype=dtype)
    y = lin(x, make_splits(splits_list, device), p)
    ref = grouped_linear_ref(x, stacked(lin.weights()), splits_list, stacked(lin.biases()), p)
    assert_close(y[:rows], ref[:rows], dtype, "GroupedLinear")


def test_state_dict_round_trips_across_layouts(device):
    packed = build("linear", device, layout="packed")
    per_expert = build("linear", device, layout="per-expert")
    sd = packed.state_dict()
    assert set(sd) == {"weight", "bias"}
    per_expert.load_state_dict(sd)  # packed checkpoint -> per-expert module (split)
    assert set(per_expert.state_dict()) == {f"weight{g}" for g in range(4)} | {f"bias{g}" for g in range(4)}
    for g in range(4):
        assert torch.equal(getattr(per_expert, f"weight{g}"), packed.weight[g])
    again = build("linear", device, layout="packed")
    again.weight.data.zero_()
    again.load_state_dict(per_expert.state_dict())  # per-expert checkpoint -> packed module (stack)
    assert torch.equal(again.weight, packed.weight) and torch.equal(again.bias, packed.bias)
    # The [G*N, K] form splits into G equal chunks.
    flat = {"weight": packed.weight.reshape(-1, 32), "bias": packed.bias.reshape(-1)}
    per_expert.load_state_dict(flat)
    assert torch.equal(per_expert.weight3, packed.weight[3])
    with pytest.raises(RuntimeError, match="cannot split"):
        per_expert.load_state_dict({"weight": torch.zeros(5, 32), "bias": packed.bias})
    # TransformerEngine's single grouped parameter [G*N, K] loads into a packed module too.
    again.weight.data.zero_()
    again.bias.data.zero_()
    again.load_state_dict(flat)
    assert torch.equal(again.weight, packed.weight) and torch.equal(again.bias, packed.bias)
    # Experts that disagree: named.
    bad = per_expert.state_dict()
    bad["weight1"] = torch.zeros(48, 31, dtype=bad["weight0"].dtype, device=device)
    with pytest.raises(RuntimeError, match=r"checkpoint key 'weight1' is \[48, 31\] .*but 'weight0' is \[48, 32\]"):
        again.load_state_dict(bad)


def test_a_checkpoint_missing_an_expert_names_it(device):
    packed = me.GroupedMLP(4, 16, 8, bias=True, device=device, dtype=torch.float32)
    per_expert = me.GroupedMLP(4, 16, 8, bias=True, layout="per-expert", device=device, dtype=torch.float32)
    sd = per_expert.state_dict()
    del sd["fc1.weight2"]
    for module in (packed, per_expert):
        with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: [^\n]*"fc1.weight2"'):
            module.load_state_dict(sd)
        assert "fc1.weight2" in module.load_state_dict(sd, strict=False).missing_keys
    # Nested in a model, the expert is named too.
    model = torch.nn.ModuleDict({"mlp": packed})
    with pytest.raises(RuntimeError, match=r'"mlp.fc1.weight2"'):
        model.load_state_dict({f"mlp.{k}": v for k, v in sd.items()})


def test_input_of_another_dtype_or_device_names_the_module_setting(device):
    mlp = me.GroupedMLP(2, 16, 8, device=device)  # the default dtype: bfloat16
    lin = me.GroupedLinear(2, 16, 8, device=device)
    x = torch.zeros(4, 16, dtype=torch.float32, device=device)
    s = make_splits([2, 2], device)
    for module, name in ((mlp, "GroupedMLP"), (lin, "GroupedLinear")):
        with pytest.raises(ValueError, match=rf"{name}: x is torch.float32 but the module's parameters are "
                                             r"torch.bfloat16; pass x.to\(torch.bfloat16\), or build the module "
                                             r"with dtype=torch.float32"):
            module(x, s)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="x is on cpu but the module's parameters are on cuda"):
            mlp(torch.zeros(4, 16, dtype=torch.bfloat16), s.cpu())


def test_bad_module_arguments_and_checkpoints_are_named(device):
    with pytest.raises(ValueError, match=r"dtype must be a floating-point dtype .*, got torch.int64"):
        me.GroupedLinear(2, 16, 16, device=device, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"G \(num_groups\) must be an integer, got float 2.0"):
        me.GroupedLinear(2.0, 16, 16, device=device)
    with pytest.raises(ValueError, match=r"GroupedMLP: limit must be > 0"):
        me.GroupedMLP(2, 16, 32, limit=-5.0, device=device)
    with pytest.raises(ValueError, match=r"GroupedMLP: alpha and offset must be finite"):
        me.GroupedMLP(2, 16, 32, alpha=float("nan"), device=device)
    with pytest.raises(TypeError, match=r"mark_not_offload: expected tensors, got int"):
        me.mark_not_offload(3)
    # A checkpoint value that is no tensor: torch's own message, naming the key.
    with pytest.raises(RuntimeError, match=r'While copying the parameter named "weight", expected torch.Tensor'):
        me.GroupedLinear(2, 16, 16, device=device).load_state_dict({"weight": [[0.0]]})
    # glu_from with an FC1 of the wrong rows: the key and what was expected.
    m = me.GroupedMLP(2, 16, 32, glu_layout="pairs", device=device, dtype=torch.float32)
    bad = {**m.state_dict(), "fc1.weight": torch.zeros(2, 60, 16, device=device)}
    with pytest.raises(ValueError, match=r"GroupedMLP.load_state_dict: fc1.weight: \[2, 60, 16\] does not hold FC1 rows "
                                         r"of 2F = 64 .*expected the module's \[2, 64, 16\]"):
        m.load_state_dict(bad, glu_from="halves")


def test_mlp_checkpoint_glu_layout_conversion(device):
    """A Megatron checkpoint (FC1 rows in halves) loads into a pairs module and computes the same."""
    halves = me.GroupedMLP(2, 32, 16, bias=True, glu_layout="halves", device=device, dtype=DTYPE[device.type])
    pairs = me.GroupedMLP(2, 32, 16, bias=True, glu_layout="pairs", layout="per-expert", device=device,
                          dtype=DTYPE[device.type])
    pairs.load_state_dict(halves.state_dict(), glu_from="halves")
    x = torch.randn(20, 32, dtype=DTYPE[device.type], device=device)
    s = make_splits([12, 8], device)
    assert_close(pairs(x, s), halves(x, s), DTYPE[device.type], "halves vs pairs")


@pytest.mark.parametrize("activation", ["srelu", "gelu_tanh"])
def test_non_gated_mlp_module(device, activation):
    """FC1 of F rows; the module matches plain PyTorch; its state dict round-trips; a GLU layout
    (in the constructor or as glu_from) is refused; the repr names no GLU layout."""
    dtype = DTYPE[device.type]
    torch.manual_seed(13)
    splits_list, T = ROUTINGS["mixed"]
    G, H, F = len(splits_list), 32, 24
    mlp = me.GroupedMLP(G, H, F, bias=True, activation=activation, layout="per-expert", device=device, dtype=dtype)
    assert mlp.fc1.weights()[0].shape == (F, H) and mlp.fc1.biases()[0].shape == (F,)
    assert "glu_layout" not in repr(mlp) and activation in repr(mlp)
    x = torch.randn(T, H, dtype=dtype, device=device, requires_grad=True)
    p = torch.rand(T, device=device, requires_grad=True)
    splits = make_splits(splits_list, device)
    y = mlp(x, splits, p)
    dy = torch.randn(T, H, dtype=dtype, device=device)
    y.backward(dy)

    def stacked(ps):
        return torch.stack([t.detach() for t in ps]).double().requires_grad_(True)

    w1, b1, w2, b2 = (stacked(ps) for ps in (mlp.fc1.weights(), mlp.fc1.biases(), mlp.fc2.weights(), mlp.fc2.biases()))
    x64, p64 = x.detach().double().requires_grad_(True), p.detach().double().requires_grad_(True)
    ref = expert_mlp_ref(x64, w1, w2, splits_list, p64, b1, b2, "halves", activation, storage=dtype)
    ref.backward(dy.double())
    rows = sum(splits_list)
    assert_close(y[:rows], ref[:rows], dtype, "y")
    assert_close(x.grad[:rows], x64.grad[:rows], dtype, "dx")
    assert_close(p.grad[:rows], p64.grad[:rows], dtype, "dprobs")
    assert_close(torch.stack([t.grad for t in mlp.fc1.weights()]), w1.grad, dtype, "dW1")
    assert_close(torch.stack([t.grad for t in mlp.fc2.weights()]), w2.grad, dtype, "dW2")
    assert_close(torch.stack([t.grad for t in mlp.fc1.biases()]), b1.grad, dtype, "db1")

    packed = me.GroupedMLP(G, H, F, bias=True, activation=activation, device=device, dtype=dtype)
    packed.load_state_dict(mlp.state_dict())
    assert torch.equal(packed.fc1.weights()[0], torch.stack(mlp.fc1.weights()))
    with pytest.raises(ValueError, match=f"glu_from = 'halves' given, but the module's activation {activation} is "
                                         r"not gated \(FC1's rows have no GLU layout\)"):
        packed.load_state_dict(mlp.state_dict(), glu_from="halves")
    with pytest.raises(ValueError, match=f"GroupedMLP: GLU layout pairs given for {activation}, which is not gated"):
        me.GroupedMLP(G, H, F, activation=activation, glu_layout="pairs", device=device, dtype=dtype)


def test_compile_of_a_module_forward(device):
    m = build("mlp", device)
    x = torch.randn(40, 32, dtype=DTYPE[device.type], device=device)
    s, p = make_splits([9, 0, 1, 23], device), torch.rand(40, device=device)
    eager = m(x, s, p)
    compiled = torch.compile(m, backend="aot_eager")(x, s, p)
    assert torch.equal(compiled, eager)


def test_contract_holds_under_saved_tensor_hooks(device):
    """Saved-tensor hooks (activation offload is one) may hand back other Python objects than the
    parameters that were saved; main_grad and the flags still land on the module's parameters."""
    m = build("mlp", device, accumulate_into_main_grad=True)
    attach_ddp(m, with_flag=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
        run(m, device)
    for p in weight_params(m):
        assert p.grad_added_to_main_grad and p.main_grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_frozen_parameters_get_no_gradient(device, kind):
    expected = plain_wgrads(kind, device, "packed")
    m = build(kind, device)
    frozen = weight_params(m)[0]
    frozen.requires_grad_(False)
    run(m, device)
    assert frozen.grad is None
    for p, ref in zip(weight_params(m)[1:], expected[1:]):
        assert torch.equal(p.grad.float(), ref)
    assert all(b.grad is not None for b in m.parameters() if b.dim() == 2)  # the biases (packed [G, N])


# GroupedMLP options under which its bf16 backward runs as two autograd nodes (FC2's, then FC1's),
# and those that keep one node; the two must give the one node's bits.
TWO_NODE_CASES = [
    ("plain", {}, {}),
    ("per_expert_no_bias", dict(layout="per-expert", bias=False), {}),
    ("main_grad", dict(accumulate_into_main_grad=True), {}),
    ("x_without_grad", {}, dict(x_grad=False)),
    ("probs_without_grad", {}, dict(probs_grad=False)),
    ("fc1_frozen", {}, dict(frozen="fc1")),
    ("fc2_frozen", {}, dict(frozen="fc2")),
    ("only_fc1_grads", {}, dict(frozen="fc2", probs_grad=False)),
    ("fusion_all", dict(fusion="all"), {}),
]


@pytest.mark.parametrize("name,opts,how", TWO_NODE_CASES, ids=[c[0] for c in TWO_NODE_CASES])
def test_two_node_backward_equals_the_one_node(device, monkeypatch, name, opts, how):
    """The MLP's backward as two autograd nodes (FC2's weight gradient handed to autograd before
    FC1's exists) gives the one node's output and gradients bit for bit, in every contract mode; y
    is no view (in-place use of it stays allowed)."""
    import moe_engine.torch.modules as modules

    outs, two_node_names = [], []
    for two in (True, False):
        if not two:
            monkeypatch.setattr(modules, "_mlp_two_nodes", lambda *a: False)
        m = build("mlp", device, **opts) if "bias" not in opts else me.GroupedMLP(
            4, 32, 16, activation="clamped_qgeglu", glu_layout="pairs", device=device, dtype=DTYPE[device.type],
            **opts)
        if opts.get("accumulate_into_main_grad"):
            attach_ddp(m, with_flag=True)
        if how.get("frozen"):
            getattr(m, how["frozen"]).requires_grad_(False)
        torch.manual_seed(5)
        T = 40
        x = torch.randn(T, 32, dtype=DTYPE[device.type], device=device, requires_grad=how.get("x_grad", True))
        probs = torch.rand(T, device=device, requires_grad=how.get("probs_grad", True))
        y = m(x, make_splits([9, 0, 1, 23], device), probs)
        assert y._base is None
        two_node_names.append(type(y.grad_fn).__name__)
        y.mul_(1.5)  # in-place on the output: allowed on either path
        y.backward(torch.randn_like(y))
        grads = [x.grad, probs.grad] + [getattr(p, "main_grad", None) if opts.get("accumulate_into_main_grad")
                                        else p.grad for p in m.parameters()]
        outs.append([y.detach()] + grads)
    expect_two = how.get("frozen") != "fc2" or how.get("probs_grad", True)
    assert ("Fc2Function" in two_node_names[0]) == expect_two, two_node_names
    assert "Fc2Function" not in two_node_names[1]
    for i, (a, b) in enumerate(zip(*outs)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), i


def test_two_node_backward_hands_fc2s_weight_gradient_on_before_fc1s_node(device):
    """FC2's weight gradient reaches .grad (its buffer freed) before FC1's node runs, so the two
    weight gradients never coexist: what the two nodes are for."""
    m = build("mlp", device)
    order = []
    for name, p in (("fc2.weight", m.fc2.weight), ("fc1.weight", m.fc1.weight)):
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    x = torch.randn(40, 32, dtype=DTYPE[device.type], device=device, requires_grad=True)
    y = m(x, make_splits([9, 0, 1, 23], device), torch.rand(40, device=device, requires_grad=True))
    fc1_node = next(n for n, _ in y.grad_fn.next_functions if n is not None and "Fc1Function" in type(n).__name__)
    fc1_node.register_prehook(lambda grads: order.append("FC1's node"))
    y.backward(torch.randn_like(y))
    assert order == ["fc2.weight", "FC1's node", "fc1.weight"], order


def test_delayed_wgrad_runs_only_the_two_weight_gradients(device, monkeypatch):
    """backward keeps dL/dh and FC2's input for the delayed weight gradients, so backward_dw runs the
    two wgrad GEMMs alone: no second pass of FC2's dgrad and the activation's backward."""
    from moe_engine import _C

    calls = {"expert_mlp_backward": 0, "grouped_linear_wgrad": 0}
    for name in calls:
        real = getattr(_C, name)

        def counted(*args, name=name, real=real):
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(_C, name, counted)
    m = build("mlp", device, delay_wgrad_compute=True)
    run(m, device)
    assert calls == {"expert_mlp_backward": 1, "grouped_linear_wgrad": 0}
    m.backward_dw()
    assert calls == {"expert_mlp_backward": 1, "grouped_linear_wgrad": 2}
