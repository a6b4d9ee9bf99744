"""Nemotron-H's multi-token-prediction (MTP) layers (Nemotron 3 Super), as a drafter (speculative_config method "mtp",
vLLM's alias "nemotron_h_mtp").

The checkpoints carry, beside the decoder, one MTP step of a few blocks under `mtp.layers.{i}.*`, their kinds in
config.json's mtp_layers_block_type (the releases: ["attention", "moe"]) or the older mtp_hybrid_override_pattern
string ("*E"); num_nextn_predict_layers counts the steps. At position i the step reads the target's last hidden state
h_i (after its final norm) and the embedding of the token t_{i+1} after it, as vLLM's NemotronHMTP computes it:

    x = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])              (2H -> H, no bias; the first block's tensors)
    x = the blocks over x, each x + mixer(norm(x))                   (the target's block kinds: NoPE attention, MoE)
    o_i = final_layernorm(x)                                        (the last block's tensor)
    draft = argmax(lm_head(o_i))

o_i chains the next draft (worker/mtp_proposer.py). The blocks are the target's own classes (models/nemotron_h.py
NemotronHBlock: the attention layer, the E layer's experts, router and latent projections); the embedding and the
LM head are the target's (the releases store no copies under mtp.*). Mamba blocks in the MTP pattern are refused (a
drafter's recurrent state per draft is not kept), and the pattern must hold exactly one attention block (the
proposer keeps one layer's twin KV cache; the releases have one). One MTP step, as vLLM drafts (it asserts it).

Quantized checkpoints: the layers are quantized as the rest of the model (the target's quantization_config, its
exclude list read against the checkpoint's `mtp.layers.N.*` names, as vLLM maps them), and a layer stored in a
precision the exclude list does not explain (FP8 scales on a layer it leaves float, or none on one it quantizes) is
refused by name rather than guessed; a checkpoint whose mtp.* tensors have no scales at all runs the MTP layers in
float (worker/mtp_proposer.py load_predictor reads which).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import get_attention_backend
from ferrox.attention.metadata import AttentionMetadata
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear
from ferrox.layers.quant.method import use_quant_config
from ferrox.model_spec import ModelLoadError, UnsupportedModelError
from ferrox.models.moe import expected_checkpoint_keys, load_moe_tensors
from ferrox.models.mtp_layer import MtpLayer
from ferrox.models.nemotron_h import NemotronHBlock, per_expert_tensors, take_kv_scales
from ferrox.models.nemotron_h_moe import NemotronHMoE, NemotronHMoeConfig

PREFIX = "mtp."
_KINDS = {"attention": "full_attention", "full_attention": "full_attention", "moe": "moe", "mlp": "mlp",
          "mamba": "mamba", "linear_attention": "mamba"}
_LETTERS = {"*": "full_attention", "E": "moe", "-": "mlp", "M": "mamba"}
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
# (the fusion's modules live on the first block in the checkpoint, the final norm on the last)
_FUSION = ("eh_proj", "enorm", "hnorm")


def mtp_block_kinds(config: dict[str, Any]) -> list[str]:
    """The MTP step's block kinds ("full_attention" / "moe" / "mlp" / "mamba"): mtp_layers_block_type (transformers 5,
    the releases), else mtp_hybrid_override_pattern (M, *, -, E), else transformers' default [attention, moe]."""
    listed, pattern = config.get("mtp_layers_block_type"), config.get("mtp_hybrid_override_pattern")
    kinds_of_pattern = None
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_LETTERS):
            raise ModelLoadError(f"config.json: mtp_hybrid_override_pattern {pattern!r} must be a string of M, *, -, E")
        kinds_of_pattern = [_LETTERS[c] for c in pattern]
    if listed is None:
        return kinds_of_pattern or ["full_attention", "moe"]
    if not isinstance(listed, list) or not listed or any(t not in _KINDS for t in listed):
        raise ModelLoadError(f"config.json: mtp_layers_block_type must list some of {', '.join(_KINDS)}, got "
                             f"{listed!r}")
    kinds = [_KINDS[t] for t in listed]
    if kinds_of_pattern is not None and kinds_of_pattern != kinds:
        raise ModelLoadError(f"config.json: mtp_layers_block_type {listed!r} and mtp_hybrid_override_pattern "
                             f"{pattern!r} disagree")
    return kinds


def check_mtp_config(config: dict[str, Any]) -> list[str]:
    """The block kinds of the one MTP step ferrox drafts with, or the refusal naming the field."""
    count = config.get("num_nextn_predict_layers") or 0
    if count != 1:
        why = ("declares no multi-token-prediction layers" if count == 0 else
               f"declares {count} multi-token-prediction steps; ferrox drafts with exactly one (as vLLM)")
        raise UnsupportedModelError(f"speculative_config.method 'mtp': config.json's num_nextn_predict_layers {why}")
    kinds = mtp_block_kinds(config)
    if "mamba" in kinds:
        raise UnsupportedModelError(f"speculative_config.method 'mtp': the MTP blocks {kinds} hold a Mamba block "
                                    "(mtp_layers_block_type / mtp_hybrid_override_pattern), whose per-draft recurrent "
                                    "state ferrox does not keep (vLLM runs attention and MoE blocks only)")
    if kinds.count("full_attention") != 1:
        raise UnsupportedModelError(f"speculative_config.method 'mtp': the MTP blocks {kinds} must hold exactly one "
                                    "attention block (mtp_layers_block_type / mtp_hybrid_override_pattern; the "
                                    "releases' is ['attention', 'moe']): ferrox keeps one KV cache for the layer")
    return kinds


class NemotronHMultiTokenPredictor(MtpLayer):
    def __init__(self, target: Any, quant_config: Any = None, *, float_fc: bool = False):
        """target: the NemotronHForCausalLM whose checkpoint holds the layers; quant_config: the target's where the
        checkpoint quantized them (None: float); float_fc: eh_proj left float all the same."""
        super().__init__(target)
        spec = target.spec
        kinds = check_mtp_config(spec.hf_config)
        moe = target.moe
        if moe is None and "moe" in kinds:
            moe = NemotronHMoeConfig.from_config(spec.hf_config)
        dtype, device = target.model.embed_tokens.weight.dtype, target.lm_head_weight.device
        h, eps, ops = spec.hidden_size, spec.rms_norm_eps, target.ops
        # A backend of its own: the MTP step's attention metadata is not the target step's.
        self.backend = get_attention_backend(device, target.kernels)
        with use_quant_config(None if float_fc else quant_config):
            self.eh_proj = Linear(2 * h, h, bias=False, dtype=dtype, device=device)
        with use_quant_config(quant_config):
            self.layers = nn.ModuleList(NemotronHBlock(spec, kind, self.backend, ops, dtype, device, moe)
                                        for kind in kinds)
        self.enorm = RMSNorm(h, eps, dtype, device, ops)
        self.hnorm = RMSNorm(h, eps, dtype, device, ops)
        self.final_layernorm = RMSNorm(h, eps, dtype, device, ops)
        if quant_config is not None:  # (its exclude list, matched in the checkpoint's names: checkpoint_module_name)
            quant_config.keep_unquantized(self)

    def checkpoint_module_name(self, name: str) -> str:
        """The checkpoint's name of module `name` (the fusion on the first block, the final norm on the last)."""
        head = name.partition(".")[0]
        if head in _FUSION:
            return f"{PREFIX}layers.0.{name}"
        if head == "final_layernorm":
            return f"{PREFIX}layers.{len(self.layers) - 1}.{name}"
        return PREFIX + name if head == "layers" else name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """o for each (token, hidden state, position) row (module docstring); `kv_cache`: the attention block's.
        (NoPE attention: the positions only place the rows in the cache, through `meta`.)"""
        e = self.enorm(self.target.embed_input_ids(input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden)], dim=-1))
        self.backend.begin_forward(meta)
        no_state: Any = None  # (no Mamba block: no recurrent-state rows)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, kv_cache, meta, no_state)
        out, _ = self.final_layernorm(x, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    # ---- loading --------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's mtp.* tensors (others skipped): experts per expert or stacked, the attention block's
        FP8 KV-cache scales, as the target reads its own blocks'."""
        tensors = [(self._module_name(name), tensor) for name, tensor in weights if name.startswith(PREFIX)]
        self._check_precision([name for name, _ in tensors])
        stream: Iterator[tuple[str, Any]] = iter(tensors)
        moe = [module.moe for module in self.modules() if isinstance(module, NemotronHMoE)]
        if moe:
            stream = per_expert_tensors(stream, moe[0].num_experts)
        load_moe_tensors(self, take_kv_scales(self, stream), self.spec.architecture, expected_checkpoint_keys(self))

    def _module_name(self, name: str) -> str:
        """A checkpoint tensor's name in this module's terms (the reverse of checkpoint_module_name)."""
        name = name[len(PREFIX):]
        last = f"layers.{len(self.layers) - 1}."
        if name.startswith(last + "final_layernorm."):
            return name[len(last):]
        if name.startswith(tuple(f"layers.0.{leaf}." for leaf in _FUSION)):
            return name[len("layers.0."):]
        return name

    def _check_precision(self, names: list[str]) -> None:
        """Every quantizable layer stored as it is built: FP8 (its weight scales present) where the quantization
        config (and its exclude list) quantizes it, float where it does not (module docstring)."""
        stored = {_quantized_module(name) for name in names if name.endswith(_SCALE_SUFFIXES)}
        for name, module in self.named_modules():
            if not hasattr(module, "weight_method"):
                continue
            method = module.weight_method
            built = method is not None and not method.float_weight
            if built != (name in stored):
                where = self.checkpoint_module_name(name)
                shards = getattr(module, "shard_sizes", None)
                if shards:  # (a merged layer: the checkpoint's names of its shards)
                    where = " / ".join(f"{where.rpartition('.')[0]}.{shard}_proj" for shard in shards)
                raise UnsupportedModelError(
                    f"quantization_config: the MTP layer's {where} is stored {'FP8' if name in stored else 'unquantized'}"
                    f" while the checkpoint's quantization_config (its exclude list) "
                    f"{'leaves it unquantized' if name in stored else 'quantizes it'}; ferrox does not guess which "
                    "precision the drafter runs in")


def _quantized_module(name: str) -> str:
    """The module (this predictor's name) whose stored weight a scale tensor `name` belongs to: each expert's
    projections are the experts layer, q / k / v the merged qkv_proj, an MLP's up_proj its one-shard gate_up_proj
    (models/ungated_mlp.py)."""
    module = name.rpartition(".")[0]
    module = re.sub(r"\.experts\.\d+\.(up|down)_proj$", ".experts", module)
    module = re.sub(r"\.(q|k|v)_proj$", ".qkv_proj", module)
    return re.sub(r"\.up_proj$", ".gate_up_proj", module)
