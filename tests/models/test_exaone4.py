"""EXAONE 4.0 (models/exaone4.py) against transformers on tiny random checkpoints: the 32B's layout (three windowed,
rotating layers then a global one without rotary; windows crossed by the prompts) and the 1.2B's (no window, every
layer rotating, tied embeddings): greedy tokens and last-prompt logits, chunked prefill and batching, the real engine
with a 16-token budget; the layer kinds from layer_types or from sliding_window_pattern (a number or letters);
mutations that must show (rotary on the global layer, no window); the refusals by name."""

from __future__ import annotations

import os

import pytest
import torch
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import spec_for_context

from tests.helpers import tiny_models
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_exaone4 import make_tiny_exaone4
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
BUILDERS = {"hybrid": lambda d: make_tiny_exaone4(d, seed=41),
            "full": lambda d: make_tiny_exaone4(d, sliding_window=None, tie_word_embeddings=True, seed=42)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, transformers model)."""
    root = tmp_path_factory.mktemp("exaone4")
    out = {}
    for name, build in BUILDERS.items():
        folder = build(root / name)
        out[name] = (folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    return out


def _load(folder: str, max_model_len: int = 256):
    """As served: the windows as spec_for_context sets them for the context."""
    source = resolve_model(folder)
    return load_model(source, spec_for_context(load_model_spec(source), max_model_len), dtype=torch.float32,
                      device="cpu")


@pytest.mark.parametrize("name", list(BUILDERS))
def test_matches_transformers(tiny, name):
    folder, ref = tiny[name]
    model = _load(folder)
    expected = {"hybrid": ([8, 8, 8, 0], (True, True, True, False)), "full": ([0] * 4, (True,) * 4)}[name]
    assert ([layer.self_attn.window for layer in model.model.layers], model.model.rotary_layers) == expected
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))


def test_engine_chunked_prefill_matches_transformers(tiny):
    folder, ref = tiny["hybrid"]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


def test_layer_kinds_from_the_pattern(tiny, tmp_path):
    """Without layer_types: sliding_window_pattern 4 gives the same model; letters "LG" alternate; the global
    layers keep no rotary even where the window is no shorter than the context."""
    folder, ref = tiny["hybrid"]
    derived = _load(copy_with_config(folder, tmp_path / "derived", layer_types=None))
    assert derived.model.rotary_layers == (True, True, True, False)
    assert_greedy_and_logits_match(derived, ref, PROMPTS[3:], [tiny_models.EOS_TOKEN_ID], label="derived")
    letters = _load(copy_with_config(folder, tmp_path / "letters", layer_types=None, sliding_window_pattern="LG"))
    assert [layer.self_attn.window for layer in letters.model.layers] == [8, 0, 8, 0]
    assert letters.model.rotary_layers == (True, False, True, False)
    wide = _load(copy_with_config(folder, tmp_path / "wide", sliding_window=4096))
    assert [layer.self_attn.window for layer in wide.model.layers] == [0] * 4
    assert wide.model.rotary_layers == (True, True, True, False)


def test_mutations_show(tiny, tmp_path):
    """The global layer rotating, or no window: the long prompt's logits move (so the parity above checks both)."""
    folder, _ = tiny["hybrid"]
    model = _load(folder)
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    rotating = _load(folder)
    rotating.model.rotary_layers = (True,) * 4
    unwindowed = _load(folder)
    for layer in unwindowed.model.layers:
        layer.self_attn.window = 0
    for changed in (rotating, unwindowed):
        _, logits = run_greedy(changed, PROMPTS[3:], 1, return_prefill_logits=True)
        assert not torch.allclose(logits[0], expected[0], atol=1e-3)


@pytest.mark.parametrize(("fields", "words"), [
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]},
     "layer_types"),
    ({"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern"),
])
def test_unsupported_fields_are_refused_by_name(tiny, tmp_path, fields, words):
    folder = copy_with_config(tiny["hybrid"][0], tmp_path / "bad", **fields)
    with pytest.raises(Exception, match=f"config.json.*{words}"):
        _load(folder)


def test_tensor_parallel_engine_matches_one_rank(tiny):
    """Two gloo ranks (windowed and global NoPE layers, post-norms, per-head q/k norms) answer as one."""
    assert_tensor_parallel_matches_one_rank(tiny["hybrid"][0], PROMPTS)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel set on CPU needs "
                    "TRITON_INTERPRET=1")
def test_triton_kernel_set_matches_transformers(tiny):
    """The GPU's op set (the fused q/k norm + rotary kernel on the windowed layers, torch norms on the global one)
    under the interpreter: the long prompt's logits and a few greedy tokens."""
    folder, ref = tiny["hybrid"]
    assert_triton_kernel_set_matches(folder, ref, PROMPTS[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu(tiny):
    """The windowed layers and the global NoPE layer on the CUDA engine (CUDA graphs) against the CPU engine."""
    assert_cuda_engine_matches_cpu(tiny["hybrid"][0], PROMPTS, max_tokens=8, max_model_len=256)
