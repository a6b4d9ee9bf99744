"""An MTP layer for the tiny hybrid Qwens (tests/helpers/tiny_qwen3_5.py), written into their checkpoint as the
releases carry it (`mtp.fc`, `mtp.layers.0.*`, `mtp.norm`, `mtp.pre_fc_norm_hidden`, `mtp.pre_fc_norm_embedding`;
config.json's mtp_num_hidden_layers / num_nextn_predict_layers), and a reference of what it drafts, built from
transformers' own decoder layer (transformers has no MTP module: it drops mtp.* at load).

The layer is the checkpoint's full-attention decoder layer copied (its output projections scaled, so it is not the
target's and its attention weighs in), with random zero-centred norms and a random fc; `embed_gain` adds that much identity on fc's embedding
half, which makes the layer's argmax lean to the token it is given (a model that repeats itself then accepts such
drafts).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_qwen3_5 import LAYER_TYPES

FULL_LAYER = max(i for i, kind in enumerate(LAYER_TYPES) if kind == "full_attention")
# The copy's output projections scaled (so it is not the target's layer, and its attention weighs in its drafts).
_SCALED = {"o_proj.weight": 3.0, "down_proj.weight": 0.5, "down_proj": 0.5}


def _scale(name: str) -> float:
    return next((v for k, v in _SCALED.items() if name.endswith(k)), 1.0)


def add_mtp_layer(folder: str, *, seed: int = 1, embed_gain: float = 0.0) -> dict[str, torch.Tensor]:
    """Write the MTP tensors into `folder`'s model.safetensors and declare the layer in config.json; returns them."""
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    # (the multimodal checkpoints keep the decoder under model.language_model., the MTP layer at the top level)
    text = "model.language_model." if any(k.startswith("model.language_model.") for k in weights) else "model."
    prefix = f"{text}layers.{FULL_LAYER}."
    mtp = {}
    for name, tensor in weights.items():
        if name.startswith(prefix):
            value = tensor.clone() * _scale(name)
            mtp["mtp.layers.0." + name[len(prefix):]] = value
    h = weights[f"{text}embed_tokens.weight"].shape[1]
    fc = torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5
    fc[:, :h] += embed_gain * torch.eye(h)
    mtp["mtp.fc.weight"] = fc
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        mtp[f"mtp.{norm}.weight"] = torch.rand(h, generator=gen) * 0.6 - 0.3  # zero-centred: x (1 + w)
    save_file({**weights, **mtp}, path, metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    key = "num_nextn_predict_layers" if config.get("model_type") == "qwen3_next" else "mtp_num_hidden_layers"
    config.get("text_config", config)[key] = 1
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return mtp


class MtpReference:
    """What the MTP layer drafts after a token sequence, from scratch: the target's (transformers') final hidden
    states h_i, the pairs (h_i, t_{i+1}) at positions i, transformers' decoder layer over them (causal), the
    target's lm_head; chained as vLLM chains MTP drafts (the layer's output and its draft as the next pair)."""

    layer_index = FULL_LAYER  # (the decoder layer the checkpoint's MTP layer copies)
    norm_names = ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")
    prefix, fc_name = "mtp.", "fc"

    def __init__(self, ref: Any, mtp: dict[str, torch.Tensor]) -> None:
        self.ref = ref
        inner = ref.model
        # The copied layer, scaled as the checkpoint's copy is (in memory, transformers fuses the experts).
        self.layer = copy.deepcopy(inner.layers[self.layer_index])
        with torch.no_grad():
            for name, param in self.layer.named_parameters():
                param.mul_(_scale(name))
        self.norms = {}
        for norm in self.norm_names:
            module = copy.deepcopy(inner.norm)
            module.weight.data.copy_(mtp[f"{self.prefix}{norm}.weight"])
            self.norms[norm] = module
        # (the reference runs where `ref` is: on a GPU box, its transformers may run hybrid layers on CUDA only)
        self.device = next(ref.parameters()).device
        self.layer.to(self.device)
        for module in self.norms.values():
            module.to(self.device)
        self.fc = mtp[f"{self.prefix}{self.fc_name}.weight"].to(self.device)
        self.mrope = inner.config.model_type.startswith("qwen3_5")

    @torch.no_grad()
    def _layer(self, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        inner, dev = self.ref.model, self.device
        e = self.norms["pre_fc_norm_embedding"](inner.embed_tokens(torch.tensor(tokens, device=dev)))
        x = torch.cat([e, self.norms["pre_fc_norm_hidden"](hidden)], dim=-1) @ self.fc.t()
        n = x.shape[0]
        pos = torch.arange(n, device=dev)[None]
        rotary = inner.rotary_emb(x[None], pos[None].expand(3, 1, n) if self.mrope else pos)
        mask = torch.full((n, n), float("-inf"), device=dev).triu(1)[None, None]
        out = self.layer(x[None], position_embeddings=rotary, attention_mask=mask, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        return self.norms["norm"](out[0])

    def _logits(self, o: torch.Tensor) -> torch.Tensor:
        return self.ref.lm_head(o)

    @torch.no_grad()
    def drafts(self, seq: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """The k drafts after `seq` (its last token just sampled), and the logits each came from."""
        hidden = self.ref.model(input_ids=torch.tensor([seq[:-1]], device=self.device)).last_hidden_state[0]
        tokens = list(seq[1:])
        drafts, logits = [], []
        for _ in range(k):
            o = self._layer(hidden, tokens)
            row = self._logits(o[-1])
            drafts.append(int(row.argmax()))
            logits.append(row)
            hidden = torch.cat([hidden, o[-1:]])
            tokens.append(drafts[-1])
        return drafts, logits


def add_deepseek_layout_mtp(folder: str, *, seed: int = 1, embed_gain: float = 0.0) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's layout of the same, GLM-4.5's too (model.layers.{num_hidden_layers}.*: the last decoder layer copied and scaled,
    eh_proj, enorm / hnorm / shared_head.norm around 1, and the copies of the embedding and lm_head the releases
    carry); config.json's num_nextn_predict_layers set to 1. Returns the tensors, named without their prefix."""
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    n = int(config["num_hidden_layers"])
    gen = torch.Generator().manual_seed(seed)
    last, mtp_prefix = f"model.layers.{n - 1}.", f"model.layers.{n}."
    mtp = {name[len(last):]: tensor.clone() * _scale(name) for name, tensor in weights.items()
           if name.startswith(last)}
    h = weights["model.embed_tokens.weight"].shape[1]
    eh = torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5
    eh[:, :h] += embed_gain * torch.eye(h)
    mtp["eh_proj.weight"] = eh
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{norm}.weight"] = torch.rand(h, generator=gen) * 0.6 + 0.7
    mtp["embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    mtp["shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file({**weights, **{mtp_prefix + k: v for k, v in mtp.items()}}, path, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return mtp


class DeepseekLayoutMtpReference(MtpReference):
    """MtpReference for the DeepSeek-V3 / GLM-4.5 layer: eh_proj over [enorm(embedding, zero at position 0) |
    hnorm(h)], the copied decoder layer (its output includes the residual), shared_head.norm before the lm_head; the
    layer's output (not normed) chains the next draft."""

    layer_index = -1
    norm_names = ("enorm", "hnorm", "shared_head.norm")
    prefix, fc_name = "", "eh_proj"

    @torch.no_grad()
    def _layer(self, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        inner, dev = self.ref.model, self.device
        e = inner.embed_tokens(torch.tensor(tokens, device=dev))
        e[0] = 0.0  # (the pair at position 0)
        x = torch.cat([self.norms["enorm"](e), self.norms["hnorm"](hidden)], dim=-1) @ self.fc.t()
        n = x.shape[0]
        pos = torch.arange(n, device=dev)[None]
        mask = torch.full((n, n), float("-inf"), device=dev).triu(1)[None, None]
        out = self.layer(x[None], position_embeddings=inner.rotary_emb(x[None], pos), attention_mask=mask,
                         position_ids=pos)
        return (out[0] if isinstance(out, tuple) else out)[0]

    def _logits(self, o: torch.Tensor) -> torch.Tensor:
        return self.ref.lm_head(self.norms["shared_head.norm"](o))
