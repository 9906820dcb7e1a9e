"""Plain PyTorch references in float64 (per-expert loops over host-side splits) and test inputs."""

import torch

TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}


def rel_err(out, ref):
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, dtype, what=""):
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: rel. error {err:.3g} > {TOL[dtype]:.3g}"


def similarity_diff(a, b):
    """DeepGEMM's 1 - 2 sum(a b) / sum(a^2 + b^2), the FP8 tests' measure of a result against that of
    the unquantized inputs."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    den = (a.square() + b.square()).sum()
    return (1 - 2 * (a * b).sum() / den).item() if den > 0 else 0.0


def assert_similar(got, want, bound, what):
    assert not got.detach().isnan().any(), f"{what}: NaN"
    diff = similarity_diff(got, want)
    assert diff <= bound, f"{what}: similarity difference {diff:.3g} > {bound:.3g}"


def needs_fp8_gemm(device):
    """Skips on a GPU without the FP8 GEMMs (they run on the Hopper kernel only)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) != (9, 0):
        import pytest

        pytest.skip("the FP8 GEMMs run on the Hopper kernel only (compute capability 9.0)")


# Routings with the odd cases: empty experts, 1-row experts, sizes off every tile, one expert
# holding all tokens, G = 1 and G = 256; capacity above the sum (a tail no expert owns).
ROUTINGS = {
    "mixed": ([5, 0, 1, 37, 0, 130], 200),
    "one_expert_all": ([0, 0, 77, 0], 77),
    "g1": ([45], 50),
    "g256": ([(g * 7) % 5 for g in range(256)], 600),
    "all_empty": ([0, 0, 0], 9),
}


def make_splits(splits, device, dtype=torch.int64):
    return torch.tensor(splits, dtype=dtype, device=device)


def bounds(splits):
    off = [0]
    for s in splits:
        off.append(off[-1] + s)
    return off


def expert(w, g):
    """Expert g of a packed tensor or a list."""
    return w[g] if isinstance(w, torch.Tensor) else w[g]


def grouped_linear_ref(x, w, splits, bias=None, row_scale=None):
    x = x.double()
    y = torch.zeros(x.shape[0], expert(w, 0).shape[0], dtype=torch.float64, device=x.device)
    off = bounds(splits)
    for g in range(len(splits)):
        a, b = off[g], off[g + 1]
        y[a:b] = x[a:b] @ expert(w, g).double().T
        if bias is not None:
            bg = expert(bias, g).double()
            y[a:b] += bg if row_scale is None else row_scale[a:b, None].double() * bg
    return y


def glu_columns(layout, ffn):
    """Indices of the gate and linear columns among the 2F."""
    if layout == "halves":
        s = ffn
    elif layout == "pairs":
        s = 1
    else:
        s = int(layout.split(":")[1])
    idx = torch.arange(2 * ffn).reshape(-1, 2, s)
    return idx[:, 0].reshape(-1), idx[:, 1].reshape(-1)


def glu_ref(h, layout, activation, limit=7.0, alpha=1.702, offset=1.0):
    """The activation of FC1's output h: a GLU over h's [T, 2F] gate/linear columns in ``layout``, or
    a non-gated activation elementwise over h [T, F] (PyTorch's own functions)."""
    if activation == "srelu":
        return torch.relu(h) ** 2
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(h, approximate="tanh")
    ffn = h.shape[1] // 2
    gi, li = glu_columns(layout, ffn)
    gate, lin = h[:, gi], h[:, li]
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * lin
    # docs/design.md section 3: the gradient is 0 where gate > limit / |linear| > limit (it passes at
    # equality, unlike torch.clamp's backward).
    g = torch.where(gate > limit, torch.full_like(gate, limit), gate)
    l_ = torch.where(lin.abs() > limit, lin.sign() * limit, lin) + offset
    return g * torch.sigmoid(alpha * g) * l_


def expert_mlp_ref(x, w1, w2, splits, probs=None, b1=None, b2=None, layout="halves", activation="swiglu",
                   storage=None, **act):
    """Float64, differentiable: y = FC2(act(FC1 x + b1) * p) + p * b2, per expert (glu_ref's
    activations: FC1 has 2F rows for a GLU, F for srelu / gelu_tanh). ``storage``: the
    dtype the kernels keep the pre-activation and the activation in; the reference rounds them the
    same way (straight-through), since the clamp makes the gradient jump at the limit."""

    def stored(t):
        return t if storage is None else t.to(storage).to(t.dtype)

    off = bounds(splits)
    rows = []
    for g in range(len(splits)):
        a, b = off[g], off[g + 1]
        h = x[a:b] @ expert(w1, g).T
        if b1 is not None:
            h = h + expert(b1, g)
        act_out = glu_ref(stored(h), layout, activation, **act)
        p = probs[a:b, None] if probs is not None else 1.0
        y = stored(act_out * p) @ expert(w2, g).T
        if b2 is not None:
            y = y + p * expert(b2, g)
        rows.append(y)
    T = x.shape[0]
    tail = torch.zeros(T - off[-1], x.shape[1], dtype=x.dtype, device=x.device)
    return torch.cat(rows + [tail])


def attach_ddp(m, with_flag, zero_out=False):
    """What Megatron's DDP does: a float32 main_grad per parameter, grad_added_to_main_grad reset to
    False, and a post-accumulation hook that adds .grad into main_grad unless the flag says the
    kernel already did (or zero_out_wgrad), then clears .grad. Parameters marked
    skip_backward_post_hook (delayed wgrad) get that hook through the module's
    register_wgrad_accumulation_and_reduce_hooks instead, as Megatron's DDP does. Returns the log."""
    log = []
    delayed = []
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if with_flag:
            p.grad_added_to_main_grad = False
        if zero_out:
            p.zero_out_wgrad = True

        def hook(*_, p=p):
            if p.grad is not None and (not getattr(p, "grad_added_to_main_grad", False) or zero_out):
                p.main_grad.add_(p.grad.float())
            p.grad = None
            log.append(p)

        if getattr(p, "skip_backward_post_hook", False):
            delayed.append(hook)
        else:
            p.register_post_accumulate_grad_hook(hook)
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: [h() for h in delayed])
    return log
