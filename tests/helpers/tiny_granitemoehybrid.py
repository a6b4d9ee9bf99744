"""Tiny random Mamba2 hybrids in a temp folder, as transformers saves them: Granite 4.0-H
(GraniteMoeHybridForCausalLM, granitemoehybrid) and Nemotron-H (NemotronHForCausalLM, nemotron_h; its config written
as the releases write it, hybrid_override_pattern and num_hidden_layers).

Shapes: hidden 32, four layers (mamba, attention, mamba, mamba: layer_types written as the releases write them,
"mamba" / "attention"), attention 4 / 2 heads of 8, Mamba2 4 heads of 16 (expand 2), 2 groups of B / C of
d_state 16 (two heads a group), a 4-tap conv with bias, a 48-wide shared MLP. MoE: 4 experts of 24, top 2. The
multipliers are Granite's kind (embedding 3, residual 0.5, attention 1/8, logits 2) so a missed fold shows.

Randomised so that nothing is trivial: norm weights in [0.5, 1.5], A_log = log(A) for A in [0.05, 1]
(transformers' init A = 1..H makes the state forget within a few tokens), dt_bias in [-1, 1], D in [-1, 1], conv
taps N(0, 0.5), routers N(0, 0.5).
"""

from __future__ import annotations

from typing import Any

from tests.helpers.tiny_models import _common, _randomize_norms, _save, build_tokenizer

LAYER_TYPES = ["mamba", "attention", "mamba", "mamba"]


def _randomize_mamba(model) -> None:
    import torch

    _randomize_norms(model)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("MambaLayer", "Mamba2Mixer")):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.05, 1.0).log_())
                module.dt_bias.uniform_(-1.0, 1.0)
                module.D.uniform_(-1.0, 1.0)
                module.conv1d.weight.normal_(0.0, 0.5)
                module.conv1d.bias.normal_(0.0, 0.2)
        for name, param in model.named_parameters():
            if name.endswith("router.weight"):
                param.normal_(0.0, 0.5)


def _rewrite_config(folder: str, **fields: Any) -> None:
    import json
    import os

    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    saved.update(fields)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=2)


NEMOTRON_PATTERN = "M*-M-"


def make_tiny_nemotron_h(folder, *, seed: int = 0) -> str:
    """A NemotronHForCausalLM: layers M * - M - (Mamba2 4 heads of 16, 2 groups of d_state 16, in_proj / out_proj
    with biases; NoPE attention 4 / 2 heads of 8; ReLU^2 MLPs 48 wide)."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    tok = build_tokenizer()
    fields = _common(tok, 32, len(NEMOTRON_PATTERN), 4, 2, 48, 512, False)
    fields.pop("num_hidden_layers")
    fields.pop("rms_norm_eps")
    config = NemotronHConfig(**fields, hybrid_override_pattern=NEMOTRON_PATTERN, mamba_num_heads=4, mamba_head_dim=16,
                             ssm_state_size=16, n_groups=2, conv_kernel=4, expand=2, head_dim=8, use_bias=True,
                             layer_norm_epsilon=1e-5)
    config.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).to(torch.float32)
    _randomize_mamba(model)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    _rewrite_config(str(folder), hybrid_override_pattern=NEMOTRON_PATTERN, num_hidden_layers=len(NEMOTRON_PATTERN))
    return str(folder)


def make_tiny_granitemoehybrid(folder, *, seed: int = 0, experts: int = 0, rope: bool = False,
                               **overrides: Any) -> str:
    """A GraniteMoeHybridForCausalLM: dense (experts 0: the shared MLP only) or with `experts` routed experts;
    rope False: NoPE attention (the releases'), True: rotary."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    tok = build_tokenizer()
    fields = _common(tok, 32, len(LAYER_TYPES), 4, 2, 24, 512, False)
    fields.update(layer_types=list(LAYER_TYPES), mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16,
                  mamba_d_head=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, mamba_conv_bias=True,
                  mamba_proj_bias=False, shared_intermediate_size=48, num_local_experts=experts,
                  num_experts_per_tok=2, position_embedding_type="rope" if rope else "nope",
                  embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=2.0)
    fields.update(overrides)
    config = GraniteMoeHybridConfig(**fields)
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(config).to(torch.float32)
    _randomize_mamba(model)
    _save(str(folder), model, tok, max_shard_size=None, generation=None)
    # The releases' names for the layer kinds (transformers 5 writes its own, linear_attention / full_attention).
    _rewrite_config(str(folder), layer_types=list(fields["layer_types"]))
    return str(folder)
