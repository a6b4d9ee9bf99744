"""Hunyuan dense and MoE (models/hunyuan.py) against transformers on tiny random checkpoints (q/k normed per head after
rotary; with the releases' NTK-alpha rope scaling and without; the MoE's routed experts beside its shared MLP):
greedy tokens and last-prompt logits, chunked prefill and batching, the real engine with a 16-token budget, two gloo
ranks; what must show when left out (alpha, the norms' place after rotary); the release's per-layer lists (equal:
taken; differing, or use_cla: refused by name); a length-dependent dynamic scaling refused by name; on a GPU, the CUDA
engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ferrox.errors import UnsupportedModelError
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.weights import iter_safetensors
from ferrox.models.hunyuan import HunyuanAttention
from ferrox.models.registry import get_model_class

from tests.helpers import tiny_models
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_hunyuan import make_tiny_hunyuan, make_tiny_hunyuan_moe
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_cuda_engine_matches_cpu,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    assert_tensor_parallel_matches_one_rank,
    chunked_engine_outputs,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], [4, 4, 4, 4, 8], list(range(3, 70))]
BUILDERS = {"alpha": lambda d: make_tiny_hunyuan(d, seed=81), "plain": lambda d: make_tiny_hunyuan(d, alpha=None,
                                                                                                   seed=82),
            "moe": lambda d: make_tiny_hunyuan_moe(d, seed=83)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models.models_with_references(tmp_path_factory.mktemp("hunyuan"), BUILDERS)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    # (norms after rotary: on the GPU's op set the fused one-token path takes no layer)
    triton = get_model_class([model.spec.architecture])(load_model_spec(resolve_model(tiny[name][0])), torch.float32,
                                                        "cpu", kernels="triton")
    assert triton.model.decode_path.layers is None
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))


@pytest.mark.parametrize("name", ["alpha", "moe"])
def test_engine_chunked_prefill_matches_transformers(tiny, name):
    folder, _, ref = tiny[name]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


def test_tensor_parallel_engine_matches_one_rank(tiny):
    """Two gloo rank processes of the MoE (Llama's sharded attention with replicated per-head norms, experts sharded by
    intermediate rows, the shared MLP as Llama's) generate what one rank does."""
    assert_tensor_parallel_matches_one_rank(tiny["moe"][0], PROMPTS)


def test_what_must_show(tiny, monkeypatch):
    """alpha ignored (the plain theta), or the norms before rotary (Qwen3's order, same weights): the long prompt's
    logits move."""
    folder, model, _ = tiny["alpha"]
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    assert model.spec.rope_scaling is None and model.spec.rope_theta == pytest.approx(10_000.0 * 1000.0 ** (16 / 14))
    no_alpha = type(model)(dataclasses.replace(model.spec, rope_theta=10_000.0), torch.float32, "cpu")
    no_alpha.load_weights(iter_safetensors(folder))
    no_alpha.finalize_weights()
    _, logits = run_greedy(no_alpha, PROMPTS[3:], 1, return_prefill_logits=True)
    assert not torch.allclose(logits[0], expected[0], atol=1e-3)

    def norms_first(self, x, rope, kv_cache, meta):
        t, d = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj(x)
        q = self.query_layernorm(qkv[:, :q_size].reshape(-1, d)).view(t, self.num_heads, d)
        k = self.key_layernorm(qkv[:, q_size:q_size + kv_size].reshape(-1, d)).view(t, self.num_kv_heads, d)
        q, k = rope.rotate(q, k)
        o = self.backend.forward(q, k, qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, d), kv_cache, meta,
                                 self.scale, self.kv_scales, window=self.window)
        return self.o_proj(o.reshape(t, q_size))

    monkeypatch.setattr(HunyuanAttention, "forward", norms_first)
    _, logits = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    assert not torch.allclose(logits[0], expected[0], atol=1e-3)


def test_moe_per_layer_lists(tiny, tmp_path):
    """The release's per-layer lists: equal entries load the same model; differing ones and use_cla are refused."""
    folder, model, _ = tiny["moe"]
    listed = tiny_models.load_float32(copy_with_config(folder, tmp_path / "lists", moe_topk=[2, 2], num_experts=8,
                                                       num_shared_expert=[1, 1], moe_intermediate_size=[32, 32]))
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    _, logits = run_greedy(listed, PROMPTS[3:], 1, return_prefill_logits=True)
    assert torch.equal(logits[0], expected[0])
    for fields, match in (({"moe_topk": [2, 3]}, "moe_topk"), ({"use_cla": True}, "use_cla")):
        with pytest.raises(UnsupportedModelError, match=f"config.json: {match}"):
            tiny_models.load_float32(copy_with_config(folder, tmp_path / match, **fields))


def test_length_dependent_dynamic_scaling_is_refused(tiny, tmp_path):
    folder = copy_with_config(tiny["plain"][0], tmp_path / "dynamic",
                              rope_parameters={"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        tiny_models.load_float32(folder)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["alpha", "moe"])
def test_cuda_engine_matches_cpu(tiny, name):
    assert_cuda_engine_matches_cpu(tiny[name][0], PROMPTS, max_tokens=8, max_model_len=256)
