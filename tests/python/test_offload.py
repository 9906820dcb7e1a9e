"""Activation offload (GPU): bit-identical to no offload, with and without CUDA graphs; peak
memory drops; the opt-outs hold; many layers x steps leak neither device nor pinned memory; the
whole layer stack with delayed wgrad + main_grad accumulation replays from a graph."""

import gc

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine.torch as me  # noqa: E402
from reference import make_splits  # noqa: E402

T, H, F, G = 1024, 256, 512, 4
PER_LAYER = T * (H + 2 * F) * 2  # what a layer keeps: x and the pre-activation (bf16)
X_BYTES = T * H * 2  # the stack's input: a leaf that requires grad, so never offloaded
MIN_BYTES = 64 << 10  # offload x and the pre-activation, not the probs or splits


def offloader(n):
    return me.ActivationOffload(n, min_bytes=MIN_BYTES)


def stack(n, cuda, **opt):
    torch.manual_seed(0)
    layers = [me.GroupedMLP(G, H, F, glu_layout="blocks:32", accumulate_into_main_grad=True, device=cuda, **opt)
              for _ in range(n)]
    for m in layers:
        for p in m.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=cuda)
    return layers


def inputs(seed, cuda, routing=(300, 0, 1, 600)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(cuda, torch.bfloat16)
    p = torch.rand(T, generator=g).to(cuda)
    dy = torch.randn(T, H, generator=g).to(cuda, torch.bfloat16)
    return x, p, dy, make_splits(list(routing), cuda)


def step(layers, x, p, dy, splits, offload=None):
    """Forward + backward of the stack (+ backward_dw); returns y and dx."""
    x = x.detach().requires_grad_()
    h = x
    for i, m in enumerate(layers):
        if offload is None:
            h = m(h, splits, p)
        else:
            with offload.layer(i) as scope:
                h = scope.output(m(h, splits, p))
    h.backward(dy)
    for m in layers:
        m.backward_dw()
    return h.detach(), x.grad


def grads(layers):
    return [p.main_grad.clone() for m in layers for p in m.parameters()]


def zero(layers):
    for m in layers:
        for p in m.parameters():
            p.main_grad.zero_()


def test_offload_is_bit_identical_and_lowers_peak_memory(cuda):
    layers = stack(8, cuda)
    args = inputs(1, cuda)
    step(layers, *args)  # warm-up (kernels, workspace)
    zero(layers)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y0, dx0 = step(layers, *args)
    peak_off = torch.cuda.max_memory_allocated() - base
    after_off = torch.cuda.memory_allocated() - base  # y and dx
    g0 = grads(layers)
    zero(layers)
    offload = offloader(len(layers))
    step(layers, *args, offload=offload)  # first step: allocates the pinned buffers
    zero(layers)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y1, dx1 = step(layers, *args, offload=offload)
    torch.cuda.synchronize()
    peak_on = torch.cuda.max_memory_allocated() - base
    assert torch.cuda.memory_allocated() - base == after_off  # nothing retained but y and dx
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for a, b in zip(g0, grads(layers)):
        assert torch.equal(a, b)
    # x and the pre-activation of 7 of the 8 layers went to the host, but for the stack's input
    # (held by autograd anyway); layer 6, still held when backward began, was kept and not
    # copied back
    assert offload.offloaded_bytes == 7 * PER_LAYER - X_BYTES
    assert offload.reloaded_bytes == 6 * PER_LAYER - X_BYTES
    assert peak_off - peak_on >= 3 * PER_LAYER, (peak_on, peak_off)
    # Saved activations resident: two layers' at most (the window), against all eight without
    # offload (offload_layers=0 only counts; the caller's input is not counted); nothing is left
    # counted after the step.
    small = 64 << 10  # probs and splits
    assert 2 * PER_LAYER <= offload.peak_saved_bytes <= 2 * PER_LAYER + small, offload.peak_saved_bytes
    assert offload.saved_bytes == 0
    meter = me.ActivationOffload(len(layers), offload_layers=0)
    zero(layers)
    y2, dx2 = step(layers, *args, offload=meter)
    assert torch.equal(y0, y2) and torch.equal(dx0, dx2)
    assert meter.offloaded_bytes == 0 and meter.saved_bytes == 0
    assert 8 * PER_LAYER - X_BYTES <= meter.peak_saved_bytes <= 8 * PER_LAYER - X_BYTES + small, \
        meter.peak_saved_bytes


def test_offload_of_x_only_layers_is_bit_identical(cuda):
    # recompute_fc1: a layer keeps x alone and runs FC1 again in backward
    layers = stack(4, cuda, recompute_fc1=True)
    args = inputs(4, cuda)
    y0, dx0 = step(layers, *args)
    g0 = grads(layers)
    zero(layers)
    offload = offloader(len(layers))
    y1, dx1 = step(layers, *args, offload=offload)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for a, b in zip(g0, grads(layers)):
        assert torch.equal(a, b)
    # layer 0's x is the caller's (a leaf), layer 2 is kept, layer 3 is the last
    assert offload.offloaded_bytes == 2 * X_BYTES and offload.reloaded_bytes == X_BYTES
    assert offload.saved_bytes == 0


def test_opt_outs_keep_tensors_on_the_device(cuda):
    layers = stack(3, cuda)
    layers[1].offload_activations = False
    args = inputs(2, cuda)
    offload = offloader(3)
    y1, _ = step(layers, *args, offload=offload)
    # layer 0's pre-activation only: its x is the caller's, layer 1 opted out, layer 2 is last
    assert offload.offloaded_bytes == PER_LAYER - X_BYTES
    layers[1].offload_activations = True
    x, p, dy, splits = args
    h = x.detach().requires_grad_()
    with offload.layer(0) as scope:
        with me.no_offload():
            h = scope.output(layers[0](h, splits, p))
    with offload.layer(1) as scope:
        me.mark_not_offload(h)  # the layer's input stays; its pre-activation goes
        h = scope.output(layers[1](h, splits, p))
    with offload.layer(2) as scope:
        h = scope.output(layers[2](h, splits, p))
    assert offload.offloaded_bytes == T * 2 * F * 2
    h.backward(dy)
    assert torch.equal(h.detach(), y1)


def test_many_layers_and_steps_leak_nothing(cuda):
    # Garbage of earlier tests in reference cycles (Megatron-core's modules, for one) would be
    # freed by whichever collection runs during the steps below, lowering memory_allocated.
    gc.collect()
    layers = stack(12, cuda)
    offload = offloader(12)
    args = inputs(3, cuda)
    step(layers, *args, offload=offload)
    torch.cuda.synchronize()
    allocated, pinned = torch.cuda.memory_allocated(), offload.pinned_bytes()
    for s in range(10):
        step(layers, *inputs(10 + s, cuda, routing=(s * 50, 0, 1, 1000 - s * 50)), offload=offload)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == allocated
        assert offload.pinned_bytes() == pinned
        assert offload.saved_bytes == 0


@pytest.mark.parametrize("with_offload", [False, True])
def test_layer_stack_with_delayed_wgrad_replays_from_a_graph(cuda, with_offload):
    layers = stack(4, cuda, delay_wgrad_compute=True)
    offload = offloader(4) if with_offload else None
    sx, sp, sdy, ssplits = inputs(0, cuda)
    static = {}

    def run():
        static["y"], static["dx"] = step(layers, sx, sp, sdy, ssplits, offload=offload)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # eager warm-up: pinned buffers, pointer tables, error records
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):
        run()
    for i, routing in enumerate([(300, 0, 1, 600), (0, 0, 0, 1024), (1, 1, 1, 1), (500, 500, 0, 0)]):
        x, p, dy, splits = inputs(100 + i, cuda, routing)
        zero(layers)
        ye, dxe = step(layers, x, p, dy, splits)  # eager, no offload: the reference
        ge = grads(layers)
        zero(layers)
        sx.copy_(x)
        sp.copy_(p)
        sdy.copy_(dy)
        ssplits.copy_(splits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static["y"], ye) and torch.equal(static["dx"], dxe), f"routing {i}"
        for a, b in zip(grads(layers), ge):
            assert torch.equal(a, b), f"routing {i}: main_grad"
    me.check_errors()
