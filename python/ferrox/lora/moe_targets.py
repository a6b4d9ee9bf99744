"""Which MoE experts an adapter may adapt, and an adapter's expert modules packed per MoE layer (lora/moe.py).

An adapter names a layer's experts in one of two formats (never both for one layer: refused by name, naming a
tensor of each):
- One module per expert projection, as a checkpoint with per-expert tensors names the expert's weights (vLLM reads
  them so): `model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj / down_proj` (Qwen2-MoE, Qwen3-MoE and the others)
  or `model.layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2` (Mixtral, MiniMax-M2: gate, up, down), the
  spellings the MoE loader takes (models/moe.py); Gemma 4's experts sit on the decoder layer itself,
  `model.layers.{i}.experts.{e}.gate_proj...` (vLLM's module path `model.layers.{i}.moe.experts.{e}...` taken too),
  Nemotron-H's in its mixer, `model.layers.{i}.mixer.experts.{e}.up_proj / down_proj` (the releases' `backbone.`
  spelling read as `model.`: models/nemotron_h.py lora_rewrite), with no gate_proj: its experts are not gated.
- PEFT's target_parameters format: one pair per stacked parameter `<block>.experts.gate_up_proj / down_proj` of a
  layer, as PEFT 0.22 adapts transformers 5's stacked experts (every family's; PEFT turns gate_proj / up_proj /
  down_proj targets into these on them), unpacked per expert by lora/expert_params.py into the modules above
  (`model.layers.{i}.<block>.experts.{e}.gate_proj...`; the block `mlp`, Llama 4's `feed_forward`, Nemotron-H's
  `mixer` with `experts.up_proj / down_proj`, Gemma 4's experts on the layer: `model.layers.{i}.experts`).
Each module's A and B are then checked against the expert's checkpoint shapes (gate / up: A [r, H], B [I, r]; down:
A [r, I], B [H, r]; H the experts' width: Nemotron 3 Super's moe_latent_size) and cut to this rank's share: the gate
and up B rows and the down A columns of its intermediate rows, and under expert parallelism only its experts (the
others' are checked and skipped).

Families: LoRA on the experts runs on Qwen2-MoE, Qwen3-MoE, Mixtral, GLM-4.5, DeepSeek-V2 / V3, Hunyuan (A13B),
ERNIE 4.5 MoE, OLMoE, MiniMax-M2 and the hybrid Qwens' text models (Qwen3-Next, Qwen3.5-MoE / Qwen3.6-MoE: their
linear-attention layers take adapters too, lora/manager.py) with float experts (gated SiLU, no biases; vLLM's classes
of these families all take LoRA), in either format. gpt-oss's float experts (biases, clamped SwiGLU: lora/moe.py runs
both, as the layer does), Qwen3-VL-MoE's, the multimodal Qwen3.5-MoE's and Llama 4's (its MoE layers every
interleave_moe_layer_step, the router's sigmoid score scaling the experts' input, which the adapter's delta sees as
the base expert does) take them in the target_parameters format only, their checkpoints stacking the experts (their
per-expert modules refused by name). Gemma 4's (26B-A4B, enable_moe_block: GELU-tanh gated, gate rows then up as
transformers' Gemma4TextExperts chunks them; its router's per_expert_scale scales the routing weight, not the input,
which is pre_feedforward_layernorm_2's output for the base experts and the adapter alike) and Nemotron-H's (Nemotron
3 Nano / Super: ReLU^2 and not gated, an up and a down projection; with moe_latent_size the experts' input is
fc1_latent_proj's output, so are their adapters') take them in either format, as vLLM's classes of both do (per
expert; Nemotron-H's is_non_gated_moe). Any other family's expert modules, or quantized experts (FP8, MXFP4: gpt-oss's
MXFP4 checkpoints, dequantized on CPU, are quantized experts all the same; Nemotron 3's FP8 releases), are refused by
name, with the reason: an activation or biases lora/moe.py does not run, quantized, or not tested with adapters here
(Mistral 4).

Shared experts (a dense MLP of Linear layers beside the routed ones, in transformers 5 too: Qwen2-MoE's and the hybrid
Qwens' `mlp.shared_expert`, DeepSeek's, GLM-4.5's and ERNIE 4.5's `mlp.shared_experts`, Hunyuan's `mlp.shared_mlp`,
Llama 4's `feed_forward.shared_expert`, Nemotron-H's `mixer.shared_experts`: a ReLU^2 up_proj / down_proj) take
adapters as the dense MLPs do, one module per projection (the manager wraps their gate_up_proj and down_proj:
lora/manager.py), on the same families (not yet under the multimodal
Qwen3.5-MoE class, refused by name there); their tensor-parallel cut is the dense MLP's, and the layer sums them with
the routed experts exactly (layers/fused_moe.py experts_with_shared: a wrapped shared down_proj all-reduces its own
partial sum with its delta).
The shared expert's sigmoid gate `shared_expert_gate` (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE) is refused by name: vLLM
builds it as a plain linear layer, which its LoRA never adapts. DeepSeek's latent attention takes adapters on the
projections it runs (q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, o_proj); kv_b_proj, absorbed into the
attention at load, is refused by name. Nemotron 3 Super's latent projections (fc1_latent_proj / fc2_latent_proj,
vLLM's ReplicatedLinear, which its LoRA adapts) take adapters as whole projections (lora/manager.py); fc2's delta joins
the rank's partial sum as its product does (it is linear), so tensor parallelism stays exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ferrox.layers.fused_moe import FusedMoE, SwigluOai
from ferrox.lora.adapter import LoRAAdapterError, LoRAModule, PeftAdapter
from ferrox.lora.expert_params import StackedLayerShape, StackedLayout, unstack
from ferrox.lora.moe import ExpertSlotWeights, LoRAExperts
from ferrox.lora.slots import TokenSlots

# An expert projection's module path: the decoder layer, the MoE block's name (none: Gemma 4's experts on the layer),
# the expert, the projection (Llama 4's block, feed_forward, only as its stacked pairs unpack: lora/expert_params.py;
# each family's blocks: _module_blocks).
_EXPERT_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\."
                            r"(?:(?P<block>mlp|block_sparse_moe|feed_forward|mixer|moe)\.)?"
                            r"experts\.(?P<expert>\d+)\.(?P<proj>\w+)$")
_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward", "mixer", "moe", None)
# Any name that looks like one expert's module, in any family (for the refusal's wording).
_ANY_EXPERT = re.compile(r"\.experts\.\d+\.")
_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
SUPPORTED = ("Qwen2-MoE, Qwen3-MoE, Mixtral, GLM-4.5, DeepSeek-V2 / V3, Hunyuan, ERNIE 4.5 MoE, OLMoE, "
             "MiniMax-M2, Qwen3-Next and Qwen3.5-MoE (float experts), Gemma 4 (GELU-tanh) and Nemotron-H (ReLU^2, "
             "not gated), one module per expert or in PEFT's target_parameters format, and gpt-oss, Qwen3-VL-MoE, "
             "the multimodal Qwen3.5-MoE and Llama 4 (float experts, in PEFT's target_parameters format only)")
# How each family's stacked experts take PEFT's target_parameters pairs (lora/expert_params.py: every family here, as
# transformers 5 stacks them all; gate_up_proj holds the gate half, then the up half, but in gpt-oss, which
# interleaves them; Llama 4's stored [E, in, out] without saying so).
_STACKED = StackedLayout()
_PARAMETER_FAMILIES = {
    **dict.fromkeys(("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "HunYuanMoEV1ForCausalLM",
                     "Ernie4_5_MoeForCausalLM", "OlmoeForCausalLM", "MiniMaxM2ForCausalLM", "Qwen3_5MoeForCausalLM",
                     "Qwen3NextForCausalLM", "Qwen3VLMoeForConditionalGeneration",
                     "Qwen3_5MoeForConditionalGeneration"), _STACKED),
    "GptOssForCausalLM": StackedLayout(interleaved=True),
    **dict.fromkeys(("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
                    StackedLayout(block="feed_forward", factors_swapped=True)),
    # (Gemma 4's experts sit on the decoder layer: `model.layers.{i}.experts`)
    **dict.fromkeys(("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), StackedLayout(block="")),
    "NemotronHForCausalLM": StackedLayout(block="mixer", gated=False),
}
# The MoE blocks a family's per-expert modules sit in (None: on the decoder layer), where not mlp / block_sparse_moe.
_MODULE_BLOCKS: dict[str, tuple[str | None, ...]] = {
    # (vLLM's Gemma 4 holds its FusedMoE at `moe.experts`, as its per-expert adapters name it)
    **dict.fromkeys(("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), (None, "moe")),
    "NemotronHForCausalLM": ("mixer",),
}
# The families whose experts take the stacked format only (their checkpoints stack the experts: one gate_up_proj /
# down_proj a layer, which vLLM reads as is_3d_moe_weight), with the reason a per-expert module is refused. gpt-oss's
# are refused at resolve; the others' as a module no projection of the model takes (the reason in why_not).
_STACKED_ONLY = {
    "GptOssForCausalLM": "",
    # (the multimodal Qwens: their text-only siblings take per-expert modules)
    **{name: f"not on {name}: vLLM reads its expert adapters in the stacked format only (is_3d_moe_weight: "
             "target_parameters experts.gate_up_proj / experts.down_proj, one pair a layer), not one module per expert"
       for name in ("Qwen3VLMoeForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")},
    **{name: f"{name}'s experts take adapters in PEFT's target_parameters format only (its checkpoints stack them: "
             "feed_forward.experts.gate_up_proj / down_proj, one pair a layer), not one module per expert"
       for name in ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")},
}
# The MoE block's shared-expert MLPs the manager wraps (its _PROJECTIONS), and the names that only look like one.
SHARED_EXPERT_PARENTS = ("mlp.shared_expert", "mlp.shared_experts", "mlp.shared_mlp", "feed_forward.shared_expert",
                         "mixer.shared_experts")
_SHARED_EXPERT = re.compile(r"\.(mlp\.(shared_expert|shared_experts|shared_mlp)|feed_forward\.shared_expert|"
                            r"mixer\.shared_experts)\.")
_REFUSED_MODULES = {
    "shared_expert_gate": "the shared expert's shared_expert_gate takes no adapters (vLLM runs it as a plain linear "
                          "layer, which its LoRA does not adapt)",
    "kv_b_proj": "the latent attention's kv_b_proj takes no adapters: it is absorbed into the attention at load and "
                 "never run as a layer (q_proj / q_a_proj / q_b_proj, kv_a_proj_with_mqa and o_proj take them)",
}


@dataclass(frozen=True, slots=True)
class ExpertTarget:
    layer: int  # index into the manager's expert layers
    expert: int  # in the checkpoint
    proj: str  # "gate", "up" or "down"


class ExpertTargets:
    """The model's MoE layers that take adapters: each decoder layer's FusedMoE at `<layer>.mlp.experts`, wrapped
    (hooked) with a LoRAExperts, or the reason none is."""

    def __init__(self, model: nn.Module, decoder_layers: list[nn.Module], token_slots: TokenSlots, *, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, use_triton: bool) -> None:
        self.layers: list[LoRAExperts] = []
        self.bases: list[FusedMoE] = []
        self._index_of: dict[int, int] = {}  # decoder layer -> index into layers
        self.refusal = _refusal(model)
        self.shared_refusal = shared_expert_refusal(model)
        self.family = type(model).__name__
        for i, experts in adaptable_experts(model, decoder_layers):
            wrapped = LoRAExperts(experts, token_slots, max_loras=max_loras, max_rank=max_rank, dtype=dtype,
                                  device=device, use_triton=use_triton)
            experts.lora = wrapped
            self._index_of[i] = len(self.layers)
            self.layers.append(wrapped)
            self.bases.append(experts)

    def is_expert_name(self, name: str) -> bool:
        """Whether a target_modules entry names expert modules of this model (a suffix of one's path)."""
        leaf = name.rsplit(".", 1)[-1]
        if not self.layers or leaf not in _PROJECTIONS:
            return False
        pattern = re.compile(rf"(^|.*\.){re.escape(name)}$")
        return any(pattern.match(f"model.layers.{i}.{block + '.' if block else ''}experts.{e}.{leaf}")
                   for i in self._index_of for block in _BLOCKS
                   for e in range(self.bases[self._index_of[i]].num_experts))

    def why_not(self, name: str) -> str | None:
        """Why an expert, shared-expert or absorbed module of an adapter is not taken (None: no reason known)."""
        why = _REFUSED_MODULES.get(name.rsplit(".", 1)[-1])
        if why is not None:
            return why
        if _SHARED_EXPERT.search(name) is not None:
            refusal = self.shared_refusal
            return None if refusal is None else f"LoRA on the shared experts runs on {SUPPORTED}: {refusal}"
        if _ANY_EXPERT.search(name) is None and _EXPERT_MODULE.match(name) is None:
            return None
        if self.refusal is not None:
            return f"LoRA on the routed experts runs on {SUPPORTED}: {self.refusal}"
        if _STACKED_ONLY.get(self.family):
            return f"LoRA on the routed experts runs on {SUPPORTED}: {_STACKED_ONLY[self.family]}"
        return None

    def resolve(self, adapter: PeftAdapter, name: str, module: LoRAModule) -> ExpertTarget | None:
        """The expert an adapter module adapts (its tensors' shapes checked), None when the name is no expert
        module of a layer that takes adapters; LoRAAdapterError naming the tensor for an expert index out of range,
        an unknown projection, a layer without experts, or a wrong shape."""
        match = _EXPERT_MODULE.match(name)
        if match is None or not self.layers:
            return None
        if match["block"] not in _module_blocks(self.family):
            return None  # (another family's block: no module of this model's)
        where = f"{adapter.weights_file}: tensor {module.a_key!r} adapts {name!r}"
        # (an unpacked target_parameters module keeps its stacked pair's tensor names)
        if self.family in _STACKED_ONLY and module.a_key not in {p.a_key for p in adapter.stacked.values()}:
            if _STACKED_ONLY[self.family]:
                return None  # (why_not says why)
            raise LoRAAdapterError(f"{where}: {self.family}'s experts take adapters in PEFT's target_parameters "
                                   "format only (mlp.experts.gate_up_proj / down_proj, as vLLM reads them)")
        proj = _PROJECTIONS.get(match["proj"])
        if proj is None:
            raise LoRAAdapterError(f"{where}: {match['proj']!r} is not an expert projection (gate_proj, up_proj, "
                                   "down_proj; Mixtral's w1, w3, w2)")
        index = self._index_of.get(int(match["layer"]))
        if index is None:
            raise LoRAAdapterError(f"{where}: decoder layer {match['layer']} has no routed experts")
        base = self.bases[index]
        if proj == "gate" and not base.gated:
            raise LoRAAdapterError(f"{where}: {self.family}'s experts are not gated (up_proj and down_proj only)")
        expert = int(match["expert"])
        if expert >= base.num_experts:
            raise LoRAAdapterError(f"{where}: expert {expert} is out of range (the layer has {base.num_experts} "
                                   "experts)")
        hidden, inter = base.hidden_size, base.checkpoint_intermediate_size
        a_shape, b_shape = ((module.rank, inter), (hidden, module.rank)) if proj == "down" else (
            (module.rank, hidden), (inter, module.rank))
        for key, tensor, expected in ((module.a_key, module.lora_a, a_shape), (module.b_key, module.lora_b, b_shape)):
            if tuple(tensor.shape) != expected:
                raise LoRAAdapterError(f"{adapter.weights_file}: tensor {key!r} shape {tuple(tensor.shape)}, model "
                                       f"expects {expected} (expert {expert}'s {proj} projection)")
        return ExpertTarget(index, expert, proj)

    def unstack(self, adapter: PeftAdapter, modules: dict[str, LoRAModule]) -> dict[str, LoRAModule]:
        """The adapter's target_parameters pairs as per-expert modules (lora/expert_params.py); refused by name on a
        model whose experts take none, or where `modules` (the adapter's others) adapt the same layer's experts one
        module per expert too (which would leave one format ignored, or two deltas on one expert)."""
        layout = _PARAMETER_FAMILIES.get(self.family)
        if layout is None or not self.layers:
            why = self.refusal or f"not on {self.family}"
            raise LoRAAdapterError(f"{adapter.config_file}: target_parameters {list(adapter.target_parameters)}: "
                                   f"LoRA on stacked experts runs on {SUPPORTED}: {why}")
        shapes = {i: StackedLayerShape(self.bases[k].num_experts, self.bases[k].hidden_size,
                                       self.bases[k].checkpoint_intermediate_size) for i, k in self._index_of.items()}
        unpacked = unstack(adapter, shapes, layout)
        stacked_key = {int(m["layer"]): module.a_key for name, module in unpacked.items()
                       if (m := _EXPERT_MODULE.match(name)) is not None}
        for name, module in modules.items():
            match = _EXPERT_MODULE.match(name)
            if match is not None and int(match["layer"]) in stacked_key:
                raise LoRAAdapterError(f"{adapter.weights_file}: tensors {module.a_key!r} (one module per expert) and "
                                       f"{stacked_key[int(match['layer'])]!r} (target_parameters) both adapt decoder "
                                       f"layer {match['layer']}'s experts: an adapter names a layer's experts in one "
                                       "format")
        return unpacked

    def pack(self, modules: list[tuple[ExpertTarget, LoRAModule]], rank: int, dtype: torch.dtype,
             pin: bool) -> tuple[ExpertSlotWeights | None, ...]:
        """Each expert layer's share of the adapter as its slots hold it (lora/moe.py ExpertSlotWeights), None
        for a layer the adapter leaves alone."""
        by_layer: dict[int, list[tuple[ExpertTarget, LoRAModule]]] = {}
        for target, module in modules:
            by_layer.setdefault(target.layer, []).append((target, module))
        out: list[ExpertSlotWeights | None] = [None] * len(self.layers)
        for index, items in by_layer.items():
            base = self.bases[index]
            num, hidden = base.num_local_experts, base.hidden_size
            start, inter = base.inter_start, base.intermediate_size
            slices = 2 if base.gated else 1  # gate | up, or (non-gated experts) the up rows alone
            w13_a = torch.zeros(num, slices * rank, hidden, dtype=dtype)
            w13_b = torch.zeros(num, slices * inter, rank, dtype=dtype)
            w2_a = torch.zeros(num, rank, inter, dtype=dtype)
            w2_b = torch.zeros(num, hidden, rank, dtype=dtype)
            present = torch.zeros(num, dtype=torch.int32)
            for target, module in items:
                local = target.expert - base.expert_start
                if not 0 <= local < num:
                    continue  # another rank's expert (expert parallelism)
                r = module.rank
                present[local] = 1
                # Scaling baked into B (in float32, rounded once), as the dense projections'.
                b = module.lora_b * module.scaling
                if target.proj == "down":
                    w2_a[local, :r] = module.lora_a[:, start:start + inter]
                    w2_b[local, :, :r] = b
                else:
                    half = 1 if target.proj == "up" and base.gated else 0
                    w13_a[local, half * rank:half * rank + r] = module.lora_a
                    w13_b[local, half * inter:(half + 1) * inter, :r] = b[start:start + inter]
            if pin:
                w13_a, w13_b, w2_a, w2_b, present = (t.pin_memory() for t in (w13_a, w13_b, w2_a, w2_b, present))
            out[index] = ExpertSlotWeights(w13_a, w13_b, w2_a, w2_b, present)
        return tuple(out)


def adaptable_experts(model: nn.Module, decoder_layers: list[nn.Module]) -> list[tuple[int, FusedMoE]]:
    """(decoder layer index, its FusedMoE) of every MoE layer whose experts take adapters; none where the family's
    experts are refused (`_refusal`)."""
    if _refusal(model) is not None:
        return []
    out = []
    for i, layer in enumerate(decoder_layers):
        # (Llama 4's MoE block: feed_forward; Nemotron-H's: its mixer; Gemma 4's experts: on the layer itself)
        found = [getattr(getattr(layer, block, None), "experts", None) for block in ("mlp", "feed_forward", "mixer")]
        experts = next((e for e in (*found, getattr(layer, "experts", None)) if isinstance(e, FusedMoE)), None)
        if experts is not None:  # (dense layers have none)
            out.append((i, experts))
    return out


def _module_blocks(family: str) -> tuple[str | None, ...]:
    """The MoE blocks a family's per-expert modules may sit in (None: on the decoder layer, Gemma 4's)."""
    layout = _PARAMETER_FAMILIES.get(family)
    if family in _MODULE_BLOCKS:
        return _MODULE_BLOCKS[family]
    return ("mlp", "block_sparse_moe", "feed_forward") if layout is not None and layout.block == "feed_forward" else (
        "mlp", "block_sparse_moe")


def _families() -> tuple[type[nn.Module], ...]:
    """The model classes whose routed and shared experts take adapters (exactly these: a subclass may load or run
    its experts otherwise, e.g. Mistral 4's router; gpt-oss, the multimodal Qwens and Llama 4 take their expert
    adapters stacked only: _STACKED_ONLY)."""
    from ferrox.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from ferrox.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
    from ferrox.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
    from ferrox.models.glm4_moe import Glm4MoeForCausalLM
    from ferrox.models.gpt_oss import GptOssForCausalLM
    from ferrox.models.hunyuan import HunYuanMoEV1ForCausalLM
    from ferrox.models.llama4 import Llama4ForCausalLM, Llama4ForConditionalGeneration
    from ferrox.models.minimax_m2 import MiniMaxM2ForCausalLM
    from ferrox.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
    from ferrox.models.nemotron_h import NemotronHForCausalLM
    from ferrox.models.olmo2 import OlmoeForCausalLM
    from ferrox.models.qwen3_5 import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
    from ferrox.models.qwen3_5_vl import Qwen3_5MoeForConditionalGeneration
    from ferrox.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration

    return (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, Glm4MoeForCausalLM, DeepseekV2ForCausalLM,
            DeepseekV3ForCausalLM, HunYuanMoEV1ForCausalLM, Ernie4_5_MoeForCausalLM, OlmoeForCausalLM,
            MiniMaxM2ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM, GptOssForCausalLM,
            Qwen3VLMoeForConditionalGeneration, Qwen3_5MoeForConditionalGeneration, Llama4ForCausalLM,
            Llama4ForConditionalGeneration, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, NemotronHForCausalLM)


def latent_attention(model: nn.Module) -> bool:
    """Whether the model's decoder layers run DeepSeek's latent attention with adapters (DeepSeek-V2 / V3 only)."""
    from ferrox.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    return type(model) in (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)


def shared_expert_refusal(model: nn.Module) -> str | None:
    """Why this model's shared experts take no adapters (None: they do, or it has none)."""
    name = type(model).__name__
    if type(model) not in _families():
        return f"not on {name}"
    if name == "Qwen3_5MoeForConditionalGeneration":
        # (the text model's shared expert takes them; under the multimodal class it is not checked against PEFT yet)
        return f"not on {name} (its shared expert is not tested with adapters here yet)"
    return None


def _refusal(model: nn.Module) -> str | None:
    """Why this model's experts take no adapters (None: they do)."""
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not experts:
        return f"{type(model).__name__} has no routed experts"
    if type(model) not in _families():
        return f"not on {type(model).__name__}"
    if type(model).__name__ == "GptOssForCausalLM":
        from ferrox.models.gpt_oss import is_mxfp4

        # (on CPU the MXFP4 experts are dequantized at load, but they are the quantized checkpoint's all the same)
        if is_mxfp4(model.spec):  # type: ignore[arg-type]
            return "this model's experts are quantized (MXFP4); float experts only"
    for layer in experts:
        if layer.weight_method is not None or layer.w13_scale is not None:
            kind = type(layer.weight_method).__name__ if layer.weight_method is not None else "FP8"
            return f"this model's experts are quantized ({kind}); float experts only"
        # gpt-oss's experts: biases and the clamped SwiGLU (lora/moe.py adds both, as the layer's own run does);
        # Gemma 4's GELU-tanh and Nemotron-H's non-gated ReLU^2 (the layer's own activation, lora/moe.py)
        if type(model).__name__ != "GptOssForCausalLM" and (isinstance(layer.activation, SwigluOai)
                                                           or layer.w13_bias is not None):
            return "these experts are not SiLU-, GELU-tanh-gated or ReLU^2 without biases"
    return None
