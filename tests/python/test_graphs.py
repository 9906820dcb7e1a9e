"""CUDA graphs: a module's forward+backward captured once (torch.cuda.graph, global capture mode)
and replayed with new routings, bit-identical to eager runs."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine.torch as me
from reference import make_splits

ROUTINGS = [[64, 0, 1, 191], [0, 0, 0, 256], [1, 1, 1, 1], [100, 100, 40, 0], [0, 0, 0, 0]]


def routing_inputs(i, T, H, device):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    p = torch.rand(T, generator=g).to(device)
    dy = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    return x, p, dy


@pytest.mark.parametrize("layout", ["packed", "per-expert"])
def test_mlp_forward_backward_replays_with_new_routing(cuda, layout):
    T, H, F = 256, 64, 64
    torch.manual_seed(0)
    m = me.GroupedMLP(4, H, F, bias=True, glu_layout="blocks:32", layout=layout, accumulate_into_main_grad=True,
                      device=cuda)
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=cuda)
    static_x = torch.zeros(T, H, dtype=torch.bfloat16, device=cuda, requires_grad=True)
    static_p = torch.zeros(T, device=cuda, requires_grad=True)
    static_dy = torch.zeros(T, H, dtype=torch.bfloat16, device=cuda)
    static_splits = make_splits(ROUTINGS[0], cuda)

    def step():
        y = m(static_x, static_splits, static_p)
        y.backward(static_dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside capture
            static_x.grad = static_p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = static_p.grad = None
    for q in m.parameters():
        q.grad = None  # the bias gradients are allocated inside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):
        static_y = step()

    for i, routing in enumerate(ROUTINGS):
        x, p, dy = routing_inputs(i, T, H, cuda)
        # eager reference
        for q in m.parameters():
            q.main_grad.zero_()
        xe, pe = x.clone().requires_grad_(), p.clone().requires_grad_()
        ye = m(xe, make_splits(routing, cuda), pe)
        ye.backward(dy)
        eager_main = [q.main_grad.clone() for q in m.parameters()]
        for q in m.parameters():
            q.main_grad.zero_()
        # replay
        with torch.no_grad():
            static_x.copy_(x)
            static_p.copy_(p)
            static_dy.copy_(dy)
            static_splits.copy_(make_splits(routing, cuda))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, ye), f"routing {i}: y"
        assert torch.equal(static_x.grad, xe.grad), f"routing {i}: dx"
        assert torch.equal(static_p.grad, pe.grad), f"routing {i}: dprobs"
        for a, b in zip(m.parameters(), eager_main):
            assert torch.equal(a.main_grad, b), f"routing {i}: main_grad"
    me.check_errors()


def test_functional_ops_replay_with_per_expert_weights(cuda):
    T, K, N = 200, 64, 48
    w = [torch.randn(N, K, device=cuda, dtype=torch.bfloat16) for _ in range(3)]
    x = torch.randn(T, K, device=cuda, dtype=torch.bfloat16)
    splits = make_splits([50, 0, 150], cuda)
    me.grouped_linear(x, w, splits)  # warm-up: uploads the pointer table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = me.grouped_linear(x, w, splits)
    for routing in ([200, 0, 0], [0, 7, 100], [1, 1, 1]):
        splits.copy_(make_splits(routing, cuda))
        graph.replay()
        assert torch.equal(y, me.grouped_linear(x, w, make_splits(routing, cuda)))
