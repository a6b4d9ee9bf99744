"""LoRAManager: serve many LoRA adapters of one base model in the same batch.

Built once on a loaded model, it
- wraps every decoder layer's projections (qkv_proj, o_proj, gate_up_proj, down_proj; a hybrid model's
  linear-attention layers their qkvz_proj, ba_proj, out_proj instead of the attention's, its Mamba2 layers their
  in_proj, out_proj; DeepSeek's latent attention the projections it runs) in a LoRALinear (lora/layers.py), whose
  forward adds each token's adapter delta to the base output;
- hooks an MoE model's routed experts (FusedMoE) with a LoRAExperts (lora/moe.py: each expert its own adapter
  pair for gate, up and down; non-gated experts up and down) and wraps its shared experts' projections as a dense
  MLP's (Nemotron 3 Super's latent projections as whole layers), on the families
  lora/moe_targets.py names; others' expert and shared-expert modules are refused by name;
- keeps added adapters in a CPU cache (LRU, max_cpu_loras), packed for this model (lora/packed.py), their
  lora_B rows rewritten as the model's loader rewrites its weights' rows where it does (the model's
  `lora_rewrite`: lora/rewrite.py);
- keeps max_loras of them in GPU slots (lora/slots.py SlotTable), swapped in LRU order by copying
  into the slot buffers in place, so CUDA graphs captured earlier stay valid;
- before each forward, `prepare_step` turns each token's adapter id into its slot index in the
  persistent `token_slots` buffer the wrapped layers read.

Under tensor parallelism every rank has a manager over its shard of the model (each packs its own
share of an adapter: lora/layers.py). The driver's decides; it returns the step's `SlotPlan`
(adapters copied into slots, each token's slot), which travels with the step's arrays
(lora/rank_plan.py), and every other rank's `follow` applies it, so the slots agree rank for rank.

An adapter id (LoRARequest.lora_int_id) is the adapter's identity; 0 is the base model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from ferrox.attention.decode_path import DecodePath
from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.layers.linear import Linear, MergedLinear
from ferrox.lora.adapter import LoRAAdapterError, read_peft_adapter
from ferrox.lora.layers import LoRALinear
from ferrox.lora.moe import LoRAExperts
from ferrox.lora.moe_targets import (
    SHARED_EXPERT_PARENTS,
    ExpertTargets,
    adaptable_experts,
    latent_attention,
    shared_expert_refusal,
)
from ferrox.lora.packed import PackedAdapter, ProjectionTarget, pack_adapter
from ferrox.lora.request import LoRARequest
from ferrox.lora.slots import SlotTable, TokenSlots

# (parent module in a decoder layer (a dotted path), merged projection, module name in the model's checkpoint
# terms -> its slice name (None: whole)). Names are those after the model's lora_rewrite: a hybrid Qwen's in_proj_qkv
# arrives cut into in_proj_q / _k / _v, Qwen3-Next's in_proj_qkvz / in_proj_ba into Qwen3.5's names
# (models/qwen3_5.py).
_PROJECTIONS: tuple[tuple[str, str, dict[str, str | None]], ...] = (
    ("self_attn", "qkv_proj", {"q_proj": "q", "k_proj": "k", "v_proj": "v"}),
    ("self_attn", "o_proj", {"o_proj": None}),
    # DeepSeek-V2 / V3's latent attention (models/mla_attention.py): the projections it runs as layers. kv_b_proj
    # is absorbed into the attention at load (never run as a layer), so an adapter of it is refused by name.
    ("self_attn", "q_proj", {"q_proj": None}),
    ("self_attn", "q_a_proj", {"q_a_proj": None}),
    ("self_attn", "q_b_proj", {"q_b_proj": None}),
    ("self_attn", "kv_a_proj_with_mqa", {"kv_a_proj_with_mqa": None}),
    # The Gated DeltaNet of a hybrid model's linear-attention layers (layers/gated_delta_net.py).
    ("linear_attn", "qkvz_proj", {"in_proj_q": "q", "in_proj_k": "k", "in_proj_v": "v", "in_proj_z": "z"}),
    ("linear_attn", "ba_proj", {"in_proj_b": "b", "in_proj_a": "a"}),
    ("linear_attn", "out_proj", {"out_proj": None}),
    ("mlp", "gate_up_proj", {"gate_proj": "gate", "up_proj": "up"}),
    ("mlp", "down_proj", {"down_proj": None}),
    # An MoE layer's shared expert, a dense MLP beside the routed experts (Qwen2-MoE's and the hybrid Qwens'
    # shared_expert, DeepSeek's, GLM-4.5's and ERNIE 4.5's shared_experts, Hunyuan's shared_mlp; Llama 4's below), on
    # the families lora/moe_targets.py names (SHARED_EXPERT_PARENTS).
    ("mlp.shared_expert", "gate_up_proj", {"gate_proj": "gate", "up_proj": "up"}),
    ("mlp.shared_expert", "down_proj", {"down_proj": None}),
    ("mlp.shared_experts", "gate_up_proj", {"gate_proj": "gate", "up_proj": "up"}),
    ("mlp.shared_experts", "down_proj", {"down_proj": None}),
    ("mlp.shared_mlp", "gate_up_proj", {"gate_proj": "gate", "up_proj": "up"}),
    ("mlp.shared_mlp", "down_proj", {"down_proj": None}),
    # Llama 4's dense layers, and its MoE layers' shared expert (their routed experts: lora/moe_targets.py).
    ("feed_forward", "gate_up_proj", {"gate_proj": "gate", "up_proj": "up"}),
    ("feed_forward", "down_proj", {"down_proj": None}),
    ("feed_forward.shared_expert", "gate_up_proj", {"gate_proj": "gate", "up_proj": "up"}),
    ("feed_forward.shared_expert", "down_proj", {"down_proj": None}),
    # Granite 4.0-H: a Mamba2 mixer (layers/mamba2_mixer.py; in_proj one checkpoint tensor over its five slices
    # z, x, B, C, dt, cut as its loader cuts it: lora/packed.py) or the attention, then the shared MLP.
    ("mamba", "in_proj", {"in_proj": None}),
    ("mamba", "out_proj", {"out_proj": None}),
    ("shared_mlp", "gate_up_proj", {"gate_proj": "gate", "up_proj": "up"}),
    ("shared_mlp", "down_proj", {"down_proj": None}),
    # Nemotron-H: one mixer a layer, whichever it is: the attention, a Mamba2 mixer or a ReLU^2 MLP (gate_up_proj
    # holds its up rows alone). Its MoE layers' mixer has experts instead (lora/moe_targets.py), a ReLU^2 shared
    # expert and, in Nemotron 3 Super, the latent projections around the experts (whole layers: fc2's delta joins
    # the rank's partial sum it maps, as its product does).
    ("mixer", "qkv_proj", {"q_proj": "q", "k_proj": "k", "v_proj": "v"}),
    ("mixer", "o_proj", {"o_proj": None}),
    ("mixer", "in_proj", {"in_proj": None}),
    ("mixer", "out_proj", {"out_proj": None}),
    ("mixer", "gate_up_proj", {"up_proj": "up"}),
    ("mixer", "down_proj", {"down_proj": None}),
    ("mixer.shared_experts", "gate_up_proj", {"up_proj": "up"}),
    ("mixer.shared_experts", "down_proj", {"down_proj": None}),
    ("mixer", "fc1_latent_proj", {"fc1_latent_proj": None}),
    ("mixer", "fc2_latent_proj", {"fc2_latent_proj": None}),
)
# Every decoder layer has one of these token mixers, with these projections; Nemotron-H's blocks have one `mixer`
# of any kind (an MLP or MoE block included), so they name none.
_MIXERS = (("self_attn", ("qkv_proj", "o_proj")), ("linear_attn", ("qkvz_proj", "ba_proj", "out_proj")),
           ("mamba", ("in_proj", "out_proj")), ("mixer", ()))
# DeepSeek-V2 / V3's latent attention (its query projection: q_proj, or q_a_proj and q_b_proj).
_LATENT_MIXER = ("self_attn", ("kv_a_proj_with_mqa", "o_proj"))


@dataclass(slots=True)
class SlotPlan:
    """One step's slot decisions: the adapters copied into slots before it, each token's slot (-1: none)."""

    loads: list[tuple[int, LoRARequest]]  # (slot, adapter)
    slot_of_token: npt.NDArray[np.int32]


def token_capacity(max_num_batched_tokens: int, max_num_seqs: int, verify_len: int) -> int:
    """The token slots a step may need: its token budget, or a speculative verify step replayed in a CUDA
    graph (verify_len = k + 1 rows per request: lora/slots.py relayout)."""
    return max(max_num_batched_tokens, max_num_seqs * max(1, verify_len))


class LoRAManager:
    def __init__(self, model: nn.Module, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 device: torch.device | str, dtype: torch.dtype, max_num_tokens: int) -> None:
        for field, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank),
                             ("max_num_tokens", max_num_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{field}: must be an integer >= 1, got {value!r}", param=field)
        if max_cpu_loras is None:
            max_cpu_loras = max_loras
        if isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int) or max_cpu_loras < max_loras:
            raise InvalidArgumentError(f"max_cpu_loras: must be an integer >= max_loras ({max_loras}), got "
                                       f"{max_cpu_loras!r}", param="max_cpu_loras")
        refusal = getattr(model, "lora_refusal", None)  # a family whose layers LoRA cannot adapt exactly
        if refusal:
            raise UnsupportedModelError(f"enable_lora: {refusal}")
        layers = _decoder_layers(model)
        # A family whose loader rewrites projection rows declares how an adapter's B rows follow (lora/rewrite.py).
        self._rewrite = getattr(model, "lora_rewrite", None)
        if self._rewrite is None and getattr(model, "reorders_partial_rotary", False) and getattr(
                getattr(model, "spec", None), "rotary_dim", None) is not None:
            raise UnsupportedModelError(f"enable_lora: {type(model).__name__}'s q/k rows are reordered at load for "
                                        "its partial rotary, and it declares no lora_rewrite that would reorder an "
                                        "adapter's rows the same way; LoRA is not supported for it")
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = torch.device(device)
        self.dtype = dtype
        use_triton = getattr(model, "kernels", "torch") == "triton"
        self._token_slots = TokenSlots(max_num_tokens, self.device, keep_groups=not use_triton)
        self.layers: list[LoRALinear] = []
        self._targets: dict[str, ProjectionTarget] = {}
        for i, layer in enumerate(layers):
            for parent_name, parent, attr, hf_slices, base in _projections(model, layer):
                widths = dict(base.shard_sizes) if isinstance(base, MergedLinear) else {attr: base.out_features}
                wrapped = LoRALinear(base, widths, self._token_slots, max_loras=max_loras, max_rank=max_lora_rank,
                                     dtype=dtype, device=self.device, use_triton=use_triton)
                setattr(parent, attr, wrapped)
                for hf_name, slice_name in hf_slices.items():
                    if slice_name is not None and slice_name not in wrapped.slice_names:
                        continue  # (an ungated MLP's gate_up_proj holds the up rows alone: GPT-NeoX, Phi-2...)
                    # (slice_name None: the module is the whole layer; of a merged one, every slice: Mamba2's in_proj)
                    s = (wrapped.slice_names.index(slice_name) if slice_name is not None
                         else 0 if len(wrapped.slice_names) == 1 else None)
                    self._targets[f"model.layers.{i}.{parent_name}.{hf_name}"] = ProjectionTarget(len(self.layers), s)
                self.layers.append(wrapped)
        # The routed experts of the MoE families that take adapters on them (hooked: FusedMoE.lora).
        self.experts = ExpertTargets(model, layers, self._token_slots, max_loras=max_loras, max_rank=max_lora_rank,
                                     dtype=dtype, device=self.device, use_triton=use_triton)
        # The fused one-token decode path (attention/fused_decode.py) reads the projections'
        # weights directly, so it would run the base model only; every step goes through the
        # layers instead (the general path: no fused step, logits by one matmul).
        model.model.decode_path = DecodePath()  # type: ignore[union-attr]
        # Speculative verify steps replayed in CUDA graphs move each token to a padded row; the
        # token slots must follow (worker/cuda_graphs.py calls the model's verify_row_hooks).
        model.verify_row_hooks = (self._token_slots.relayout,)  # type: ignore[assignment]
        self._cache: OrderedDict[int, PackedAdapter] = OrderedDict()  # least recently used first
        self._slots = SlotTable(max_loras)

    # ---- adapters ---------------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> None:
        """Read, check and cache an adapter (a no-op for an id already cached). On any error
        (LoRAAdapterError naming the file and field) nothing changes."""
        if not isinstance(request, LoRARequest):
            raise InvalidArgumentError(f"lora_request: expected a LoRARequest, got {type(request).__name__}",
                                       param="lora_request")
        if request.lora_int_id in self._cache:
            self._cache.move_to_end(request.lora_int_id)
            return
        if not request.lora_path:
            raise LoRAAdapterError(f"lora_path: adapter {request.lora_name!r} (id {request.lora_int_id}) has no "
                                   "path to load it from")
        adapter = read_peft_adapter(request.lora_path)
        packed = pack_adapter(request, adapter, self.layers, self._targets, max_lora_rank=self.max_lora_rank,
                              dtype=self.dtype, pin=self.device.type == "cuda", rewrite=self._rewrite,
                              experts=self.experts)
        while len(self._cache) >= self.max_cpu_loras:
            self._drop(next(iter(self._cache)))
        self._cache[request.lora_int_id] = packed

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (CPU cache and GPU slot); False if it was not there."""
        if lora_int_id not in self._cache:
            return False
        self._drop(lora_int_id)
        return True

    def list_adapters(self) -> list[LoRARequest]:
        return [packed.request for packed in self._cache.values()]

    def slot_of(self, lora_int_id: int) -> int | None:
        """The GPU slot an adapter sits in now (None: not in a slot)."""
        return self._slots.slot_of(lora_int_id)

    def _drop(self, lora_int_id: int) -> None:
        del self._cache[lora_int_id]
        self._slots.release(lora_int_id)

    # ---- steps ------------------------------------------------------------------------------------
    @property
    def token_slots(self) -> torch.Tensor:
        """int32 [max_num_tokens]: each token's slot (-1: base model); layers read [:T]."""
        return self._token_slots.buffer

    def prepare_step(self, token_lora_ids: npt.NDArray[Any]) -> SlotPlan:
        """Give the step's adapters GPU slots (copying in those that lack one) and write each
        token's slot into `token_slots`. token_lora_ids: int [T], 0 = base model. ValueError for
        more distinct adapters than max_loras or an id never added; then nothing changes. Returns
        what it decided, for the other tensor-parallel ranks (`follow`)."""
        ids = np.asarray(token_lora_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"token_lora_ids must be a 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        if ids.size > self._token_slots.max_num_tokens:
            raise ValueError(f"step has {ids.size} tokens, max_num_tokens is {self._token_slots.max_num_tokens}")
        present = np.unique(ids)
        present = present[present != 0]
        if present.size > self.max_loras:
            raise ValueError(f"step uses {present.size} adapters, max_loras is {self.max_loras}")
        unknown = [int(i) for i in present if int(i) not in self._cache]
        if unknown:
            raise ValueError(f"adapter id(s) {unknown} not loaded (add_adapter first)")
        adapters = [int(i) for i in present]
        for lora_int_id in adapters:
            self._cache.move_to_end(lora_int_id)
        loads = []
        for lora_int_id, slot in self._slots.assign(adapters):
            self._load_slot(slot, self._cache[lora_int_id])
            loads.append((slot, self._cache[lora_int_id].request))
        slot_of_token = np.full(ids.size, -1, dtype=np.int32)
        if adapters:
            slot_of_id = np.array([self._slots.slot_of(i) for i in adapters], dtype=np.int32)
            index = np.searchsorted(present, ids).clip(max=present.size - 1)
            slot_of_token = np.where(ids == 0, -1, slot_of_id[index]).astype(np.int32)
        self._token_slots.write(slot_of_token)
        return SlotPlan(loads, slot_of_token)

    def follow(self, plan: SlotPlan) -> None:
        """A non-driver tensor-parallel rank: apply the driver's decisions for this step (reading an
        adapter's share from its folder when this rank's CPU cache lacks it)."""
        for slot, request in plan.loads:
            self.add_adapter(request)
            self._cache.move_to_end(request.lora_int_id)
            self._load_slot(slot, self._cache[request.lora_int_id])
        self._token_slots.write(plan.slot_of_token)

    def _load_slot(self, slot: int, packed: PackedAdapter) -> None:
        for layer, weights in zip(self.layers, packed.weights, strict=True):
            if weights is None:
                layer.load_slot(slot, None, None)
            else:
                layer.load_slot(slot, *weights)
        expert_layers: list[LoRAExperts] = self.experts.layers
        for experts, expert_weights in zip(expert_layers, packed.experts or (None,) * len(expert_layers),
                                           strict=True):
            experts.load_slot(slot, expert_weights)


def slot_bytes(model: nn.Module, *, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Bytes of the adapter slot buffers a LoRAManager on this model allocates: every wrapped projection's A and B
    stacks and the adaptable experts' (lora/moe.py: 128 experts at rank 16 and 4 slots are GBs). The manager is
    built after the KV cache is sized, so the GPU budget leaves this much (worker/model_setup.py). 0 for a model
    the manager will refuse (it says why then)."""
    try:
        layers = _decoder_layers(model)
    except (UnsupportedModelError, InvalidArgumentError):
        return 0
    elements = 0
    for layer in layers:
        for _, _, attr, _, base in _projections(model, layer):
            widths = dict(base.shard_sizes) if isinstance(base, MergedLinear) else {attr: base.out_features}
            elements += max_loras * max_rank * (len(widths) * base.in_features + sum(widths.values()))
    for _, experts in adaptable_experts(model, layers):
        elements += LoRAExperts.slot_elements(experts, max_loras, max_rank)
    return elements * torch.empty((), dtype=dtype).element_size()


def _projections(model: nn.Module, layer: nn.Module) -> Iterator[tuple[str, nn.Module, str, dict[str, str | None],
                                                                      Linear]]:
    """(parent path, parent, attribute, checkpoint names -> slices, the layer) of every projection of a decoder layer
    that takes adapters: the manager wraps these, slot_bytes counts them. A shared expert's only on the families
    whose shared experts take adapters (lora/moe_targets.py)."""
    shared_ok = shared_expert_refusal(model) is None
    for parent_name, attr, hf_slices in _PROJECTIONS:
        if parent_name in SHARED_EXPERT_PARENTS and not shared_ok:
            continue
        parent: Any = layer
        for part in parent_name.split("."):
            parent = getattr(parent, part, None)
        base = getattr(parent, attr, None)
        if isinstance(base, Linear):  # (not e.g. an MoE layer's experts in place of gate_up/down)
            yield parent_name, parent, attr, hf_slices, base


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """model.model.layers, each with self_attn.qkv_proj and self_attn.o_proj (Llama family), or a hybrid
    model's linear attention (linear_attn.qkvz_proj, ba_proj, out_proj) or Mamba2 mixer (mamba.in_proj, out_proj)
    in their place, or Nemotron-H's one mixer; DeepSeek-V2 / V3's latent attention (self_attn.kv_a_proj_with_mqa
    and o_proj)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not hasattr(inner, "decode_path"):
        raise UnsupportedModelError(f"enable_lora: {type(model).__name__} has no decoder layers at model.layers "
                                    "(LoRA runs on Llama-family layouts)")
    if any(isinstance(module, LoRALinear) for module in layers.modules()):
        raise InvalidArgumentError("enable_lora: this model already has a LoRAManager", param="enable_lora")
    latent = latent_attention(model)
    for i, layer in enumerate(layers):
        mixer, attrs = next(((name, attrs) for name, attrs in _MIXERS if getattr(layer, name, None) is not None),
                            _MIXERS[0])
        if latent:
            mixer, attrs = _LATENT_MIXER
        for attr in attrs:
            proj = getattr(getattr(layer, mixer, None), attr, None)
            if not isinstance(proj, Linear):
                raise UnsupportedModelError(f"enable_lora: {type(model).__name__} layer {i} has no {mixer}.{attr} "
                                            "(LoRA runs on Llama-family layouts)")
    return list(layers)

