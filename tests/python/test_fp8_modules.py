"""FP8 in the modules and the functional API: GroupedLinear / GroupedMLP with ``fp8_recipe`` and
``expert_mlp_fp8``, on the CPU backend and (where a GPU is visible) on CUDA.

- Outputs and every gradient against the float64 MLP / grouped linear of the unquantized inputs
  (DeepGEMM's similarity difference, the C++ suites' bound), and loosely against the bf16 modules;
  empty and 1-row experts, G = 1, a tail of rows no expert owns (zeros in y, dx, dprobs).
- ``override_linear_precision``: each overridden GEMM gives the unquantized module's result bit for
  bit; GroupedMLP with overrides is GroupedLinear's FP8 layers around the activation, bit for bit.
- The training contract: the six main_grad rows, delayed wgrad, packed == per-expert bit for bit.
- The weight cache: one quantization across micro-batches, again after an optimizer step, an
  ``invalidate_fp8_weights()``, a new address; what backward keeps is FP8: x's columns, or its rows
  where the columns would be more than twice their bytes (many small experts); the MLP tests run
  both forms.
- One routing per layer per step, torch.compile of a module step, opcheck of the new ops.
- Saved tensors through a byte-copy round trip (what offload does), and on the GPU: a captured
  module step replayed with new routings and weights, ActivationOffload of FP8 layers.
"""

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine.torch as me
from moe_engine import _C
from moe_engine.torch import fp8 as fp8_impl
from moe_engine.torch import offload as offload_impl
from reference import (assert_close, assert_similar, attach_ddp, expert_mlp_ref, grouped_linear_ref, make_splits,
                       needs_fp8_gemm, similarity_diff)

E4M3 = torch.float8_e4m3fn
ops = torch.ops.moe_engine

# DeepGEMM's similarity difference against the float64 result of the unquantized inputs
# (tests/cpp/fp8_mlp_support.hpp): the MLP's outputs end chains of two to four quantized GEMMs
# (measured 1.3e-3 to 3.4e-3 here); one GEMM of two quantized operands shows about 6.7e-4. A wrong
# scale, block, expert or operand gives 1e-1 and more.
MLP_BOUND = 5e-3
LINEAR_BOUND = 2e-3

# (splits, T, H, F): empty and 1-row experts with a tail no expert owns, G = 1, experts past one
# 128-token tile with F off a multiple of 128, every expert empty, many experts of few tokens (0 to
# 3 each: x's columns would be 33 times its rows' bytes).
CASES = {
    "mixed": ([37, 0, 1, 150], 200, 128, 128),
    "g1": ([45], 50, 256, 128),
    "off_tiles": ([129, 3, 120], 260, 128, 192),
    "all_empty": ([0, 0, 0], 9, 128, 64),
    "many_small": ([0, 3, 2, 1] * 8, 64, 128, 128),
    "srelu": ([37, 0, 1, 150], 200, 128, 128),
    "gelu_tanh": ([129, 3, 120], 260, 128, 192),
}
GLU = {"mixed": ("swiglu", "blocks:32"), "g1": ("clamped_qgeglu", "pairs"), "off_tiles": ("swiglu", "halves"),
       "all_empty": ("swiglu", "halves"), "many_small": ("swiglu", "pairs"), "srelu": ("srelu", "halves"),
       "gelu_tanh": ("gelu_tanh", "halves")}  # the non-gated activations: FC1 of F rows
# (case, x_form) of the MLP tests that run both forms of x kept (force_x_form): the columns forced
# on a case whose rule keeps rows, and the rule on the many small experts' case.
FORM_CASES = [("mixed", "columns"), ("mixed", "rule"), ("many_small", "rule")]
FORM_IDS = ["mixed-columns", "mixed-rows", "many_small-rows"]
DTYPES = [torch.bfloat16, torch.float32]
CONTRACT_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}


def force_x_form(monkeypatch, form):
    """What the FP8 MLP keeps of x for FC1's weight gradient: ``rule`` as
    ``expert_mlp_fp8_keeps_x_rows(T, G)`` says (rows for every case above: their experts are small
    next to the 128-token column tiles), or ``columns`` / ``rows`` forced."""
    if form != "rule":
        monkeypatch.setattr(fp8_impl, "expert_mlp_fp8_keeps_x_rows", lambda T, G: form == "rows")


def stacked(params):
    return torch.stack([p.detach() for p in params]) if len(params) > 1 else params[0].detach()


def inputs(T, H, dtype, device, seed, out_features=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype).requires_grad_()
    p = (torch.rand(T, generator=g) * 0.95 + 0.05).to(device).requires_grad_()
    dy = torch.randn(T, out_features or H, generator=g).to(device, dtype)
    return x, p, dy


def mlp(G, H, F, device, dtype, recipe=me.Fp8Recipe(), seed=0, activation="swiglu", glu_layout="halves", **opt):
    torch.manual_seed(seed)
    m = me.GroupedMLP(G, H, F, bias=True, activation=activation, glu_layout=glu_layout, fp8_recipe=recipe,
                      device=device, dtype=dtype, **opt)
    with torch.no_grad():  # biases of the size the C++ suites use, so that their gradients count
        for b in m.fc1.biases() + m.fc2.biases():
            b.uniform_(-0.5, 0.5)
    return m


def linear(G, K, N, device, dtype, recipe=me.Fp8Recipe(), seed=0, **opt):
    torch.manual_seed(seed)
    m = me.GroupedLinear(G, K, N, bias=True, scale_bias=True, fp8_recipe=recipe, device=device, dtype=dtype, **opt)
    with torch.no_grad():
        for b in m.biases():
            b.uniform_(-0.5, 0.5)
    return m


def mlp_step(m, x, p, dy, splits):
    """Forward + backward; returns y, dx, dprobs and the parameters' gradients (packed per weight)."""
    x = x.detach().requires_grad_()
    p = p.detach().requires_grad_()
    y = m(x, splits, p)
    y.backward(dy)
    m.backward_dw()
    grads = [stacked([q.grad for q in ps]) for ps in (m.fc1.weights(), m.fc1.biases(), m.fc2.weights(),
                                                       m.fc2.biases())]
    return [y.detach(), x.grad, p.grad] + grads


def mlp_float64(m, x, p, dy, splits_list, glu_layout, activation):
    """The float64 MLP of the unquantized inputs and m's parameters: y, dx, dprobs, dw1, db1, dw2, db2
    (mlp_step's order)."""
    ref_in = [t.detach().cpu().double().requires_grad_() for t in
              (x, stacked(m.fc1.weights()), stacked(m.fc2.weights()), p, stacked(m.fc1.biases()),
               stacked(m.fc2.biases()))]
    ref_y = expert_mlp_ref(*ref_in[:3], splits_list, *ref_in[3:], glu_layout, activation)
    ref_y.backward(dy.cpu().double())
    return [ref_y, ref_in[0].grad, ref_in[3].grad, ref_in[1].grad, ref_in[4].grad, ref_in[2].grad, ref_in[5].grad]


def linear_step(m, x, p, dy, splits):
    x = x.detach().requires_grad_()
    p = p.detach().requires_grad_()
    y = m(x, splits, p)
    y.backward(dy)
    m.backward_dw()
    return [y.detach(), x.grad, p.grad, stacked([q.grad for q in m.weights()]), stacked([q.grad for q in m.biases()])]


# ---- accuracy ----


@pytest.mark.parametrize("x_form", ["columns", "rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_mlp_matches_the_float64_mlp(device, case, dtype, x_form, monkeypatch):
    """Either form of x kept for FC1's weight gradient (rows: backward makes the columns from them,
    a second rounding of x) gives every result within the bound."""
    needs_fp8_gemm(device)
    force_x_form(monkeypatch, x_form)
    splits_list, T, H, F = CASES[case]
    activation, glu_layout = GLU[case]
    rows = sum(splits_list)
    m = mlp(len(splits_list), H, F, device, dtype, activation=activation, glu_layout=glu_layout)
    x, p, dy = inputs(T, H, dtype, device, seed=1)
    got = mlp_step(m, x, p, dy, make_splits(splits_list, device))
    y, dx, dp = got[:3]
    want = mlp_float64(m, x, p, dy, splits_list, glu_layout, activation)
    names = ["y", "dx", "dprobs", "dw1", "db1", "dw2", "db2"]
    for name, a, b in zip(names, got, want):
        if name in ("y", "dx", "dprobs"):
            a, b = a[:rows], b[:rows]
        assert_similar(a, b, MLP_BOUND, name)
    # rows no expert owns: exactly zero
    assert torch.all(y[rows:] == 0) and torch.all(dx[rows:] == 0) and torch.all(dp[rows:] == 0)
    assert y.dtype == dtype and dx.dtype == dtype and got[3].dtype == dtype
    if rows == 0:
        assert all(torch.all(t == 0) for t in got)


def test_the_bound_tells_a_wrong_result_apart(device):
    """The similarity bound fails an FP8 result compared with a slightly wrong computation (two
    experts' FC2 weights swapped): the checks above can fail."""
    needs_fp8_gemm(device)
    splits_list, T, H, F = CASES["mixed"]
    m = mlp(4, H, F, device, torch.bfloat16, glu_layout="blocks:32")
    x, p, dy = inputs(T, H, torch.bfloat16, device, seed=1)
    y = m(x.detach(), make_splits(splits_list, device), p.detach())
    w2 = m.fc2.weight.detach().cpu().double()[[0, 1, 3, 2]]
    wrong = expert_mlp_ref(x.detach().cpu().double(), m.fc1.weight.detach().cpu().double(), w2, splits_list,
                           p.detach().cpu().double(), m.fc1.bias.detach().cpu().double(),
                           m.fc2.bias.detach().cpu().double(), "blocks:32", "swiglu")
    assert similarity_diff(y[:188], wrong[:188]) > 20 * MLP_BOUND


OVERRIDES = [(False, False, False), (True, False, False), (False, True, False), (False, False, True),
             (True, True, True)]


@pytest.mark.parametrize("override", OVERRIDES, ids=["fp8", "fprop-hp", "dgrad-hp", "wgrad-hp", "all-hp"])
@pytest.mark.parametrize("case", ["mixed", "g1", "all_empty"])
def test_linear_matches_float64_and_overrides_run_unquantized(device, case, override):
    """Every output and gradient within FP8's error of the float64 grouped linear; a GEMM the
    recipe overrides gives the unquantized module's result bit for bit."""
    needs_fp8_gemm(device)
    splits_list, T, K, N = CASES[case]
    dtype = torch.bfloat16
    rows = sum(splits_list)
    splits = make_splits(splits_list, device)
    G = len(splits_list)
    m = linear(G, K, N, device, dtype, recipe=me.Fp8Recipe(override_linear_precision=override))
    plain = linear(G, K, N, device, dtype, recipe=None)
    x, p, dy = inputs(T, K, dtype, device, seed=2, out_features=N)
    got = linear_step(m, x, p, dy, splits)
    unquantized = linear_step(plain, x, p, dy, splits)
    ref_in = [t.detach().cpu().double().requires_grad_() for t in (x, m.weight, m.bias, p)]
    ref_y = grouped_linear_ref(ref_in[0], ref_in[1], splits_list, ref_in[2], ref_in[3])
    ref_y.backward(dy.cpu().double())
    want = [ref_y, ref_in[0].grad, ref_in[3].grad, ref_in[1].grad, ref_in[2].grad]
    for name, a, b in zip(["y", "dx", "dscales", "dw", "db"], got, want):
        if name in ("y", "dx", "dscales"):
            assert torch.all(a[rows:] == 0), f"{name}: rows past sum(splits)"
            a, b = a[:rows], b[:rows]
        assert_similar(a, b, LINEAR_BOUND, name)
    # the bias and row-scale gradients read dy unquantized, whatever the recipe
    assert torch.equal(got[4], unquantized[4]) and torch.equal(got[2], unquantized[2])
    fprop_hp, dgrad_hp, wgrad_hp = override
    for name, hp, a, b in (("y", fprop_hp, got[0], unquantized[0]), ("dx", dgrad_hp, got[1], unquantized[1]),
                           ("dw", wgrad_hp, got[3], unquantized[3])):
        if hp:
            assert torch.equal(a, b), f"{name}: an overridden GEMM runs unquantized"
        elif rows:
            assert not torch.equal(a, b), f"{name}: expected the FP8 GEMM"


@pytest.mark.parametrize("delayed", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("override", OVERRIDES[1:], ids=["fprop-hp", "dgrad-hp", "wgrad-hp", "all-hp"])
@pytest.mark.parametrize("case", ["mixed", "g1", "srelu"])
def test_mlp_overrides_are_two_fp8_linear_layers(device, case, override, delayed):
    """A recipe that runs some GEMMs unquantized: GroupedMLP gives what GroupedLinear's FP8 layers
    with the same recipe and weights give around the activation (FC1 with b1, the activation times
    p, FC2 with b2 scaled by p) bit for bit, delayed wgrad included, and every result within FP8's
    error of the float64 MLP."""
    needs_fp8_gemm(device)
    splits_list, T, H, F = CASES[case]
    activation, glu_layout = GLU[case]
    G, rows, dtype = len(splits_list), sum(splits_list), torch.bfloat16
    recipe = me.Fp8Recipe(override_linear_precision=override)
    m = mlp(G, H, F, device, dtype, recipe=recipe, activation=activation, glu_layout=glu_layout,
            delay_wgrad_compute=delayed)
    splits = make_splits(splits_list, device)
    x, p, dy = inputs(T, H, dtype, device, seed=4)
    got = mlp_step(m, x, p, dy, splits)

    W = m.fc1.weights()[0].shape[-2]
    fc1 = me.GroupedLinear(G, H, W, bias=True, fp8_recipe=recipe, device=device, dtype=dtype)
    fc2 = me.GroupedLinear(G, F, H, bias=True, scale_bias=True, fp8_recipe=recipe, device=device, dtype=dtype)
    with torch.no_grad():
        for mine, theirs in ((fc1.weights() + fc1.biases(), m.fc1.weights() + m.fc1.biases()),
                             (fc2.weights() + fc2.biases(), m.fc2.weights() + m.fc2.biases())):
            for a, b in zip(mine, theirs):
                a.copy_(b)
    xx, pp = x.detach().requires_grad_(), p.detach().requires_grad_()
    act = me.glu(fc1(xx, splits), splits, pp, activation=activation, layout=glu_layout)
    y = fc2(act, splits, pp)
    y.backward(dy)
    want = [y.detach(), xx.grad, pp.grad] + [stacked(g) for g in (
        [q.grad for q in fc1.weights()], [q.grad for q in fc1.biases()], [q.grad for q in fc2.weights()],
        [q.grad for q in fc2.biases()])]
    names = ["y", "dx", "dprobs", "dw1", "db1", "dw2", "db2"]
    for name, a, b in zip(names, got, want):
        assert torch.equal(a, b), f"{name}: not the two FP8 layers' result"

    ref = mlp_float64(m, x, p, dy, splits_list, glu_layout, activation)
    for name, a, b in zip(names, got, ref):
        if name in ("y", "dx", "dprobs"):
            assert torch.all(a[rows:] == 0), f"{name}: rows past sum(splits)"
            a, b = a[:rows], b[:rows]
        assert_similar(a, b, MLP_BOUND, name)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_fp8_modules_are_close_to_the_bf16_modules(device, kind):
    needs_fp8_gemm(device)
    splits_list, T, H, F = CASES["off_tiles"]
    splits = make_splits(splits_list, device)
    dtype = torch.bfloat16
    if kind == "mlp":
        fp8_m, bf16_m, step = mlp(3, H, F, device, dtype), mlp(3, H, F, device, dtype, recipe=None), mlp_step
        x, p, dy = inputs(T, H, dtype, device, seed=3)
    else:
        fp8_m, bf16_m, step = linear(3, H, F, device, dtype), linear(3, H, F, device, dtype, recipe=None), linear_step
        x, p, dy = inputs(T, H, dtype, device, seed=3, out_features=F)
    for i, (a, b) in enumerate(zip(step(fp8_m, x, p, dy, splits), step(bf16_m, x, p, dy, splits))):
        assert_similar(a, b, 1e-2, f"output {i}")


# ---- the functional form ----


@pytest.mark.parametrize("case, x_form", FORM_CASES, ids=FORM_IDS)
def test_functional_expert_mlp_fp8_matches_the_module(device, case, x_form, monkeypatch):
    """expert_mlp_fp8 over master weights (quantized in the call) or over Fp8Weights with their
    masters gives the module's results bit for bit; an Fp8Weight without a master gets no gradient."""
    needs_fp8_gemm(device)
    force_x_form(monkeypatch, x_form)
    splits_list, T, H, F = CASES[case]
    splits = make_splits(splits_list, device)
    recipe = me.Fp8Recipe(pow2_scales=True, amax_epsilon=1e-6)
    m = mlp(len(splits_list), H, F, device, torch.bfloat16, recipe=recipe, glu_layout="blocks:32")
    x, p, dy = inputs(T, H, torch.bfloat16, device, seed=4)
    want = mlp_step(m, x, p, dy, splits)
    w1, b1, w2, b2 = [t.detach().clone().requires_grad_() for t in (m.fc1.weight, m.fc1.bias, m.fc2.weight,
                                                                     m.fc2.bias)]

    def call(fc1, fc2, **kw):
        xi, pi = x.detach().requires_grad_(), p.detach().requires_grad_()
        y = me.expert_mlp_fp8(xi, fc1, fc2, splits, pi, b1, b2, layout="blocks:32", recipe=recipe, **kw)
        y.backward(dy)
        return y.detach(), xi.grad, pi.grad

    got = call(w1, w2)
    assert all(torch.equal(a, b) for a, b in zip(got, want[:3]))
    assert torch.equal(w1.grad, want[3]) and torch.equal(b1.grad, want[4])
    assert torch.equal(w2.grad, want[5]) and torch.equal(b2.grad, want[6])
    for t in (w1, w2, b1, b2):
        t.grad = None
    w1_8 = me.quantize_fp8_weight(w1, pow2_scales=True, amax_epsilon=1e-6)
    w2_8 = me.quantize_fp8_weight(w2, pow2_scales=True, amax_epsilon=1e-6)
    got = call(w1_8, w2_8, fc1_master_weight=w1)
    assert all(torch.equal(a, b) for a, b in zip(got, want[:3]))
    assert torch.equal(w1.grad, want[3]) and w2.grad is None and torch.equal(b2.grad, want[6])
    # per-expert masters get per-expert gradients
    experts = [t.detach().clone().requires_grad_() for t in w2.unbind(0)]
    call(w1_8, experts)
    assert torch.equal(torch.stack([t.grad for t in experts]), want[5])


# ---- the training contract ----

ROWS = json.loads((Path(__file__).resolve().parent.parent / "data" / "grad_contract.json").read_text())["rows"]


def contract_module(kind, device, **opt):
    """kind: linear, mlp, or mlp-overrides (a bf16 wgrad: the MLP as two FP8 GroupedLinear layers)."""
    dtype = CONTRACT_DTYPE[device.type]
    if kind == "linear":
        return linear(4, 32, 48, device, dtype, seed=11, **opt)
    if kind == "mlp-overrides":
        opt["recipe"] = me.Fp8Recipe(override_linear_precision=(False, False, True))
    return mlp(4, 32, 16, device, dtype, seed=11, activation="clamped_qgeglu", glu_layout="pairs", **opt)


def contract_run(m, device, seed=5):
    g = torch.Generator().manual_seed(seed)
    dtype = CONTRACT_DTYPE[device.type]
    x = torch.randn(40, 32, generator=g).to(device, dtype).requires_grad_()
    probs = torch.rand(40, generator=g).to(device)
    y = m(x, make_splits([9, 0, 1, 23], device), probs)
    y.backward(torch.randn(y.shape, generator=g).to(device, dtype))
    return x


def weight_params(m):
    return m.fc1.weights() + m.fc2.weights() if isinstance(m, me.GroupedMLP) else m.weights()


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlp-overrides"])
@pytest.mark.parametrize("layout", ["packed", "per-expert"])
@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_every_row_of_the_gradient_contract(device, kind, layout, row):
    """The FP8 wgrad goes where the bf16 one goes: main_grad (accumulated or overwritten, float32),
    a delayed backward_dw, the dummy with grad_added_to_main_grad; what autograd gets follows the
    shared table."""
    needs_fp8_gemm(device)
    plain = contract_module(kind, device, layout=layout)
    contract_run(plain, device)
    expected = [p.grad.float().clone() for p in weight_params(plain)]
    into_main, delayed = row["main_grad"], row["delay"]
    m = contract_module(kind, device, layout=layout, accumulate_into_main_grad=into_main,
                        delay_wgrad_compute=delayed, overwrite_main_grad=row["overwrite"])
    weights = weight_params(m)
    ddp_log = attach_ddp(m, with_flag=row["flag"], zero_out=row["zero_out"]) if into_main else []
    if into_main:
        for p in weights:
            p.main_grad.fill_(1.0)
    fired = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append(True))
    seen = {}
    for p in weights:
        p.register_hook(lambda g, p=p: seen.__setitem__(id(p), g))
    contract_run(m, device)

    for p, ref in zip(weights, expected):
        got = seen.get(id(p))
        if row["handed_back"] == "grad":
            assert got is not None and torch.equal(got.float(), ref)
        elif row["handed_back"] == "none":
            assert got is None
        else:  # the dummy: all zeros, no entries
            assert got is not None and got.shape == p.shape and got.is_sparse and got._nnz() == 0
        assert hasattr(p, "grad_added_to_main_grad") == row["flag"]
        if row["flag"]:
            assert p.grad_added_to_main_grad == row["flag_after_backward"]
    m.backward_dw()
    assert len(fired) == (1 if delayed else 0)
    if into_main:
        assert len(ddp_log) == len(list(m.parameters()))
    dtype = CONTRACT_DTYPE[device.type]
    for p, ref in zip(weights, expected):
        if row["flag"]:
            assert p.grad_added_to_main_grad == row["flag_after_dw"]
        if into_main:
            base = 0.0 if row["mode"] == "overwrite" else 1.0
            assert_close(p.main_grad - base, ref, dtype, f"main_grad {row['name']}")
        elif delayed:
            assert torch.equal(p.grad.float(), ref)


@pytest.mark.parametrize("kind, x_form", [("linear", "rule"), ("mlp", "rule"), ("mlp", "columns")],
                         ids=["linear", "mlp-rows", "mlp-columns"])
def test_delayed_wgrads_across_microbatches_equal_immediate_ones(device, kind, x_form, monkeypatch):
    needs_fp8_gemm(device)
    force_x_form(monkeypatch, x_form)
    delayed = contract_module(kind, device, delay_wgrad_compute=True)
    immediate = contract_module(kind, device)
    for seed in (1, 2):
        xd = contract_run(delayed, device, seed)
        xi = contract_run(immediate, device, seed)
        assert torch.equal(xd.grad, xi.grad)
    assert all(p.grad is None for p in weight_params(delayed))
    delayed.backward_dw()
    for p, q in zip(delayed.parameters(), immediate.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("kind, case, x_form", [("linear", "mixed", "rule")] + [("mlp", *c) for c in FORM_CASES],
                         ids=["linear"] + [f"mlp-{i}" for i in FORM_IDS])
def test_per_expert_parameters_give_the_packed_results_bit_for_bit(device, kind, case, x_form, monkeypatch):
    needs_fp8_gemm(device)
    force_x_form(monkeypatch, x_form)
    splits_list, T, H, F = CASES[case]
    splits = make_splits(splits_list, device)
    dtype, G = torch.bfloat16, len(splits_list)
    if kind == "mlp":
        packed = mlp(G, H, F, device, dtype, glu_layout="blocks:32", accumulate_into_main_grad=True)
        per_expert = mlp(G, H, F, device, dtype, glu_layout="blocks:32", layout="per-expert",
                         accumulate_into_main_grad=True)
        x, p, dy = inputs(T, H, dtype, device, seed=6)
    else:
        packed = linear(G, H, F, device, dtype, accumulate_into_main_grad=True)
        per_expert = linear(G, H, F, device, dtype, layout="per-expert", accumulate_into_main_grad=True)
        x, p, dy = inputs(T, H, dtype, device, seed=6, out_features=F)
    per_expert.load_state_dict(packed.state_dict())
    results = []
    for m in (packed, per_expert):
        for q in m.parameters():
            q.main_grad = torch.zeros(q.shape, dtype=torch.float32, device=device)
        xi, pi = x.detach().requires_grad_(), p.detach().requires_grad_()
        y = m(xi, splits, pi)
        y.backward(dy)
        grads = [g for e in ([m.fc1, m.fc2] if kind == "mlp" else [m])
                 for g in (stacked([q.main_grad for q in e.weights()]), stacked([q.grad for q in e.biases()]))]
        results.append([y.detach(), xi.grad, pi.grad] + grads)
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"result {i}"


# ---- the weight cache ----


class CountQuantizations:
    """Counts the weight quantizations the modules' caches run."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = fp8_impl.quantize_fp8_weight

        def counting(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(fp8_impl, "quantize_fp8_weight", counting)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_weights_are_quantized_once_until_they_change(device, kind, monkeypatch):
    needs_fp8_gemm(device)
    splits_list, T, H, F = CASES["mixed"]
    splits = make_splits(splits_list, device)
    dtype = torch.bfloat16
    make = (lambda: mlp(4, H, F, device, dtype, glu_layout="blocks:32")) if kind == "mlp" else (
        lambda: linear(4, H, F, device, dtype))
    m = make()
    x, p, dy = inputs(T, H, dtype, device, seed=7, out_features=H if kind == "mlp" else F)
    step = mlp_step if kind == "mlp" else linear_step
    per_quantization = 2 if kind == "mlp" else 1
    counter = CountQuantizations(monkeypatch)

    def forward(module):
        return module(x.detach(), splits, p.detach()).detach()

    def fresh():
        """A module that never cached anything, with m's current weights."""
        other = make()
        other.load_state_dict(m.state_dict())
        return forward(other)

    for _ in range(3):  # micro-batches: forward + backward
        step(m, x, p, dy, splits)
    assert counter.count == per_quantization
    cached = m._fp8_weights[0].weight if kind == "mlp" else m._fp8_weight.weight
    addresses = [t.data_ptr() for t in (cached.data, cached.scales, cached.data_t, cached.scales_t)]
    assert not cached.data.requires_grad and getattr(cached.data, "_moe_weight", False)

    torch.optim.SGD(m.parameters(), lr=0.5).step()  # bumps every parameter's version counter
    counter.count = 0
    y = forward(m)
    assert counter.count == per_quantization
    assert [t.data_ptr() for t in (cached.data, cached.scales, cached.data_t, cached.scales_t)] == addresses
    counter.count = 0
    assert torch.equal(y, fresh())
    assert counter.count == per_quantization  # the fresh module's own
    counter.count = 0

    weight = weight_params(m)[0]
    weight.data.mul_(0.5)  # behind autograd's back: the version counter does not move
    assert torch.equal(forward(m), y) and counter.count == 0
    m.invalidate_fp8_weights()
    stale, y = y, forward(m)
    assert counter.count == per_quantization and not torch.equal(y, stale)
    assert torch.equal(y, fresh())

    counter.count = 0
    weight.data = weight.data.clone()  # a new address
    forward(m)
    assert counter.count == 1
    m.load_state_dict(m.state_dict())  # copies in place: the versions move
    counter.count = 0
    forward(m)
    assert counter.count == per_quantization


def test_a_weight_changed_between_forward_and_backward_is_an_error(device):
    """As in the bf16 modules: autograd's version check guards the weights that backward reads
    (the cache quantizes a changed weight in place)."""
    needs_fp8_gemm(device)
    m = contract_module("mlp", device)
    x = torch.randn(40, 32, device=device, dtype=CONTRACT_DTYPE[device.type], requires_grad=True)
    y = m(x, make_splits([9, 0, 1, 23], device))
    with torch.no_grad():
        m.fc2.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def saved_by(fn):
    """(dtype, shape) of every tensor autograd saves while fn runs, weights (parameters, cached
    quantized copies) left out."""
    saved = []

    def pack(t):
        if not offload_impl._is_weight(t):
            saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def kept_x_shapes(form, T, G, H):
    """(dtype, shape) of what the FP8 MLP keeps of x in ``form``."""
    if form == "rows":
        return [(E4M3, (T, H)), (torch.float32, ((H + 127) // 128, me.fp8_scales_pitch(T)))]
    C = me.fp8_columns_capacity(T, G)
    return [(E4M3, (H, C)), (torch.float32, (C // 128, H))]


# (splits, T, what the rule keeps of x): experts of 50 tokens on average next to 128-token column
# tiles (C = 768 > 2T), the boundary C = 2T (columns), many experts of 2 tokens (C = 4224 = 33 T).
KEPT_CASES = [([37, 0, 1, 150], 200, "rows"), ([200, 100], 320, "columns"), (CASES["many_small"][0], 64, "rows")]


@pytest.mark.parametrize("splits_list, T, form", KEPT_CASES, ids=["mixed", "boundary", "many_small"])
def test_backward_keeps_fp8_tensors_only(device, splits_list, T, form):
    """The MLP keeps the pre-activation's rows and x's columns, or x's rows where the columns would
    be more than twice their bytes (C++ expert_mlp_fp8_keeps_x_rows), all FP8 with float32 scales."""
    needs_fp8_gemm(device)
    H, F = 128, 128
    G, dtype = len(splits_list), torch.bfloat16
    assert _C.expert_mlp_fp8_keeps_x_rows(T, G) == (form == "rows")
    splits = make_splits(splits_list, device)
    x, p, _ = inputs(T, H, dtype, device, seed=8)
    m = mlp(G, H, F, device, dtype, glu_layout="blocks:32")
    kept = saved_by(lambda: m(x, splits, p))
    activations = [s for s in kept if s[0] != torch.int64]
    assert sorted(activations, key=str) == sorted(kept_x_shapes(form, T, G, H) + [
        (E4M3, (T, 2 * F)), (torch.float32, (2, me.fp8_scales_pitch(T))),  # the pre-activation's rows
    ], key=str)  # x and probs are the caller's leaves: held by autograd anyway, not counted
    # int64: splits and the routing's offsets [G + 1], and the columns' offsets [G + 1]
    assert sorted(s for dt, s in kept if dt == torch.int64) == [(G,)] + [(G + 1,)] * (2 if form == "columns" else 1)
    assert not any(dt == dtype for dt, _ in activations), "no 16-bit activation is kept"
    frozen = mlp(G, H, F, device, dtype, glu_layout="blocks:32")
    for q in frozen.fc1.weights():
        q.requires_grad_(False)
    kept = saved_by(lambda: frozen(x, splits, p))
    assert (E4M3, (T, 2 * F)) in kept and (E4M3, (H, me.fp8_columns_capacity(T, G))) not in kept
    assert kept.count((E4M3, (T, H))) == 0, "no FC1 wgrad: neither form of x"


def test_linear_keeps_x_columns(device):
    needs_fp8_gemm(device)
    splits_list, T, H, F = CASES["mixed"]
    G, dtype = len(splits_list), torch.bfloat16
    splits = make_splits(splits_list, device)
    C = me.fp8_columns_capacity(T, G)
    x, p, _ = inputs(T, H, dtype, device, seed=8)
    lin = linear(G, H, F, device, dtype)
    activations = [s for s in saved_by(lambda: lin(x, splits, p)) if s[0] != torch.int64]
    assert sorted(activations, key=str) == sorted([(E4M3, (H, C)), (torch.float32, (C // 128, H))], key=str)
    lin.fp8_recipe = me.Fp8Recipe(override_linear_precision=(False, False, True))  # wgrad reads x itself
    assert (dtype, (T, H)) in saved_by(lambda: lin(x * 1, splits, p))


def test_many_small_experts_keep_x_rows(device, monkeypatch):
    """G = 32 experts of 0 to 3 tokens: the module keeps x's rows (1/33 of the columns' bytes);
    every result within the bound of the float64 MLP, and all but FC1's weight gradient (the one
    that reads x's columns, here made from the rows) bit for bit those of a module that keeps the
    columns; delayed wgrads equal immediate ones."""
    needs_fp8_gemm(device)
    splits_list, T, H, F = CASES["many_small"]
    activation, glu_layout = GLU["many_small"]
    G, dtype, rows = len(splits_list), torch.bfloat16, sum(splits_list)
    assert fp8_impl.expert_mlp_fp8_keeps_x_rows(T, G) and _C.expert_mlp_fp8_keeps_x_rows(T, G)
    splits = make_splits(splits_list, device)
    x, p, dy = inputs(T, H, dtype, device, seed=15)

    def make(**opt):
        return mlp(G, H, F, device, dtype, activation=activation, glu_layout=glu_layout, **opt)

    m = make()
    kept = saved_by(lambda: m(x, splits, p))
    assert (E4M3, (T, H)) in kept and (torch.float32, (1, me.fp8_scales_pitch(T))) in kept
    assert not any(s == (H, me.fp8_columns_capacity(T, G)) for _, s in kept), "no x columns"
    got = mlp_step(m, x, p, dy, splits)

    want = mlp_float64(m, x, p, dy, splits_list, glu_layout, activation)
    names = ["y", "dx", "dprobs", "dw1", "db1", "dw2", "db2"]
    for name, a, b in zip(names, got, want):
        if name in ("y", "dx", "dprobs"):
            assert torch.all(a[rows:] == 0), f"{name}: rows past sum(splits)"
            a, b = a[:rows], b[:rows]
        assert_similar(a, b, MLP_BOUND, name)

    delayed = make(delay_wgrad_compute=True)
    assert all(torch.equal(a, b) for a, b in zip(mlp_step(delayed, x, p, dy, splits), got)), "delayed"

    force_x_form(monkeypatch, "columns")
    columns = mlp_step(make(), x, p, dy, splits)
    for name, a, b in zip(names, got, columns):
        if name == "dw1":
            assert_similar(a, b, MLP_BOUND, "dw1 of the rows against dw1 of the columns")
        else:
            assert torch.equal(a, b), f"{name}: does not read x's columns"


@pytest.mark.parametrize("kind, x_form", [("linear", "rule"), ("mlp", "columns"), ("mlp", "rows")],
                         ids=["linear", "mlp-columns", "mlp-rows"])
def test_saved_tensors_survive_a_byte_copy_round_trip(device, kind, x_form, monkeypatch):
    """What ActivationOffload does to a saved tensor (a copy of its bytes, back into a new tensor)
    changes no result: the FP8 data, the float32 scales and the int64 offsets come back exact."""
    needs_fp8_gemm(device)
    force_x_form(monkeypatch, x_form)
    splits_list, T, H, F = CASES["off_tiles"]
    splits = make_splits(splits_list, device)
    dtype = torch.bfloat16
    m = mlp(3, H, F, device, dtype) if kind == "mlp" else linear(3, H, F, device, dtype)
    step = mlp_step if kind == "mlp" else linear_step
    x, p, dy = inputs(T, H, dtype, device, seed=9, out_features=H if kind == "mlp" else F)
    want = step(m, x, p, dy, splits)
    for q in m.parameters():
        q.grad = None
    dtypes = set()

    def pack(t):
        if offload_impl._is_weight(t):
            return t
        dtypes.add(t.dtype)
        host = torch.empty(t.shape, dtype=t.dtype)
        offload_impl._bytes(host).copy_(offload_impl._bytes(t))
        return host

    def unpack(host):
        back = torch.empty(host.shape, dtype=host.dtype, device=device)
        offload_impl._bytes(back).copy_(offload_impl._bytes(host))
        return back

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        got = step(m, x, p, dy, splits)
    assert {E4M3, torch.float32, torch.int64} <= dtypes
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"result {i}"


# ---- routing, torch.compile ----


@pytest.mark.parametrize("kind, options", [
    ("linear", {}), ("linear", {"delay_wgrad_compute": True}),
    ("linear", {"recipe": me.Fp8Recipe(override_linear_precision=(True, False, False))}),
    ("mlp", {}), ("mlp", {"delay_wgrad_compute": True}),
], ids=["linear", "linear-delayed", "linear-fprop-hp", "mlp", "mlp-delayed"])
def test_modules_compute_the_routing_once_per_layer_per_step(device, kind, options):
    needs_fp8_gemm(device)
    dtype = CONTRACT_DTYPE[device.type]
    make = linear if kind == "linear" else mlp
    layers = [make(4, 32, 32, device, dtype, seed=i, **options) for i in range(3)]
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        start = _C.group_layout_computations()
        h = x = torch.randn(40, 32, generator=g).to(device, dtype).requires_grad_()
        for i, layer in enumerate(layers):
            splits = make_splits([[9, 0, 1, 23], [0, 40, 0, 0], [10, 10, 10, 5]][i], device)
            h = layer(h, splits, torch.rand(40, generator=g).to(device).requires_grad_())
        h.backward(torch.randn(h.shape, generator=g).to(device, dtype))
        for layer in layers:
            layer.backward_dw()
        count = _C.group_layout_computations() - start
        assert count == 3, f"step {seed}: {count} GroupLayout computations for 3 layers"
        assert x.grad is not None


@pytest.mark.parametrize("kind, case, x_form", [("linear", "mixed", "rule")] + [("mlp", *c) for c in FORM_CASES],
                         ids=["linear"] + [f"mlp-{i}" for i in FORM_IDS])
def test_compiled_module_step_is_bit_identical(device, kind, case, x_form, monkeypatch):
    """The fake implementations give the real ops' shapes, whichever form of x the MLP keeps."""
    needs_fp8_gemm(device)
    force_x_form(monkeypatch, x_form)
    splits_list, T, H, F = CASES[case]
    splits = make_splits(splits_list, device)
    dtype, G = CONTRACT_DTYPE[device.type], len(splits_list)
    if kind == "mlp":
        make, step = (lambda: mlp(G, H, F, device, dtype, glu_layout="blocks:32")), mlp_step
        x, p, dy = inputs(T, H, dtype, device, seed=10)
    else:
        make, step = (lambda: linear(G, H, F, device, dtype)), linear_step
        x, p, dy = inputs(T, H, dtype, device, seed=10, out_features=F)
    eager, module = make(), make()  # the same parameters (the same seed)
    traced = set()

    def forward_compiler(gm, example_inputs):  # aot_eager, noting which ops were traced
        traced.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    from torch._dynamo.backends.common import aot_autograd

    # The weight cache runs eagerly (a graph break); the module's autograd function and the FP8
    # ops it calls are traced through their fake implementations.
    compiled = torch.compile(module, backend=aot_autograd(fw_compiler=forward_compiler))
    for _ in range(2):  # the second step reuses the cached weights and the compiled graph
        want = step(eager, x, p, dy, splits)
        got = step(compiled, x, p, dy, splits)  # attributes reach the module itself
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"result {i}"
    fp8_op = "moe_engine.expert_mlp_fp8.default" if kind == "mlp" else "moe_engine.grouped_linear_fp8.default"
    assert fp8_op in traced, sorted(traced)


# ---- the custom ops ----


def mlp_op_args(device):
    torch.manual_seed(12)
    T, H, F, s = 12, 32, 16, torch.tensor([4, 0, 5], device=device)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    w1, w2 = me.quantize_fp8_weight(torch.randn(3, 2 * F, H, device=device)), me.quantize_fp8_weight(
        torch.randn(3, H, F, device=device))
    b1, b2 = torch.randn(3, 2 * F, dtype=torch.bfloat16, device=device), torch.randn(3, H, dtype=torch.bfloat16,
                                                                                       device=device)
    p = torch.rand(T, device=device)
    glu = me.glu_text("swiglu", "halves")
    return T, H, F, s, x, w1, w2, b1, b2, p, glu


@pytest.mark.parametrize("x_form", ["columns", "rows"])
def test_opcheck_of_the_fp8_mlp_ops(x_form):
    """The fake implementations against the real ops (test_schema compares inputs with
    torch.allclose, which has no float8 kernel; the forward's kept FP8 tensors hold unwritten
    bytes past the routed tokens, so two runs are compared on the backward only), with either form
    of x kept: backward takes the one kept, the other None."""
    T, H, F, s, x, w1, w2, b1, b2, p, glu = mlp_op_args("cpu")
    fwd = (x, p, w1.data, w1.scales, w2.data, w2.scales, [b1], [b2], s, glu, "forward", x_form, True, False, 0.0)
    torch.library.opcheck(ops.expert_mlp_fp8, fwd, test_utils=("test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(ops.expert_mlp_fp8, (x, None, w1.data, w1.scales, w2.data, w2.scales, [], [], s, glu,
                                               "none", "none", False, True, 1e-3), test_utils=("test_faketensor",))
    _, *saved_x, hd, hs, routing = ops.expert_mlp_fp8(*fwd)
    dy = torch.randn(T, H, dtype=torch.bfloat16)
    bwd = (dy, *fp8_impl.kept_x(x_form, saved_x), hd, hs, p, w1.data, w1.scales, w1.data_t, w1.scales_t, w2.data,
           w2.scales, w2.data_t, w2.scales_t, [b1], [b2], s, glu, "forward", False, 0.0, True, True, True,
           [torch.zeros(3, 2 * F, H)], "accumulate", [torch.empty(3, H, F, dtype=torch.bfloat16)], "write", routing)
    torch.library.opcheck(ops.expert_mlp_fp8_backward_, bwd,
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(ops.quantize_fp8, (x, s, True, True, False, 0.0, routing), test_utils=("test_faketensor",))
    w = torch.randn(3, 2 * F, H)
    out = me.quantize_fp8_weight(w)
    torch.library.opcheck(ops.quantize_fp8_weight_, ([w], out.data, out.scales, out.data_t, out.scales_t, True, 0.0),
                          test_utils=("test_faketensor",))


SAVED_KEYS = {"columns": ("x_data", "x_scales", "x_offsets"), "rows": ("x_rows_data", "x_rows_scales"), "none": ()}
SAVED_ORDER = ("x_data", "x_scales", "x_offsets", "x_rows_data", "x_rows_scales", "fc1_out_data", "fc1_out_scales")


def test_fake_shapes_follow_the_cpp_functions():
    from torch._subclasses.fake_tensor import FakeTensorMode

    T, H, F, s, x, w1, w2, b1, b2, p, glu = mlp_op_args("cpu")
    for form in ("columns", "rows", "none"):
        args = ("forward", form, True, False, 0.0)
        real = ops.expert_mlp_fp8(x, p, w1.data, w1.scales, w2.data, w2.scales, [b1], [b2], s, glu, *args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = ops.expert_mlp_fp8(*[mode.from_tensor(t) for t in (x, p, w1.data, w1.scales, w2.data, w2.scales)],
                                      [mode.from_tensor(b1)], [mode.from_tensor(b2)], mode.from_tensor(s), glu, *args)
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
        shapes = _C.expert_mlp_fp8_saved_shapes(T, 3, H, F, _C.GluSpec.parse(glu))
        kept = SAVED_KEYS[form] + ("fc1_out_data", "fc1_out_scales")
        assert [list(t.shape) for t in real[1:8]] == [shapes[k] if k in kept else [0] for k in SAVED_ORDER]
    with pytest.raises(ValueError, match=r"expert_mlp_fp8: save_x: expected one of none, columns, rows, got 'both'"):
        ops.expert_mlp_fp8(x, p, w1.data, w1.scales, w2.data, w2.scales, [b1], [b2], s, glu, "forward", "both", True,
                           False, 0.0)
    for activation, fc1_rows in (("swiglu", 384), ("srelu", 192)):  # FC1's rows: 2F for a GLU, F otherwise
        spec = _C.GluSpec(activation)
        for T, G in ((T, G) for T in (1, 5, 64, 300) for G in (1, 3, 32, 64)):
            want = _C.expert_mlp_fp8_saved_shapes(T, G, 128, 192, spec)
            for form in ("columns", "rows"):
                got = fp8_impl._mlp_saved_outputs(torch.empty(T, 128, device="meta"), torch.empty(G, device="meta"),
                                                  fc1_rows, form, True)
                kept = SAVED_KEYS[form] + ("fc1_out_data", "fc1_out_scales")
                assert [list(t.shape) for t in got] == [want[k] if k in kept else [0] for k in SAVED_ORDER]
    # the rule: C++'s, around C = 2T (not monotonic in T: C grows in steps of 128)
    for G in (1, 2, 4, 32):
        for T in list(range(0, 40)) + list(range(120, 140)) + list(range(250, 260)) + list(range(500, 520)) + [4096]:
            assert fp8_impl.expert_mlp_fp8_keeps_x_rows(T, G) == _C.expert_mlp_fp8_keeps_x_rows(T, G), (T, G)
    assert _C.expert_mlp_fp8_keeps_x_rows(127, 1) and not _C.expert_mlp_fp8_keeps_x_rows(128, 1)  # C = 256
    swiglu, srelu = _C.GluSpec("swiglu"), _C.GluSpec("srelu")
    assert _C.expert_mlp_fp8_forward_workspace_size(300, 128, 192, "bfloat16", swiglu) > \
        _C.expert_mlp_fp8_forward_workspace_size(300, 128, 192, "bfloat16", srelu) > 0
    plain = _C.expert_mlp_fp8_backward_workspace_size(300, 4, 128, 192, "float32", swiglu, "forward")
    assert plain > 0
    assert _C.expert_mlp_fp8_backward_workspace_size(300, 4, 128, 192, "float32", swiglu, "forward", False) == plain
    assert _C.expert_mlp_fp8_backward_workspace_size(300, 4, 128, 192, "float32", swiglu, "forward", x_rows=True) > plain
    # fusion forward and all run the same passes; the one-pass backward's dL/dh copies sit beside
    # dy's and act's buffers in the 16-bit dL/dh's place, which fusion none keeps to itself (its
    # dprobs shares are per 128 features, not per 128 columns of h: fewer bytes) ...
    dense = _C.expert_mlp_fp8_backward_workspace_size(1024, 4, 128, 192, "float32", swiglu, "forward")
    assert _C.expert_mlp_fp8_backward_workspace_size(1024, 4, 128, 192, "float32", swiglu, "all") == dense
    assert _C.expert_mlp_fp8_backward_workspace_size(1024, 4, 128, 192, "float32", swiglu, "none") < dense
    # ... except where the columns are mostly padding (300 tokens over 4 experts): no one pass there,
    # so no room for it
    assert _C.expert_mlp_fp8_backward_workspace_size(300, 4, 128, 192, "float32", swiglu, "all") == plain
    assert _C.expert_mlp_fp8_backward_workspace_size(300, 4, 128, 192, "float32", swiglu, "none") == plain


# ---- errors ----


def test_bad_recipes_and_settings_are_clear_errors(device):
    bf16 = torch.bfloat16
    with pytest.raises(TypeError, match=r"Fp8Recipe: pow2_scales: expected a bool, got int"):
        me.Fp8Recipe(pow2_scales=1)
    with pytest.raises(ValueError, match=r"Fp8Recipe: amax_epsilon: expected a finite value >= 0, got -1"):
        me.Fp8Recipe(amax_epsilon=-1)
    with pytest.raises(TypeError, match=r"Fp8Recipe: amax_epsilon: expected a float, got str"):
        me.Fp8Recipe(amax_epsilon="0")
    with pytest.raises(TypeError, match=r"Fp8Recipe: override_linear_precision: expected three bools \(fprop, "
                                        r"dgrad, wgrad\), got \(True, False\)"):
        me.Fp8Recipe(override_linear_precision=(True, False))
    assert me.Fp8Recipe(override_linear_precision=[True, False, True]).override_linear_precision == (True, False, True)
    with pytest.raises(TypeError, match=r"GroupedMLP: fp8_recipe: expected a moe_engine.torch.Fp8Recipe or None, "
                                        r"got dict"):
        me.GroupedMLP(2, 32, 16, fp8_recipe={"pow2_scales": True}, device=device)
    with pytest.raises(TypeError, match=r"GroupedLinear: fp8_recipe: expected a moe_engine.torch.Fp8Recipe or None, "
                                        r"got bool"):
        me.GroupedLinear(2, 32, 16, fp8_recipe=True, device=device)
    with pytest.raises(ValueError, match=r"GroupedLinear: fp8_recipe needs bfloat16 or float32 parameters .*got "
                                         r"torch.float16"):
        me.GroupedLinear(2, 32, 16, fp8_recipe=me.Fp8Recipe(), device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"GroupedMLP: fp8_recipe needs sizes that are multiples of 16, got ffn = 24"):
        me.GroupedMLP(2, 32, 24, fp8_recipe=me.Fp8Recipe(), device=device)
    with pytest.raises(ValueError, match=r"GroupedMLP: fp8_recipe and recompute_fc1=True"):
        me.GroupedMLP(2, 32, 16, recompute_fc1=True, fp8_recipe=me.Fp8Recipe(), device=device)
    m = me.GroupedMLP(2, 32, 16, fp8_recipe=me.Fp8Recipe(), device=device)
    with pytest.raises(TypeError, match=r"GroupedMLP: fp8_recipe: expected a moe_engine.torch.Fp8Recipe or None"):
        m.fp8_recipe = "fp8"
    s = make_splits([2, 2], device)
    m.half()
    with pytest.raises(ValueError, match=r"GroupedMLP: fp8_recipe needs bfloat16 or float32 parameters and x .*got "
                                         r"torch.float16"):
        m(torch.zeros(4, 32, dtype=torch.float16, device=device), s)

    # the functional form
    x = torch.randn(4, 32, dtype=bf16, device=device, requires_grad=True)
    w1, w2 = torch.randn(2, 32, 32, dtype=bf16, device=device), torch.randn(2, 32, 16, dtype=bf16, device=device)
    with pytest.raises(ValueError, match=r"expert_mlp_fp8: recipe: the fused expert MLP runs all six GEMMs in FP8; "
                                         r"override_linear_precision must be \(False, False, False\), got "
                                         r"\(True, True, True\)"):
        me.expert_mlp_fp8(x, w1, w2, s, recipe=me.Fp8Recipe(override_linear_precision=(True, True, True)))
    with pytest.raises(TypeError, match=r"expert_mlp_fp8: recipe: expected a moe_engine.torch.Fp8Recipe"):
        me.expert_mlp_fp8(x, w1, w2, s, recipe=(True, 0.0))
    only_forward = me.quantize_fp8_weight(w1, columnwise=False)
    with pytest.raises(ValueError, match=r"expert_mlp_fp8: fc1_weight: backward reads the transposed copy "
                                         r"fc1_weight.data_t, but it is None"):
        me.expert_mlp_fp8(x, only_forward, w2, s)
    with pytest.raises(ValueError, match=r"expert_mlp_fp8: fc2_master_weight goes with an Fp8Weight fc2_weight"):
        me.expert_mlp_fp8(x, w1, w2, s, fc2_master_weight=w2)
    with pytest.raises(TypeError, match=r"expert_mlp_fp8: fc1_weight: expected an Fp8Weight, or the weight to "
                                        r"quantize \(a tensor or G tensors\), got NoneType"):
        me.expert_mlp_fp8(x, None, w2, s)
    with pytest.raises(ValueError, match=r"expert_mlp_forward \(fp8\): x: expected bfloat16 or float32, got float16"):
        me.expert_mlp_fp8(x.detach().half(), w1, w2, s)
    needs_fp8_gemm(device)
    with torch.no_grad():  # no backward: the forward copy alone will do
        assert me.expert_mlp_fp8(x, only_forward, w2, s).shape == (4, 32)


# ---- GPU: CUDA graphs, activation offload ----

GRAPH_ROUTINGS = [[64, 0, 1, 191], [0, 0, 0, 256], [1, 1, 1, 1], [100, 100, 40, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("kind, x_form", [("linear", "rule"), ("mlp", "rule"), ("mlp", "columns")],
                         ids=["linear", "mlp-rows", "mlp-columns"])
@pytest.mark.parametrize("layout", ["packed", "per-expert"])
def test_captured_module_step_replays_with_new_routings_and_weights(cuda, kind, layout, x_form, monkeypatch):
    """Forward + backward with main_grad accumulation, captured once, replayed with new splits:
    bit-identical to eager steps. The weight quantization is captured too, so a replay after an
    optimizer step reads the new weights. (T = 256 over 4 experts: the rule keeps x's rows.)"""
    needs_fp8_gemm(cuda)
    force_x_form(monkeypatch, x_form)
    T, H, F = 256, 128, 128
    if kind == "mlp":
        m = mlp(4, H, F, cuda, torch.bfloat16, glu_layout="blocks:32", layout=layout, accumulate_into_main_grad=True)
    else:
        m = linear(4, H, F, cuda, torch.bfloat16, layout=layout, accumulate_into_main_grad=True)
    for q in m.parameters():
        q.main_grad = torch.zeros(q.shape, dtype=torch.float32, device=cuda)
    static_x = torch.zeros(T, H, dtype=torch.bfloat16, device=cuda, requires_grad=True)
    static_p = torch.zeros(T, device=cuda, requires_grad=True)
    static_dy = torch.zeros(T, H if kind == "mlp" else F, dtype=torch.bfloat16, device=cuda)
    static_splits = make_splits(GRAPH_ROUTINGS[0], cuda)

    def step():
        y = m(static_x, static_splits, static_p)
        y.backward(static_dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside capture: the caches, pointer tables, error records
            static_x.grad = static_p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = static_p.grad = None
    for q in m.parameters():
        q.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):
        static_y = step()

    def check(i, routing):
        """The replay first (so that it cannot lean on anything an eager step refreshed), then the
        eager step of the same inputs."""
        g = torch.Generator().manual_seed(i)
        x = torch.randn(T, H, generator=g).to(cuda, torch.bfloat16)
        p = torch.rand(T, generator=g).to(cuda)
        dy = torch.randn(static_dy.shape, generator=g).to(cuda, torch.bfloat16)
        for q in m.parameters():
            q.main_grad.zero_()
        with torch.no_grad():
            static_x.copy_(x)
            static_p.copy_(p)
            static_dy.copy_(dy)
            static_splits.copy_(make_splits(routing, cuda))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [static_y.clone(), static_x.grad.clone(), static_p.grad.clone()]
        replayed_main = [q.main_grad.clone() for q in m.parameters()]
        for q in m.parameters():
            q.main_grad.zero_()
        xe, pe = x.clone().requires_grad_(), p.clone().requires_grad_()
        ye = m(xe, make_splits(routing, cuda), pe)
        ye.backward(dy)
        for name, a, b in zip(("y", "dx", "dprobs"), replayed, (ye, xe.grad, pe.grad)):
            assert torch.equal(a, b), f"routing {i}: {name}"
        for a, q in zip(replayed_main, m.parameters()):
            assert torch.equal(a, q.main_grad), f"routing {i}: main_grad"

    for i, routing in enumerate(GRAPH_ROUTINGS):
        check(i, routing)
    with torch.no_grad():  # an optimizer step between replays
        for q in m.parameters():
            q.mul_(0.5)
    check(len(GRAPH_ROUTINGS), GRAPH_ROUTINGS[0])
    me.check_errors()


@pytest.mark.parametrize("x_form", ["rule", "rows"], ids=["columns", "rows"])
def test_offload_of_fp8_layers_is_bit_identical(cuda, x_form, monkeypatch):
    """ActivationOffload moves what FP8 layers keep (E4M3 data, float32 scales) to the host and
    back bit for bit; the cached quantized weights stay where they are. (Experts of 300 and 600
    tokens: the rule keeps x's columns.)"""
    needs_fp8_gemm(cuda)
    force_x_form(monkeypatch, x_form)
    T, H, F, G = 1024, 256, 512, 4
    layers = [mlp(G, H, F, cuda, torch.bfloat16, seed=i, glu_layout="blocks:32", accumulate_into_main_grad=True)
              for i in range(4)]
    for m in layers:
        for q in m.parameters():
            q.main_grad = torch.zeros(q.shape, dtype=torch.float32, device=cuda)
    x, p, dy = inputs(T, H, torch.bfloat16, cuda, seed=13)
    splits = make_splits([300, 0, 1, 600], cuda)

    def step(offload=None):
        for m in layers:
            for q in m.parameters():
                q.main_grad.zero_()
        h = x0 = x.detach().requires_grad_()
        for i, m in enumerate(layers):
            if offload is None:
                h = m(h, splits, p.detach())
            else:
                with offload.layer(i) as scope:
                    h = scope.output(m(h, splits, p.detach()))
        h.backward(dy)
        return [h.detach(), x0.grad] + [q.main_grad.clone() for m in layers for q in m.parameters()]

    want = step()
    offload = me.ActivationOffload(len(layers), min_bytes=8 << 10)
    for _ in range(2):  # the first step allocates the pinned buffers
        got = step(offload)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"result {i}"
    assert not _C.expert_mlp_fp8_keeps_x_rows(T, G)  # the rule keeps the columns here
    per_layer = sum(math.prod(s) * (1 if dt == E4M3 else 4) for dt, s in kept_x_shapes(
        "rows" if x_form == "rows" else "columns", T, G, H)) + T * 2 * F + (2 * F // 128) * me.fp8_scales_pitch(T) * 4
    # layers 0..2 go out (layer 3 is the last), layer 2 is still held when backward begins
    assert offload.offloaded_bytes == 3 * per_layer
    assert offload.reloaded_bytes == 2 * per_layer
    assert offload.saved_bytes == 0


@pytest.mark.parametrize("x_form", ["columns", "rows"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_and_unfused_steps_give_the_same_bytes(device, bias, x_form, monkeypatch):
    """fusion="none" runs every step of the FP8 MLP as its own op; the default fuses the steps
    around the GLU on CUDA (the backward's in one pass when both weight gradients and no FC1 bias
    gradient are asked for): the same results bit for bit, immediate and delayed, either form of x
    kept, but dprobs, whose per-token sums over the features the fused passes add in another order."""
    needs_fp8_gemm(device)
    force_x_form(monkeypatch, x_form)
    splits_list, T, H, F = CASES["off_tiles"]
    splits = make_splits(splits_list, device)
    x, p, dy = inputs(T, H, torch.bfloat16, device, seed=14)
    results = []
    for fusion in ("forward", "none"):
        for delay in (False, True):
            torch.manual_seed(0)
            m = me.GroupedMLP(3, H, F, bias=bias, glu_layout="pairs", fusion=fusion, delay_wgrad_compute=delay,
                              fp8_recipe=me.Fp8Recipe(), device=device)
            xi, pi = x.detach().requires_grad_(), p.detach().requires_grad_()
            y = m(xi, splits, pi)
            y.backward(dy)
            m.backward_dw()
            results.append([y.detach(), xi.grad, pi.grad] + [q.grad for q in m.parameters()])
    for other in results[1:]:
        for i, (a, b) in enumerate(zip(results[0], other)):
            if i == 2:  # dprobs
                assert similarity_diff(a, b) < 1e-9, f"result {i}"
            else:
                assert torch.equal(a, b), f"result {i}"
