"""MiniMax-M2 (MiniMaxM2ForCausalLM, models/minimax_m2.py) against transformers on a tiny random checkpoint.

The checkpoint is written by transformers' MiniMaxM2 (Mixtral's names: block_sparse_moe.experts.{e}.w1/w2/w3,
the correction bias beside the router), then its config.json is put in the released models' shape: no
partial_rotary_factor, the rotary width as a top-level `rotary_dim` (16 of 32 dims), `rope_theta` at the top
level, MiniMax's own fields (qk_norm_type per_layer, scoring_func, use_routing_bias, attn_type_list,
num_mtp_modules), and an MTP layer's tensors after the last decoder layer, as the released checkpoints carry.
Norms, the router and the correction bias are randomised (tests/helpers/tiny_glm.py), so the whole-projection
q/k norm, the partial rotary and the biased choice of experts each decide the tokens compared.

Compared: greedy tokens (and the prefill's last logits) through the model driver, chunked prefill and
batching, the whole engine with a 16-token budget (logprobs), and 2 tensor-parallel gloo ranks with expert
parallelism, where the q/k norms' mean of squares is all-reduced across the ranks.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer
from ferrox.loader.weights import iter_safetensors
from ferrox.model_spec import ModelLoadError, UnsupportedModelError
from ferrox.models.minimax_m2 import MiniMaxM2Block, MiniMaxM2ForCausalLM, ProjectionRMSNorm

from tests.helpers import tiny_models
from tests.helpers.config_edit import edit_config
from tests.helpers.driver import run_greedy
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_cuda_engine_matches_cpu,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    chunked_engine_outputs,
    cut_at_eos,
    hf_greedy,
    hf_last_logits,
)

pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
]
NUM_LAYERS, HEAD_DIM, ROTARY_DIM = 3, 32, 16


def make_tiny_minimax_m2(folder, *, seed: int = 0) -> str:
    """A MiniMax-M2 (8 experts, top 2; 4 query heads over 2 KV heads of 32 dims, 16 of them rotating) with a
    released config.json's fields and one MTP layer."""
    from transformers import MiniMaxM2Config
    from transformers import MiniMaxM2ForCausalLM as HFMiniMaxM2

    from tests.helpers.tiny_glm import _add_mtp_layer, _randomize

    tok = tiny_models.build_tokenizer()
    params = tiny_models._common(tok, 64, NUM_LAYERS, 4, 2, 32, 2048, False)  # (intermediate_size: an expert's)
    config = MiniMaxM2Config(**params, head_dim=HEAD_DIM, num_local_experts=8, num_experts_per_tok=2,
                             rotary_dim=ROTARY_DIM, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = HFMiniMaxM2(config).to(torch.float32)
    _randomize(model, router_std=0.5)
    folder = tiny_models._save(str(folder), model, tok, max_shard_size=None, generation=None)
    edit_config(folder, rope_parameters=None, rope_theta=1e6, rotary_dim=ROTARY_DIM, qk_norm_type="per_layer",
                use_qk_norm=True, scoring_func="sigmoid", use_routing_bias=True, shared_intermediate_size=0,
                attn_type_list=[1] * NUM_LAYERS, use_mtp=True, num_mtp_modules=1, mtp_transformer_layers=1)
    _add_mtp_layer(folder, NUM_LAYERS)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, ferrox model, transformers model), float32 on the CPU."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("tiny_minimax_m2"),
                                              {"m2": make_tiny_minimax_m2})["m2"]


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    tok = load_tokenizer(resolve_model(tiny[0]))
    return [tok.encode(t) for t in TEXTS] + [list(range(3, 70))]  # 67 tokens: several KV blocks


def test_reference_reads_the_released_config_shape(tiny):
    """The test is worth its name: transformers rotates 16 of 32 dims from the top-level rotary_dim, and so
    does ferrox; the layers are MiniMax's (whole-projection norms, biased sigmoid routing)."""
    folder, model, ref = tiny
    assert ref.config.rope_parameters["partial_rotary_factor"] == ROTARY_DIM / HEAD_DIM
    assert model.spec.rotary_dim == ROTARY_DIM and model.spec.rope_theta == 1e6
    attn, block = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_norm, ProjectionRMSNorm) and attn.q_norm.weight.shape == (4 * HEAD_DIM,)
    assert isinstance(block, MiniMaxM2Block) and block.renormalize
    assert block.e_score_correction_bias is not None and block.e_score_correction_bias.abs().sum() > 0


def test_greedy_and_logits_match_transformers(tiny, prompts):
    folder, model, ref = tiny
    eos = load_tokenizer(resolve_model(folder)).eos_token_ids
    assert_greedy_and_logits_match(model, ref, prompts, eos, label="minimax_m2")


def test_chunked_prefill_and_batching_do_not_change_tokens(tiny, prompts):
    assert_chunking_and_batching_keep_tokens(tiny[1], prompts, alone=slice(1, 2))


def test_engine_chunked_prefill_matches_transformers(tiny, prompts):
    """The real engine (Rust scheduler, paged KV, sampler) with a 16-token budget: the 67-token prompt is
    prefilled in chunks; greedy tokens and their logprobs against transformers."""
    folder, _, ref = tiny
    assert_outputs_match_transformers(ref, prompts, chunked_engine_outputs(folder, prompts, max_model_len=256))


def test_tp2_expert_parallel_matches_transformers(tiny, prompts):
    """2 gloo ranks, 2 query heads and 1 KV head each (the q/k norms' statistics all-reduced), 4 whole experts
    each: the same greedy tokens as transformers, logprobs to the sharded sums' rounding."""
    folder, _, ref = tiny
    outs = chunked_engine_outputs(folder, prompts, max_model_len=256, tensor_parallel_size=2,
                                  enable_expert_parallel=True)
    assert_outputs_match_transformers(ref, prompts, outs, abs_tol=5e-4)


def test_mtp_layers_are_skipped_only_when_the_config_declares_them(tiny):
    folder, model, _ = tiny
    tensors = dict(iter_safetensors(folder))
    assert any(name.startswith(f"model.layers.{NUM_LAYERS}.") for name in tensors)  # the MTP layer
    model.num_mtp_layers = 0
    try:
        with pytest.raises(ModelLoadError, match=rf"model\.layers\.{NUM_LAYERS}\."):
            model.load_weights(tensors.items())
    finally:
        model.num_mtp_layers = 1
        model.load_weights(tensors.items())  # leave the shared model as it was


@pytest.mark.parametrize("fields, match", [
    ({"scoring_func": "softmax"}, r"config\.json: scoring_func 'softmax'"),
    ({"qk_norm_type": "per_head"}, r"qk_norm_type 'per_head'"),
    ({"use_qk_norm": False}, r"use_qk_norm False"),
    ({"attn_type_list": [0, 1, 1]}, r"attn_type_list has linear-attention layers"),
    ({"shared_intermediate_size": 64}, r"shared_intermediate_size 64"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32}},
     r"quantization_config \(quant_method 'awq'\).*MiniMaxM2"),
])
def test_unsupported_configs_are_refused_by_name(tiny, fields, match):
    spec = tiny[1].spec
    edited = dataclasses.replace(spec, hf_config={**spec.hf_config, **fields})
    with pytest.raises(UnsupportedModelError, match=match):
        MiniMaxM2ForCausalLM(edited, torch.float32, "cpu")


# ---- the Triton kernel set (the GPU's) ------------------------------------------------------------------
def _triton_model(tiny) -> MiniMaxM2ForCausalLM:
    folder, model, _ = tiny
    built = MiniMaxM2ForCausalLM(model.spec, torch.float32, "cpu", kernels="triton")
    built.load_weights(iter_safetensors(folder))
    built.finalize_weights()
    return built


def test_one_token_decode_takes_the_general_layers(tiny):
    """The fused one-token kernels norm q/k per head and route with softmax top-k: MiniMax-M2's layers step
    aside there (the path may still fuse the lm_head)."""
    assert _triton_model(tiny).model.decode_path.layers is None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernel set on CPU needs TRITON_INTERPRET=1")
def test_triton_kernel_set_matches_transformers(tiny, prompts):
    """The Triton rotary (in place on the normed q/k) and the fused MoE kernels, under the interpreter."""
    _, _, ref = tiny
    model = _triton_model(tiny)
    ids = prompts[0]
    ours, logits = run_greedy(model, [ids], 3, block_size=16, return_prefill_logits=True)
    torch.testing.assert_close(logits[0], hf_last_logits(ref, ids), atol=1e-4, rtol=1e-4)
    assert cut_at_eos(ours[0], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu(tiny, prompts):
    """float32 and bfloat16 on CUDA (CUDA graphs, the fused MoE kernels over the biased sigmoid top-k's ids,
    the Triton rotary on the normed q/k) against the CPU float32 engine, itself checked against transformers."""
    assert_cuda_engine_matches_cpu(tiny[0], prompts, max_tokens=8, max_model_len=256)
