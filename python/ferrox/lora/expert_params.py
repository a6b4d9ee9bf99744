"""PEFT's `target_parameters` adapters on stacked experts (gpt-oss, Qwen3-VL-MoE, the multimodal Qwen3.5-MoE): LoRA
on the 3-D expert parameters `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, unpacked into the per-expert
gate / up / down pairs that lora/moe.py holds.

What PEFT 0.22 writes (peft/tuners/lora/layer.py ParamWrapper, read and checked on a tiny gpt-oss): for a parameter
[E, d1, d2], one lora_A [r * E, in] and one lora_B [out, r * E] per layer. Expert e's pair is
A_e = lora_A.view(E, r, in)[e] (expert-major rows) and B_e = lora_B.view(out, r, E)[:, :, e] (expert-MINOR
columns), and the merged weight gains scaling * (B_e A_e) in the parameter's own layout: for gpt-oss, whose experts
are stored [E, in, out] (transformers' is_transposed), the delta is (B_e A_e)^T, so y = x W_e + scaling * B_e (A_e x)
is the usual LoRA with in = H, out = 2I for gate_up_proj and in = I, out = H for down_proj. The tensors' names do not
say which parameter they adapt: PEFT nests one ParamWrapper per parameter on the same `experts` module, so the
second one's pair is saved under `experts.base_layer.lora_A` and so on. The shapes do say it (gate_up: A [rE, H],
B [2I, rE]; down: A [rE, I], B [H, rE]; never equal, as H = I and H = 2I cannot both hold), so each pair is matched
by shape against the model's layer and refused by name when it fits neither or two pairs claim one parameter.

gpt-oss's gate_up_proj interleaves gate and up along 2I (even rows gate, odd up); models/gpt_oss.py de-interleaves
w13 at load, so the adapter's B rows follow: gate B = B_e[0::2], up B = B_e[1::2], each with A_e (gate and up share
one A in this format, so the slot holds it twice).

Qwen3-VL-MoE and the multimodal Qwen3.5-MoE (transformers 5, checked with peft on their tiny models): gate_up_proj
[E, 2I, H] and down_proj [E, H, I], [E, out, in] (no is_transposed: ParamWrapper swaps in / out), so A and B have
the shapes above and the delta is B_e A_e as is; gate_up's 2I rows are the gate rows, then the up rows (transformers
chunks them in two; models/qwen3_vl_moe.py unfuse_experts cuts w13 so), hence gate B = B_e[:I], up B = B_e[I:].
Their pairs sit under the checkpoint's `model.language_model.layers.{i}`, read as decoder layer i.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ferrox.lora.adapter import LoRAAdapterError, LoRAModule, PeftAdapter

# The module a stacked pair sits on: the decoder layer's experts, under any nesting of ParamWrappers.
# The multimodal Qwens' adapters name the text layers as their checkpoints do, under `model.language_model.` (read as
# `model.`, as their loaders and lora_rewrite read them).
_STACKED_MODULE = re.compile(r"^model\.(?:language_model\.)?layers\.(?P<layer>\d+)\.mlp\.experts(?:\.base_layer)*$")


@dataclass(frozen=True, slots=True)
class StackedLayerShape:
    """One decoder layer's experts as the checkpoint holds them (whole, before any tensor-parallel cut)."""

    num_experts: int
    hidden: int
    intermediate: int  # I of each expert (gate_up has 2I rows)


def unstack(adapter: PeftAdapter, shapes: dict[int, StackedLayerShape], *, interleaved: bool) -> dict[str, LoRAModule]:
    """The adapter's stacked pairs as per-expert modules named `model.layers.{i}.mlp.experts.{e}.gate_proj` /
    `up_proj` / `down_proj` (lora/moe_targets.py reads them so). shapes: the MoE layers taking adapters, by decoder
    layer. interleaved: gate / up alternate along gate_up_proj's 2I outputs (gpt-oss)."""
    out: dict[str, LoRAModule] = {}
    claimed: dict[tuple[int, str], str] = {}
    for name, pair in adapter.stacked.items():
        match = _STACKED_MODULE.match(name)
        where = f"{adapter.weights_file}: tensor {pair.a_key!r}"
        if match is None:
            raise LoRAAdapterError(f"{where}: {name!r} is not a decoder layer's mlp.experts (target_parameters adapt "
                                   "the experts' gate_up_proj / down_proj only)")
        layer = int(match["layer"])
        shape = shapes.get(layer)
        if shape is None:
            raise LoRAAdapterError(f"{where}: decoder layer {layer} has no routed experts that take adapters")
        num, hidden, inter = shape.num_experts, shape.hidden, shape.intermediate
        a, b = pair.lora_a, pair.lora_b
        rank = pair.rank
        if a.shape[0] != rank * num or b.shape[1] != rank * num:
            raise LoRAAdapterError(f"{where} {tuple(a.shape)} and {pair.b_key!r} {tuple(b.shape)}: not a stacked pair "
                                   f"of the layer's {num} experts at r={rank} ([{rank * num}, in] and "
                                   f"[out, {rank * num}])")
        param = {(hidden, 2 * inter): "gate_up_proj", (inter, hidden): "down_proj"}.get((a.shape[1], b.shape[0]))
        if param is None:
            raise LoRAAdapterError(
                f"{where} {tuple(a.shape)} and {pair.b_key!r} {tuple(b.shape)} fit neither experts.gate_up_proj "
                f"(A [{rank * num}, {hidden}], B [{2 * inter}, {rank * num}]) nor experts.down_proj (A [{rank * num}, "
                f"{inter}], B [{hidden}, {rank * num}]) of decoder layer {layer}")
        previous = claimed.setdefault((layer, param), pair.a_key)
        if previous != pair.a_key:
            raise LoRAAdapterError(f"{where} and {previous!r} both adapt decoder layer {layer}'s experts.{param}")
        per_a = a.view(num, rank, a.shape[1])
        per_b = b.view(b.shape[0], rank, num)
        prefix = f"model.layers.{layer}.mlp.experts"
        for e in range(num):
            a_e, b_e = per_a[e].contiguous(), per_b[:, :, e].contiguous()
            if param == "down_proj":
                parts = {"down_proj": b_e}
            elif interleaved:
                parts = {"gate_proj": b_e[0::2].contiguous(), "up_proj": b_e[1::2].contiguous()}
            else:
                parts = {"gate_proj": b_e[:inter].contiguous(), "up_proj": b_e[inter:].contiguous()}
            for proj, b_part in parts.items():
                out[f"{prefix}.{e}.{proj}"] = LoRAModule(f"{prefix}.{e}.{proj}", a_e, b_part, pair.scaling,
                                                         pair.a_key, pair.b_key)
    return out

