"""Seed-OSS (SeedOssForCausalLM: the Llama decoder with q/k/v, o_proj and MLP biases switched apart) against
transformers on tiny random checkpoints: greedy tokens and last-prompt logits through the test driver,
chunked prefill and batching, the real engine with a 16-token budget (long prompts prefilled in chunks,
logprobs compared), transformers' defaults of the bias fields when config.json leaves them out, the layers
each config builds, the fused one-token path the Triton kernel set takes (run under TRITON_INTERPRET=1),
and the refusals by name."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.loader.weights import iter_safetensors
from ferrox.models.registry import get_model_class
from ferrox.models.seed_oss import SeedOssForCausalLM

from tests.helpers import tiny_models
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    chunked_engine_outputs,
    cut_at_eos,
    hf_greedy,
    hf_last_logits,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], [4, 4, 4, 4, 8], list(range(3, 70))]  # 67: 5 blocks


def make_tiny_seed_oss(folder, *, attention_bias: bool = True, attention_out_bias: bool = False,
                       mlp_bias: bool = False, head_dim: int = 32, seed: int = 0) -> str:
    """A Seed-OSS: GQA 4/2 with head_dim decoupled from hidden_size / num_heads (Seed-OSS-36B: 80 heads of 128
    over 5120), untied, rope_theta 1e7 as the hub's; norms and every bias randomised (transformers inits
    them at 1 and 0) so each decides something in the tokens compared."""
    from transformers import SeedOssConfig
    from transformers import SeedOssForCausalLM as HFSeedOss

    tok = tiny_models.build_tokenizer()
    params = tiny_models._common(tok, 64, 2, 4, 2, 96, 2048, False)
    config = SeedOssConfig(**params, head_dim=head_dim, attention_bias=attention_bias,
                           attention_out_bias=attention_out_bias, mlp_bias=mlp_bias,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e7})
    torch.manual_seed(seed)
    model = HFSeedOss(config).to(torch.float32)
    tiny_models._randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.1)
    return tiny_models._save(str(folder), model, tok, max_shard_size=None, generation=None)


BUILDERS = {
    # Seed-OSS-36B's switches: q/k/v bias, none on o_proj or the MLP.
    "seed_oss": lambda d: make_tiny_seed_oss(d, seed=41),
    # every bias the config can turn on (o_proj's and the MLP's go through the fused kernels' epilogues)
    "all_biases": lambda d: make_tiny_seed_oss(d, attention_out_bias=True, mlp_bias=True, seed=42),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model); built once for the module."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("seed_oss"), BUILDERS)


def _biases(model) -> list[tuple[bool, bool, bool, bool]]:
    """Per layer: (qkv_proj, o_proj, gate_up_proj, down_proj) carry a bias."""
    return [(layer.self_attn.qkv_proj.bias is not None, layer.self_attn.o_proj.bias is not None,
             layer.mlp.gate_up_proj.bias is not None, layer.mlp.down_proj.bias is not None)
            for layer in model.model.layers]


# ---- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    assert isinstance(model, SeedOssForCausalLM)
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)


def test_chunked_prefill_and_batching_do_not_change_tokens(tiny):
    _, model, _ = tiny["all_biases"]
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))


def test_engine_chunked_prefill_matches_transformers(tiny):
    """The real engine (Rust scheduler, paged KV, sampler) with a 16-token budget: the long prompt is
    prefilled in chunks; greedy tokens and their logprobs against transformers."""
    folder, _, ref = tiny["seed_oss"]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


# ---- what the config builds ---------------------------------------------------------------------------
def test_layers_follow_the_bias_switches(tiny):
    assert _biases(tiny["seed_oss"][1]) == [(True, False, False, False)] * 2
    assert _biases(tiny["all_biases"][1]) == [(True, True, True, True)] * 2
    attn = tiny["seed_oss"][1].model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 32)  # head_dim as written, not 64 / 4


def test_bias_fields_left_out_take_transformers_defaults(tiny, tmp_path):
    """config.json without attention_bias / attention_out_bias: transformers' SeedOss defaults (true, false),
    not Llama's (false for both), so the checkpoint's q/k/v biases load and the outputs still match."""
    folder, _, ref = tiny["seed_oss"]
    bare = copy_with_config(folder, tmp_path / "bare", attention_bias=None, attention_out_bias=None)
    model = tiny_models.load_float32(bare)
    assert _biases(model) == [(True, False, False, False)] * 2
    ours, logits = run_greedy(model, PROMPTS[:1], 4, return_prefill_logits=True)
    torch.testing.assert_close(logits[0], hf_last_logits(ref, PROMPTS[0]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("fields", "error", "words"), [
    ({"sliding_window": 16}, UnsupportedModelError, "sliding_window.*SeedOss"),
    # hidden_size 64 / 4 heads is 16, where transformers would take 128
    ({"head_dim": None}, UnsupportedModelError, "head_dim is missing.*128"),
    ({"attention_out_bias": "yes"}, ModelLoadError, "attention_out_bias"),
])
def test_unsupported_fields_are_refused_by_name(tiny, tmp_path, fields, error, words):
    folder = copy_with_config(tiny["seed_oss"][0], tmp_path / "edited", **fields)
    with pytest.raises(error, match=f"config.json.*{words}"):
        tiny_models.load_float32(folder)


# ---- the Triton kernel set (the GPU's): the fused one-token path ------------------------------------------
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_model(tiny, name: str, **replace: Any):
    folder, model, _ = tiny[name]
    spec = dataclasses.replace(model.spec, **replace)
    built = get_model_class([spec.architecture])(spec, torch.float32, "cpu", kernels="triton")
    built.load_weights(iter_safetensors(folder))
    built.finalize_weights()
    return built


def test_one_token_decode_takes_the_fused_layers(tiny):
    """Pre-norm Llama layers: the fused one-token kernels run them, o_proj's and the MLP's biases included."""
    layers = _triton_model(tiny, "all_biases").model.decode_path.layers
    assert layers is not None and len(layers) == 2
    assert layers[0].o_proj.bias is not None and layers[0].down_proj.bias is not None


@pytest.mark.skipif(not INTERPRETED, reason="the Triton kernel set on CPU needs TRITON_INTERPRET=1")
def test_triton_kernel_set_matches_transformers(tiny, monkeypatch):
    """A prompt prefilled a token a step, so its logits come through the fused one-token kernels (every bias
    in their epilogues) at every position; the steps counted so the fused path is what is compared."""
    _, _, ref = tiny["all_biases"]
    model = _triton_model(tiny, "all_biases")
    path = model.model.decode_path
    fused_steps = []
    forward = path.forward
    monkeypatch.setattr(path, "forward", lambda *a, **k: fused_steps.append(1) or forward(*a, **k))
    ids = PROMPTS[1]
    ours, logits = run_greedy(model, [ids], 3, block_size=16, prefill_chunk=1, return_prefill_logits=True)
    torch.testing.assert_close(logits[0], hf_last_logits(ref, ids), atol=1e-4, rtol=1e-4)
    assert cut_at_eos(ours[0], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 3)
    assert fused_steps


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(BUILDERS))
def test_cuda_engine_matches_cpu_engine(tiny, name):
    """On CUDA with CUDA graphs (fused one-token decode with every bias): float32 tokens equal the CPU
    engine's, bfloat16 close (tests/models/conftest.py). A 200-token prompt too."""
    from tests.models.conftest import assert_cuda_engine_matches_cpu

    prompts = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], [(13 * i + 4) % 300 + 3 for i in range(200)]]
    assert_cuda_engine_matches_cpu(tiny[name][0], prompts, max_tokens=12, max_model_len=256)
