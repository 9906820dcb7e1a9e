"""Every Python example in README.md and docs/python.md runs, on every device present.

The examples are fragments (they use `x`, `splits`, `w`, ... without making them); each runs here
after a preamble that makes those names with small, mutually consistent shapes. The README's
sizes (hidden 4096, ffn 14336) are shrunk so that the CPU run stays small; nothing else is edited.
"""

import importlib.util
import os
import re

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
me = pytest.importorskip("moe_engine.torch")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
HIDDEN, FFN, GROUPS = 64, 96, 8


def python_blocks(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


EXAMPLES = [(doc, i, code) for doc in ("README.md", "docs/python.md")
            for i, code in enumerate(python_blocks(doc))]


def test_the_docs_have_examples():
    assert {doc for doc, _, _ in EXAMPLES} == {"README.md", "docs/python.md"}


def namespace(device):
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16

    def rand(*shape, dtype=bf16, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

    splits_host = torch.tensor([5, 0, 1, 17, 3, 0, 9, 2])
    tokens = int(splits_host.sum())
    G, H, F = GROUPS, HIDDEN, FFN
    layers = [me.GroupedMLP(G, H, F, device=device, dtype=bf16) for _ in range(8)]
    megatron_sd = me.GroupedMLP(G, H, F, layout="per-expert", device=device, dtype=bf16).state_dict()
    return dict(
        torch=torch, me=me, G=G, hidden=H, ffn=F, layers=layers, megatron_sd=megatron_sd,
        splits=splits_host.to(device), probs=rand(tokens, dtype=torch.float32, scale=1.0).abs(),
        x=rand(tokens, H).requires_grad_(), dy=rand(tokens, H), h=rand(tokens, 2 * F),
        d_out=rand(tokens, F), w=rand(G, H, H), b=rand(G, H), row_scale=rand(tokens, dtype=torch.float32),
        w1=rand(G, 2 * F, H), w2=rand(G, H, F), b1=rand(G, 2 * F), b2=rand(G, H),
        main_grad=torch.zeros(G, H, H, dtype=torch.float32, device=device),
        main_grad1=torch.zeros(G, 2 * F, H, dtype=torch.float32, device=device),
        main_grad2=torch.zeros(G, H, F, dtype=torch.float32, device=device),
        hook=lambda *args: None, loss_fn=lambda y: y.float().square().mean(), num_experts=G, topk=2,
        layer=me.MoELayer(H, F, G, 2, device=device, dtype=bf16))


@pytest.mark.parametrize("doc,index,code", EXAMPLES, ids=[f"{d}-{i}" for d, i, _ in EXAMPLES])
def test_doc_example_runs(doc, index, code, device):
    code = (code.replace('device="cuda"', f'device="{device.type}"')
                .replace("hidden=4096", f"hidden={HIDDEN}").replace("ffn=14336", f"ffn={FFN}"))
    if "ActivationOffload" in code and device.type != "cuda":
        pytest.skip("activation offload moves tensors to pinned host memory: CUDA only (documented)")
    if "megatron" in code and importlib.util.find_spec("megatron") is None:
        pytest.skip("the example uses megatron-core, which is not installed (pip install megatron-core)")
    scope = namespace(device)
    if "ep_group" not in code:
        exec(compile(code, f"{doc} example {index}", "exec"), scope)
        return
    # Expert parallelism: the example runs as rank 0 of a one-rank group (its init line is that).
    import tempfile

    import torch.distributed as dist

    code = re.sub(r"^dist\.init_process_group\(.*$", "", code, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1)
        try:
            scope["dist"] = dist
            exec(compile(code, f"{doc} example {index}", "exec"), scope)
        finally:
            dist.destroy_process_group()
