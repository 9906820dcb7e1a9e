"""moe-engine experts inside megatron-core's ``MoELayer``.

``GroupedMLPExperts`` is an experts module with the constructor and forward contract of
megatron-core's ``SequentialMLP`` / ``TEGroupedMLP`` (``megatron/core/transformer/moe/experts.py``),
built by ``MoELayer`` through ``build_module(submodules.experts, num_local_experts, config,
pg_collection=...)``. It runs ``moe_engine.torch.GroupedMLP`` on the local experts. To use it, put
it into the layer spec in place of Megatron's experts::

    from megatron.core.transformer.spec_utils import ModuleSpec
    from moe_engine.megatron import GroupedMLPExperts

    layer_spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=True)  # or the TE spec
    layer_spec.submodules.mlp.submodules.experts = ModuleSpec(module=GroupedMLPExperts)
    # or: moe_engine.megatron.use_moe_engine_experts(layer_spec)

What it maps from the ``TransformerConfig``:

- ``hidden_size``, ``moe_ffn_hidden_size``, ``params_dtype``, ``add_bias_linear`` (FC1's bias before
  the activation, FC2's scaled by the probs, as Megatron's experts), ``init_method`` (FC1) and
  ``output_layer_init_method`` (FC2) per expert, biases zero, ``use_cpu_initialization`` (CPU
  parameters, else the current CUDA device), ``perform_initialization``;
- the activation: ``gated_linear_unit`` with ``F.silu`` (swiglu; with
  ``activation_func_clamp_value`` or ``glu_linear_offset`` the clamped form, alpha 1) or
  ``quick_gelu`` (clamped_qgeglu: alpha 1.702, ``activation_func_clamp_value`` as the limit, inf
  when None, ``glu_linear_offset``); non-gated ``squared_relu`` (srelu) and ``fast_gelu`` /
  ``partial(F.gelu, approximate="tanh")`` (gelu_tanh);
- ``gradient_accumulation_fusion`` -> ``accumulate_into_main_grad`` (the weight gradients go into
  ``param.main_grad``, float32, with ``grad_added_to_main_grad`` as Megatron's DDP sets it);
  ``delay_wgrad_compute`` (``backward_dw()``; the DDP hooks register on the inner
  ``GroupedMLP``, which has ``register_wgrad_accumulation_and_reduce_hooks``);
- ``moe_apply_probs_on_input`` (x scaled by the probs in its dtype, the MLP then without probs;
  needs ``moe_router_topk == 1``, as Megatron's experts assert);
- ``recompute_granularity == "selective"`` with ``"moe_act"`` in ``recompute_modules`` ->
  ``recompute_fc1`` (backward keeps x and recomputes FC1 and the activation);
- ``expert_model_parallel_size``: the local experts only; weights get ``allreduce = False``
  when it is > 1, as Megatron's expert weights.

Anything it cannot serve is a ``ValueError`` at construction that names the setting: expert
tensor parallelism > 1, ``moe_latent_size``, FP8 / FP4 (``config.fp8`` / ``config.fp4``; moe-engine's
own FP8 is ``fp8_recipe`` in the spec's params), other activations, fine-grained activation
offloading of the experts. ``tokens_per_expert`` may be on the host (a list, or a CPU tensor: copied
to the device) or on the tokens' device (used as it is: never read on the host, so no sync).

Checkpoints (``state_dict`` / ``load_state_dict``): saved in ``TEGroupedMLP``'s keys and layout,
``linear_fc1.weight{i}`` ``[2F, H]`` (FC1 rows in Megatron's "halves" order: gate rows, then up
rows), ``linear_fc2.weight{i}`` ``[H, F]`` and the biases ``linear_fc{1,2}.bias{i}``; loaded from
those, from ``SequentialMLP``'s ``local_experts.{i}.linear_fc{1,2}.{weight,bias}``, from the legacy
``GroupedMLP``'s ``weight1`` ``[H, G*2F]`` / ``weight2`` ``[G*F, H]``, and from the module's own
packed keys; ``_extra_state`` keys (TransformerEngine's) are ignored. ``sharded_state_dict``
(distributed checkpointing) gives the ShardedTensors of ``SequentialMLP`` / ``TEGroupedMLP``
(``{prefix}experts.linear_fc1.weight`` over the global experts, FC1 split into its two GLU halves),
so distributed checkpoints move between them and this module.

Options a ``ModuleSpec`` can pass in ``params`` (keyword-only): ``glu_layout`` (default ``halves``,
Megatron's; ``blocks:32`` or ``pairs`` let the Hopper FC1 epilogue fuse the GLU; the state dicts
stay in halves, converted on save and load; distributed checkpointing needs ``halves``),
``fusion``, ``layout`` (``packed`` or ``per-expert`` parameters), ``recompute_fc1`` (None: from the
config), ``fp8_recipe``.

This module imports megatron-core; nothing else in moe_engine does.
"""

from __future__ import annotations

import functools
import operator
from typing import List, Optional, Sequence, Union

try:
    import megatron.core  # noqa: F401
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "moe_engine.megatron needs megatron-core, which could not be imported "
        f"({_err}); install it (pip install megatron-core) or use moe_engine.torch.GroupedMLP directly"
    ) from _err

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C
from .torch import GroupedMLP

__all__ = ["GroupedMLPExperts", "experts_spec", "use_moe_engine_experts", "activation_of"]


def _pg_sizes(pg_collection):
    """(ep size, ep rank, expert-tp size, expert-dp rank) of the process groups (1, 0, 1, 0 when
    there are none: a single process without megatron's parallel state)."""
    if pg_collection is None:
        try:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        except Exception:  # parallel state not initialized
            return None, 1, 0, 1, 0

    def size_rank(name):
        g = getattr(pg_collection, name, None)
        if g is None:
            return 1, 0
        return g.size(), g.rank()

    ep_size, ep_rank = size_rank("ep")
    tp_size, _ = size_rank("expt_tp")
    _, dp_rank = size_rank("expt_dp")
    return pg_collection, ep_size, ep_rank, tp_size, dp_rank


def _is(fn, name: str) -> bool:
    """fn is megatron's activation ``name`` (megatron.core.activations or its fusions module)."""
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)
    return getattr(fn, "__name__", None) == name and str(getattr(fn, "__module__", "")).startswith("megatron.")


def activation_of(config: TransformerConfig) -> dict:
    """The GroupedMLP activation keywords (``activation``, ``limit``, ``alpha``, ``offset``) for the
    config's ``activation_func`` / ``gated_linear_unit`` / ``activation_func_clamp_value`` /
    ``glu_linear_offset``; a ``ValueError`` for one moe-engine does not implement."""
    fn = config.activation_func
    clamp = getattr(config, "activation_func_clamp_value", None)
    offset = float(getattr(config, "glu_linear_offset", 0.0) or 0.0)
    name = getattr(fn, "__name__", None) or repr(fn)
    if config.gated_linear_unit:
        if fn is F.silu or _is(fn, "silu"):
            if clamp is None and offset == 0.0:
                return {"activation": "swiglu"}
            alpha = 1.0
        elif _is(fn, "quick_gelu"):
            alpha = 1.702
        else:
            raise ValueError(
                f"moe_engine.megatron: gated_linear_unit with activation_func {name} is not supported; "
                "moe-engine's GLUs are F.silu (swiglu) and quick_gelu (clamped_qgeglu)")
        limit = float("inf") if clamp is None else float(clamp)
        return {"activation": "clamped_qgeglu", "limit": limit, "alpha": alpha, "offset": offset}
    if clamp is not None:
        raise ValueError("moe_engine.megatron: activation_func_clamp_value applies to GLUs only; "
                         "this config has gated_linear_unit=False")
    if _is(fn, "squared_relu"):
        return {"activation": "srelu"}
    if _is(fn, "fast_gelu") or (isinstance(fn, functools.partial) and fn.func is F.gelu
                                and fn.keywords.get("approximate") == "tanh" and not fn.args):
        return {"activation": "gelu_tanh"}
    raise ValueError(
        f"moe_engine.megatron: activation_func {name} without gated_linear_unit is not supported; "
        "moe-engine's non-gated activations are squared_relu (srelu) and fast_gelu or "
        "partial(F.gelu, approximate='tanh') (gelu_tanh); F.gelu (erf) is not one of them")


def _reject_unsupported(config: TransformerConfig, tp_size: int) -> None:
    etp = getattr(config, "expert_tensor_parallel_size", None) or 1
    if tp_size > 1 or etp > 1:
        raise ValueError(
            f"moe_engine.megatron: expert tensor parallelism is not supported (expert_tensor_parallel_size = "
            f"{max(etp, tp_size)}); set expert_tensor_parallel_size=1 (experts split by expert parallelism only)")
    if getattr(config, "moe_latent_size", None) is not None:
        raise ValueError("moe_engine.megatron: moe_latent_size is not supported (the experts' input is hidden_size)")
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        raise ValueError(
            "moe_engine.megatron: config.fp8 / config.fp4 (TransformerEngine's recipes) are not supported by "
            "GroupedMLPExperts; moe-engine's FP8 block scaling is ModuleSpec(module=GroupedMLPExperts, "
            "params={'fp8_recipe': moe_engine.torch.Fp8Recipe()}) with the config's fp8 unset")
    offload = set(getattr(config, "offload_modules", None) or ())
    if getattr(config, "fine_grained_activation_offloading", False) and offload & {"expert_fc1", "moe_act"}:
        raise ValueError(
            "moe_engine.megatron: fine-grained activation offloading of expert_fc1 / moe_act is not supported; "
            "moe_engine.torch.ActivationOffload offloads the experts' saved tensors")
    if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
        raise ValueError(
            f"moe_engine.megatron: moe_apply_probs_on_input needs moe_router_topk == 1 (got "
            f"{config.moe_router_topk}), as in megatron-core's experts")


def _count(c) -> int:
    """One entry of a tokens_per_expert list: an integer (Python, NumPy, or an integer 0-dim tensor),
    not a bool, float or string, which int() would truncate or parse."""
    if isinstance(c, bool) or (isinstance(c, Tensor) and (c.dtype == torch.bool or c.dtype.is_floating_point)):
        raise TypeError(f"moe_engine.megatron: tokens_per_expert must hold integer token counts, got {c!r}")
    try:
        return operator.index(c)
    except TypeError:
        raise TypeError(f"moe_engine.megatron: tokens_per_expert must hold integer token counts, got "
                        f"{type(c).__name__} {c!r}") from None


class GroupedMLPExperts(MegatronModule):
    """The local experts of a megatron-core ``MoELayer`` on ``moe_engine.torch.GroupedMLP``
    (module docstring: what the config maps to, what is rejected, the checkpoint formats).

    ``forward(permuted_local_hidden_states [T, H], tokens_per_expert [G], permuted_probs [T])``
    returns ``(output [T, H], None)``: ``output = FC2(act(FC1 x + b1) * p) + p * b2`` per expert,
    rows sorted by expert as Megatron's token dispatchers give them."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules=None,
                 pg_collection=None, *, glu_layout: str = "halves", fusion: str = "forward",
                 layout: str = "packed", recompute_fc1: Optional[bool] = None, fp8_recipe=None):
        super().__init__(config=config)
        pg_collection, ep_size, ep_rank, tp_size, dp_rank = _pg_sizes(pg_collection)
        _reject_unsupported(config, tp_size)
        self.num_local_experts = num_local_experts
        self.ep_size, self.ep_rank, self.expt_dp_rank = ep_size, ep_rank, dp_rank
        act = activation_of(config)
        self.gated = bool(config.gated_linear_unit)
        if not self.gated and glu_layout != "halves":
            raise ValueError(f"moe_engine.megatron: glu_layout={glu_layout!r} with a non-gated activation "
                             f"({act['activation']}); leave it halves")
        if recompute_fc1 is None:
            recompute_fc1 = (config.recompute_granularity == "selective"
                             and "moe_act" in (getattr(config, "recompute_modules", None) or ()))
        self.apply_probs_on_input = bool(config.moe_apply_probs_on_input)
        device = torch.device("cpu") if config.use_cpu_initialization else torch.device(
            "cuda", torch.cuda.current_device())
        self.hidden, self.ffn = config.hidden_size, config.moe_ffn_hidden_size
        self.mlp = GroupedMLP(
            num_local_experts, config.hidden_size, config.moe_ffn_hidden_size, bias=config.add_bias_linear,
            glu_layout=glu_layout, fusion=fusion, recompute_fc1=recompute_fc1, layout=layout,
            accumulate_into_main_grad=bool(config.gradient_accumulation_fusion),
            delay_wgrad_compute=bool(getattr(config, "delay_wgrad_compute", False)), fp8_recipe=fp8_recipe,
            device=device, dtype=config.params_dtype, **act)
        self._init_parameters(config)
        self._mark_parameters()
        self._register_state_dict_hook(GroupedMLPExperts._save_megatron_keys)
        self._register_load_state_dict_pre_hook(self._load_megatron_keys)

    # ---- parameters ----

    def _init_parameters(self, config: TransformerConfig) -> None:
        """Megatron's initialization: init_method for FC1, output_layer_init_method for FC2, each
        expert's [N, K] on its own (on the GPU under the expert-parallel RNG stream when megatron's
        tracker has one), biases zero."""
        if not config.perform_initialization:
            return
        fork = None
        if not config.use_cpu_initialization:
            try:
                from megatron.core.tensor_parallel.random import (
                    get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name)

                tracker, name = get_cuda_rng_tracker(), get_expert_parallel_rng_tracker_name()
                if name in tracker.get_states():
                    fork = tracker.fork(name)
            except Exception:
                fork = None
        with torch.no_grad(), (fork if fork is not None else _nullcontext()):
            for params, init in ((self.mlp.fc1, config.init_method), (self.mlp.fc2, config.output_layer_init_method)):
                for w in params.weights():
                    for expert in (w.unbind(0) if w.dim() == 3 else (w,)):
                        init(expert)
                for b in params.biases():
                    b.zero_()

    def _mark_parameters(self) -> None:
        """The attributes megatron-core's optimizer, DDP and grad-norm code read on expert weights."""
        expert_parallel = self.ep_size > 1
        for fc, tp_dim in ((self.mlp.fc1, -2), (self.mlp.fc2, -1)):
            for w in fc.weights():
                w.allreduce = not expert_parallel
                w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, w.dim() + tp_dim, 1
            for b in fc.biases():
                b.allreduce = not expert_parallel
                if fc is self.mlp.fc1:  # FC1's bias is column-parallel; FC2's is duplicated
                    b.tensor_model_parallel, b.partition_dim, b.partition_stride = True, b.dim() - 1, 1

    # ---- forward ----

    def _splits(self, tokens_per_expert, device: torch.device) -> Tensor:
        if isinstance(tokens_per_expert, Tensor):
            if tokens_per_expert.dim() != 1 or tokens_per_expert.shape[0] != self.num_local_experts:
                raise ValueError(f"moe_engine.megatron: tokens_per_expert must be [{self.num_local_experts}] "
                                 f"(one count per local expert), got {list(tokens_per_expert.shape)}")
            dtype = tokens_per_expert.dtype
            if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
                raise TypeError(f"moe_engine.megatron: tokens_per_expert must be an integer tensor (token counts), got "
                                f"{dtype}; a conversion would truncate or reinterpret the counts")
            if tokens_per_expert.device == device:
                return tokens_per_expert if tokens_per_expert.dtype in (torch.int64, torch.int32) else \
                    tokens_per_expert.to(torch.int64)
            if tokens_per_expert.device.type != "cpu":
                raise ValueError(f"moe_engine.megatron: tokens_per_expert is on {tokens_per_expert.device}, "
                                 f"the tokens on {device}")
            return tokens_per_expert.to(device=device, dtype=torch.int64, non_blocking=True)
        if isinstance(tokens_per_expert, (str, bytes)):
            raise TypeError(f"moe_engine.megatron: tokens_per_expert must be an integer tensor or a list of ints, got "
                            f"{type(tokens_per_expert).__name__}")
        counts = [_count(c) for c in tokens_per_expert]
        if len(counts) != self.num_local_experts:
            raise ValueError(f"moe_engine.megatron: tokens_per_expert has {len(counts)} counts, expected "
                             f"{self.num_local_experts} (one per local expert)")
        return torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)

    def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Union[Tensor, Sequence[int]],
                permuted_probs: Optional[Tensor]):
        x = permuted_local_hidden_states
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        splits = self._splits(tokens_per_expert, x.device)
        probs = None if permuted_probs is None else permuted_probs.reshape(-1)
        if self.apply_probs_on_input and probs is not None:
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = None
        elif probs is not None and probs.dtype != torch.float32:
            probs = probs.float()
        y = self.mlp(x, splits, probs)  # T = 0 too: every weight still gets its (zero) gradient
        return y.reshape(shape), None

    def backward_dw(self) -> None:
        """The delayed weight gradients (``delay_wgrad_compute``), then the hooks that megatron's
        DDP registered on the inner GroupedMLP."""
        self.mlp.backward_dw()

    # ---- checkpoints ----

    def _glu_perm(self, src: str, dst: str) -> Optional[Tensor]:
        if not self.gated or _C.glu_layout_name(src) == _C.glu_layout_name(dst):
            return None
        return torch.tensor(_C.glu_row_permutation(src, dst, self.ffn))

    def _expert_tensors(self, fc, name: str) -> List[Tensor]:
        """The G per-expert tensors of fc's ``name`` (weight or bias), detached views."""
        ts = fc.weights() if name == "weight" else fc.biases()
        if len(ts) == 1 and fc.packed:
            return list(ts[0].detach().unbind(0))
        return [t.detach() for t in ts]

    @staticmethod
    def _save_megatron_keys(module: "GroupedMLPExperts", state_dict, prefix, local_metadata):
        """state_dict hook: the inner module's keys -> TEGroupedMLP's (per expert, FC1 rows in halves)."""
        for k in [k for k in state_dict if k.startswith(prefix + "mlp.")]:
            del state_dict[k]
        perm = module._glu_perm(module.mlp.glu_layout, "halves")
        for fc, name in ((module.mlp.fc1, "linear_fc1"), (module.mlp.fc2, "linear_fc2")):
            for kind in ("weight", "bias") if fc.has_bias else ("weight",):
                for i, t in enumerate(module._expert_tensors(fc, kind)):
                    if perm is not None and fc is module.mlp.fc1:
                        t = t[perm.to(t.device)]
                    state_dict[f"{prefix}{name}.{kind}{i}"] = t

    def _load_megatron_keys(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                            error_msgs):
        """load_state_dict pre-hook: TEGroupedMLP / SequentialMLP / legacy GroupedMLP keys -> the
        inner module's per-expert keys (the inner module's own hook then packs them), FC1 rows from
        halves to the module's GLU layout. Keys already in the inner module's form are left alone."""
        G = self.num_local_experts
        inner = {"linear_fc1": prefix + "mlp.fc1.", "linear_fc2": prefix + "mlp.fc2."}
        renamed = {}
        for k in list(state_dict):
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix):]
            if rest.endswith("_extra_state") and (rest.startswith("linear_fc") or rest.startswith("local_experts.")):
                del state_dict[k]
                continue
            parts = rest.split(".")
            if len(parts) == 2 and parts[0] in inner and parts[1].rstrip("0123456789") in ("weight", "bias") \
                    and parts[1] not in ("weight", "bias"):  # TEGroupedMLP: linear_fc1.weight3
                renamed[k] = inner[parts[0]] + parts[1]
            elif len(parts) == 4 and parts[0] == "local_experts" and parts[1].isdigit() and parts[2] in inner \
                    and parts[3] in ("weight", "bias"):  # SequentialMLP: local_experts.3.linear_fc1.weight
                renamed[k] = inner[parts[2]] + parts[3] + parts[1]
        for k, new in renamed.items():
            state_dict[new] = state_dict.pop(k)
        for legacy, fc, transpose in (("weight1", "fc1", True), ("weight2", "fc2", True)):
            k = prefix + legacy
            if k in state_dict:  # legacy GroupedMLP: weight1 [H, G*W], weight2 [G*F, H] (x @ w)
                t = state_dict.pop(k)
                if legacy == "weight1":  # megatron reads it as weight1.view(G, H, W)
                    experts = t.reshape(G, t.shape[0], -1).transpose(1, 2)  # [G, W, H]
                else:
                    experts = t.reshape(G, -1, t.shape[-1]).transpose(1, 2)  # [G, H, F]
                for i in range(G):
                    state_dict[f"{prefix}mlp.{fc}.weight{i}"] = experts[i]
                renamed[k] = None
        perm = self._glu_perm("halves", self.mlp.glu_layout)
        if perm is not None and renamed:
            for i in range(G):
                for kind in ("weight", "bias"):
                    k = f"{prefix}mlp.fc1.{kind}{i}"
                    if k in state_dict:
                        state_dict[k] = state_dict[k][perm.to(state_dict[k].device)]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """megatron-core's distributed checkpoint of the local experts: the ShardedTensors of
        SequentialMLP / TEGroupedMLP (key ``{prefix}experts.linear_fc{1,2}.{weight,bias}`` over the
        global experts, or ``{prefix}experts.{e}.`` ... with ``singleton_local_shards``; FC1 split into
        its GLU halves by megatron's swiglu factory); the dict's keys are this module's state_dict
        keys, so ``load_state_dict`` takes what ``dist_checkpointing.load`` returns."""
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        if self.gated and self.mlp.glu_layout != "halves":
            raise NotImplementedError(
                f"moe_engine.megatron: sharded_state_dict with glu_layout={self.mlp.glu_layout}: distributed "
                "checkpoints hold FC1 in halves; build the experts with glu_layout='halves' to use them")
        singleton = bool((metadata or {}).get("singleton_local_shards", False))
        num_global = self.ep_size * self.num_local_experts
        out = {}
        for fc, name in ((self.mlp.fc1, "linear_fc1"), (self.mlp.fc2, "linear_fc2")):
            for kind in ("weight", "bias") if fc.has_bias else ("weight",):
                for i, t in enumerate(self._expert_tensors(fc, kind)):
                    e = self.ep_rank * self.num_local_experts + i
                    if singleton:
                        key, offsets = f"{prefix}experts.{e}.{name}.{kind}", tuple(sharded_offsets)
                    else:
                        key = f"{prefix}experts.{name}.{kind}"
                        offsets = (*sharded_offsets, (len(sharded_offsets), e, num_global))
                    sh = ShardedTensor.from_rank_offsets(key, t, *offsets, replica_id=(0, 0, self.expt_dp_rank),
                                                         prepend_axis_num=len(offsets))
                    if self.gated and fc is self.mlp.fc1:
                        sh = apply_swiglu_sharded_factory(sh, offsets, singleton)
                    out[f"{prefix}{name}.{kind}{i}"] = sh
        return out


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def experts_spec(**params):
    """``ModuleSpec(module=GroupedMLPExperts, params=params)``: the experts entry of
    ``MoESubmodules`` (params: the keyword options of ``GroupedMLPExperts``)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=GroupedMLPExperts, params=dict(params))


def use_moe_engine_experts(spec, **params):
    """Puts ``experts_spec(**params)`` in place of the experts of every ``MoESubmodules`` found in
    ``spec`` (a ModuleSpec of an MoE layer, a transformer layer, or a block of layers; in place) and
    returns ``spec``. A spec with no MoE layer is a ``ValueError``."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    found = []

    def walk(obj, seen):
        if obj is None or id(obj) in seen or isinstance(obj, (str, int, float, bool, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, MoESubmodules):
            obj.experts = experts_spec(**params)
            found.append(obj)
            return
        if isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, seen)
            return
        if isinstance(obj, dict):
            for o in obj.values():
                walk(o, seen)
            return
        for attr in ("submodules", "layer_specs", "mlp"):
            if hasattr(obj, attr):
                walk(getattr(obj, attr), seen)
        if hasattr(obj, "__dataclass_fields__"):
            for f in obj.__dataclass_fields__:
                walk(getattr(obj, f, None), seen)

    walk(spec, set())
    if not found:
        raise ValueError("moe_engine.megatron.use_moe_engine_experts: the spec has no MoE layer (MoESubmodules)")
    return spec
