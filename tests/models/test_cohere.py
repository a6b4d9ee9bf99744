"""Cohere (Command R, Aya; Command R+'s per-head q/k LayerNorms: models/cohere.py) and Cohere2 (Command R7B / Command
A: models/cohere2.py) against transformers on tiny random checkpoints. Cohere2: three windowed layers with interleaved
rotary, a global layer without rotary, the parallel LayerNorm block, logit_scale, tied embeddings; the prompts cross
the 8-token window. Checked: greedy tokens and last-prompt logits, chunked prefill and batching, the real engine with
a 16-token budget, two gloo ranks; Cohere2's layer kinds from sliding_window_pattern; what must show when left out
(the global layer's NoPE, the q/k row reordering, the q/k norm weights' reordering, logit_scale); the refusals by
name; the Triton kernel set under the interpreter; on a GPU, the CUDA engine."""

from __future__ import annotations

import os

import pytest
import torch
from ferrox.errors import UnsupportedModelError
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.weights import iter_safetensors
from ferrox.model_spec import spec_for_context

from tests.helpers import tiny_models
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_cohere import make_tiny_cohere, make_tiny_cohere2
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_cuda_engine_matches_cpu,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    assert_tensor_parallel_matches_one_rank,
    assert_triton_kernel_set_matches,
    chunked_engine_outputs,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], [4, 4, 4, 4, 8], list(range(3, 70))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, transformers model)."""
    folder = make_tiny_cohere2(tmp_path_factory.mktemp("cohere2") / "c", seed=61)
    return folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_v1(tmp_path_factory):
    """name -> (folder, transformers model): Aya's layout, and Command R+'s with q/k norms."""
    root = tmp_path_factory.mktemp("cohere")
    out = {}
    for name, qk_norm, seed in (("aya", False, 62), ("plus", True, 63)):
        folder = make_tiny_cohere(root / name, use_qk_norm=qk_norm, seed=seed)
        out[name] = (folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    return out


def _load(folder: str, max_model_len: int = 256):
    """As served: the windows as spec_for_context sets them for the context."""
    source = resolve_model(folder)
    return load_model(source, spec_for_context(load_model_spec(source), max_model_len), dtype=torch.float32,
                      device="cpu")


def test_matches_transformers(tiny):
    folder, ref = tiny
    model = _load(folder)
    assert [layer.self_attn.window for layer in model.model.layers] == [8, 8, 8, 0]
    assert model.model.rotary_layers == (True, True, True, False)
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label="cohere2")
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))


def test_engine_chunked_prefill_matches_transformers(tiny):
    folder, ref = tiny
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


def test_tensor_parallel_engine_matches_one_rank(tiny):
    """Two gloo rank processes (Llama's sharded projections, the parallel block's two all-reduces) generate what one
    rank does."""
    assert_tensor_parallel_matches_one_rank(tiny[0], PROMPTS)


def test_layer_kinds_from_the_pattern(tiny, tmp_path):
    folder, ref = tiny
    derived = _load(copy_with_config(folder, tmp_path / "derived", layer_types=None))
    assert derived.model.rotary_layers == (True, True, True, False)
    assert_greedy_and_logits_match(derived, ref, PROMPTS[3:], [tiny_models.EOS_TOKEN_ID], label="derived")
    every_other = _load(copy_with_config(folder, tmp_path / "two", layer_types=None, sliding_window_pattern=2))
    assert [layer.self_attn.window for layer in every_other.model.layers] == [8, 0, 8, 0]


def test_what_must_show(tiny):
    """The global layer rotating, the q/k rows in the checkpoint's order, or logits unscaled: each moves the long
    prompt's logits (so the parity above checks all three)."""
    folder, _ = tiny
    model = _load(folder)
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    rotating = _load(folder)
    rotating.model.rotary_layers = (True,) * 4
    unordered = _load(folder)
    unordered.rotary_order = None
    unordered.load_weights(iter_safetensors(folder))
    unordered.finalize_weights()
    unscaled = _load(folder)
    unscaled.logit_scale = 1.0
    for changed in (rotating, unordered, unscaled):
        _, logits = run_greedy(changed, PROMPTS[3:], 1, return_prefill_logits=True)
        assert not torch.allclose(logits[0], expected[0], atol=1e-3)


@pytest.mark.parametrize(("fields", "match"), [
    ({"sliding_window": None}, "sliding_window null"),
    ({"use_qk_norm": True}, "use_qk_norm"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}, "quantization_config"),
])
def test_unsupported_configs_are_refused_by_name(tiny, tmp_path, fields, match):
    with pytest.raises(UnsupportedModelError, match=f"config.json: {match}"):
        _load(copy_with_config(tiny[0], tmp_path / "bad", **fields))


def test_lora_rows_follow_the_loader(tiny):
    """An adapter's q_proj / k_proj lora_B rows are permuted as the weights' (models/glm4.py lora_rewrite)."""
    from tests.lora.adapters import assert_lora_rows_follow_the_loader

    assert_lora_rows_follow_the_loader(tiny[0], _load(tiny[0]))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel set on CPU needs "
                    "TRITON_INTERPRET=1")
def test_triton_kernel_set_matches_transformers(tiny):
    folder, ref = tiny
    assert_triton_kernel_set_matches(folder, ref, PROMPTS[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu(tiny):
    assert_cuda_engine_matches_cpu(tiny[0], PROMPTS, max_tokens=8, max_model_len=256)


# ---- Cohere (Command R, R+, Aya) ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["aya", "plus"])
def test_cohere_matches_transformers(tiny_v1, name):
    folder, ref = tiny_v1[name]
    model = _load(folder)
    assert model.model.rotary_layers == (True,) * 3
    assert (model.model.layers[0].self_attn.q_norm is not None) == (name == "plus")
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)


def test_cohere_engine_matches_transformers(tiny_v1):
    folder, ref = tiny_v1["plus"]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


def test_cohere_qk_norm_weights_follow_the_rotary_rows(tiny_v1):
    """Command R+'s per-head norm weights are reordered with the q/k rows: loaded in the checkpoint's order, the
    logits move."""
    folder, _ = tiny_v1["plus"]
    model = _load(folder)
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    order = model.rotary_order
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            heads = norm.weight.view(-1, model.spec.head_dim)
            heads.copy_(heads[:, torch.argsort(order)].clone())  # (back to the checkpoint's order)
    _, logits = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    assert not torch.allclose(logits[0], expected[0], atol=1e-3)


def test_cohere_qk_norm_under_tensor_parallelism(tiny_v1):
    """Command R+ (104B: served under tensor parallelism) on two ranks: each holds its heads' q/k norm weights (the
    one-rank model's rows of them: 2 of 4 query heads, 1 of 2 KV heads), and two gloo ranks answer as one."""
    from ferrox.distributed.parallel_state import TPGroup, use_tp_group

    folder = tiny_v1["plus"][0]
    whole = _load(folder)
    source = resolve_model(folder)
    for rank in (0, 1):
        with use_tp_group(TPGroup(rank=rank, size=2)):
            shard = load_model(source, spec_for_context(load_model_spec(source), 256), dtype=torch.float32,
                               device="cpu")
        for full, part in zip(whole.model.layers, shard.model.layers, strict=True):
            q_rows = full.self_attn.q_norm.weight.view(4, -1)[2 * rank:2 * rank + 2].reshape(-1)
            k_rows = full.self_attn.k_norm.weight.view(2, -1)[rank].reshape(-1)
            assert torch.equal(part.self_attn.q_norm.weight, q_rows)
            assert torch.equal(part.self_attn.k_norm.weight, k_rows)
    assert_tensor_parallel_matches_one_rank(folder, PROMPTS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cohere_cuda_engine_matches_cpu(tiny_v1):
    assert_cuda_engine_matches_cpu(tiny_v1["plus"][0], PROMPTS, max_tokens=8, max_model_len=256)
