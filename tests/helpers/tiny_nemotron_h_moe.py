"""A tiny random Nemotron 3 (NemotronHForCausalLM with "E" layers) in a temp folder, as transformers saves it: the
releases' per-expert names (`backbone.layers.N.mixer.experts.{e}.up_proj.weight`...), its config written as the
releases write it (hybrid_override_pattern and num_hidden_layers).

Shapes: hidden 64, layers M E * E - M (Mamba2 4 heads of 16, 2 groups of d_state 16; NoPE attention 4 / 2 heads of
16; a 96-wide ReLU^2 MLP), 8 experts of 32 in 4 groups, 2 groups kept, top 3, a 48-wide shared expert, routed
scaling 2.5. `latent`: the experts 32 wide behind fc1 / fc2_latent_proj (Nemotron 3 Super's shape), with mlp_bias.

Randomised so that nothing is trivial: the Mamba2 parameters as tests/helpers/tiny_granitemoehybrid.py does, the
router N(0, 0.3) (logits of a few units: sigmoid scores spread over (0, 1)), e_score_correction_bias N(0, 0.2)
(it moves choices), the linear biases N(0, 0.1) (transformers initialises them to zero).

`add_nemotron_h_mtp` writes Nemotron 3 Super's multi-token-prediction step into such a folder (mtp.layers.*).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.helpers.tiny_granitemoehybrid import _randomize_mamba, _rewrite_config
from tests.helpers.tiny_models import _common, _save, build_tokenizer

if TYPE_CHECKING:
    import torch

NEMOTRON_MOE_PATTERN = "ME*E-M"
EXPERTS, TOP_K, GROUPS, KEPT_GROUPS = 8, 3, 4, 2


def make_tiny_nemotron_h_moe(folder, *, latent: bool = False, seed: int = 0) -> str:
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    tok = build_tokenizer()
    fields = _common(tok, 64, len(NEMOTRON_MOE_PATTERN), 4, 2, 96, 512, False)
    fields.pop("num_hidden_layers")
    fields.pop("rms_norm_eps")
    config = NemotronHConfig(**fields, hybrid_override_pattern=NEMOTRON_MOE_PATTERN, mamba_num_heads=4,
                             mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, head_dim=16,
                             use_bias=True, layer_norm_epsilon=1e-5, n_routed_experts=EXPERTS,
                             num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                             moe_shared_expert_intermediate_size=48, n_group=GROUPS, topk_group=KEPT_GROUPS,
                             routed_scaling_factor=2.5, norm_topk_prob=not latent,
                             moe_latent_size=32 if latent else None, mlp_bias=latent)
    config.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).to(torch.float32)
    _randomize_mamba(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mixer.gate.weight"):
                param.normal_(0.0, 0.3)
            elif name.endswith(".bias") and "conv1d" not in name:
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    _rewrite_config(str(folder), hybrid_override_pattern=NEMOTRON_MOE_PATTERN,
                    num_hidden_layers=len(NEMOTRON_MOE_PATTERN))
    return str(folder)


# ---- Nemotron 3 Super's multi-token-prediction layers (models/nemotron_h_mtp.py) ---------------------------------
MTP_BLOCKS = ("*", "E")  # (the releases' mtp_layers_block_type ["attention", "moe"])
# The target's layer each MTP block copies, and the factors its output projections are scaled by (so it is not the
# target's layer, and each block weighs in), by the end of the tensor's name.
MTP_SOURCES = {"*": NEMOTRON_MOE_PATTERN.index("*"), "E": NEMOTRON_MOE_PATTERN.rindex("E")}
_MTP_SCALED = {"o_proj.weight": 3.0, "down_proj.weight": 0.5}


def mtp_scale(name: str) -> float:
    return next((v for k, v in _MTP_SCALED.items() if name.endswith(k)), 1.0)


def add_nemotron_h_mtp(folder: str, *, seed: int = 1, embed_gain: float = 0.0,
                       config_fields: dict | None = None) -> dict[str, torch.Tensor]:
    """Write Nemotron 3 Super's MTP tensors into `folder`'s model.safetensors as the releases name them
    (`mtp.layers.0.{enorm,hnorm,eh_proj}`, `mtp.layers.{i}.{norm,mixer.*}` for the blocks MTP_BLOCKS,
    `mtp.layers.1.final_layernorm`) and declare them in config.json (num_nextn_predict_layers 1,
    mtp_layers_block_type; `config_fields` set beside). Each block is the target's layer MTP_SOURCES names, copied and
    scaled (mtp_scale); eh_proj random, with `embed_gain` identity on its embedding half (the layer's argmax then
    leans to the token it is given); the three norms random around 1. Returns the MTP tensors."""
    import json
    import os

    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    mtp: dict[str, torch.Tensor] = {}
    for i, letter in enumerate(MTP_BLOCKS):
        source = f"backbone.layers.{MTP_SOURCES[letter]}."
        for name, tensor in weights.items():
            if name.startswith(source):
                mtp[f"mtp.layers.{i}.{name[len(source):]}"] = tensor.clone() * mtp_scale(name)
    h = weights["backbone.embeddings.weight"].shape[1]
    eh = torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5
    eh[:, :h] += embed_gain * torch.eye(h)
    mtp["mtp.layers.0.eh_proj.weight"] = eh
    for norm in ("mtp.layers.0.enorm", "mtp.layers.0.hnorm", f"mtp.layers.{len(MTP_BLOCKS) - 1}.final_layernorm"):
        mtp[f"{norm}.weight"] = torch.rand(h, generator=gen) * 0.6 + 0.7
    save_file({**weights, **mtp}, path, metadata={"format": "pt"})
    kinds = {"*": "attention", "E": "moe", "-": "mlp", "M": "mamba"}
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.update(num_nextn_predict_layers=1, mtp_layers_block_type=[kinds[c] for c in MTP_BLOCKS],
                  **(config_fields or {}))
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return mtp
