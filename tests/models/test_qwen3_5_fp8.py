"""Qwen3.5 and Qwen3-Next as their FP8 releases publish them (Qwen3.5-397B-A17B-FP8, Qwen3.6-35B-A3B-FP8,
Qwen3-Next-80B-A3B-Instruct-FP8): block-wise E4M3 weights (`weight_scale_inv` per 32 x 32 block here) for the full
attention's q / k / v / o, the linear attention's in_proj_qkv / in_proj_z / out_proj (Qwen3-Next: the fused
in_proj_qkvz, quantized across its key-head groups), the dense and shared-expert MLPs and every routed expert;
in_proj_b / in_proj_a (Qwen3-Next: in_proj_ba, which its release lists layer by layer in modules_to_not_convert),
the conv kernel, A_log, dt_bias, norms, routers, the shared-expert gate, embeddings and lm_head stay float. The
tiny Qwen3-Next has key heads of 32 and 2 value heads of 16 per key head, so that each group's q, k, v and z rows
are whole 32-row blocks, as the release's 128, 128, 256 and 256 are whole 128-row ones.

ferrox dequantizes the full attention's q / k / v at load (their rows are reordered for the partial rotary:
models/qwen3_5.py check_quantization) and cuts Qwen3-Next's in_proj_qkvz scales with its rows
(split_qwen3_next_projections); every other quantized projection runs FP8 with activations quantized per
token and group of 32. The reference is transformers on the dequantized weights with the same activation rounding
(tests/helpers/fp8_moe_checkpoints.py) except on q / k / v: greedy tokens equal and logprobs to float32 rounding on
the CPU; the split's scales and an FP8 in_proj_ba (dequantized at load) against the float split; the refusals;
on a GPU, the CUDA engine follows the same reference within the FP8 tests' bound."""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import pytest
import torch
from ferrox.errors import UnsupportedModelError
from ferrox.layers.fused_moe import FusedMoE
from ferrox.layers.quant.fp8_block import Fp8BlockLinear
from safetensors.torch import load_file

from tests.helpers import tiny_qwen3_5
from tests.helpers.fp8_moe_checkpoints import dequantize, quantize, reference_model
from tests.helpers.quant_checkpoints import (
    assert_follows_reference,
    engine_greedy,
    make_llm,
    reference_greedy,
    write_checkpoint,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

BLOCK = (32, 32)
PROMPTS = [[5, 9, 33, 7, 100, 41], list(range(40, 110)), [17]]
_QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_qkvz|in_proj_z|out_proj)|"
                        r"(gate|up|down)_proj)\.weight$")
_QKV = re.compile(r"\.self_attn\.[qkv]_proj\.weight$")
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
          "modules_to_not_convert": ["lm_head", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a",
                                     "linear_attn.in_proj_b", "linear_attn.conv1d"]}
# Qwen3-Next-80B-A3B-Instruct-FP8 names its float in_proj_ba one linear-attention layer at a time
# (model.layers.{0..46}.linear_attn.in_proj_ba; in_proj_qkvz is not listed: FP8); the gates named alike here.
_LAYERS = tiny_qwen3_5.LAYER_TYPES
NEXT_CONFIG = {**CONFIG, "modules_to_not_convert": [
    "lm_head",
    *(f"model.layers.{i}.linear_attn.in_proj_ba" for i, kind in enumerate(_LAYERS) if kind == "linear_attention"),
    *(f"model.layers.{i}.mlp.{gate}" for i in range(len(_LAYERS)) for gate in ("gate", "shared_expert_gate"))]}
# Dk 32 and r Dv 2 x 16: one 32-row block per group component.
NEXT_FIELDS = {"linear_key_head_dim": 32, "linear_value_head_dim": 16}
BUILDS = {"dense": tiny_qwen3_5.make_tiny_qwen3_5, "moe": tiny_qwen3_5.make_tiny_qwen3_5_moe,
          "next": functools.partial(tiny_qwen3_5.make_tiny_qwen3_next, **NEXT_FIELDS)}


def fp8_release(float_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in float_weights.items():
        if _QUANTIZED.search(name) and "shared_expert_gate" not in name:
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = quantize(w, "block", BLOCK)
        else:
            out[name] = w
    return out


@pytest.fixture(scope="module", params=["dense", "moe", "next"])
def release(request, tmp_path_factory):
    """(FP8 folder, its tensors, the reference model)."""
    float_folder = BUILDS[request.param](tmp_path_factory.mktemp(f"q35_{request.param}"), seed=5)
    tensors = fp8_release(load_file(os.path.join(float_folder, "model.safetensors")))
    config = NEXT_CONFIG if request.param == "next" else CONFIG
    folder = write_checkpoint(float_folder, tmp_path_factory.mktemp(f"q35_fp8_{request.param}"), config, tensors)
    # transformers on the dequantized weights, inputs rounded through E4M3 per group -- but for q / k / v, which
    # ferrox dequantizes at load: plain float products there.
    rounded = {k: v for k, v in tensors.items() if not _QKV.search(k)}
    ref = reference_model(float_folder, rounded, BLOCK, "weight_scale_inv")
    modules = dict(ref.named_modules())
    with torch.no_grad():
        for name, codes in tensors.items():
            if _QKV.search(name):
                modules[name[:-len(".weight")]].weight.data = dequantize(codes, tensors[name + "_scale_inv"], BLOCK)
    return folder, tensors, ref


def test_release_matches_the_fake_quantized_reference(release):
    folder, _, ref = release
    llm = make_llm(folder, dtype="float32")
    model = llm.engine.runner.model
    layer = model.model.layers[0].linear_attn
    assert isinstance(layer.qkvz_proj.quant, Fp8BlockLinear) and layer.ba_proj.quant is None
    attn = model.model.layers[3].self_attn
    assert attn.qkv_proj.quant is None and isinstance(attn.o_proj.quant, Fp8BlockLinear)
    assert all(m.w13.dtype == torch.float8_e4m3fn for m in model.modules() if isinstance(m, FusedMoE))
    got = engine_greedy(llm, PROMPTS)
    for prompt, (tokens, logprobs) in zip(PROMPTS, got, strict=True):
        ref_tokens, ref_logprobs = reference_greedy(ref, prompt, 8)
        assert tokens == ref_tokens, prompt
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=2e-4, rtol=2e-4)


def test_unaligned_blocks_and_other_methods_are_refused(release, tmp_path):
    from ferrox.layers.quant.config import resolve_quant_config
    from ferrox.loader.model_loader import load_model_spec
    from ferrox.loader.source import resolve_model
    from ferrox.models.qwen3_5 import check_quantization

    folder, _, _ = release
    spec = load_model_spec(resolve_model(folder))
    wide = {**spec.hf_config, "quantization_config": {**CONFIG, "weight_block_size": [64, 64]}}
    cut = ("Qwen3-Next's in_proj_qkvz holds, per key head, 32 q, 32 k, 32 v and 32 z rows"
           if spec.hf_config["model_type"] == "qwen3_next" else "in_proj_qkv's q / k blocks of 32 rows")
    with pytest.raises(UnsupportedModelError, match=r"weight_block_size \[64, 64\]: " + re.escape(cut)):
        check_quantization(spec, resolve_quant_config(None, dataclasses.replace(spec, hf_config=wide)))
    if spec.hf_config["model_type"] == "qwen3_next":  # key heads on block edges, but a group's 16 v / z rows not
        narrow = dataclasses.replace(spec, hf_config={**spec.hf_config, "linear_value_head_dim": 8})
        with pytest.raises(UnsupportedModelError, match=r"weight_block_size \[32, 32\]: .* 32 q, 32 k, 16 v and 16 z"):
            check_quantization(narrow, resolve_quant_config(None, narrow))
    int4 = {**spec.hf_config, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                      "zero_point": True, "version": "gemm"}}
    with pytest.raises(UnsupportedModelError, match="takes block-wise FP8 checkpoints"):
        check_quantization(spec, resolve_quant_config(None, dataclasses.replace(spec, hf_config=int4)))


def test_next_scales_are_cut_with_their_rows_and_an_fp8_in_proj_ba_is_dequantized():
    """split_qwen3_next_projections on one block-FP8 layer (the tiny Qwen3-Next's shapes): in_proj_qkv's and
    in_proj_z's codes with their cut scales are the float split of the dequantized in_proj_qkvz, exactly; an FP8
    in_proj_ba (its scales first) arrives as the float split of its dequantized weight."""
    from ferrox.models.qwen3_5 import split_qwen3_next_projections

    config = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, **NEXT_FIELDS}
    torch.manual_seed(0)
    qkvz, qkvz_scales = quantize(torch.randn(2 * (32 + 32 + 32 + 32), 64), "block", BLOCK)
    ba, ba_scales = quantize(torch.randn(2 * 4, 64), "block", BLOCK)
    layer = "model.layers.0.linear_attn."
    got = dict(split_qwen3_next_projections(
        [(f"{layer}in_proj_ba.weight_scale_inv", ba_scales), (f"{layer}in_proj_qkvz.weight", qkvz),
         (f"{layer}in_proj_qkvz.weight_scale_inv", qkvz_scales), (f"{layer}in_proj_ba.weight", ba)],
        config, BLOCK))
    want = dict(split_qwen3_next_projections(
        [(f"{layer}in_proj_qkvz.weight", dequantize(qkvz, qkvz_scales, BLOCK)),
         (f"{layer}in_proj_ba.weight", dequantize(ba, ba_scales, BLOCK))], config))
    got = {name[len(layer):]: t for name, t in got.items()}
    want = {name[len(layer):]: t for name, t in want.items()}
    assert sorted(got) == ["in_proj_a.weight", "in_proj_b.weight", "in_proj_qkv.weight",
                           "in_proj_qkv.weight_scale_inv", "in_proj_z.weight", "in_proj_z.weight_scale_inv"]
    for part in ("qkv", "z"):
        codes, scales = got[f"in_proj_{part}.weight"], got[f"in_proj_{part}.weight_scale_inv"]
        assert codes.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(dequantize(codes, scales, BLOCK), want[f"in_proj_{part}.weight"], rtol=0, atol=0)
    for part in ("b", "a"):
        torch.testing.assert_close(got[f"in_proj_{part}.weight"], want[f"in_proj_{part}.weight"], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_follows_the_reference(release):
    """The CUDA engine in float32 (block GEMMs, FP8 expert kernels, fla's delta rule, CUDA graphs): each prompt's
    tokens the reference's best up to 0.15 nats and logprobs within 0.15 (the FP8 GPU tests' bound)."""
    folder, _, ref = release
    llm = make_llm(folder, device="cuda", dtype="float32")
    for prompt, (tokens, logprobs) in zip(PROMPTS, engine_greedy(llm, PROMPTS), strict=True):
        assert_follows_reference(ref, prompt, tokens, logprobs, nats=0.15)


@pytest.mark.parametrize("mtp_quantized", [False, True], ids=["float-mtp-layer", "fp8-mtp-layer"])
def test_mtp_drafts_in_an_fp8_release(tmp_path, mtp_quantized):
    """speculative_config method 'mtp' on an FP8 release: its MTP layer quantized as the decoder layers (its fc left
    float and listed in modules_to_not_convert, as vLLM's workaround for the releases expects) or all float; the
    drafter is built as the tensors say, and the answers are the FP8 engine's without drafts."""
    from ferrox.layers.linear import Linear

    from tests.helpers.mtp_layer import add_mtp_layer

    float_folder = tiny_qwen3_5.make_tiny_qwen3_5(tmp_path / "float", seed=5)
    add_mtp_layer(float_folder, embed_gain=0.5)
    weights = load_file(os.path.join(float_folder, "model.safetensors"))
    mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    tensors = fp8_release(weights if mtp_quantized else {k: v for k, v in weights.items() if k not in mtp})
    tensors.update({} if mtp_quantized else mtp)
    config = {**CONFIG, "modules_to_not_convert": [*CONFIG["modules_to_not_convert"], "mtp.fc"]}
    folder = write_checkpoint(float_folder, tmp_path / "fp8", config, tensors)
    plain = engine_greedy(make_llm(folder, dtype="float32"), PROMPTS, 12)
    llm = make_llm(folder, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    predictor = llm.engine.drafter.predictor
    assert predictor.fc.quant is None
    o_proj = predictor.layers[0].self_attn.o_proj
    assert isinstance(o_proj.quant, Fp8BlockLinear) if mtp_quantized else o_proj.quant is None
    assert all(isinstance(m, Linear) for m in (predictor.fc, o_proj))
    spec = engine_greedy(llm, PROMPTS, 12)
    for (tokens, logprobs), (spec_tokens, spec_logprobs) in zip(plain, spec, strict=True):
        assert tokens == spec_tokens
        torch.testing.assert_close(torch.tensor(spec_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)
