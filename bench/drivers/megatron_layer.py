"""An anchor of bench/drivers/layer-bench.py: Megatron-core's MoELayer on one GPU, without
TransformerEngine (megatron-core 0.16.x from PyPI).

What runs, and why:
  world size 1   torch.distributed with one rank (nccl on CUDA, gloo on the CPU) over an in-memory
                 store, then parallel_state.initialize_model_parallel(1, 1): tensor, pipeline and
                 expert parallel sizes 1. MoELayer needs the process groups even on one GPU.
  spec           get_moe_module_spec(use_te=False, moe_grouped_gemm=...): the layer without
                 TransformerEngine. Its experts are one of two classes: GroupedMLP (one grouped GEMM
                 for all experts per FC, from the `grouped_gemm` package; chosen when it imports) or
                 SequentialMLP (a Python loop over the experts, each a ColumnParallelLinear /
                 RowParallelLinear MLP, with the split sizes on the host). TEGroupedMLP (the default
                 with TE) is out of scope.
  dispatcher     "alltoall" (Megatron's recommendation for dropless MoE) or "allgather"; with one
                 rank neither communicates, both permute with moe_utils.permute (unfused: fused
                 permutation needs TE) and sync once for the per-expert counts. alltoall also sorts
                 the chunks by local expert (a copy of the rows even with one rank).
  config         bf16 parameters and compute; router in float32 (moe_router_dtype="fp32": logits,
                 softmax and probs in float32, as the other layers of the benchmark);
                 moe_router_score_function="softmax" with moe_router_pre_softmax=False (softmax over
                 the top-k logits = the top-k softmax probabilities renormalized, norm_topk_prob);
                 no load-balancing loss (moe_router_load_balancing_type="none", as the others run
                 with aux_loss_coeff 0); gated_linear_unit=True with F.silu (SwiGLU, halves layout:
                 gate first), no biases, bias_activation_fusion=True (Megatron's fused weighted
                 SwiGLU, the router prob applied to the activation as in the others); no TE
                 fusions (moe_permute_fusion, moe_router_fusion off: they need TE).

A compatibility shim: megatron-core 0.16.1's moe_utils.RouterGatingLinearFunction reads the module
global te_general_gemm, which is only defined when TransformerEngine imports (NameError otherwise);
with te_general_gemm = None it takes its own non-TE path (torch.mm in the router dtype).

On the CPU (smoke tests of the benchmark only), two more: the router moves its weight to
torch.cuda.current_device() whenever it finds it on the CPU, so that call is pointed at the CPU; and
the alltoall dispatcher creates a CUDA stream, so only "allgather" runs there.
"""
import torch
import torch.nn.functional as F


def import_error():
    """None when megatron-core imports, else why not (a line for the report)."""
    try:
        import megatron.core  # noqa: F401
        from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: F401
    except Exception as e:  # ImportError, or a megatron-core that does not match this torch
        return f"{type(e).__name__}: {e}"
    return None


def grouped_gemm_available():
    try:
        import grouped_gemm  # noqa: F401
    except Exception:
        return False
    return True


def version():
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")


_initialized = False


def initialize(device):
    """One-rank torch.distributed and Megatron's parallel state (once per process)."""
    global _initialized
    if _initialized:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if device.type == "cpu":
        torch.cuda.current_device = lambda: "cpu"
    else:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    _initialized = True


class MegatronLayer(torch.nn.Module):
    """Megatron's MoELayer behind the benchmark's interface: forward(x [T, H]) -> y [T, H]; weights
    set from and read into the benchmark's canonical form (router [E, H], gate / up [E, F, H],
    down [E, H, F])."""

    def __init__(self, num_experts, hidden, ffn, topk, *, dispatcher="alltoall", experts="auto", device):
        super().__init__()
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        initialize(device)
        if experts == "auto":
            experts = "grouped" if grouped_gemm_available() else "sequential"
        config = TransformerConfig(
            num_layers=1, hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
            num_moe_experts=num_experts, moe_router_topk=topk, moe_router_score_function="softmax",
            moe_router_pre_softmax=False, moe_router_dtype="fp32", moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=experts == "grouped",
            moe_permute_fusion=False, moe_router_fusion=False, gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, bias_activation_fusion=True, bf16=True, params_dtype=torch.bfloat16,
            perform_initialization=False, use_cpu_initialization=device.type == "cpu")
        spec = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=experts == "grouped")
        self.layer = build_module(spec, config=config).to(device)
        self.layer.train()
        self.num_experts, self.hidden, self.ffn = num_experts, hidden, ffn
        self.dispatcher, self.experts_kind = dispatcher, experts
        self.experts_class = type(self.layer.experts).__name__
        self.dispatcher_class = type(self.layer.token_dispatcher).__name__

    def forward(self, x):
        y, bias = self.layer(x.view(x.shape[0], 1, x.shape[1]))
        assert bias is None
        return y.view(x.shape)

    def routing_counts(self, x):
        """Tokens per expert of Megatron's own router on x (no gradient)."""
        with torch.no_grad():
            _, routing_map = self.layer.router(x.view(x.shape[0], 1, x.shape[1]))
        return routing_map.sum(dim=0).long(), routing_map

    def _fc_params(self):
        """(fc1, fc2): GroupedMLP's weight1 and weight2, or SequentialMLP's per-expert lists."""
        ex = self.layer.experts
        if self.experts_class == "GroupedMLP":
            # weight1 [H, E 2F] holds w1 [E, H, 2F] in its memory, weight2 [E F, H] holds w2 [E, F, H]
            return ex.weight1, ex.weight2
        return ([m.linear_fc1.weight for m in ex.local_experts], [m.linear_fc2.weight for m in ex.local_experts])

    def load(self, w):
        """Copies the canonical weights w in."""
        E, H, Fd = self.num_experts, self.hidden, self.ffn
        fc1, fc2 = self._fc_params()
        with torch.no_grad():
            self.layer.router.weight.copy_(w["router"])
            if self.experts_class == "GroupedMLP":
                fc1.view(E, H, 2 * Fd).copy_(torch.cat([w["gate"], w["up"]], dim=1).transpose(1, 2))
                fc2.view(E, Fd, H).copy_(w["down"].transpose(1, 2))
            else:
                for e in range(E):
                    fc1[e].copy_(torch.cat([w["gate"][e], w["up"][e]], dim=0))
                    fc2[e].copy_(w["down"][e])

    def grads(self):
        """The accumulated weight gradients in the canonical form."""
        E, H, Fd = self.num_experts, self.hidden, self.ffn
        fc1, fc2 = self._fc_params()
        if self.experts_class == "GroupedMLP":
            g1 = fc1.grad.view(E, H, 2 * Fd).transpose(1, 2)
            g2 = fc2.grad.view(E, Fd, H).transpose(1, 2)
        else:
            g1 = torch.stack([p.grad for p in fc1])
            g2 = torch.stack([p.grad for p in fc2])
        return {"router": self.layer.router.weight.grad, "gate": g1[:, :Fd], "up": g1[:, Fd:], "down": g2}

    def describe(self):
        return {"experts_class": self.experts_class, "dispatcher": self.dispatcher,
                "dispatcher_class": self.dispatcher_class}
