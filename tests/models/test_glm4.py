"""GLM-4.5 (Glm4MoeForCausalLM) and GLM-4-0414 (Glm4ForCausalLM) against transformers on tiny random
checkpoints: greedy tokens and logits through the test driver, chunked prefill and batching, the real
engine with a 16-token budget, the layer layout each config asks for (dense first layers, grouped
routing, shared experts, q/k norms, partial rotary in both layouts and its default), the MTP layers
skipped at load, the refusals by name, LoRA adapters' rows following the loader's, tensor-parallel shards and two gloo ranks; on a
GPU the engine in bfloat16 with CUDA graphs against the CPU float32 engine."""

from __future__ import annotations

import os

import pytest
import torch
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.errors import UnsupportedModelError
from ferrox.layers.fused_moe import FusedMoE
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import MergedLinear, RowParallelLinear
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.weights import iter_safetensors
from ferrox.model_spec import ModelLoadError
from ferrox.models.glm4 import interleaved_rotary_order
from ferrox.models.glm4_moe import Glm4MoeBlock
from ferrox.models.llama import LlamaMLP
from ferrox.models.registry import get_model_class

from tests.helpers import tiny_glm, tiny_models
from tests.helpers.config_edit import copy_with_config as _copy_with_config
from tests.helpers.driver import run_greedy
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_cuda_engine_matches_cpu,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    assert_tensor_parallel_matches_one_rank,
    chunked_engine_outputs,
    cut_at_eos,
    hf_greedy,
    hf_last_logits,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], [4, 4, 4, 4, 8], list(range(3, 70))]  # 67: 5 blocks
BUILDERS = {
    # GLM-4.5 / 4.6: q/k norms, 4 groups of 2 experts (2 kept), a correction bias, 2.5x scaling, an MTP layer.
    "glm4_moe": lambda d: tiny_glm.make_tiny_glm4_moe(d, seed=21),
    # GLM-4.5-Air-like: no q/k norms, one group, no renormalisation, partial_rotary_factor left to its
    # default, tied embeddings, two dense layers and two shared experts.
    "glm4_moe_air": lambda d: tiny_glm.make_tiny_glm4_moe(d, num_layers=3, use_qk_norm=False, n_group=1,
                                                          topk_group=1, norm_topk_prob=False, n_shared_experts=2,
                                                          first_k_dense_replace=2, partial_rotary_factor=None,
                                                          routed_scaling_factor=1.0, tie_word_embeddings=True,
                                                          mtp_layers=0, seed=22),
    "glm4": lambda d: tiny_glm.make_tiny_glm4(d, seed=23),
    "glm4_default_rotary": lambda d: tiny_glm.make_tiny_glm4(d, partial_rotary_factor=None, seed=24),
    # GLM-4-9B in transformers' Glm layout: the same without the sandwich norms.
    "glm": lambda d: tiny_glm.make_tiny_glm(d, seed=25),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model); built once for the module."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("glm4"), BUILDERS)




# ---- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    folder, model, ref = tiny[name]
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)


@pytest.mark.parametrize("name", ["glm4_moe", "glm4", "glm"])
def test_chunked_prefill_and_batching_do_not_change_tokens(tiny, name):
    _, model, _ = tiny[name]
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))


@pytest.mark.parametrize("name", ["glm4_moe", "glm4", "glm"])
def test_engine_chunked_prefill_matches_transformers(tiny, name):
    """The real engine (Rust scheduler, paged KV, sampler) with a 16-token budget: the long prompt is
    prefilled in chunks; greedy tokens and their logprobs against transformers."""
    folder, _, ref = tiny[name]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


# ---- what the configs build -------------------------------------------------------------------------
def test_layers_follow_the_config(tiny):
    glm, air = tiny["glm4_moe"][1], tiny["glm4_moe_air"][1]
    assert [isinstance(layer.mlp, Glm4MoeBlock) for layer in glm.model.layers] == [False, True, True]
    assert [isinstance(layer.mlp, Glm4MoeBlock) for layer in air.model.layers] == [False, False, True]
    block = glm.model.layers[1].mlp
    assert (block.routing.n_group, block.routing.topk_group, block.routing.routed_scaling_factor) == (4, 2, 2.5)
    assert block.renormalize and not air.model.layers[2].mlp.renormalize
    assert isinstance(block.shared_experts, LlamaMLP) and block.shared_expert is None  # no Qwen-style gate
    assert air.model.layers[2].mlp.shared_experts.down_proj.in_features == 2 * 32  # n_shared_experts=2
    attn = glm.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None and attn.q_norm is not None
    assert air.model.layers[0].self_attn.q_norm is None
    assert glm.spec.rotary_dim == 16 and air.spec.rotary_dim == 16  # air: transformers' default 0.5
    dense = tiny["glm4"][1].model.layers[0]
    assert dense.self_attn.qkv_proj.bias is not None and dense.self_attn.o_proj.bias is None
    assert tiny["glm4_default_rotary"][1].spec.rotary_dim == 16


def test_one_token_decode_takes_the_general_layers(tiny):
    """The fused one-token kernels route with softmax top-k: GLM-4.5's layers step aside there (the
    path may still fuse the lm_head); GLM-4's four-norm layer is not their shape either."""
    for name in ("glm4_moe", "glm4"):
        spec = tiny[name][1].spec
        model = get_model_class([spec.architecture])(spec, torch.float32, "cpu", kernels="triton")
        assert model.model.decode_path.layers is None, name
    # GLM-4-9B's pre-norm Llama layers take the fused kernels (its reordered partial rotary in their rope rows).
    spec = tiny["glm"][1].spec
    glm = get_model_class([spec.architecture])(spec, torch.float32, "cpu", kernels="triton")
    assert glm.model.decode_path.layers is not None
    attn = glm.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None


def test_interleaved_rotary_rows_are_reordered_at_load(tiny):
    folder, model, _ = tiny["glm4"]
    tensors = dict(iter_safetensors(folder))
    order = interleaved_rotary_order(32, 16)
    assert order[:8].tolist() == list(range(0, 16, 2)) and order[16:24].tolist() == list(range(1, 16, 2))
    qkv = model.model.layers[1].self_attn.qkv_proj
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(qkv.weight[32:64], q[32:64][order], rtol=0, atol=0)  # head 1
    gate_up = tensors["model.layers.1.mlp.gate_up_proj.weight"]
    torch.testing.assert_close(model.model.layers[1].mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)


def test_mtp_layers_are_skipped_only_when_the_config_declares_them(tiny, tmp_path):
    folder = tiny["glm4_moe"][0]
    assert any(name.startswith("model.layers.3.") for name, _ in iter_safetensors(folder))  # the MTP layer
    undeclared = _copy_with_config(folder, tmp_path / "no_mtp", num_nextn_predict_layers=0)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\."):
        tiny_models.load_float32(undeclared)


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("name, fields, match", [
    ("glm4_moe", {"quantization_config": AWQ}, r"config\.json: quantization_config \(quant_method 'awq'\).*Glm4Moe"),
    ("glm4", {"quantization_config": AWQ}, r"config\.json: quantization_config \(quant_method 'awq'\).*Glm4For"),
    ("glm4_moe", {"scoring_func": "softmax"}, r"config\.json: scoring_func 'softmax'"),
    ("glm4_moe", {"topk_method": "greedy"}, r"config\.json: topk_method 'greedy'"),
    ("glm4_moe", {"n_group": 3}, r"config\.json: n_group 3 / topk_group 2"),
    ("glm4_moe", {"hidden_act": "gelu"}, r"config\.json: hidden_act 'gelu'"),
    ("glm4", {"hidden_act": "gelu"}, r"config\.json: hidden_act 'gelu'"),
])
def test_unsupported_configs_are_refused_by_name(tiny, tmp_path, name, fields, match):
    folder = _copy_with_config(tiny[name][0], tmp_path / "edited", **fields)
    with pytest.raises(UnsupportedModelError, match=match):
        tiny_models.load_float32(folder)


FP8_BLOCK = (32, 32)  # the tiny heads' 32 rows: one block row a head, as GLM-4.5's 128 with 128-row blocks


def _block_fp8_copy(float_folder: str, dest, block: tuple[int, int]) -> tuple[str, dict[str, torch.Tensor]]:
    """GLM-4.5-FP8's published layout: every projection (attention, dense, shared and routed experts) E4M3
    with a scale per block (`weight_scale_inv`), the router, norms and biases as they were."""
    from safetensors.torch import load_file

    from tests.helpers.fp8_block_checkpoints import quantize_blocks
    from tests.helpers.fp8_moe_checkpoints import fp8_config
    from tests.helpers.quant_checkpoints import write_checkpoint

    tensors = {}
    for name, w in load_file(f"{float_folder}/model.safetensors").items():
        if name.endswith("_proj.weight"):
            tensors[name], tensors[f"{name.rsplit('.', 1)[0]}.weight_scale_inv"] = quantize_blocks(w, block)
        else:
            tensors[name] = w
    return write_checkpoint(float_folder, dest, fp8_config("block", block), tensors), tensors


def test_block_fp8_checkpoint_follows_the_fake_quantized_reference(tiny, tmp_path):
    """GLM-4.5-FP8 / Air-FP8 load as stored: the q/k rows reordered inside their block rows keep their block
    scales. Logits and greedy tokens against transformers on the dequantized weights with each projection's
    input rounded through E4M3 per token and block (tests/helpers/fp8_moe_checkpoints.py)."""
    from tests.helpers.fp8_moe_checkpoints import reference_model
    from tests.helpers.quant_checkpoints import load_checkpoint

    float_folder = tiny["glm4_moe"][0]
    folder, tensors = _block_fp8_copy(float_folder, tmp_path / "fp8", FP8_BLOCK)
    model = load_checkpoint(folder)
    attn = model.model.layers[1].self_attn
    assert attn.qkv_proj.quant is not None and model.model.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    reference = reference_model(float_folder, {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")},
                                FP8_BLOCK, "weight_scale_inv")
    prompts = PROMPTS[:3]
    ours, logits = run_greedy(model, prompts, 6, return_prefill_logits=True)
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_last_logits(reference, ids), atol=1e-3, rtol=1e-3)
        assert cut_at_eos(ours[i], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(reference, ids, 6), i


def test_block_fp8_across_head_blocks_and_dense_glm4_fp8_are_refused(tiny, tmp_path):
    """16-row blocks of 32-dim heads: the rotary reordering moves rows across blocks (refused, naming the
    block size); GLM-4-0414's fused gate_up_proj is cut by rows at load (its FP8 checkpoints are refused)."""
    folder, _ = _block_fp8_copy(tiny["glm4_moe"][0], tmp_path / "fp8_16", (16, 16))
    with pytest.raises(UnsupportedModelError, match=r"weight_block_size \[16, 16\]: .* across 16-row blocks"):
        tiny_models.load_float32(folder)
    folder, _ = _block_fp8_copy(tiny["glm4"][0], tmp_path / "glm4_fp8", FP8_BLOCK)
    with pytest.raises(UnsupportedModelError, match=r"quantization_config \(quant_method 'fp8'\).*Glm4ForCausalLM"):
        tiny_models.load_float32(folder)


@pytest.mark.parametrize("name", ["glm4_moe", "glm4", "glm"])
def test_lora_rows_follow_the_loader(tiny, name):
    """An adapter's lora_B rows go through the loader's row edits (permuted q/k rows, gate_up_proj cut, the MTP
    layer dropped): each checkpoint weight fed through lora_rewrite lands where the loader put it. (Against
    transformers + peft: tests/lora/test_lora_families.py.)"""
    from tests.lora.adapters import assert_lora_rows_follow_the_loader

    assert_lora_rows_follow_the_loader(tiny[name][0])


# ---- tensor parallelism ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["glm4_moe", "glm4"])
def test_tensor_parallel_ranks_load_their_part(tiny, name):
    """Two ranks built in this process and loaded through lazy safetensors slices hold exactly their
    part of the one-rank model's weights (q/k rows reordered per head before a rank takes its heads;
    GLM-4's fused gate_up cut by rows; the experts' and shared experts' intermediate rows split)."""
    folder, whole, _ = tiny[name]
    spec = whole.spec
    cls = get_model_class([spec.architecture])
    full = dict(whole.named_modules())
    for rank in range(2):
        with use_tp_group(TPGroup(rank=rank, size=2)), torch.no_grad():
            part = cls(load_model_spec(resolve_model(folder)), torch.float32, "cpu")
            part.load_weights(iter_safetensors(folder, lazy=True))
        kinds = set()
        for module_name, module in part.named_modules():
            other = full[module_name]
            if isinstance(module, MergedLinear):
                for shard, (start, size, _) in module.checkpoint_rows.items():
                    mine = module.weight[module.shard_offsets[shard]:module.shard_offsets[shard] + size]
                    theirs = other.weight[other.shard_offsets[shard] + start:other.shard_offsets[shard] + start + size]
                    assert torch.equal(mine, theirs), (module_name, shard)
            elif isinstance(module, RowParallelLinear):
                assert torch.equal(module.weight, other.weight[:, module.in_start:module.in_start + module.in_features])
            elif isinstance(module, FusedMoE):
                inter, start = module.intermediate_size, module.inter_start
                full_inter = other.intermediate_size
                assert torch.equal(module.w13[:, :inter], other.w13[:, start:start + inter])
                assert torch.equal(module.w13[:, inter:], other.w13[:, full_inter + start:full_inter + start + inter])
                assert torch.equal(module.w2, other.w2[:, :, start:start + inter])
            elif isinstance(module, RMSNorm) or module_name.endswith(".gate"):
                assert all(torch.equal(p, q) for p, q in zip(module.parameters(), other.parameters(), strict=True))
            else:
                continue
            kinds.add(type(module).__name__)
        assert {"QKVLinear", "MergedLinear", "RowParallelLinear", "RMSNorm"} <= kinds, kinds


@pytest.mark.parametrize("kw", [{}, {"enable_expert_parallel": True}])
def test_tensor_parallel_engine_matches_one_rank(tiny, kw):
    """Two gloo rank processes (experts sharded by intermediate rows, or split whole with expert
    parallelism; the shared experts and dense MLPs sharded as Llama's) generate what one rank does.
    (GLM-4's layers are Llama's sharded layers: its ranks' weights are checked above.)"""
    assert_tensor_parallel_matches_one_rank(tiny["glm4_moe"][0], PROMPTS, **kw)


# ---- GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(BUILDERS))
def test_cuda_engine_matches_cpu(tiny, name):
    """bfloat16 on CUDA (CUDA graphs, the fused MoE kernels over grouped_topk's ids) against the CPU
    float32 engine."""
    folder = tiny[name][0]
    assert_cuda_engine_matches_cpu(folder, PROMPTS, max_tokens=8, max_model_len=256)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel set on CPU needs "
                    "TRITON_INTERPRET=1")
def test_glm_fused_one_token_kernels_match_transformers(tiny, monkeypatch):
    """GLM-4-9B on the GPU's op set under the interpreter: prefill through the Triton layers, every decode step through
    the fused one-token kernels (counted), with the reordered partial rotary and the q/k/v biases."""
    folder, _, ref = tiny["glm"]
    spec = tiny["glm"][1].spec
    model = get_model_class([spec.architecture])(spec, torch.float32, "cpu", kernels="triton")
    model.load_weights(iter_safetensors(folder))
    model.finalize_weights()
    path = model.model.decode_path
    fused = []
    forward = path.forward
    monkeypatch.setattr(path, "forward", lambda *a, **k: fused.append(1) or forward(*a, **k))
    ours, logits = run_greedy(model, [PROMPTS[1]], 3, block_size=16, return_prefill_logits=True)
    torch.testing.assert_close(logits[0], hf_last_logits(ref, PROMPTS[1]), atol=1e-4, rtol=1e-4)
    assert cut_at_eos(ours[0], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, PROMPTS[1], 3)
    assert fused
