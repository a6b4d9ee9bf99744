"""ERNIE 4.5 dense (models/ernie4_5.py) against transformers on tiny random checkpoints (biases on every projection,
tied embeddings; and without biases, untied): greedy tokens and last-prompt logits, chunked prefill and batching, the
real engine with a 16-token budget; the interleaved rotary's q/k rows reordered at load (the stream without the
reordering must not match); tensor-parallel ranks holding their part; the refusals by name; on a GPU, the CUDA
engine against the CPU engine."""

from __future__ import annotations

import pytest
import torch
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.errors import UnsupportedModelError
from ferrox.layers.linear import QKVLinear
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.weights import iter_safetensors
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.registry import get_model_class

from tests.helpers import tiny_models
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_ernie4_5 import make_tiny_ernie4_5
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_cuda_engine_matches_cpu,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    chunked_engine_outputs,
    hf_last_logits,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], [4, 4, 4, 4, 8], list(range(3, 70))]
BUILDERS = {"biased": lambda d: make_tiny_ernie4_5(d, seed=51),
            "plain": lambda d: make_tiny_ernie4_5(d, use_bias=False, tie_word_embeddings=False, seed=52)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model)."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("ernie4_5"), BUILDERS)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    assert (model.model.layers[0].self_attn.qkv_proj.bias is not None) == (name == "biased")
    assert (model.model.layers[0].self_attn.o_proj.bias is not None) == (name == "biased")
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))


def test_engine_chunked_prefill_matches_transformers(tiny):
    folder, _, ref = tiny["biased"]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


def test_interleaved_rotary_rows_are_reordered_at_load(tiny):
    """The same weights loaded as Llama's (no reordering: half-split pairs over interleaved rows) miss the
    reference: the reordering is what the parity above rests on."""
    folder, model, ref = tiny["biased"]
    plain = LlamaForCausalLM(model.spec, torch.float32, "cpu")
    plain.load_weights(iter_safetensors(folder))
    plain.finalize_weights()
    _, logits = run_greedy(plain, PROMPTS[3:], 1, return_prefill_logits=True)
    assert not torch.allclose(logits[0], hf_last_logits(ref, PROMPTS[3]), atol=1e-3)


def test_tensor_parallel_ranks_load_their_part(tiny):
    """Two ranks hold the one-rank model's q/k/v rows of their heads, reordered per head before the split."""
    folder, whole, _ = tiny["biased"]
    cls = get_model_class(["Ernie4_5ForCausalLM"])
    full = whole.model.layers[0].self_attn.qkv_proj
    q, kv, d = 4 * 128, 2 * 128, 128
    for rank in range(2):
        with use_tp_group(TPGroup(rank=rank, size=2)), torch.no_grad():
            part = cls(load_model_spec(resolve_model(folder)), torch.float32, "cpu")
            part.load_weights(iter_safetensors(folder, lazy=True))
        mine = part.model.layers[0].self_attn.qkv_proj
        assert isinstance(mine, QKVLinear)
        for tensor, whole_tensor in ((mine.weight, full.weight), (mine.bias, full.bias)):
            expected = torch.cat([whole_tensor[rank * q // 2:(rank + 1) * q // 2],
                                  whole_tensor[q + rank * d:q + (rank + 1) * d],
                                  whole_tensor[q + kv + rank * d:q + kv + (rank + 1) * d]])
            assert torch.equal(tensor, expected)


@pytest.mark.parametrize(("fields", "match"), [
    ({"attention_bias": False}, "attention_bias False differs from use_bias"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}, "quantization_config"),
])
def test_unsupported_configs_are_refused_by_name(tiny, tmp_path, fields, match):
    folder = copy_with_config(tiny["biased"][0], tmp_path / "bad", **fields)
    with pytest.raises(UnsupportedModelError, match=f"config.json: {match}"):
        tiny_models.load_float32(folder)


def test_lora_is_refused_by_name(tiny):
    from ferrox.lora.manager import LoRAManager

    with pytest.raises(UnsupportedModelError, match=r"enable_lora: Ernie4_5ForCausalLM's q/k rows are permuted"):
        LoRAManager(tiny["biased"][1], max_loras=1, max_lora_rank=8, max_cpu_loras=None, device="cpu",
                    dtype=torch.float32, max_num_tokens=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu(tiny):
    assert_cuda_engine_matches_cpu(tiny["biased"][0], PROMPTS, max_tokens=8, max_model_len=256)
