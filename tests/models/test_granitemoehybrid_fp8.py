"""IBM Granite 4.0-H in FP8 (models/granitemoehybrid.py): tiny Granite 4.0-H checkpoints (tests/helpers/
tiny_granitemoehybrid.py, dense and with 4 routed experts; residual_multiplier 0.22, embedding 3, attention 1/8,
logits 2) quantized here as the publishers' tools write them, run by the real engine against transformers on the
same weights dequantized.

- compressed-tensors float8 as llm-compressor's FP8_DYNAMIC recipe for Granite 4 writes it (ibm-granite's -FP8
  releases): E4M3 codes with a scale per output channel, activations quantized per token at run time, the experts'
  fused input_linear / output_linear as [E, rows, in] codes with [E, rows, 1] scales; `ignore` names lm_head, the
  routers and (as a selective recipe would) layer 0's Mamba projections and layer 2's shared input_linear, in the
  checkpoint's spelling.
- ModelOpt FP8 (dense): a per-tensor weight scale and a static input scale calibrated on the float model.
- quantization="fp8" on the float checkpoint: each row quantized at load.

The reference rounds each quantized projection's input through E4M3 as the engine does (per token, or at the static
scale), the experts' input and gated intermediate per token as the FP8 expert kernels do. residual_multiplier is
folded into the scales of the FP8 layers (exact), so the engine must match to FP8-rounding noise; a missed or double
fold would not."""

from __future__ import annotations

import functools
import os
import re
import types

import pytest
import torch
import torch.nn.functional as F
from ferrox.layers.fused_moe import FusedMoE
from ferrox.layers.quant.fp8_linear import Fp8Linear
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import UnsupportedModelError
from safetensors.torch import load_file

from tests.helpers.quant_checkpoints import load_checkpoint, write_checkpoint
from tests.helpers.tiny_granitemoehybrid import make_tiny_granitemoehybrid
from tests.models.conftest import assert_outputs_match_transformers, chunked_engine_outputs
from tests.models.test_nemotron_h_fp8 import fake_quantize

transformers = pytest.importorskip("transformers")

FP8 = torch.float8_e4m3fn
RESIDUAL = 0.22  # (the releases' value: not a power of two, so a fold into rounded codes would show)
PROMPTS = [[5, 9, 11], list(range(3, 43)), [(7 * i) % 300 + 3 for i in range(30)]]
_QUANTIZED = re.compile(r"\.(mamba\.(in|out)_proj|self_attn\.[qkvo]_proj|shared_mlp\.(input|output)_linear"
                        r"|block_sparse_moe\.(input|output)_linear)\.weight$")
# llm-compressor's Granite 4 recipe ignores lm_head and the routers; the last two entries keep layers float as a
# selective recipe would (a regex, and an exact name in the checkpoint's spelling of the shared MLP).
CT_IGNORE = ["lm_head", r"re:.*block_sparse_moe\.router", r"re:model\.layers\.0\.mamba\..*",
             "model.layers.2.shared_mlp.input_linear"]


def _ct_ignored(module: str) -> bool:
    return module.startswith("model.layers.0.mamba.") or module == "model.layers.2.shared_mlp.input_linear"


def quantized_tensors(float_weights: dict[str, torch.Tensor], *, per_tensor: bool = False,
                      float_modules=lambda module: False, scale_dtype: torch.dtype = torch.float32,
                      input_amax: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """The float checkpoint with every projection (the experts' fused tensors too) as E4M3 codes and `weight_scale`
    (absmax / 448 per output channel, [.., rows, 1]; or per tensor, []), `input_scale` (amax / 448) for the
    modules of input_amax; float_modules(module) left float, as an export that ignores them writes them."""
    out = {}
    for name, w in float_weights.items():
        module = name.rsplit(".", 1)[0]
        if not _QUANTIZED.search(name) or float_modules(module):
            out[name] = w
            continue
        w = w.float()
        amax = w.abs().amax() if per_tensor else w.abs().amax(dim=-1, keepdim=True)
        scale = amax.clamp(min=1e-12) / 448.0
        out[name] = (w / scale).clamp(-448, 448).to(FP8)
        out[f"{module}.weight_scale"] = scale.to(scale_dtype)
        if input_amax is not None:
            out[f"{module}.input_scale"] = torch.tensor(input_amax[module] / 448.0)
    return out


def calibrate(float_folder: str) -> dict[str, float]:
    """Each projection's largest input over PROMPTS in the float model (checkpoint module name -> amax)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def record(name, module, args):
        amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and _QUANTIZED.search(f"{name}.weight"):
            module.register_forward_pre_hook(functools.partial(record, name))
    with torch.inference_mode():
        for prompt in PROMPTS:
            model(torch.tensor([prompt]))
    return amax


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' GraniteMoeHybridExperts, one (token, slot) pair at a time, the input and the gated SiLU
    intermediate rounded through E4M3 per row, as the FP8 expert kernels quantize them."""
    out = torch.zeros_like(hidden_states)
    x = fake_quantize(hidden_states, None)
    for t in range(x.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            gate, up = F.linear(x[t:t + 1], self.gate_up_proj[e]).chunk(2, dim=-1)
            act = fake_quantize(F.silu(gate) * up, None)
            out[t] += top_k_weights[t, j] * F.linear(act, self.down_proj[e])[0]
    return out


def reference_model(float_folder: str, tensors: dict[str, torch.Tensor]):
    """transformers (float32) on `tensors` dequantized (codes x weight_scale), each quantized projection's input
    rounded at its static input_scale or per token (module docstring)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, codes in tensors.items():
            if codes.dtype != FP8:
                continue
            module = name.rsplit(".", 1)[0]
            w = codes.float() * tensors[f"{module}.weight_scale"].float()
            if ".block_sparse_moe." in module:  # (transformers 5 holds the fused experts as experts.<param>)
                experts = modules[f"{module.rsplit('.', 1)[0]}.experts"]
                param = "gate_up_proj" if module.endswith("input_linear") else "down_proj"
                getattr(experts, param).data = w
                experts.forward = types.MethodType(_experts_forward, experts)
                continue
            static = tensors.get(f"{module}.input_scale")
            s = None if static is None else float(static)
            modules[module].weight.data = w
            modules[module].register_forward_pre_hook(lambda m, args, s=s: (fake_quantize(args[0], s),))
    return model


@pytest.fixture(scope="module")
def floats(tmp_path_factory):
    root = tmp_path_factory.mktemp("granite_fp8")
    return {"dense": make_tiny_granitemoehybrid(root / "dense", residual_multiplier=RESIDUAL),
            "moe": make_tiny_granitemoehybrid(root / "moe", experts=4, rope=True, seed=1,
                                              residual_multiplier=RESIDUAL)}


def _float_weights(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def compressed_tensors_checkpoint(float_folder: str, folder, targets: list[str]) -> tuple[str, dict[str, torch.Tensor]]:
    """llm-compressor's FP8_DYNAMIC (module docstring): bfloat16 per-channel scales, no input scales."""
    tensors = quantized_tensors(_float_weights(float_folder), float_modules=_ct_ignored, scale_dtype=torch.bfloat16)
    scheme = {"num_bits": 8, "type": "float", "symmetric": True}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": targets, "weights": {**scheme, "strategy": "channel",
                                                                               "dynamic": False},
                                            "input_activations": {**scheme, "strategy": "token", "dynamic": True}}},
              "ignore": CT_IGNORE, "kv_cache_scheme": None}
    return write_checkpoint(float_folder, folder, config, tensors), tensors


@pytest.fixture(scope="module")
def ct_moe(floats, tmp_path_factory):
    # (the recipe names its expert modules beside Linear: llm-compressor's Granite 4 example)
    return compressed_tensors_checkpoint(floats["moe"], tmp_path_factory.mktemp("granite_ct_moe"),
                                         ["Linear", "GraniteMoeHybridParallelExpertsLinear"])


def test_layers_take_the_checkpoint_and_the_folds(floats, ct_moe):
    """What the recipe quantized runs FP8 with residual_multiplier on its weight scale (codes as stored); what
    `ignore` names runs float, its multiplier folded into the float weight as before."""
    folder, tensors = ct_moe
    model = load_checkpoint(folder)
    layers = model.model.layers
    mamba = layers[2].mamba
    for proj in (mamba.in_proj, mamba.out_proj, layers[1].self_attn.qkv_proj, layers[1].self_attn.o_proj,
                 layers[3].shared_mlp.gate_up_proj, layers[2].shared_mlp.down_proj):
        assert isinstance(proj.quant, Fp8Linear) and proj.quant.activations == "dynamic-token"
    stored = tensors["model.layers.2.mamba.out_proj.weight_scale"].float().reshape(-1)
    assert torch.equal(mamba.out_proj.weight.view(torch.uint8),
                       tensors["model.layers.2.mamba.out_proj.weight"].view(torch.uint8))
    torch.testing.assert_close(mamba.out_proj.weight_scale, stored * RESIDUAL, rtol=0, atol=0)
    stored = tensors["model.layers.1.self_attn.o_proj.weight_scale"].float().reshape(-1)
    torch.testing.assert_close(layers[1].self_attn.o_proj.weight_scale, stored * RESIDUAL, rtol=0, atol=0)
    assert torch.equal(mamba.in_proj.weight_scale, tensors["model.layers.2.mamba.in_proj.weight_scale"].float()
                       .reshape(-1))  # (no multiplier on in_proj)
    float_weights = _float_weights(floats["moe"])
    for proj in (layers[0].mamba.in_proj, layers[0].mamba.out_proj, layers[2].shared_mlp.gate_up_proj):
        assert proj.quant is None and proj.weight.dtype == torch.float32
    torch.testing.assert_close(layers[0].mamba.out_proj.weight,
                               float_weights["model.layers.0.mamba.out_proj.weight"] * RESIDUAL)
    assert layers[2].mamba.conv1d.weight.dtype == torch.float32 and layers[2].mamba.A_log.dtype == torch.float32
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 4 and all(m.w13.dtype == FP8 and m.w13.shape == (4, 48, 32) for m in experts)
    down = tensors["model.layers.0.block_sparse_moe.output_linear.weight_scale"].float()  # [E, H, 1]
    torch.testing.assert_close(experts[0].w2_scale, down.reshape(4, 32) * RESIDUAL, rtol=0, atol=0)
    gate_up = tensors["model.layers.0.block_sparse_moe.input_linear.weight_scale"].float()
    assert torch.equal(experts[0].w13_scale, gate_up.reshape(4, 48))


def test_compressed_tensors_moe_matches_the_dequantized_reference(floats, ct_moe):
    folder, tensors = ct_moe
    outs = chunked_engine_outputs(folder, PROMPTS)
    assert_outputs_match_transformers(reference_model(floats["moe"], tensors), PROMPTS, outs, abs_tol=2e-3)


def test_compressed_tensors_dense_matches_the_dequantized_reference(floats, tmp_path):
    folder, tensors = compressed_tensors_checkpoint(floats["dense"], tmp_path / "ct_dense", ["Linear"])
    outs = chunked_engine_outputs(folder, PROMPTS)
    assert_outputs_match_transformers(reference_model(floats["dense"], tensors), PROMPTS, outs, abs_tol=2e-3)


def test_modelopt_dense_matches_the_dequantized_reference(floats, tmp_path):
    """Per-tensor scales (the shared input_linear's one scale on both its halves) and static input scales."""
    tensors = quantized_tensors(_float_weights(floats["dense"]), per_tensor=True,
                                input_amax=calibrate(floats["dense"]))
    config = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"],
              "producer": {"name": "modelopt", "version": "0.35.0"}}
    folder = write_checkpoint(floats["dense"], tmp_path / "modelopt", config, tensors)
    outs = chunked_engine_outputs(folder, PROMPTS)
    assert_outputs_match_transformers(reference_model(floats["dense"], tensors), PROMPTS, outs, abs_tol=2e-3)


def test_online_fp8_matches_the_rows_quantized_reference(floats):
    """quantization="fp8": the float weights, multipliers folded, quantized per row at load -- the reference's
    per-channel rounding of the unfolded rows (the fold moves no code: each row's scale takes the same factor)."""
    outs = chunked_engine_outputs(floats["moe"], PROMPTS, quantization="fp8")
    tensors = quantized_tensors(_float_weights(floats["moe"]))
    assert_outputs_match_transformers(reference_model(floats["moe"], tensors), PROMPTS, outs, abs_tol=2e-3)


@pytest.mark.parametrize("hf,message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]},
     r"quantization 'fp8' is not supported for GraniteMoeHybridForCausalLM: .*block-wise FP8"),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"},
     r"quantization 'modelopt' \(quant_algo FP8_PB_WO\) is not supported for GraniteMoeHybridForCausalLM"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True}}}},
     r"quantization 'compressed-tensors' is not supported for GraniteMoeHybridForCausalLM"),
])
def test_refusals(floats, hf, message):
    """Block-wise FP8 (the in_proj's dt segment is a row per head, no whole 128-row block) and integer formats, by
    name, before any weight loads."""
    from ferrox.layers.quant.config import resolve_quant_config

    source = resolve_model(floats["dense"])
    spec = load_model_spec(source)
    spec.hf_config["quantization_config"] = hf
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(source, spec, dtype=torch.float32, device="cpu", quant_config=resolve_quant_config(None, spec))
