"""A tiny random Nemotron 3 (NemotronHForCausalLM with "E" layers) in a temp folder, as transformers saves it: the
releases' per-expert names (`backbone.layers.N.mixer.experts.{e}.up_proj.weight`...), its config written as the
releases write it (hybrid_override_pattern and num_hidden_layers).

Shapes: hidden 64, layers M E * E - M (Mamba2 4 heads of 16, 2 groups of d_state 16; NoPE attention 4 / 2 heads of
16; a 96-wide ReLU^2 MLP), 8 experts of 32 in 4 groups, 2 groups kept, top 3, a 48-wide shared expert, routed
scaling 2.5. `latent`: the experts 32 wide behind fc1 / fc2_latent_proj (Nemotron 3 Super's shape), with mlp_bias.

Randomised so that nothing is trivial: the Mamba2 parameters as tests/helpers/tiny_granitemoehybrid.py does, the
router N(0, 0.3) (logits of a few units: sigmoid scores spread over (0, 1)), e_score_correction_bias N(0, 0.2)
(it moves choices), the linear biases N(0, 0.1) (transformers initialises them to zero).
"""

from __future__ import annotations

from tests.helpers.tiny_granitemoehybrid import _randomize_mamba, _rewrite_config
from tests.helpers.tiny_models import _common, _save, build_tokenizer

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
