"""FP8 mixture-of-experts checkpoints for tests, and the reference they must match.

A tiny float MoE folder (tiny_models.make_tiny_qwen3_moe / _qwen2_moe / _mixtral) is quantized here,
independently of ferrox's loader and kernels, into one of three layouts:

- "block": DeepSeek-V3's / Qwen3-30B-A3B-FP8's, `weight` E4M3 and `weight_scale_inv` per BN x BK block;
- "tensor": AutoFP8's, `weight` and one `weight_scale` per projection (per tensor);
- "row": one scale per output row (what `quantization="fp8"` computes at load);
- "channel": llm-compressor's float8 layout (compressed-tensors, RedHatAI/Qwen3-30B-A3B-FP8-dynamic),
  a `weight_scale` [out, 1] per projection, routers ignored by a regex as that checkpoint does.

Every decoder projection is quantized, the experts' too (`experts.{e}.gate_proj` / `w1` ...), while
routers and Qwen2-MoE's shared-expert gate stay float, as the published checkpoints keep them.

The reference is transformers on the float folder with each projection's weight replaced by its
dequantized codes and its input rounded through E4M3 (per token, or per token and group of BK);
the experts module's forward is replaced by a loop over (token, slot) pairs doing the same, with the
gated intermediate rounded through E4M3 before the down projection, as an FP8 engine quantizes it.
"""

from __future__ import annotations

import re
import types

import torch
import torch.nn.functional as F

from tests.helpers.fp8_block_checkpoints import dequantize_blocks, fake_quantize_groups, quantize_blocks

FP8 = torch.float8_e4m3fn
# Projections quantized: attention, dense MLPs, shared experts, routed experts (Qwen and Mixtral names).
_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_EXPERT = re.compile(r"^(?P<layer>.+)\.(mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_EXPERT_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def quantize(w: torch.Tensor, layout: str, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes, float32 scales) of one projection: per block, per tensor ([] scale) or per row ([out])."""
    if layout == "block":
        assert block is not None
        return quantize_blocks(w, block)
    wf = w.float()
    amax = wf.abs().max() if layout == "tensor" else wf.abs().amax(dim=1)
    scale = amax.clamp(min=1e-12) / 448.0
    codes = (wf / (scale if layout == "tensor" else scale[:, None])).clamp(-448, 448).to(FP8)
    return codes, (scale[:, None] if layout == "channel" else scale).float()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    if block is not None:
        return dequantize_blocks(codes, scale, block)
    return codes.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))


def quantized_tensors(float_weights: dict[str, torch.Tensor], layout: str, block: tuple[int, int] | None = None,
                      scale_name: str = "weight_scale") -> dict[str, torch.Tensor]:
    """The float checkpoint with every projection quantized (scales `<module>.<scale_name>`)."""
    out = {}
    for name, w in float_weights.items():
        if _QUANTIZED.search(name) and "shared_expert_gate" not in name:
            module = name.rsplit(".", 1)[0]
            out[name], out[f"{module}.{scale_name}"] = quantize(w, layout, block)
        else:
            out[name] = w
    return out


def fp8_config(layout: str, block: tuple[int, int] | None = None) -> dict:
    """config.json quantization_config of the fp8 layout (dynamic activations), or compressed-tensors'
    for "channel"."""
    if layout == "channel":
        args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
                "actorder": None, "observer": "minmax", "observer_kwargs": {}}
        return {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
                "weights": {**args, "strategy": "channel", "dynamic": False},
                "input_activations": {**args, "strategy": "token", "dynamic": True, "observer": None}}},
        }
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if layout == "block":
        assert block is not None
        config["weight_block_size"] = list(block)
    return config


def _fake_quantize(x: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    return fake_quantize_groups(x, block[1] if block is not None else x.shape[-1]).to(x.dtype)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts module, one (token, slot) pair at a time, inputs rounded through E4M3."""
    out = torch.zeros_like(hidden_states)
    x = _fake_quantize(hidden_states, self.fp8_block)
    inter = self.down_proj.shape[2]
    for t in range(x.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            gate_up = F.linear(x[t], self.gate_up_proj[e])
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            y = F.linear(_fake_quantize(act[None], self.fp8_block)[0], self.down_proj[e])
            out[t] += top_k_weights[t, j] * y
    return out


def reference_model(float_folder: str, tensors: dict[str, torch.Tensor], block: tuple[int, int] | None,
                    scale_name: str = "weight_scale"):
    """transformers (float32) running `tensors` dequantized, inputs fake-quantized (module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, codes in tensors.items():
            if codes.dtype != FP8:
                continue
            module_name = name.rsplit(".", 1)[0]
            w = dequantize(codes, tensors[f"{module_name}.{scale_name}"], block)
            expert = _EXPERT.match(name)
            if expert is None:
                linear = modules[module_name]
                linear.weight.data = w
                linear.register_forward_pre_hook(lambda m, args: (_fake_quantize(args[0], block),))
                continue
            experts = modules[f"{expert['layer']}.mlp.experts"]
            e, role = int(expert["e"]), _EXPERT_ROLE[expert["proj"]]
            inter = experts.down_proj.shape[2]
            if role == "down":
                experts.down_proj.data[e] = w
            else:
                rows = slice(0, inter) if role == "gate" else slice(inter, 2 * inter)
                experts.gate_up_proj.data[e, rows] = w
            experts.fp8_block = block
            experts.forward = types.MethodType(_experts_forward, experts)
    return model
