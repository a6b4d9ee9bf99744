"""ERNIE 4.5 dense and MoE (models/ernie4_5.py, ernie4_5_moe.py) against transformers on tiny random checkpoints
(dense: biases on every projection, tied embeddings; and without biases, untied. MoE: a dense first layer, sparse
layers with a shared expert and a randomised balancing bias; and every other layer sparse up to an end index): greedy tokens and last-prompt logits, chunked prefill and batching, the real engine with a 16-token budget;
the interleaved rotary's q/k rows reordered at load and the balancing bias (each left out must not match); the MTP
tensors skipped; tensor-parallel ranks; the refusals by name; on a GPU, the CUDA engine against the CPU engine."""

from __future__ import annotations

import pytest
import torch
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.linear import QKVLinear
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.weights import iter_safetensors
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.registry import get_model_class

from tests.helpers import tiny_models
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_ernie4_5 import make_tiny_ernie4_5, make_tiny_ernie4_5_moe
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_cuda_engine_matches_cpu,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    assert_tensor_parallel_matches_one_rank,
    chunked_engine_outputs,
    hf_last_logits,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], [4, 4, 4, 4, 8], list(range(3, 70))]
BUILDERS = {"biased": lambda d: make_tiny_ernie4_5(d, seed=51),
            "plain": lambda d: make_tiny_ernie4_5(d, use_bias=False, tie_word_embeddings=False, seed=52),
            "moe": lambda d: make_tiny_ernie4_5_moe(d, seed=53),
            # (layers 1 and 3 sparse: interval 2 up to end index 3; two shared experts)
            "moe_interval": lambda d: make_tiny_ernie4_5_moe(d, num_layers=5, interval=2, end=3, num_shared=2,
                                                             seed=54)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model)."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("ernie4_5"), BUILDERS)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    biased = name == "biased"
    assert (model.model.layers[0].self_attn.qkv_proj.bias is not None) == biased
    assert (model.model.layers[0].self_attn.o_proj.bias is not None) == biased
    if name.startswith("moe"):
        sparse = [type(layer.mlp).__name__ == "Ernie4_5MoeBlock" for layer in model.model.layers]
        assert sparse == ([False, True, True, True] if name == "moe" else [False, True, False, True, False])
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))


@pytest.mark.parametrize("name", ["biased", "moe"])
def test_engine_chunked_prefill_matches_transformers(tiny, name):
    folder, _, ref = tiny[name]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


def test_moe_balancing_bias_chooses_experts(tiny):
    """Without the bias (zeroed after loading) the sparse layers pick other experts: the long prompt's logits move."""
    _, model, ref = tiny["moe"]
    _, logits = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    torch.testing.assert_close(logits[0], hf_last_logits(ref, PROMPTS[3]), atol=1e-4, rtol=1e-4)
    saved = [layer.mlp.moe_statics.e_score_correction_bias.clone() for layer in model.model.layers[1:]]
    try:
        for layer in model.model.layers[1:]:
            layer.mlp.moe_statics.e_score_correction_bias.zero_()
        _, unbiased = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    finally:
        for layer, bias in zip(model.model.layers[1:], saved, strict=True):
            layer.mlp.moe_statics.e_score_correction_bias.copy_(bias)
    assert not torch.allclose(unbiased[0], logits[0], atol=1e-3)


def test_moe_mtp_tensors_are_skipped(tiny, tmp_path):
    """A release's MTP tensors (model.mtp_*) beside the model's: skipped at load, as transformers skips them."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, model, _ = tiny["moe"]
    copy = shutil.copytree(folder, tmp_path / "with_mtp")
    weights = load_file(f"{copy}/model.safetensors")
    weights.update({"model.mtp_linear_proj.0.weight": torch.zeros(64, 128),
                    "model.mtp_block.0.self_attn.q_proj.weight": torch.zeros(64, 64)})
    save_file(weights, f"{copy}/model.safetensors", metadata={"format": "pt"})
    loaded = tiny_models.load_float32(str(copy))
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    _, logits = run_greedy(loaded, PROMPTS[3:], 1, return_prefill_logits=True)
    assert torch.equal(logits[0], expected[0])


def test_moe_tensor_parallel_engine_matches_one_rank(tiny):
    """Two gloo rank processes (experts sharded by intermediate rows, the shared experts and the dense layer as
    Llama's, the router and its bias on every rank) generate what one rank does."""
    folder = tiny["moe"][0]
    assert_tensor_parallel_matches_one_rank(folder, PROMPTS)


def test_interleaved_rotary_rows_are_reordered_at_load(tiny):  # (the MoE loads through the same reordering)
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


@pytest.mark.parametrize(("name", "fields", "match"), [
    ("biased", {"attention_bias": False}, "attention_bias False differs from use_bias"),
    ("biased", {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}, "quantization_config"),
    ("moe", {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}, "quantization_config"),
    ("moe", {"moe_k": 9}, "moe_k 9 is more than the 8 moe_num_experts"),
    ("moe", {"moe_layer_interval": 0}, "field 'moe_layer_interval'"),
    ("moe", {"use_bias": True}, "use_bias true"),
])
def test_unsupported_configs_are_refused_by_name(tiny, tmp_path, name, fields, match):
    folder = copy_with_config(tiny[name][0], tmp_path / "bad", **fields)
    with pytest.raises((UnsupportedModelError, ModelLoadError), match=f"config.json: {match}"):
        tiny_models.load_float32(folder)


@pytest.mark.parametrize("name", ["biased", "moe"])
def test_lora_rows_follow_the_loader(tiny, name):
    """An adapter's q_proj / k_proj lora_B rows are permuted as the weights' (models/glm4.py lora_rewrite)."""
    from tests.lora.adapters import assert_lora_rows_follow_the_loader

    assert_lora_rows_follow_the_loader(tiny[name][0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["biased", "moe"])
def test_cuda_engine_matches_cpu(tiny, name):
    """float32 and bfloat16 on CUDA (CUDA graphs; the fused MoE kernels over the biased routing's ids) against the
    CPU engine."""
    assert_cuda_engine_matches_cpu(tiny[name][0], PROMPTS, max_tokens=8, max_model_len=256)
