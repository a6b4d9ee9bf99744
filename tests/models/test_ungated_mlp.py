"""Arcee (ReLU-squared MLP: models/arcee.py) and Apertus (xIELU MLP with learned parameters, q/k norms, renamed
layer norms: models/apertus.py), both on models/ungated_mlp.py, against transformers on tiny random checkpoints:
greedy tokens and last-prompt logits, chunked prefill and batching, the real engine with a 16-token budget, two gloo
ranks (the one-shard up projection split by rows); the general decode path on the GPU's op set; xIELU's parameters
must show; hidden_act refused by name; the Triton kernel set under the interpreter; on a GPU, the CUDA engine."""

from __future__ import annotations

import os

import pytest
import torch
from ferrox.errors import UnsupportedModelError
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.weights import iter_safetensors
from ferrox.models.registry import get_model_class

from tests.helpers import tiny_models
from tests.helpers.config_edit import copy_with_config
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_ungated import make_tiny_apertus, make_tiny_arcee
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
BUILDERS = {"arcee": lambda d: make_tiny_arcee(d, seed=91), "apertus": lambda d: make_tiny_apertus(d, seed=92)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models.models_with_references(tmp_path_factory.mktemp("ungated"), BUILDERS)


def _triton(folder: str):
    spec = load_model_spec(resolve_model(folder))
    model = get_model_class([spec.architecture])(spec, torch.float32, "cpu", kernels="triton")
    model.load_weights(iter_safetensors(folder))
    model.finalize_weights()
    return model


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    folder, model, ref = tiny[name]
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))
    assert _triton(folder).model.decode_path.layers is None  # (ungated MLPs: not the fused kernels' shape)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_engine_chunked_prefill_matches_transformers(tiny, name):
    folder, _, ref = tiny[name]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


def test_tensor_parallel_engine_matches_one_rank(tiny):
    assert_tensor_parallel_matches_one_rank(tiny["apertus"][0], PROMPTS)


def test_xielu_parameters_show(tiny):
    _, model, _ = tiny["apertus"]
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    act = model.model.layers[1].mlp.act_fn
    saved = act.alpha_n.detach().clone()
    try:
        act.alpha_n.data.fill_(3.0)
        _, logits = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    finally:
        act.alpha_n.data.copy_(saved)
    assert not torch.allclose(logits[0], expected[0], atol=1e-3)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_other_activation_is_refused_by_name(tiny, tmp_path, name):
    with pytest.raises(UnsupportedModelError, match="config.json: hidden_act 'silu'"):
        tiny_models.load_float32(copy_with_config(tiny[name][0], tmp_path / name, hidden_act="silu"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel set on CPU needs "
                    "TRITON_INTERPRET=1")
def test_triton_kernel_set_matches_transformers(tiny):
    folder, _, ref = tiny["apertus"]
    assert_triton_kernel_set_matches(folder, ref, PROMPTS[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(BUILDERS))
def test_cuda_engine_matches_cpu(tiny, name):
    assert_cuda_engine_matches_cpu(tiny[name][0], PROMPTS, max_tokens=8, max_model_len=256)
