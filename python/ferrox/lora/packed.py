"""An adapter laid out for one model: checked against the model's wrapped projections, then packed
per wrapped layer the way a slot holds it, ready to be copied into any slot.

A wrapped layer with S output slices (q/k/v: 3, gate/up: 2, o and down: 1) gets
  lora_a [S*r, in]   slice s's A at rows [s*r, s*r + r_s) (r: the adapter's largest rank)
  lora_b [out, r]    slice s's B at rows of its output columns, times the module's scaling (and the
                     layer's output_scale, a constant folded into its base weight: Granite)
with zeros where the adapter leaves a slice out or has a smaller rank there, in the model dtype
(pinned when the slots live on a GPU, so a slot swap is an asynchronous copy). Under tensor parallelism
each rank packs its share (lora/layers.py): the adapter's tensors are checked against the checkpoint's
shapes, then cut to the layer's input columns of A and output rows of B.

A family whose loader rewrites a projection's output rows (q/k rows permuted for the rotary layout, fused
projections cut) passes its `lora_rewrite`: the adapter's B then follow the same rows first (lora/rewrite.py).
A merged layer loaded from one checkpoint tensor (the Mamba2 in_proj: z, x, B, C, dt) is one module to an adapter:
its B is cut into the layer's slices as the loader cuts the weight, each slice taking its rows (this rank's share
under tensor parallelism) and the module's A.

An MoE model's expert modules (`...experts.{e}.gate_proj`...) are checked and packed per MoE layer by
lora/moe_targets.py (`experts`), beside the projections' weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferrox.lora.adapter import (
    UNSUPPORTED_TARGETS,
    LoRAAdapterError,
    LoRAModule,
    PeftAdapter,
    text_model_name,
)
from ferrox.lora.layers import LoRALinear
from ferrox.lora.moe import ExpertSlotWeights
from ferrox.lora.moe_targets import ExpertTarget, ExpertTargets
from ferrox.lora.request import LoRARequest
from ferrox.lora.rewrite import LoRARewrite, rewritten_modules


@dataclass(frozen=True, slots=True)
class ProjectionTarget:
    """Where an HF module (e.g. model.layers.3.self_attn.k_proj) lives among the wrapped layers."""

    layer: int  # index into the manager's wrapped layers
    slice: int | None  # output slice of that layer; None: all of them, the module's B rows in slice order


def _slice_rows(layer: LoRALinear, target: ProjectionTarget) -> list[tuple[int, int]]:
    """(slice, first row of that slice's rows in the module's B) for each slice the module adapts."""
    if target.slice is not None:
        return [(target.slice, 0)]
    totals = [total for _, _, total in layer.b_rows]
    return list(enumerate(itertools.accumulate(totals[:-1], initial=0)))


@dataclass(frozen=True, slots=True)
class PackedAdapter:
    request: LoRARequest
    rank: int
    weights: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]  # per wrapped layer; None: untouched
    experts: tuple[ExpertSlotWeights | None, ...] = ()  # per MoE layer (lora/moe.py); None: untouched


def pack_adapter(request: LoRARequest, adapter: PeftAdapter, layers: Sequence[LoRALinear],
                 targets: dict[str, ProjectionTarget], *, max_lora_rank: int, dtype: torch.dtype,
                 pin: bool, rewrite: LoRARewrite | None = None, experts: ExpertTargets | None = None) -> PackedAdapter:
    """Validate `adapter` against the model (targets, rank limit, every tensor's shape) and pack it;
    LoRAAdapterError names the file and the field or tensor at fault. rewrite: the model's lora_rewrite
    (None: the model keeps the checkpoint's rows). experts: the model's MoE layers that take adapters."""
    # (target_modules name the checkpoint's modules, e.g. in_proj_qkv, which the rewrite may rename or cut)
    _check_target_modules(adapter, targets, adapter.modules if rewrite is not None else {}, experts)
    _check_rank(adapter, [(m.rank, m.name) for m in adapter.modules.values()], max_lora_rank)
    adapted = adapter.modules if rewrite is None else rewritten_modules(adapter, rewrite)
    if adapter.stacked:  # target_parameters on stacked experts: per-expert modules (lora/expert_params.py)
        if experts is None:
            raise LoRAAdapterError(f"{adapter.config_file}: target_parameters {list(adapter.target_parameters)}: "
                                   "this model has no routed experts that take adapters")
        unpacked = experts.unstack(adapter, adapted)
        # (a stacked pair's rank is its parameter's, known once the model's shapes told which parameter it adapts)
        pair_of = {p.a_key: p.name for p in adapter.stacked.values()}
        _check_rank(adapter, [(m.rank, pair_of[m.a_key]) for m in unpacked.values()], max_lora_rank)
        adapted = {**adapted, **unpacked}
    rank = max((m.rank for m in adapted.values()), default=adapter.max_rank)
    by_layer: dict[int, list[tuple[int, int, LoRAModule]]] = {}  # layer -> (slice, its first row in B, module)
    expert_modules: list[tuple[ExpertTarget, LoRAModule]] = []
    for name, module in adapted.items():
        target = targets.get(name)
        expert = experts.resolve(adapter, name, module) if target is None and experts is not None else None
        if expert is not None:
            expert_modules.append((expert, module))
            continue
        if target is None:
            raise LoRAAdapterError(f"{adapter.weights_file}: tensor {module.a_key!r} adapts {name!r}, "
                                   f"{_not_supported(name, targets, experts)}")
        layer = layers[target.layer]
        expected_a = (module.rank, layer.a_columns[2])
        parts = _slice_rows(layer, target)
        expected_b = (sum(layer.b_rows[s][2] for s, _ in parts), module.rank)
        for key, tensor, expected in ((module.a_key, module.lora_a, expected_a), (module.b_key, module.lora_b,
                                                                                  expected_b)):
            if tuple(tensor.shape) != expected:
                part = f" (its rows for the model's {name})" if rewrite is not None else ""
                raise LoRAAdapterError(f"{adapter.weights_file}: tensor {key!r}{part} shape {tuple(tensor.shape)}, "
                                       f"model expects {expected}")
        by_layer.setdefault(target.layer, []).extend((s, offset, module) for s, offset in parts)

    weights: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(layers)
    for index, modules in by_layer.items():
        layer = layers[index]
        lora_a = torch.zeros(len(layer.slice_widths) * rank, layer.in_features, dtype=dtype)
        lora_b = torch.zeros(layer.out_features, rank, dtype=dtype)
        col_start, cols, _ = layer.a_columns
        for s, offset, module in modules:
            lo, hi = layer.slice_bounds[s], layer.slice_bounds[s + 1]
            row_start, rows, _ = layer.b_rows[s]
            row_start += offset
            lora_a[s * rank:s * rank + module.rank] = module.lora_a[:, col_start:col_start + cols]
            # Scaling baked into B (in float32, rounded once), so the kernels need none; with it any
            # constant the model folded into the base layer's weight (Linear.output_scale).
            lora_b[lo:hi, :module.rank] = module.lora_b[row_start:row_start + rows] * (
                module.scaling * layer.output_scale)
        weights[index] = (lora_a.pin_memory(), lora_b.pin_memory()) if pin else (lora_a, lora_b)
    packed_experts = experts.pack(expert_modules, rank, dtype, pin) if experts is not None else ()
    return PackedAdapter(request, rank, tuple(weights), packed_experts)


def _check_rank(adapter: PeftAdapter, ranks: list[tuple[int, str]], max_lora_rank: int) -> None:
    """LoRAAdapterError naming the config field and a module of the largest rank when it exceeds max_lora_rank."""
    rank, module = max(ranks, default=(0, ""))
    if rank > max_lora_rank:
        field = f"r={adapter.r}" if rank == adapter.r else f"rank_pattern rank {rank}"
        raise LoRAAdapterError(f"{adapter.config_file}: {field} exceeds max_lora_rank={max_lora_rank} (module "
                               f"{module!r})")


def _check_target_modules(adapter: PeftAdapter, targets: dict[str, ProjectionTarget],
                          sources: dict[str, LoRAModule], experts: ExpertTargets | None) -> None:
    """A list of target names must name projections this model has, or its experts' (lora/moe_targets.py), or
    modules of the adapter's (`sources`, given where the model's rewrite renames or cuts them: checked through their
    tensors, as a regex string is checked through the tensors it produced)."""
    if isinstance(adapter.target_modules, str):
        return
    for listed in adapter.target_modules:
        name = text_model_name(listed)  # (a full path under a vision-language prefix: as the modules are read)
        if any(t == name or t.endswith("." + name) for t in (*targets, *sources)):
            continue
        if experts is None or not experts.is_expert_name(name):
            raise LoRAAdapterError(f"{adapter.config_file}: target_modules {listed!r}: "
                                   f"{_not_supported(name, targets, experts)}")


def _not_supported(name: str, targets: dict[str, ProjectionTarget], experts: ExpertTargets | None = None) -> str:
    leaf = name.rsplit(".", 1)[-1]
    supported = ", ".join(sorted({t.rsplit(".", 1)[-1] for t in targets}))
    if leaf in UNSUPPORTED_TARGETS:
        return f"LoRA on the LM head or the embeddings is not supported (only {supported})"
    why = experts.why_not(name) if experts is not None else None
    return f"not a projection of this model that LoRA applies to ({supported})" + (f"; {why}" if why else "")

