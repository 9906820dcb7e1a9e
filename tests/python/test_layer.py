"""The whole MoE layer (moe_engine.torch.MoELayer): router, dispatch, experts, combine, against a
float64 reference written here in plain PyTorch (choices, probs, capacity drops, losses, every
gradient), with FP8 experts too (within FP8's error); expert bias; main_grad; determinism; CUDA
graphs and no host sync on the GPU (16-bit and FP8 experts)."""

import contextlib
import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine.torch as me
from reference import TOL, assert_close, assert_similar, expert_mlp_ref, needs_fp8_gemm

# (name, layer options, T): odd token counts, k = 1 and k > 1, groups, bias, drops, losses.
CASES = [
    ("softmax_k2", dict(num_experts=8, topk=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3), 37),
    ("sigmoid_groups_bias", dict(num_experts=8, topk=3, score="sigmoid", expert_bias=True, num_groups=4,
                                 topk_groups=2, scaling_factor=2.5, aux_loss_coeff=1e-2), 29),
    ("softmax_k1_drops", dict(num_experts=4, topk=1, capacity_factor=0.5, norm_topk_prob=False), 33),
    ("k2_drops_unnormalized", dict(num_experts=6, topk=2, capacity_factor=0.75, norm_topk_prob=False,
                                   z_loss_coeff=1e-2), 41),
    ("one_expert", dict(num_experts=1, topk=1), 5),
    ("no_tokens", dict(num_experts=4, topk=2, aux_loss_coeff=1e-2), 0),
]
H, F = 64, 32


def make_layer(opts, device, dtype, seed=0, **extra):
    torch.manual_seed(seed)
    layer = me.MoELayer(H, F, device=device, dtype=dtype, **opts, **extra)
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.5)  # spread logits: clear choices
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, layer.num_experts))
    return layer


def reference(layer, x, g, indices):
    """Float64: y, aux_loss and the gradients of (y g).sum() + aux_loss for the layer's weights and
    x, with the layer's choice `indices` (the choice has no gradient)."""
    r, opts = layer.router, layer
    E, k = layer.num_experts, layer.topk
    spec = r.spec
    x64 = x.detach().double().requires_grad_()
    wr = r.weight.detach().cpu().double().requires_grad_()
    w1 = layer.experts.fc1.weight.detach().cpu().double().requires_grad_()
    w2 = layer.experts.fc2.weight.detach().cpu().double().requires_grad_()
    T = x.shape[0]
    logits = x64 @ wr.T
    s = torch.softmax(logits, -1) if spec.score == "softmax" else torch.sigmoid(logits)
    p = s.gather(1, indices)
    if spec.norm_topk_prob:
        p = p / (p.sum(-1, keepdim=True) + 1e-20)
    p = p * spec.scaling_factor
    # Stable expert order of the flattened (t, j); each expert keeps its first C.
    flat = indices.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    cap = T * k if opts.capacity_factor is None else math.ceil(T * k / E * opts.capacity_factor)
    kept, splits = [], []
    for e in range(E):
        rows = order[flat[order] == e][:cap]
        kept.append(rows)
        splits.append(len(rows))
    rows = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.int64)
    xs = x64[rows // k] if T else x64[:0]
    ps = p.reshape(-1)[rows]
    out = expert_mlp_ref(xs, w1, w2, splits, ps, layout=layer.experts.glu_layout)
    y = torch.zeros(T, H, dtype=torch.float64).index_add(0, rows // k, out) if T else x64 * 0
    aux = torch.zeros((), dtype=torch.float64)
    if spec.aux_loss_coeff > 0 and T:
        q = torch.softmax(logits, -1) if spec.score == "softmax" else s / (s.sum(-1, keepdim=True) + 1e-20)
        n = torch.zeros(E, dtype=torch.float64).index_add(0, torch.topk(q.detach(), k, -1).indices.reshape(-1),
                                                          torch.ones(T * k, dtype=torch.float64))
        aux = aux + spec.aux_loss_coeff * E / (k * T * T) * (q.sum(0) * n).sum()
    if spec.z_loss_coeff > 0 and T:
        aux = aux + spec.z_loss_coeff / T * (torch.logsumexp(logits, -1) ** 2).sum()
    ((y * g.double()).sum() + aux).backward()
    return y, p, aux, {"x": x64.grad, "router": wr.grad, "fc1": w1.grad, "fc2": w2.grad}


def chosen_reference(layer, x):
    """The reference's choice from float64 logits: top-k of the scores plus bias (groups: the best
    topk_groups groups by the sum of their two best), ties to the lower index."""
    spec = layer.router.spec
    logits = x.double() @ layer.router.weight.detach().cpu().double().T
    s = torch.softmax(logits, -1) if spec.score == "softmax" else torch.sigmoid(logits)
    if layer.router.expert_bias is not None:
        s = s + layer.router.expert_bias.cpu().double()
    if spec.num_groups > 1:
        T, E = s.shape
        grp = s.reshape(T, spec.num_groups, -1)
        gscore = grp.topk(min(2, grp.shape[-1]), -1).values.sum(-1)
        keep = gscore.topk(spec.topk_groups, -1).indices
        mask = torch.zeros(T, spec.num_groups, dtype=torch.bool).scatter_(1, keep, True)
        s = s.masked_fill(~mask.repeat_interleave(E // spec.num_groups, 1), -math.inf)
    return s.topk(spec.topk, -1).indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,opts,T", CASES, ids=[c[0] for c in CASES])
def test_layer_matches_float64_reference(device, dtype, name, opts, T):
    layer = make_layer(opts, device, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_()
    g = torch.randn(T, H, generator=gen).to(device, dtype)
    r = layer.route(x.detach())
    assert r.indices.dtype == torch.int64 and r.indices.shape == (T, layer.topk)
    assert torch.equal(r.indices.cpu(), chosen_reference(layer, x.detach().cpu().float())), "choice"
    counts = torch.bincount(r.indices.reshape(-1).cpu(), minlength=layer.num_experts)
    assert torch.equal(r.counts.cpu(), counts), "counts"

    y = layer(x)
    ((y.float() * g.float()).sum() + layer.aux_loss).backward()
    ref_y, ref_p, ref_aux, ref = reference(layer, x.detach().cpu(), g.cpu(), r.indices.cpu())
    tol = TOL[dtype]
    assert_close(r.probs, ref_p, torch.float32, "probs")
    if T:
        assert_close(y, ref_y, dtype, "y")
        assert_close(x.grad, ref["x"], dtype, "dx")
        assert_close(layer.router.weight.grad, ref["router"], dtype, "router weight grad")
        assert_close(layer.experts.fc1.weight.grad, ref["fc1"], dtype, "fc1 grad")
        assert_close(layer.experts.fc2.weight.grad, ref["fc2"], dtype, "fc2 grad")
        assert abs(layer.aux_loss.item() - ref_aux.item()) <= tol * max(abs(ref_aux.item()), 1e-6)
    else:
        assert y.shape == (0, H) and x.grad.shape == (0, H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,opts,T", CASES, ids=[c[0] for c in CASES])
def test_fp8_layer_matches_float64_reference_within_fp8_error(device, dtype, name, opts, T):
    """MoELayer(fp8_recipe=...): the router's choice and probs as without it (the router is not
    quantized); y and every gradient within the FP8 tests' similarity bound of the float64 layer
    (test_fp8_modules.py's MLP_BOUND, 5e-3: a wrong scale, block or expert gives 1e-1 and more)."""
    needs_fp8_gemm(device)
    layer = make_layer(opts, device, dtype, fp8_recipe=me.Fp8Recipe())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_()
    g = torch.randn(T, H, generator=gen).to(device, dtype)
    r = layer.route(x.detach())
    assert torch.equal(r.indices.cpu(), chosen_reference(layer, x.detach().cpu().float())), "choice"
    y = layer(x)
    ((y.float() * g.float()).sum() + layer.aux_loss).backward()
    ref_y, ref_p, ref_aux, ref = reference(layer, x.detach().cpu(), g.cpu(), r.indices.cpu())
    assert_close(r.probs, ref_p, torch.float32, "probs")
    if not T:
        assert y.shape == (0, H) and x.grad.shape == (0, H)
        return
    got = {"y": y, "dx": x.grad, "router": layer.router.weight.grad, "fc1": layer.experts.fc1.weight.grad,
           "fc2": layer.experts.fc2.weight.grad}
    want = {"y": ref_y, "dx": ref["x"], "router": ref["router"], "fc1": ref["fc1"], "fc2": ref["fc2"]}
    # dx and the router's gradient also carry dprobs (sums over H of FP8-rounded terms, then the
    # scores' backward, whose differences cancel). Measured over these cases on two machines: the
    # router's gradient up to 1.1e-2 (softmax_k2, bf16, on the GPU machine's CPU), everything else up
    # to 3.2e-3. An error in the experts' FP8 path moves dprobs by O(1).
    bound = {"y": 5e-3, "dx": 1e-2, "router": 3e-2, "fc1": 5e-3, "fc2": 5e-3}
    for what in got:
        assert_similar(got[what], want[what], bound[what], what)
    assert abs(layer.aux_loss.item() - ref_aux.item()) <= TOL[dtype] * max(abs(ref_aux.item()), 1e-6)


def test_dispatch_drops_past_capacity_and_keeps_token_order(device):
    layer = make_layer(dict(num_experts=4, topk=2, capacity_factor=0.5), device, torch.float32)
    x = torch.randn(23, H, device=device)
    r = layer.route(x)
    d = layer.dispatch(x, r)
    C = math.ceil(23 * 2 / 4 * 0.5)
    assert d.x.shape == (me.permuted_rows(23, 2, 4, 0.5), H) == (4 * C, H)
    flat = r.indices.reshape(-1).cpu()
    for e in range(4):
        want = (flat == e).nonzero().reshape(-1)
        assert d.splits[e].item() == min(len(want), C)
        assert d.dropped[e].item() == max(len(want) - C, 0)
        kept = want[:C]
        start = int(d.splits[:e].sum())
        assert torch.equal(d.x[start:start + len(kept)].cpu(), x[kept // 2].cpu()), f"expert {e} rows"
    assert ((d.row_of.cpu() == -1).sum() == d.dropped.sum().cpu()).item()


def test_layer_is_deterministic(device):
    outs = []
    for _ in range(2):
        layer = make_layer(dict(num_experts=8, topk=2, aux_loss_coeff=1e-2), device, torch.bfloat16)
        x = torch.randn(57, H, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
        x.requires_grad_()
        y = layer(x)
        (y.float().square().sum() + layer.aux_loss).backward()
        outs.append([y, x.grad, layer.router.weight.grad, layer.experts.fc1.weight.grad])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


class _PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    """Runs every op as is; its presence sends the layer's ops through torch's dispatcher."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_eager_calls_without_the_dispatcher_match_the_ops(device):
    """Plain eager calls run the ops' implementations and autograd directly (FastOp); under a dispatch
    mode they go through the registered custom ops. Both give the same bits, gradients included."""
    outs = []
    for mode in (None, _PassThrough):
        layer = make_layer(dict(num_experts=8, topk=2, aux_loss_coeff=1e-2, capacity_factor=1.5), device,
                           torch.bfloat16)
        x = torch.randn(57, H, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
        x.requires_grad_()
        with (mode() if mode else contextlib.nullcontext()):
            y = layer(x)
            (y.float().square().sum() + layer.aux_loss).backward()
        outs.append([y, x.grad, layer.router.weight.grad, layer.experts.fc1.weight.grad,
                     layer.experts.fc2.weight.grad])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# Expert options the one-node path (dispatch + experts + combine as one autograd node) must carry.
ONE_NODE_CASES = [
    ("plain", {}, {}),
    ("bias_drops", dict(bias=True, capacity_factor=0.75), {}),
    ("per_expert_recompute", dict(layout="per-expert", recompute_fc1=True), {}),
    ("main_grad", dict(accumulate_into_main_grad=True), {}),
    ("delayed_wgrad", dict(delay_wgrad_compute=True), {}),
    ("x_without_grad", {}, dict(x_grad=False)),
    ("frozen_experts", {}, dict(frozen=True)),
]


@pytest.mark.parametrize("two_node_step", [True, False], ids=["two_node_step", "one_node_step"])
@pytest.mark.parametrize("name,opts,how", ONE_NODE_CASES, ids=[c[0] for c in ONE_NODE_CASES])
def test_fused_dispatch_and_combine_equal_the_separate_nodes(device, monkeypatch, name, opts, how, two_node_step):
    """In plain eager mode dispatch runs in the experts' first autograd node and combine in their
    last (one node, or two where the MLP's backward is two); a forward hook on the experts sends the
    layer through dispatch, the experts module and combine. Outputs and every gradient are the same
    bits, main_grad and delayed weight gradients included."""
    import moe_engine.torch.layer as layer_mod

    # The step's two-node form is taken from a size up (MoELayer._two_nodes): at every size, or never.
    monkeypatch.setattr(layer_mod, "_TWO_NODE_MIN_BYTES", 0 if two_node_step else 1 << 62)
    outs = []
    for three_nodes in (False, True):
        layer = make_layer(dict(num_experts=6, topk=2, aux_loss_coeff=1e-2, **opts), device, torch.bfloat16)
        if opts.get("accumulate_into_main_grad"):
            for p in layer.parameters():
                p.main_grad = torch.full(p.shape, 0.25, dtype=torch.float32, device=device)
        if how.get("frozen"):
            layer.experts.requires_grad_(False)
        hook = layer.experts.register_forward_hook(lambda *a: None) if three_nodes else None
        x = torch.randn(45, H, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
        x.requires_grad_(how.get("x_grad", True))
        y = layer(x)
        # The MLP's backward is one node with a delayed wgrad or recompute_fc1, else two (FC2's, FC1's).
        one_mlp_node = opts.get("delay_wgrad_compute") or opts.get("recompute_fc1")
        fused = "_DispatchExpertsCombine" if one_mlp_node or not two_node_step else "_Fc2Combine"
        assert type(y.grad_fn).__name__.startswith(fused) != three_nodes
        (y.float().square().sum() + layer.aux_loss).backward()
        layer.backward_dw()
        grads = [x.grad] + [getattr(p, "main_grad", None) if opts.get("accumulate_into_main_grad") else p.grad
                            for p in layer.parameters()]
        outs.append([y] + grads)
        if hook is not None:
            hook.remove()
    for i, (a, b) in enumerate(zip(*outs)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), i


def test_fc2s_weight_gradient_is_handed_on_before_dispatch_and_fc1s_node(device, monkeypatch):
    """The fused step runs as two nodes from the size where that frees _TWO_NODE_MIN_BYTES (rows x
    (H + 2F + F) elements), one node below; as two, FC2's weight gradient reaches .grad (its buffer
    freed) before the node of dispatch + FC1 runs: the two weight gradients never coexist."""
    import moe_engine.torch.layer as layer_mod

    layer = make_layer(dict(num_experts=6, topk=2), device, torch.bfloat16)
    freed = 45 * 2 * (H + 3 * F) * 2  # 45 tokens x top-2 rows, bf16
    for min_bytes, form in ((freed + 1, "_DispatchExpertsCombine"), (freed, "_Fc2Combine")):
        monkeypatch.setattr(layer_mod, "_TWO_NODE_MIN_BYTES", min_bytes)
        y = layer(torch.randn(45, H, device=device, dtype=torch.bfloat16, requires_grad=True))
        assert type(y.grad_fn).__name__.startswith(form), (min_bytes, type(y.grad_fn).__name__)
    order = []
    for name, p in (("fc2.weight", layer.experts.fc2.weight), ("fc1.weight", layer.experts.fc1.weight)):
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    x = torch.randn(45, H, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
    y = layer(x.requires_grad_())
    first = next(n for n, _ in y.grad_fn.next_functions if n is not None and "DispatchFc1" in type(n).__name__)
    first.register_prehook(lambda grads: order.append("dispatch + FC1's node"))
    y.float().square().sum().backward()
    assert order == ["fc2.weight", "dispatch + FC1's node", "fc1.weight"], order


@pytest.mark.parametrize("two_node_step", [True, False], ids=["two_node_step", "one_node_step"])
def test_fused_nodes_hold_no_saved_tensor_after_their_backward(device, monkeypatch, two_node_step):
    """A node outlives its backward until the graph goes; the fused nodes' sub-contexts drop what
    they saved once their backward has run, so the pre-activation and x_sorted are not kept through
    the rest of the backward."""
    import moe_engine.torch.layer as layer_mod

    monkeypatch.setattr(layer_mod, "_TWO_NODE_MIN_BYTES", 0 if two_node_step else 1 << 62)
    layer = make_layer(dict(num_experts=6, topk=2), device, torch.bfloat16)
    x = torch.randn(45, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    nodes = {y.grad_fn} | {n for n, _ in y.grad_fn.next_functions if n is not None}
    subs = [getattr(n, a) for n in nodes for a in ("mlp", "fc1", "fc2") if hasattr(n, a)]
    assert len(subs) == (2 if two_node_step else 1)
    y.float().square().sum().backward()
    assert all(s.saved_tensors == () for s in subs)


def test_offloaded_layer_stack_equals_the_plain_one(cuda):
    """ActivationOffload over a stack of two layers (the first offloaded, its one-node step's saved
    tensors included): outputs and gradients bit-identical to the same stack without offload."""
    outs = []
    for offload in (None, me.ActivationOffload(num_layers=2, min_bytes=0)):
        layers = [make_layer(dict(num_experts=6, topk=2), cuda, torch.bfloat16, seed=s) for s in (0, 1)]
        x = torch.randn(300, H, generator=torch.Generator().manual_seed(7)).to(cuda, torch.bfloat16)
        x.requires_grad_()
        h = x
        for i, layer in enumerate(layers):
            with (offload.layer(i) if offload else contextlib.nullcontext()) as scope:
                h = layer(h)
                if offload:
                    h = scope.output(h)
        h.float().square().sum().backward()
        if offload:
            assert offload.offloaded_bytes > 0
        outs.append([h, x.grad] + [p.grad for layer in layers for p in layer.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_expert_bias_update(device):
    layer = make_layer(dict(num_experts=4, topk=1, expert_bias=True), device, torch.float32)
    with torch.no_grad():
        layer.router.expert_bias.zero_()
    x = torch.randn(40, H, device=device)
    layer(x)
    layer(x)
    counts = layer.tokens_per_expert.cpu()
    assert torch.equal(layer.router.counts_since_update.cpu(), 2 * counts)
    layer.update_expert_bias(0.01)
    mean = counts.double().mean()
    want = 0.01 * torch.sign(mean - counts.double())
    assert torch.equal(layer.router.expert_bias.cpu(), want.float())
    assert layer.router.counts_since_update.sum().item() == 0
    layer.eval()
    layer(x)
    assert layer.router.counts_since_update.sum().item() == 0, "eval forwards do not count"


def test_router_weight_main_grad_contract(device):
    opts = dict(num_experts=4, topk=2)
    ref_layer = make_layer(opts, device, torch.bfloat16)
    layer = make_layer(opts, device, torch.bfloat16, accumulate_into_main_grad=True)
    for p in layer.parameters():
        p.main_grad = torch.full(p.shape, 0.5, dtype=torch.float32, device=device)
    x = torch.randn(31, H, device=device, dtype=torch.bfloat16)
    for m in (ref_layer, layer):
        m(x).float().square().sum().backward()
    for name, p in layer.named_parameters():
        ref_grad = dict(ref_layer.named_parameters())[name].grad.float()
        assert_close(p.main_grad - 0.5, ref_grad, torch.bfloat16, name)
        assert p.grad is None or p.grad.is_sparse, name


def test_state_dict_keys_and_round_trip(device):
    layer = make_layer(dict(num_experts=4, topk=2, expert_bias=True), device, torch.float32)
    sd = layer.state_dict()
    assert set(sd) == {"router.weight", "router.expert_bias", "experts.fc1.weight", "experts.fc2.weight"}
    other = make_layer(dict(num_experts=4, topk=2, expert_bias=True), device, torch.float32, seed=5)
    other.load_state_dict(sd)
    x = torch.randn(9, H, device=device)
    assert torch.equal(other(x), layer(x))


def test_bad_arguments_name_the_layer(device):
    layer = make_layer(dict(num_experts=4, topk=2), device, torch.float32)
    with pytest.raises(ValueError, match="MoELayer"):
        layer(torch.randn(3, H, device=device, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        layer.router(torch.randn(3, H + 1, device=device))
    with pytest.raises(ValueError, match="capacity_factor"):
        me.MoELayer(H, F, 4, 2, capacity_factor=0.0, device=device)
    with pytest.raises(ValueError, match="topk_groups"):
        me.MoELayer(H, F, 4, 2, num_groups=2, device=device)
    with pytest.raises(ValueError, match="topk"):
        me.MoELayer(H, F, 4, 5, device=device)
    with pytest.raises(ValueError, match="expert bias"):
        layer.update_expert_bias(0.1)


def test_bad_layer_and_routing_arguments_are_refused(device):
    """What int() / float() used to convert silently, and the sizes and layouts that other entry
    points already refused."""
    with pytest.raises(TypeError, match=r"MoELayer: topk must be an integer, got float 1.7"):
        me.MoELayer(H, F, 4, 1.7, device=device)
    with pytest.raises(TypeError, match=r"MoELayer: num_experts must be an integer, got bool"):
        me.MoELayer(H, F, True, 1, device=device)
    with pytest.raises(TypeError, match=r"MoELayer: capacity_factor must be a number, got str '1.0'"):
        me.MoELayer(H, F, 4, 2, capacity_factor="1.0", device=device)
    with pytest.raises(TypeError, match=r"dispatch: capacity_factor must be a number"):
        me.permuted_rows(8, 2, 4, "1.0")
    with pytest.raises(ValueError, match=r"permuted_rows: .*more than 2\^31 - 1 assignments"):
        me.permuted_rows(1 << 40, 1 << 20, 4)
    assert me.permuted_rows(4096, 8, 1 << 62, 1.0) == 4096 * 8
    with pytest.raises(ValueError, match=r"Router: hidden = 0; expected >= 1"):
        me.Router(0, 4, 2, device=device)
    with pytest.raises(ValueError, match=r"dtype must be a floating-point dtype"):
        me.MoELayer(H, F, 4, 2, device=device, dtype=torch.int32)
    # A GLU layout given for a non-gated activation is GroupedMLP's error, not silently replaced;
    # none given: blocks:32 for a GLU, halves (none) for srelu.
    with pytest.raises(ValueError, match=r"GLU layout pairs given for srelu, which is not gated"):
        me.MoELayer(H, F, 4, 2, activation="srelu", glu_layout="pairs", device=device)
    assert me.MoELayer(H, F, 4, 2, activation="srelu", device=device).experts.glu_layout == "halves"
    assert me.MoELayer(H, F, 4, 2, device=device).experts.glu_layout == "blocks:32"
    # dispatch / combine and the permute ops name what is wrong (not torch's "negative dimension").
    x = torch.randn(8, H, device=device)
    idx = torch.randint(0, 4, (8, 2), device=device)
    with pytest.raises(ValueError, match=r"permute_plan: num_experts = -3; expected >= 1"):
        me.dispatch(x, None, idx, -3)
    with pytest.raises(ValueError, match=r"permute_plan: indices: expected \[T, k\] .*, got shape \[8\]"):
        me.dispatch(x, None, idx[:, 0], 4)
    d = me.dispatch(x, None, idx, 4)
    for out in (d.x[:-1], torch.cat([d.x, d.x])):
        with pytest.raises(ValueError, match=rf"combine: out has {out.shape[0]} rows, expected the 16 rows"):
            me.combine(out, d)
    with pytest.raises(ValueError, match=r"permute: rows = -1; expected >= 0"):
        torch.ops.moe_engine.permute(x, None, d.row_of, d.splits, d.routing, -1)
    with pytest.raises(ValueError, match=r"unpermute_backward: rows = -4; expected >= 0"):
        torch.ops.moe_engine.unpermute_backward(x, None, None, d.row_of, d.splits, d.routing, -4, False)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_graph_replay_with_new_routings_is_bit_identical(cuda, fp8):
    if fp8:
        needs_fp8_gemm(cuda)
    T = 96
    layer = make_layer(dict(num_experts=8, topk=2, aux_loss_coeff=1e-2, capacity_factor=1.25, expert_bias=True),
                       cuda, torch.bfloat16, accumulate_into_main_grad=True,
                       fp8_recipe=me.Fp8Recipe() if fp8 else None)
    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=cuda)
    static_x = torch.zeros(T, H, dtype=torch.bfloat16, device=cuda, requires_grad=True)
    static_g = torch.zeros(T, H, dtype=torch.bfloat16, device=cuda)

    def step():
        y = layer(static_x)
        ((y.float() * static_g.float()).sum() + layer.aux_loss).backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            static_x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):
        static_y = step()
    for i in range(4):
        gen = torch.Generator().manual_seed(10 + i)
        x = (torch.randn(T, H, generator=gen) * (1 + i)).to(cuda, torch.bfloat16)
        g = torch.randn(T, H, generator=gen).to(cuda, torch.bfloat16)
        for p in layer.parameters():
            p.main_grad.zero_()
        xe = x.clone().requires_grad_()
        ye = layer(xe)
        ((ye.float() * g.float()).sum() + layer.aux_loss).backward()
        eager = [p.main_grad.clone() for p in layer.parameters()]
        for p in layer.parameters():
            p.main_grad.zero_()
        with torch.no_grad():
            static_x.copy_(x)
            static_g.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, ye), f"input {i}: y"
        assert torch.equal(static_x.grad, xe.grad), f"input {i}: dx"
        for p, e in zip(layer.parameters(), eager):
            assert torch.equal(p.main_grad, e), f"input {i}: main_grad"
    me.check_errors()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_no_host_sync_in_a_step(cuda, fp8):
    if fp8:
        needs_fp8_gemm(cuda)
    layer = make_layer(dict(num_experts=8, topk=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, capacity_factor=1.0),
                       cuda, torch.bfloat16, fp8_recipe=me.Fp8Recipe() if fp8 else None)
    x = torch.randn(64, H, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()  # warm-up: first-use setup may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x)
        (y.float().sum() + layer.aux_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    me.check_errors()


def test_opcheck_of_the_layer_ops():
    """Schemas and fake implementations of the router and permute ops agree with the real ops."""
    torch.manual_seed(7)
    ops = torch.ops.moe_engine
    x, wr = torch.randn(13, 16), torch.randn(6, 16)
    spec = ("softmax", 2, 1, 1, True, 1.0, 1e-2, 1e-3)
    logits, indices, probs, counts, aux, aux_counts, z = ops.router_forward(x, wr, None, *spec)
    row_of, splits, routing, dropped = ops.permute_plan(indices, 6, 0.75)
    rows = me.permuted_rows(13, 2, 6, 0.75)
    x_sorted, probs_sorted = ops.permute(x, probs, row_of, splits, routing, rows)
    cases = [
        (ops.router_forward, (x, wr, torch.zeros(6), "sigmoid", 3, 3, 2, False, 2.5, 1e-2, 0.0)),
        (ops.router_backward_, (torch.randn(13, 2), torch.tensor(1.0), torch.tensor(1.0), x, wr, logits, indices,
                                aux_counts, True, [torch.zeros(6, 16)], "write", *spec)),
        (ops.permute_plan, (indices, 6, None)),
        (ops.permute_plan, (indices, 6, 0.75)),
        (ops.permute, (x, probs, row_of, splits, routing, rows)),
        (ops.permute, (x, None, row_of, splits, routing, rows)),
        (ops.permute_backward, (x_sorted, probs_sorted, row_of, splits, routing)),
        (ops.unpermute, (x_sorted, probs, row_of, splits, routing)),
        (ops.unpermute_backward, (x, x_sorted, probs, row_of, splits, routing, rows, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    x.requires_grad_()
    for op, args in [(ops.permute, (x, probs.requires_grad_(), row_of, splits, routing, rows)),
                     (ops.unpermute, (x_sorted.requires_grad_(), probs, row_of, splits, routing))]:
        torch.library.opcheck(op, args, test_utils=("test_autograd_registration",))


def test_layer_compiles_and_matches_eager(device):
    layer = make_layer(dict(num_experts=4, topk=2, aux_loss_coeff=1e-2, capacity_factor=1.0), device, torch.float32)
    x = torch.randn(21, H, device=device, requires_grad=True)
    y = layer(x)
    (y.square().sum() + layer.aux_loss).backward()
    eager = [y.detach(), x.grad, layer.router.weight.grad, layer.experts.fc1.weight.grad]
    layer.zero_grad()
    x.grad = None
    compiled = torch.compile(layer, fullgraph=False)
    yc = compiled(x)
    (yc.square().sum() + layer.aux_loss).backward()
    for a, b in zip(eager, [yc.detach(), x.grad, layer.router.weight.grad, layer.experts.fc1.weight.grad]):
        assert torch.equal(a, b)
