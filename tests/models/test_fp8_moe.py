"""FP8 mixture-of-experts models end to end (layers/quant/fp8_moe.py): tiny Qwen3-MoE, Qwen2-MoE and
Mixtral models quantized by tests/helpers/fp8_moe_checkpoints.py -- a block-wise checkpoint (the
Qwen3-30B-A3B-FP8 layout), an AutoFP8 per-tensor checkpoint, `quantization="fp8"` at load, and
llm-compressor's per-channel float8 layout -- run by `LLM` against transformers on the dequantized
weights with every projection's input (and the experts' intermediate) rounded through E4M3: greedy
tokens identical, logprobs to float32 rounding. Refusals by name; dummy weights; on a GPU the engine (Triton kernels, the fused decode
path, CUDA graphs) against the same reference.
"""

from __future__ import annotations

import pytest
import torch
from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.fused_moe import FusedMoE
from ferrox.layers.quant.fp8_block import Fp8BlockConfig
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from safetensors.torch import load_file

from tests.helpers import tiny_models
from tests.helpers.fp8_moe_checkpoints import fp8_config, quantize, quantized_tensors, reference_model
from tests.helpers.quant_checkpoints import (
    assert_follows_reference,
    edited_copy,
    engine_greedy,
    load_checkpoint,
    make_llm,
    reference_greedy,
    write_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[5, 9, 33, 7, 100, 41], list(range(40, 75)), [17]]
NEW_TOKENS = 8
BUILDERS = {
    "qwen3_moe": lambda d: tiny_models.make_tiny_qwen3_moe(d, seed=21),
    "qwen2_moe": lambda d: tiny_models.make_tiny_qwen2_moe(d, seed=22),
    "mixtral": lambda d: tiny_models.make_tiny_mixtral(d, intermediate_size=64, seed=23),
}
# (family, layout, block): Qwen3-MoE's experts (32 rows) in 32 x 32 blocks; Qwen2-MoE as AutoFP8
# writes it (a scale per tensor); Mixtral quantized at load (quantization="fp8", a scale per row).
# Qwen3-MoE again in llm-compressor's float8 layout (a scale per channel, RedHatAI's FP8-dynamic releases).
CASES = [("qwen3_moe", "block", (32, 32)), ("qwen2_moe", "tensor", None), ("mixtral", "row", None),
         ("qwen3_moe", "channel", None)]
SCALE_NAME = {"block": "weight_scale_inv", "tensor": "weight_scale", "row": "weight_scale", "channel": "weight_scale"}


def _case_id(case) -> str:
    return f"{case[0]}-{case[1]}"


@pytest.fixture(scope="module")
def floats(tmp_path_factory):
    """family -> (float folder, its tensors), written on first use."""
    built: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}

    def get(family: str) -> tuple[str, dict[str, torch.Tensor]]:
        if family not in built:
            folder = BUILDERS[family](tmp_path_factory.mktemp(family))
            built[family] = folder, load_file(f"{folder}/model.safetensors")
        return built[family]

    return get


@pytest.fixture(scope="module")
def checkpoints(floats, tmp_path_factory):
    """case -> (folder the engine loads, the quantized tensors the reference runs, block, quantization)."""
    built: dict = {}

    def get(case):
        if case not in built:
            family, layout, block = case
            float_folder, float_weights = floats(family)
            tensors = quantized_tensors(float_weights, layout, block, SCALE_NAME[layout])
            if layout == "row":  # quantized by the engine at load
                built[case] = float_folder, tensors, None, "fp8"
            else:
                folder = write_checkpoint(float_folder, tmp_path_factory.mktemp(_case_id(case)),
                                          fp8_config(layout, block), tensors)
                built[case] = folder, tensors, block, None
        return built[case]

    return get


# ---- end to end -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_model_matches_the_fake_quantized_reference(floats, checkpoints, case):
    folder, tensors, block, quantization = checkpoints(case)
    llm = make_llm(folder, device="cpu", quantization=quantization)
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.w13.dtype == torch.float8_e4m3fn and m.block == block for m in experts)
    got = engine_greedy(llm, PROMPTS)
    reference = reference_model(floats(case[0])[0], tensors, block, SCALE_NAME[case[1]])
    for prompt, (tokens, logprobs) in zip(PROMPTS, got, strict=True):
        ref_tokens, ref_logprobs = reference_greedy(reference, prompt, NEW_TOKENS)
        assert tokens == ref_tokens, prompt
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


def test_the_fake_quantization_is_not_a_no_op(floats, checkpoints):
    """The reference differs from the float model by more than the tolerance above, and so does a
    reference whose experts alone are left in float (a test that passed on float experts would
    prove nothing about them)."""
    from transformers import AutoModelForCausalLM

    case = CASES[0]
    _, tensors, block, _ = checkpoints(case)
    float_folder, float_weights = floats(case[0])
    experts_float = {k: (float_weights[k] if ".experts." in k and k.endswith(".weight") else v)
                     for k, v in tensors.items() if not (".experts." in k and k.endswith("_scale_inv"))}
    prompt = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        logits = [m(prompt).logits[0].log_softmax(-1) for m in (
            reference_model(float_folder, tensors, block, "weight_scale_inv"),
            reference_model(float_folder, experts_float, block, "weight_scale_inv"),
            AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval())]
    assert (logits[0] - logits[1]).abs().max() > 1e-3
    assert (logits[0] - logits[2]).abs().max() > 1e-3


def test_dummy_weights_run(floats):
    """load_format="dummy" with block-FP8 and online-FP8 experts: random codes and scales of the
    right shapes, finite logprobs."""
    for family, quant in (("qwen3_moe", None), ("mixtral", "fp8")):
        folder = floats(family)[0]
        if quant is None:
            folder = write_checkpoint(folder, f"{folder}-dummy-block", fp8_config("block", (32, 32)), {})
        llm = make_llm(folder, device="cpu", load_format="dummy", quantization=quant)
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts and all(m.w13.dtype == torch.float8_e4m3fn and m.w13_scale is not None
                               and bool(torch.isfinite(m.w13_scale).all()) for m in experts)
        (tokens, logprobs), = engine_greedy(llm, PROMPTS[:1])
        assert len(tokens) == NEW_TOKENS and all(lp == lp and lp <= 0 for lp in logprobs)


# ---- refusals -------------------------------------------------------------------------------------
def test_other_methods_and_narrow_blocks_are_refused_for_experts(floats, checkpoints):
    """(Static activations are taken: the experts quantize per token, their input scales unused -- Mistral Small
    4's release, tests/models/test_mistral4.py.)"""
    from ferrox.layers.quant.awq import AWQConfig

    folder = floats("qwen3_moe")[0]
    source = resolve_model(folder)
    spec = load_model_spec(source)
    awq = AWQConfig.from_hf({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                             "version": "gemm"})
    with pytest.raises(UnsupportedModelError, match="'awq': mixture-of-experts layers do not take awq weights"):
        load_model(source, spec, dtype=torch.float32, device="cpu", quant_config=awq)
    # Blocks of 64 rows would cut across the gate and up halves of the stacked experts (32 rows each).
    with pytest.raises(UnsupportedModelError, match="moe_intermediate_size 32 .*whole 64-row weight blocks"):
        load_model(source, spec, dtype=torch.float32, device="cpu", quant_config=Fp8BlockConfig((64, 32)))
    with pytest.raises(UnsupportedModelError, match=r"blocks \[32, 16\] are too narrow"):
        load_model(source, spec, dtype=torch.float32, device="cpu", quant_config=Fp8BlockConfig((32, 16)))


def test_missing_and_mistyped_expert_tensors_are_named(floats, checkpoints, tmp_path):
    folder, _, _, _ = checkpoints(CASES[0])
    scale = "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"
    with pytest.raises(ModelLoadError, match=r"missing .*layers\.2\.mlp\.experts shard 5\.down\.weight_scale_inv"):
        load_checkpoint(edited_copy(folder, tmp_path / "no-scale", lambda t: t.pop(scale)))
    with pytest.raises(ModelLoadError, match=r"experts\.5\.down_proj\.weight_scale_inv.*shape \(1, 1\)"):
        load_checkpoint(edited_copy(folder, tmp_path / "scale", lambda t: t.update({scale: torch.ones(1, 1)})))
    weight = "model.layers.0.mlp.experts.3.gate_proj.weight"
    float_weights = floats(CASES[0][0])[1]
    with pytest.raises(ModelLoadError, match=r"experts\.3\.gate_proj\.weight.*float8_e4m3fn"):
        load_checkpoint(edited_copy(folder, tmp_path / "float", lambda t: t.update({weight: float_weights[weight]})))


def test_per_tensor_expert_scales_load_into_every_row(checkpoints):
    """AutoFP8's one scale per projection lands in every row of that expert's gate, up or down."""
    folder, tensors, _, _ = checkpoints(CASES[1])
    model = load_checkpoint(folder)
    experts = next(m for m in model.modules() if isinstance(m, FusedMoE))
    inter = experts.intermediate_size
    name = "model.layers.0.mlp.experts.4.{}.weight_scale"
    for proj, rows in (("gate_proj", experts.w13_scale[4, :inter]), ("up_proj", experts.w13_scale[4, inter:]),
                       ("down_proj", experts.w2_scale[4])):
        assert torch.equal(rows, tensors[name.format(proj)].float().expand(rows.shape[0])), proj
    codes, _ = quantize(torch.ones(3, 4), "tensor")
    assert codes.dtype == torch.float8_e4m3fn


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gpu_engine_follows_the_reference(floats, checkpoints, case):
    """The Triton expert kernels (grouped for prefill, matrix-vector for one-token decode steps, the
    fused decode path) in float32 against the CPU reference; CUDA graphs on."""
    folder, tensors, block, quantization = checkpoints(case)
    llm = make_llm(folder, device="cuda", dtype="float32", quantization=quantization)
    got = engine_greedy(llm, PROMPTS)
    reference = reference_model(floats(case[0])[0], tensors, block, SCALE_NAME[case[1]])
    for prompt, (tokens, logprobs) in zip(PROMPTS, got, strict=True):
        assert_follows_reference(reference, prompt, tokens, logprobs)
