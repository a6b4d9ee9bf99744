"""GPT-NeoX / Pythia (models/gpt_neox.py), GPT-2 (models/gpt2.py: learned positions, Conv1D weights, its own config
names), OPT (models/opt.py: positions offset by 2, ReLU MLP) and Phi-2 (models/phi.py: one LayerNorm, parallel block,
partial rotary, an LM head bias) and StarCoder2 (models/starcoder2.py: the same layers over GQA with a sliding window)
against transformers on tiny random checkpoints (Pythia's layout: parallel
residual, a quarter of each head rotating, exact GELU, biases everywhere, untied embed_out; and sequential residual,
full rotary, tanh GELU): greedy tokens and last-prompt logits, chunked prefill and batching, the real engine with a
16-token budget, two gloo ranks; the hub's config names (rotary_pct, rotary_emb_base) load the same model; the
per-head q/k/v cut and the partial rotary's row order must show; hidden_act refused by name; the Triton kernel set
under the interpreter; on a GPU, the CUDA engine."""

from __future__ import annotations

import os

import pytest
import torch
from ferrox.errors import UnsupportedModelError
from ferrox.loader.weights import iter_safetensors

from tests.helpers import tiny_models
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_gpt_neox import (
    make_tiny_gpt2,
    make_tiny_gpt_neox,
    make_tiny_opt,
    make_tiny_phi,
    make_tiny_starcoder2,
)
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
BUILDERS = {"pythia": lambda d: make_tiny_gpt_neox(d, seed=95),
            "sequential": lambda d: make_tiny_gpt_neox(d, parallel=False, rotary_pct=1.0, hidden_act="gelu_new",
                                                       seed=96),
            "gpt2": lambda d: make_tiny_gpt2(d, seed=97),
            "opt": lambda d: make_tiny_opt(d, seed=98),
            "phi": lambda d: make_tiny_phi(d, seed=99)}


@pytest.fixture(scope="module")
def starcoder2(tmp_path_factory):
    """(folder, transformers model): loaded per test with its windows served (spec_for_context)."""
    folder = make_tiny_starcoder2(tmp_path_factory.mktemp("starcoder2") / "s", seed=100)
    return folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _served(folder: str):
    from ferrox.loader.model_loader import load_model, load_model_spec
    from ferrox.loader.source import resolve_model
    from ferrox.model_spec import spec_for_context

    source = resolve_model(folder)
    return load_model(source, spec_for_context(load_model_spec(source), 256), dtype=torch.float32, device="cpu")


def test_starcoder2_matches_transformers(starcoder2, tmp_path):
    """Windowed GQA layers against transformers (the prompts cross the window); without the window the logits move."""
    folder, ref = starcoder2
    model = _served(folder)
    assert [layer.self_attn.window for layer in model.model.layers] == [8, 8]
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label="starcoder2")
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    unwindowed = _served(copy_with_config(folder, tmp_path / "full", sliding_window=None))
    _, logits = run_greedy(unwindowed, PROMPTS[3:], 1, return_prefill_logits=True)
    assert not torch.allclose(logits[0], expected[0], atol=1e-3)


def test_starcoder2_tensor_parallel_matches_one_rank(starcoder2):
    assert_tensor_parallel_matches_one_rank(starcoder2[0], PROMPTS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_starcoder2_cuda_engine_matches_cpu(starcoder2):
    assert_cuda_engine_matches_cpu(starcoder2[0], PROMPTS, max_tokens=8, max_model_len=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models.models_with_references(tmp_path_factory.mktemp("gpt_neox"), BUILDERS)


@pytest.mark.parametrize("name", ["pythia", "phi"])
def test_lora_rows_follow_the_loader(tiny, name):
    """An adapter's lora_B rows take the loader's edits (names, Pythia's query_key_value cut per head, the partial
    rotary's q/k order): each checkpoint weight fed through lora_rewrite lands where the loader put it."""
    from tests.lora.adapters import assert_lora_rows_follow_the_loader

    assert_lora_rows_follow_the_loader(tiny[name][0])


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    assert model.spec.rotary_dim == {"pythia": 4, "phi": 6}.get(name)
    if name == "gpt2":
        assert model.model.rotary_layers == (False, False) and model.spec.max_position_embeddings == 256
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))


@pytest.mark.parametrize("name", ["pythia", "gpt2", "opt", "phi"])
def test_engine_chunked_prefill_matches_transformers(tiny, name):
    folder, _, ref = tiny[name]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


@pytest.mark.parametrize("name", ["pythia", "gpt2", "phi"])
def test_tensor_parallel_engine_matches_one_rank(tiny, name):
    assert_tensor_parallel_matches_one_rank(tiny[name][0], PROMPTS)


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_learned_positions_show(tiny, name):
    """The learned positions zeroed (or OPT's offset dropped): the long prompt's logits move (no rotary carries
    position there)."""
    _, model, _ = tiny[name]
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    saved = model.model.embed_positions.weight.detach().clone()
    try:
        model.model.embed_positions.weight.data.zero_()
        _, logits = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    finally:
        model.model.embed_positions.weight.data.copy_(saved)
    assert not torch.allclose(logits[0], expected[0], atol=1e-3)
    if name == "opt":
        model.model.position_offset = 0
        try:
            _, unshifted = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
        finally:
            model.model.position_offset = 2
        assert not torch.allclose(unshifted[0], expected[0], atol=1e-3)


@pytest.mark.parametrize(("name", "fields", "match"), [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ("gpt2", {"activation_function": "relu"}, "activation_function 'relu'"),
    ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before false"),
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim 32"),
    ("opt", {"activation_function": "gelu"}, "activation_function 'gelu'"),
    ("phi", {"qk_layernorm": True}, "qk_layernorm"),
])
def test_refusals(tiny, tmp_path, name, fields, match):
    with pytest.raises(UnsupportedModelError, match=f"config.json: {match}"):
        tiny_models.load_float32(copy_with_config(tiny[name][0], tmp_path / "bad", **fields))


def test_hub_config_names(tiny, tmp_path):
    """Pythia's config.json on the hub: rotary_pct and rotary_emb_base, no rope_parameters."""
    folder, model, ref = tiny["pythia"]
    hub = tiny_models.load_float32(copy_with_config(folder, tmp_path / "hub", rope_parameters=None, rotary_pct=0.25,
                                                    rotary_emb_base=10_000))
    assert hub.spec.rotary_dim == 4
    assert_greedy_and_logits_match(hub, ref, PROMPTS[3:], [tiny_models.EOS_TOKEN_ID], label="hub")


@pytest.mark.parametrize("name", ["pythia", "phi"])
def test_what_must_show(tiny, name):
    """The partial rotary's rows left in the checkpoint's order: the long prompt's logits move."""
    folder, model, _ = tiny[name]
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    unordered = type(model)(model.spec, torch.float32, "cpu")
    unordered.rotary_order = None
    unordered.load_weights(iter_safetensors(folder))
    unordered.finalize_weights()
    _, logits = run_greedy(unordered, PROMPTS[3:], 1, return_prefill_logits=True)
    assert not torch.allclose(logits[0], expected[0], atol=1e-3)


def test_other_activation_is_refused_by_name(tiny, tmp_path):
    with pytest.raises(UnsupportedModelError, match="config.json: hidden_act 'relu'"):
        tiny_models.load_float32(copy_with_config(tiny["pythia"][0], tmp_path / "relu", hidden_act="relu"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel set on CPU needs "
                    "TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["pythia", "gpt2", "phi"])
def test_triton_kernel_set_matches_transformers(tiny, name):
    folder, _, ref = tiny[name]
    assert_triton_kernel_set_matches(folder, ref, PROMPTS[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["pythia", "gpt2", "opt", "phi"])
def test_cuda_engine_matches_cpu(tiny, name):
    assert_cuda_engine_matches_cpu(tiny[name][0], PROMPTS, max_tokens=8, max_model_len=256)
