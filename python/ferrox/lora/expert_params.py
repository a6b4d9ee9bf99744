"""PEFT's `target_parameters` adapters on stacked experts: LoRA on the 3-D expert parameters
`<block>.experts.gate_up_proj` / `<block>.experts.down_proj` (the block: `mlp`, Llama 4's `feed_forward`, Nemotron-H's
`mixer`; Gemma 4's experts sit on the decoder layer itself, `model.layers.{i}.experts`), unpacked into the per-expert
gate / up / down pairs that lora/moe.py holds. Non-gated experts (Nemotron-H's ReLU^2: transformers' NemotronHExperts)
stack `experts.up_proj` [E, I, H] in place of gate_up_proj, unpacked into up / down pairs. transformers 5 stacks the
experts of every MoE family so, and PEFT 0.22 adapts them only so (it also turns an adapter's `gate_proj` / `up_proj` /
`down_proj` targets into these parameters on those models: rank_pattern / alpha_pattern then give gate_up_proj twice
the rank and alpha).

What PEFT 0.22 writes (peft/tuners/lora/layer.py ParamWrapper, read and checked on the tiny models of each family
tested): for a parameter [E, d1, d2], one lora_A [r * E, in] and one lora_B [out, r * E] per layer. Expert e's pair is
A_e = lora_A.view(E, r, in)[e] (expert-major rows) and B_e = lora_B.view(out, r, E)[:, :, e] (expert-MINOR columns),
and the merged weight gains scaling * (B_e A_e) in the parameter's own layout, whose (in, out) PEFT reads as:
- [E, out, in], the default: (in, out) = (d2, d1), the delta B_e A_e as is. transformers 5's Qwen2-MoE, Qwen3-MoE,
  Mixtral, GLM-4.5, DeepSeek-V2 / V3, Hunyuan, ERNIE 4.5 MoE, OLMoE, MiniMax-M2, Qwen3-Next, Qwen3.5-MoE,
  Qwen3-VL-MoE and Gemma 4 store gate_up_proj [E, 2I, H] and down_proj [E, H, I] so: y = W_e x + scaling *
  B_e (A_e x), the usual LoRA with A_e [r, H], B_e [2I, r] for gate_up and A_e [r, I], B_e [H, r] for down; Nemotron-H
  its up_proj [E, I, H] (A_e [r, H], B_e [I, r]) and down_proj [E, H, I], H its experts' width (moe_latent_size where
  the latent projections wrap them).
- [E, in, out] when the experts module says so (`is_transposed`: gpt-oss): (in, out) = (d1, d2), the delta
  (B_e A_e)^T, so y = x W_e + scaling * B_e (A_e x): the usual LoRA again, with the same A_e / B_e shapes.
- Llama 4's experts are stored [E, in, out] (gate_up_proj [E, H, 2I], down_proj [E, I, H], run as x @ W_e) but say
  nothing: PEFT reads them as [E, out, in], so its A_e is [r, 2I] / [r, H] and B_e [H, r] / [I, r], and the delta B_e A_e
  lands in the stored layout: y = x (W_e + scaling * B_e A_e). As the usual LoRA that is A = B_e^T, B = A_e^T
  (`factors_swapped`).
The tensors' names do not say which parameter they adapt: PEFT nests one ParamWrapper per parameter on the same
`experts` module, so the second one's pair is saved under `experts.base_layer.lora_A` and so on. The shapes do say it
(the usual (in, out): gate_up (H, 2I), down (I, H); never both, as H = I and H = 2I cannot both hold), so each pair
is matched by shape (and its parameter's rank) against the model's layer and refused by name when it fits neither or
two pairs claim one parameter. Non-gated experts' up (H, I) and down (I, H) do fit both where H = I (a latent width
equal to the experts' intermediate size); there the nesting tells: PEFT wraps the experts' parameters in their
registration order (up_proj, then down_proj), the first innermost, so of a layer's two pairs the one under more
`base_layer`s is up_proj's; a lone pair there is the parameter target_parameters names alone, else refused by name.

gate | up along gate_up's 2I outputs: halves in every family but gpt-oss (transformers 5 chunks gate_up in two, gate
first: each family's modeling file, and the loaders stack w13 gate rows then up rows), so gate B = B[:I], up B =
B[I:]; gpt-oss interleaves them (even rows gate, odd up; models/gpt_oss.py de-interleaves w13 at load), so gate B =
B[0::2], up B = B[1::2]. Gate and up share one A in this format, so the slot holds it twice. A vision-language
checkpoint's pairs sit under its text model's prefix (`model.language_model.layers.{i}`), read as decoder layer i.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ferrox.lora.adapter import LoRAAdapterError, LoRAModule, PeftAdapter, text_model_name

# The module a stacked pair sits on: the decoder layer's experts, in its MoE block or (Gemma 4) on the layer itself,
# under any nesting of ParamWrappers (names read as the text model's: lora/adapter.py text_model_name).
_STACKED_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:(?P<block>\w+)\.)?experts"
                             r"(?P<nesting>(?:\.base_layer)*)$")


@dataclass(frozen=True, slots=True)
class StackedLayout:
    """How a family's stacked experts meet PEFT's ParamWrapper (module docstring)."""

    block: str = "mlp"  # the decoder layer's MoE block, whose `experts` hold the parameters
    interleaved: bool = False  # gate / up alternate along gate_up's 2I outputs (gpt-oss); else gate half, up half
    factors_swapped: bool = False  # stored [E, in, out] without is_transposed (Llama 4): A = B_e^T, B = A_e^T
    gated: bool = True  # False: up_proj [E, I, H] in place of gate_up_proj (Nemotron-H's ReLU^2 experts)


@dataclass(frozen=True, slots=True)
class StackedLayerShape:
    """One decoder layer's experts as the checkpoint holds them (whole, before any tensor-parallel cut)."""

    num_experts: int
    hidden: int
    intermediate: int  # I of each expert (gate_up has 2I rows)


def unstack(adapter: PeftAdapter, shapes: dict[int, StackedLayerShape],
            layout: StackedLayout) -> dict[str, LoRAModule]:
    """The adapter's stacked pairs as per-expert modules named `model.layers.{i}.<block>.experts.{e}.gate_proj` /
    `up_proj` / `down_proj` (lora/moe_targets.py reads them so; Gemma 4's without a block). shapes: the MoE layers
    taking adapters, by decoder layer."""
    out: dict[str, LoRAModule] = {}
    claimed: dict[tuple[int, str], str] = {}
    experts = f"{layout.block}.experts" if layout.block else "experts"
    first = "gate_up_proj" if layout.gated else "up_proj"
    matches = {name: _STACKED_MODULE.match(text_model_name(name)) for name in adapter.stacked}
    for name, pair in adapter.stacked.items():
        match = matches[name]
        where = f"{adapter.weights_file}: tensor {pair.a_key!r}"
        if match is None or (match["block"] or "") != layout.block:
            raise LoRAAdapterError(f"{where}: {name!r} is not a decoder layer's {experts} (target_parameters adapt "
                                   f"the experts' {first} / down_proj only)")
        layer = int(match["layer"])
        shape = shapes.get(layer)
        if shape is None:
            raise LoRAAdapterError(f"{where}: decoder layer {layer} has no routed experts that take adapters")
        num, hidden, inter = shape.num_experts, shape.hidden, shape.intermediate
        # (in, out) of each parameter as PEFT reads it: the A columns and B rows of its pair
        dims = {first: (hidden, inter * (2 if layout.gated else 1)), "down_proj": (inter, hidden)}
        if layout.factors_swapped:
            dims = {param: (d_out, d_in) for param, (d_in, d_out) in dims.items()}
        a, b = pair.lora_a, pair.lora_b
        fits = [param for param, (d_in, d_out) in dims.items()
                if tuple(a.shape) == (pair.ranks[param] * num, d_in) and tuple(b.shape) == (d_out,
                                                                                           pair.ranks[param] * num)]
        if not fits:
            want = [f"experts.{param} (A [{pair.ranks[param] * num}, {d_in}], B [{d_out}, {pair.ranks[param] * num}])"
                    for param, (d_in, d_out) in dims.items()]
            raise LoRAAdapterError(f"{where} {tuple(a.shape)} and {pair.b_key!r} {tuple(b.shape)} fit neither "
                                   f"{want[0]} nor {want[1]} of decoder layer {layer} ({num} experts)")
        param = fits[0] if len(fits) == 1 else _nested_parameter(adapter, name, pair.a_key, layer, matches, first)
        previous = claimed.setdefault((layer, param), pair.a_key)
        if previous != pair.a_key:
            raise LoRAAdapterError(f"{where} and {previous!r} both adapt decoder layer {layer}'s experts.{param}")
        rank, scaling = pair.ranks[param], pair.scalings[param]
        per_a = a.view(num, rank, a.shape[1])
        per_b = b.view(b.shape[0], rank, num)
        prefix = f"model.layers.{layer}.{experts}"
        for e in range(num):
            a_e, b_e = per_a[e], per_b[:, :, e]
            if layout.factors_swapped:  # (module docstring: x (W + B_e A_e) is LoRA with A = B_e^T, B = A_e^T)
                a_e, b_e = b_e.t(), a_e.t()
            a_e = a_e.contiguous()
            for proj, b_part in _split(param, b_e, inter, layout.interleaved).items():
                out[f"{prefix}.{e}.{proj}"] = LoRAModule(f"{prefix}.{e}.{proj}", a_e, b_part.contiguous(), scaling,
                                                         pair.a_key, pair.b_key)
    return out


def _nested_parameter(adapter: PeftAdapter, name: str, a_key: str, layer: int,
                      matches: dict[str, re.Match[str] | None], first: str) -> str:
    """The parameter of a pair whose shapes fit both (non-gated experts with H = I: module docstring): of the layer's
    two pairs, the one nested deeper is `first` (up_proj); a lone pair, the one parameter target_parameters names."""
    depth = {n: m["nesting"].count(".base_layer") for n, m in matches.items()
             if m is not None and int(m["layer"]) == layer}
    if len(depth) == 2 and len(set(depth.values())) == 2:
        return first if depth[name] == max(depth.values()) else "down_proj"
    named = {p for p in (first, "down_proj") if any(t == p or t.endswith("." + p) for t in adapter.target_parameters)}
    if len(depth) == 1 and len(named) == 1:
        return named.pop()
    raise LoRAAdapterError(f"{adapter.weights_file}: tensor {a_key!r} fits both experts.{first} and experts.down_proj "
                           f"of decoder layer {layer} (their shapes are equal: the experts' width is their "
                           "intermediate size), and neither PEFT's nesting nor target_parameters tells which it adapts")


def _split(param: str, b: torch.Tensor, inter: int, interleaved: bool) -> dict[str, torch.Tensor]:
    """One expert's B rows per projection: down's and (non-gated) up's whole, gate_up's cut into gate and up (module
    docstring)."""
    if param in ("down_proj", "up_proj"):
        return {param: b}
    if interleaved:
        return {"gate_proj": b[0::2], "up_proj": b[1::2]}
    return {"gate_proj": b[:inter], "up_proj": b[inter:]}
