"""moe_engine.megatron: GroupedMLPExperts inside megatron-core's MoELayer.

- A MoELayer with megatron-core's own SequentialMLP experts and one with GroupedMLPExperts (built
  from the layer spec by ``use_moe_engine_experts``), the same weights (the SequentialMLP state dict
  loaded into the adapter): outputs, input gradients, the router's gradient and the expert weight
  gradients, which the adapter accumulates into ``main_grad`` buffers of megatron-core's own
  DistributedDataParallel (``gradient_accumulation_fusion``); delayed wgrad through DDP's hook.
- The adapter's forward contract against a plain per-expert float64 reference (Megatron's formula,
  biases included): tokens_per_expert as a list, a CPU tensor, a device tensor; empty experts, no
  tokens; the activations it maps; probs on the input.
- State dicts: SequentialMLP / TEGroupedMLP / legacy GroupedMLP keys in, TEGroupedMLP keys out,
  across GLU layouts; sharded_state_dict equal to SequentialMLP's (keys, offsets, data).
- The configurations it rejects, and the ImportError without megatron-core.

Everything skips (with the reason) where megatron-core is not installed. world size 1: a gloo
process group (plus NCCL for CUDA tensors on a GPU). Two shims, for megatron-core 0.16.1 without
TransformerEngine: ``moe_utils.te_general_gemm`` is set to None where megatron-core left it
undefined (its router reads the name), and on the CPU ``torch.cuda.current_device`` answers "cpu"
while a layer is built and run (the router moves its weight to that device)."""

import dataclasses
import functools
import subprocess
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
import torch.nn.functional as F  # noqa: E402

try:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        import megatron.core  # noqa: F401
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.transformer_config import TransformerConfig
    MCORE = megatron.core.__version__ if hasattr(megatron.core, "__version__") else "?"
except ImportError as e:  # pragma: no cover - depends on the environment
    MCORE = None
    MCORE_WHY = f"megatron-core is not installed ({e}); pip install megatron-core (scripts/gpu fetch-deps brings its wheel)"

needs_mcore = pytest.mark.skipif(MCORE is None, reason=MCORE_WHY if MCORE is None else "")

if MCORE is not None:
    import moe_engine.megatron as mm
    from moe_engine.megatron import GroupedMLPExperts, use_moe_engine_experts

from reference import assert_close, assert_similar, needs_fp8_gemm  # noqa: E402

DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
H, FFN, E = 32, 16, 4


# ---- process groups and the CPU shims ----


@pytest.fixture(scope="module")
def mp():
    """torch.distributed (world size 1) and megatron's parallel state, once for this file."""
    if MCORE is None:
        pytest.skip(MCORE_WHY)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # megatron-core 0.16 without TE leaves it undefined
    import torch.distributed as dist

    made = False
    if not dist.is_initialized():
        path = tempfile.mktemp(prefix="moe-megatron-pg-")
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
        made = True
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if made:
        dist.destroy_process_group()


@pytest.fixture
def on(mp, device, monkeypatch):
    """The device the layers live on; on the CPU megatron's router asks torch.cuda for its device."""
    if device.type == "cpu":
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return device


def make_config(device, **over):
    """The test config; weights are made on the CPU (from torch's seed on every device) and moved."""
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_ffn_hidden_size=FFN,
                moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                use_cpu_initialization=True, params_dtype=DTYPE[device.type],
                bf16=DTYPE[device.type] == torch.bfloat16, moe_token_dispatcher_type="allgather",
                bias_activation_fusion=False, gradient_accumulation_fusion=False, moe_router_dtype="fp32")
    base.update(over)
    return TransformerConfig(**base)


def layers(device, post=None, **over):
    """(Megatron's MoELayer with SequentialMLP, the same layer with GroupedMLPExperts and
    gradient_accumulation_fusion, the same weights). ``post``: config fields set after
    TransformerConfig's own checks."""
    cfg = make_config(device, **over)
    cfg_ours = dataclasses.replace(cfg, gradient_accumulation_fusion=True)
    for k, v in (post or {}).items():
        setattr(cfg, k, v)
        setattr(cfg_ours, k, v)
    torch.manual_seed(0)
    ref = MoELayer(cfg, get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False).submodules)
    spec = use_moe_engine_experts(get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False))
    ours = MoELayer(cfg_ours, spec.submodules)
    assert type(ref.experts).__name__ == "SequentialMLP"
    assert isinstance(ours.experts, GroupedMLPExperts)
    ref.to(device), ours.to(device)
    ours.router.load_state_dict(ref.router.state_dict())
    result = ours.experts.load_state_dict(ref.experts.state_dict())
    assert not result.missing_keys and not result.unexpected_keys, result
    return ref, ours


def fc_weights(ref, which):
    return [getattr(e, which).weight for e in ref.experts.local_experts]


# ---- the layer against megatron-core's SequentialMLP ----


ACTIVATIONS = {
    "swiglu": dict(),
    "clamped_qgeglu": dict(activation_func="quick_gelu", activation_func_clamp_value=0.5, glu_linear_offset=1.0),
    "srelu": dict(gated_linear_unit=False, activation_func="squared_relu"),
    "probs_on_input": dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True),
}


def resolve(over):
    """Megatron's activation named by a string, unwrapped from its torch.compile (the same
    function, without a compilation on every test machine)."""
    from megatron.core import activations

    over = dict(over)
    if isinstance(over.get("activation_func"), str):
        fn = getattr(activations, over["activation_func"])
        over["activation_func"] = getattr(fn, "_torchdynamo_orig_callable", fn)
    return over


@needs_mcore
@pytest.mark.parametrize("case", list(ACTIVATIONS))
def test_layer_matches_sequential_mlp(on, case):
    """Forward, dx, the router's gradient and every expert's weight gradient (into DDP's main_grad)
    of a whole MoELayer step."""
    if on.type == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU layer needs torch.cuda.current_device() patched to 'cpu', which breaks torch.compile "
                    "(megatron's router) on a machine with CUDA: there the CUDA case runs, the CPU one in CI")
    ref, ours = layers(on, **resolve(ACTIVATIONS[case]))
    dtype = DTYPE[on.type]
    ddp = DistributedDataParallel(ours.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), ours)
    for p in ours.experts.parameters():
        assert p.main_grad.dtype == torch.float32 and p.grad_added_to_main_grad is False
    torch.manual_seed(3)
    x = torch.randn(12, 2, H, device=on, dtype=dtype)
    dy = torch.randn(12, 2, H, device=on, dtype=dtype)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, br = ref(xr)
    yo, bo = ddp(xo)
    assert br is None and bo is None
    assert_close(yo, yr, dtype, "y")
    yr.backward(dy)
    yo.backward(dy)
    ddp.finish_grad_sync()
    assert_close(xo.grad, xr.grad, dtype, "dx")
    assert_close(ours.router.weight.main_grad, ref.router.weight.grad, dtype, "router dw")
    for which, fc in (("linear_fc1", ours.experts.mlp.fc1), ("linear_fc2", ours.experts.mlp.fc2)):
        w = fc.weights()[0]
        assert w.grad is None  # DDP's hook dropped the dummy; the gradient is in main_grad
        for i, wr in enumerate(fc_weights(ref, which)):
            assert_close(w.main_grad[i], wr.grad, dtype, f"{which} dw expert {i}")
    # the whole layer's checkpoint: Megatron's keys out, and a SequentialMLP layer's in
    sd = ours.state_dict()
    assert "experts.linear_fc1.weight0" in sd and not any(k.startswith("experts.mlp.") for k in sd)
    result = ours.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys, result


@needs_mcore
def test_delayed_wgrad_through_ddp(on):
    """delay_wgrad_compute: backward leaves main_grad alone, MoELayer.backward_dw() fills it and
    runs DDP's hook (registered once, on the inner GroupedMLP); the result equals the immediate one."""
    grads = []
    for delayed in (False, True):
        # TransformerConfig ties delay_wgrad_compute to EP overlap: set after its checks
        ref, ours = layers(on, post=dict(delay_wgrad_compute=delayed))
        assert all(getattr(p, "skip_backward_post_hook", False) == delayed for p in ours.experts.parameters())
        ddp = DistributedDataParallel(
            ours.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, delay_wgrad_compute=delayed), ours)
        if delayed:
            assert len(ours.experts.mlp._delayed.hooks) == 2  # one per weight (packed): registered once each
        torch.manual_seed(3)
        x = torch.randn(12, 2, H, device=on, dtype=DTYPE[on.type], requires_grad=True)
        y, _ = ddp(x)
        y.backward(torch.ones_like(y))
        w1 = ours.experts.mlp.fc1.weights()[0]
        if delayed:
            assert w1.main_grad.abs().max() == 0
            ours.backward_dw()
        ddp.finish_grad_sync()
        assert w1.main_grad.abs().max() > 0
        grads.append([w.main_grad.clone() for w in ours.experts.mlp.fc1.weights() + ours.experts.mlp.fc2.weights()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


# ---- the forward contract against a plain reference ----


def experts(device, num=E, **over):
    cfg = make_config(device, **resolve(over))
    torch.manual_seed(1)
    return GroupedMLPExperts(num, cfg).to(device), cfg


def reference(m, x, counts, probs, cfg):
    """Float64 per-expert loop of Megatron's expert MLP, written from its config (not from
    moe-engine's activation names): h = FC1 x + b1; a GLU splits h into halves [gate | up],
    clamps them by activation_func_clamp_value and computes act(gate) * (up + glu_linear_offset);
    y = FC2(a * p) + p * b2; with moe_apply_probs_on_input, x * p in x's dtype and p = 1."""
    sd = m.state_dict()
    G = m.num_local_experts
    w1 = [sd[f"linear_fc1.weight{i}"].double() for i in range(G)]
    w2 = [sd[f"linear_fc2.weight{i}"].double() for i in range(G)]
    b1 = [sd[f"linear_fc1.bias{i}"].double() for i in range(G)] if cfg.add_bias_linear else None
    b2 = [sd[f"linear_fc2.bias{i}"].double() for i in range(G)] if cfg.add_bias_linear else None
    if cfg.moe_apply_probs_on_input:
        x, probs = (probs.unsqueeze(-1).to(x.dtype) * x).to(x.dtype), torch.ones_like(probs)
    x, probs = x.double(), probs.double()
    act, clamp = cfg.activation_func, cfg.activation_func_clamp_value
    rows, start = [], 0
    for i, c in enumerate(counts):
        h = x[start:start + c] @ w1[i].T
        if b1 is not None:
            h = h + b1[i]
        if cfg.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            if clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
            a = act(gate) * (up + cfg.glu_linear_offset)
        else:
            a = act(h)
        p = probs[start:start + c, None]
        y = (a * p) @ w2[i].T
        if b2 is not None:
            y = y + p * b2[i]
        rows.append(y)
        start += c
    rows.append(torch.zeros(x.shape[0] - start, x.shape[1], dtype=torch.float64, device=x.device))
    return torch.cat(rows)


MORE_ACTIVATIONS = {
    "bias": dict(add_bias_linear=True),
    "swiglu_clamped": dict(activation_func_clamp_value=0.5, glu_linear_offset=0.5, add_bias_linear=True),
    "qgeglu_unclamped": dict(activation_func="quick_gelu"),
    "gelu_tanh": dict(gated_linear_unit=False, activation_func="fast_gelu", add_bias_linear=True),
}


@needs_mcore
@pytest.mark.parametrize("form", ["list", "cpu_tensor", "device_tensor"])
@pytest.mark.parametrize("counts", [[5, 0, 1, 18], [0, 0, 0, 0], [24, 0, 0, 0]])
def test_forward_contract(mp, device, form, counts):
    m, cfg = experts(device, add_bias_linear=True, activation_func="quick_gelu", activation_func_clamp_value=1.0,
                     glu_linear_offset=1.0)
    dtype = DTYPE[device.type]
    T = sum(counts)
    torch.manual_seed(2)
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    probs = torch.rand(T, device=device, requires_grad=True)
    tpe = {"list": list(counts), "cpu_tensor": torch.tensor(counts),
           "device_tensor": torch.tensor(counts, device=device)}[form]
    y, bias = m(x, tpe, probs)
    assert bias is None and y.shape == (T, H) and y.dtype == dtype
    ref = reference(m, x.detach(), counts, probs.detach(), cfg)
    if T:
        assert_close(y, ref, dtype, "y")
    y.backward(torch.ones_like(y))  # plain .grad (no gradient_accumulation_fusion)
    assert x.grad.shape == x.shape and probs.grad.shape == probs.shape
    for p in m.parameters():
        assert p.grad is not None


@needs_mcore
@pytest.mark.parametrize("case", list(ACTIVATIONS) + list(MORE_ACTIVATIONS))
def test_forward_activations(mp, device, case):
    over = MORE_ACTIVATIONS.get(case, ACTIVATIONS.get(case))
    m, cfg = experts(device, **over)
    counts = [7, 3, 0, 14]
    dtype = DTYPE[device.type]
    x = torch.randn(sum(counts), H, device=device, dtype=dtype)
    probs = torch.rand(sum(counts), device=device)
    y, _ = m(x, counts, probs)
    assert_close(y, reference(m, x, counts, probs, cfg), dtype, case)


@needs_mcore
def test_activation_mapping(mp):
    """Megatron's activation functions as configs name them (torch.compile'd, never called here)."""
    from megatron.core import activations
    from megatron.core.fusions.fused_bias_geglu import quick_gelu as fused_quick_gelu

    def of(**over):
        cfg = make_config(torch.device("cpu"))
        for k, v in over.items():
            setattr(cfg, k, v)
        return mm.activation_of(cfg)

    inf = float("inf")
    assert of() == {"activation": "swiglu"}
    assert of(activation_func_clamp_value=7.0) == {"activation": "clamped_qgeglu", "limit": 7.0, "alpha": 1.0,
                                                   "offset": 0.0}
    assert of(activation_func=activations.quick_gelu, activation_func_clamp_value=7.0, glu_linear_offset=1.0) == {
        "activation": "clamped_qgeglu", "limit": 7.0, "alpha": 1.702, "offset": 1.0}
    assert of(activation_func=fused_quick_gelu) == {"activation": "clamped_qgeglu", "limit": inf, "alpha": 1.702,
                                                    "offset": 0.0}
    assert of(gated_linear_unit=False, activation_func=activations.squared_relu) == {"activation": "srelu"}
    assert of(gated_linear_unit=False, activation_func=activations.fast_gelu) == {"activation": "gelu_tanh"}
    assert of(gated_linear_unit=False, activation_func=functools.partial(F.gelu, approximate="tanh")) == {
        "activation": "gelu_tanh"}


@needs_mcore
def test_bf16_probs_and_3d_input(mp, device):
    m, cfg = experts(device)
    counts = [4, 4, 4, 4]
    x = torch.randn(16, H, device=device, dtype=DTYPE[device.type])
    probs = torch.rand(16, device=device)
    y, _ = m(x, counts, probs)
    y3, _ = m(x.view(16, 1, H), counts, probs.view(16, 1))
    torch.testing.assert_close(y3.view(16, H), y, rtol=0, atol=0)
    y16, _ = m(x, counts, probs.bfloat16())
    torch.testing.assert_close(y16, m(x, counts, probs.bfloat16().float())[0], rtol=0, atol=0)


@needs_mcore
def test_device_tokens_per_expert_never_synced(mp, cuda):
    """tokens_per_expert on the GPU: forward and backward run without a host sync."""
    m, cfg = experts(cuda, gradient_accumulation_fusion=True)
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=cuda)
    counts = torch.tensor([5, 0, 1, 18], device=cuda)
    x = torch.randn(24, H, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(24, device=cuda, requires_grad=True)
    dy = torch.randn(24, H, device=cuda, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, _ = m(x, counts, probs)
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = reference(m, x.detach(), [5, 0, 1, 18], probs.detach(), cfg)
    assert_close(y, ref, torch.bfloat16, "y")
    assert m.mlp.fc1.weights()[0].main_grad.abs().max() > 0


@needs_mcore
def test_gpu_initialization(mp, cuda):
    """use_cpu_initialization=False: parameters made on the current GPU, each expert's weight by
    the config's init method under megatron's expert-parallel RNG stream, biases zero."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    cfg = make_config(cuda, use_cpu_initialization=False, add_bias_linear=True, init_method_std=0.5)
    m = GroupedMLPExperts(E, cfg)
    for p in m.parameters():
        assert p.device.type == "cuda" and p.dtype == torch.bfloat16
    for b in m.mlp.fc1.biases() + m.mlp.fc2.biases():
        assert b.abs().max() == 0
    w1 = m.mlp.fc1.weights()[0].float()
    assert 0.4 < w1.std().item() < 0.6  # init_method_normal(0.5)
    assert not torch.equal(w1[0], w1[1])


@needs_mcore
def test_bad_tokens_per_expert(mp):
    m, _ = experts(torch.device("cpu"))
    x = torch.randn(6, H)
    with pytest.raises(ValueError, match="one count per local expert|one per local expert"):
        m(x, [3, 3], torch.rand(6))
    with pytest.raises(ValueError, match=r"must be \[4\]"):
        m(x, torch.tensor([3, 3]), torch.rand(6))
    # Counts that int() / .to(int64) would truncate or parse are refused, naming tokens_per_expert.
    for bad in ([2.7, 3.3, 0, 0], torch.tensor([2.7, 3.3, 0.0, 0.0]), torch.tensor([True, True, False, False]),
                ["3", "3", "0", "0"], [True, 5, 0, 0], "3300"):
        with pytest.raises(TypeError, match=r"tokens_per_expert must (be an integer tensor|hold integer token counts)"):
            m(x, bad, torch.rand(6))
    # Integers of any kind are counts.
    want, _ = m(x, [3, 3, 0, 0], torch.ones(6))
    for good in (torch.tensor([3, 3, 0, 0], dtype=torch.int32), torch.tensor([3, 3, 0, 0], dtype=torch.int16),
                 [torch.tensor(3), 3, 0, 0]):
        assert torch.equal(m(x, good, torch.ones(6))[0], want)


@needs_mcore
def test_fp8_recipe_through_the_spec_params(mp, device):
    """GroupedMLPExperts(..., fp8_recipe=Fp8Recipe()), as ``ModuleSpec(params={"fp8_recipe": ...})``
    passes it: the experts run moe-engine's FP8 MLP; y within FP8's similarity bound (the FP8 tests'
    5e-3) of the float64 reference, and dx, dprobs and the weights' gradients within it of the same
    experts without the recipe (same weights)."""
    needs_fp8_gemm(device)
    import moe_engine.torch as me

    cfg = make_config(device, add_bias_linear=True)
    torch.manual_seed(1)
    fp8 = GroupedMLPExperts(E, cfg, fp8_recipe=me.Fp8Recipe()).to(device)
    torch.manual_seed(1)
    plain = GroupedMLPExperts(E, cfg).to(device)
    assert fp8.mlp.fp8_recipe is not None and plain.mlp.fp8_recipe is None
    for (k, a), b in zip(fp8.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), k
    counts = [7, 3, 0, 150]
    dtype = DTYPE[device.type]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(counts), H, generator=gen).to(device, dtype)
    probs = torch.rand(sum(counts), generator=gen).to(device)
    dy = torch.randn(sum(counts), H, generator=gen).to(device, dtype)
    runs = []
    for m in (fp8, plain):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, _ = m(xi, counts, pi)
        y.backward(dy)
        runs.append([y, xi.grad, pi.grad] + [p.grad for p in m.parameters()])
    assert_similar(runs[0][0], reference(fp8, x, counts, probs, cfg), 5e-3, "y vs float64")
    for i, (a, b) in enumerate(zip(*runs)):
        assert_similar(a, b, 5e-3, f"result {i} vs the experts without FP8")


# ---- configurations it cannot serve ----


@needs_mcore
@pytest.mark.parametrize("over, match", [
    (dict(gated_linear_unit=True, activation_func=F.gelu), "gated_linear_unit with activation_func gelu"),
    (dict(gated_linear_unit=False, activation_func=F.gelu), "F.gelu .erf. is not one of them"),
    (dict(moe_latent_size=8), "moe_latent_size"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1"]), "offloading"),
])
def test_rejected_configs(mp, over, match):
    cfg = make_config(torch.device("cpu"))
    for k, v in over.items():  # set after construction: TransformerConfig validates some on its own
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=match):
        GroupedMLPExperts(E, cfg)


@needs_mcore
def test_rejected_parallel_and_fp8(mp):
    cfg = make_config(torch.device("cpu"))
    cfg.expert_tensor_parallel_size = 2
    with pytest.raises(ValueError, match="expert tensor parallelism is not supported"):
        GroupedMLPExperts(E, cfg)
    cfg = make_config(torch.device("cpu"))
    cfg.fp8 = "hybrid"
    with pytest.raises(ValueError, match="fp8_recipe"):
        GroupedMLPExperts(E, cfg)
    cfg = make_config(torch.device("cpu"))
    cfg.moe_apply_probs_on_input = True  # with top-2
    with pytest.raises(ValueError, match="moe_router_topk == 1"):
        GroupedMLPExperts(E, cfg)


def test_import_error_names_megatron_core():
    """Without megatron-core the adapter says what to install; moe_engine and moe_engine.torch never
    import megatron."""
    code = (
        "import sys\n"
        "import moe_engine, moe_engine.torch\n"
        "assert not any((k == 'megatron' or k.startswith('megatron.')) and sys.modules[k] is not None for k in list(sys.modules)), 'megatron imported'\n"
        "sys.modules['megatron'] = None\n"
        "try:\n"
        "    import moe_engine.megatron\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "ERR moe_engine.megatron needs megatron-core" in out.stdout and "pip install megatron-core" in out.stdout


# ---- state dicts ----


@needs_mcore
@pytest.mark.parametrize("glu_layout", ["halves", "blocks:8", "pairs"])
def test_state_dict_round_trip(mp, device, glu_layout):
    """SequentialMLP keys in; TEGroupedMLP keys out (halves), whatever the module's GLU layout; the
    same outputs; legacy GroupedMLP's weight1 / weight2 and TE's _extra_state accepted."""
    cfg = make_config(device, add_bias_linear=True)
    torch.manual_seed(0)
    seq = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False).submodules.experts
    from megatron.core.transformer.spec_utils import build_module

    ref = build_module(seq, E, cfg, pg_collection=moe_utils.get_default_pg_collection()).to(device)
    seq_sd = ref.state_dict()
    m = GroupedMLPExperts(E, cfg, glu_layout=glu_layout).to(device)
    assert m.load_state_dict(seq_sd).missing_keys == []
    sd = m.state_dict()
    names = {f"linear_fc{j}.{k}{i}" for j in (1, 2) for k in ("weight", "bias") for i in range(E)}
    assert set(sd) == names
    for i in range(E):
        for j in (1, 2):
            for k in ("weight", "bias"):
                torch.testing.assert_close(sd[f"linear_fc{j}.{k}{i}"], seq_sd[f"local_experts.{i}.linear_fc{j}.{k}"],
                                           rtol=0, atol=0)
    # TE style with _extra_state, into a module of another layout and parameter form
    te_sd = dict(sd, **{f"linear_fc{j}._extra_state": None for j in (1, 2)})
    other = GroupedMLPExperts(E, cfg, glu_layout="halves" if glu_layout != "halves" else "blocks:8",
                              layout="per-expert").to(device)
    assert not other.load_state_dict(te_sd).missing_keys
    counts = [3, 0, 7, 2]
    x = torch.randn(12, H, device=device, dtype=DTYPE[device.type])
    probs = torch.rand(12, device=device)
    assert_close(other(x, counts, probs)[0], m(x, counts, probs)[0], DTYPE[device.type], "reloaded")
    for k, v in other.state_dict().items():
        torch.testing.assert_close(v, sd[k], rtol=0, atol=0)
    # legacy GroupedMLP (no biases there): weight1 [H, G*2F] read as view(G, H, 2F), weight2 [G*F, H]
    w1 = torch.stack([sd[f"linear_fc1.weight{i}"].t() for i in range(E)])  # [G, H, 2F]
    w2 = torch.stack([sd[f"linear_fc2.weight{i}"].t() for i in range(E)])  # [G, F, H]
    legacy = {"weight1": w1.reshape(H, -1), "weight2": w2.reshape(-1, H)}
    legacy.update({f"linear_fc{j}.bias{i}": sd[f"linear_fc{j}.bias{i}"] for j in (1, 2) for i in range(E)})
    third = GroupedMLPExperts(E, cfg, glu_layout=glu_layout).to(device)
    assert not third.load_state_dict(legacy).missing_keys
    for k, v in third.state_dict().items():
        torch.testing.assert_close(v, sd[k], rtol=0, atol=0)


@needs_mcore
def test_sharded_state_dict_matches_sequential_mlp(mp):
    """Distributed checkpointing: the same ShardedTensors (key, global shape and offset, data, after
    the GLU factory's split) as SequentialMLP's, under the dict keys this module loads."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    cpu = torch.device("cpu")
    cfg = make_config(cpu, add_bias_linear=True)
    from megatron.core.transformer.spec_utils import build_module

    pgs = moe_utils.get_default_pg_collection()
    seq = build_module(get_moe_module_spec(use_te=False, num_experts=E).submodules.experts, E, cfg, pg_collection=pgs)
    m = GroupedMLPExperts(E, cfg, pg_collection=pgs)
    m.load_state_dict(seq.state_dict())

    def flat(sd):
        out = {}
        for k, v in sd.items():
            parts = v.build() if isinstance(v, ShardedTensorFactory) else [v]
            parts = parts.values() if isinstance(parts, dict) else parts
            for p in parts:
                if isinstance(p, ShardedTensor):
                    out[(p.key, tuple(p.global_offset))] = (tuple(p.global_shape), p.data, p.replica_id)
        return out

    a, b = flat(seq.sharded_state_dict(prefix="mlp.experts.")), flat(m.sharded_state_dict(prefix="mlp.experts."))
    assert set(a) == set(b) and len(a) == 6 * E  # fc1's weight and bias split into their GLU halves
    for k in a:
        assert a[k][0] == b[k][0] and a[k][2] == b[k][2], k
        torch.testing.assert_close(b[k][1], a[k][1], rtol=0, atol=0)
    assert set(m.sharded_state_dict(prefix="p.")) == {f"p.{k}" for k in m.state_dict()}
    with pytest.raises(NotImplementedError, match="glu_layout='halves'"):
        GroupedMLPExperts(E, cfg, glu_layout="blocks:8").sharded_state_dict()


@needs_mcore
def test_use_moe_engine_experts_on_a_gpt_layer_spec(mp):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=True)
    assert use_moe_engine_experts(spec, glu_layout="blocks:8") is spec
    experts_spec = spec.submodules.mlp.submodules.experts
    assert experts_spec.module is GroupedMLPExperts and experts_spec.params == {"glu_layout": "blocks:8"}
    with pytest.raises(ValueError, match="no MoE layer"):
        use_moe_engine_experts(get_gpt_layer_local_spec())
