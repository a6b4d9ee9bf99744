"""Tiny models on the Triton kernel set against the same weights on the torch kernel set: Gemma 2 (the
score cap in the prefill and unified kernels, a 130-token prompt for the prefill kernel's tiles, then
decode steps; with and without its every-other-layer sliding window) and a windowed Mistral through the
fused one-token path. Runs on CUDA, or on CPU in the Triton interpreter child (conftest.py)."""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.kv_cache import allocate_kv_caches
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import init_dummy_weights
from ferrox.model_spec import spec_for_context
from ferrox.models.registry import get_model_class

from tests.helpers.driver import StepRequest, build_step
from tests.helpers.interpreter import interpreted_or, native_only, prefill_kernel_from
from tests.kernels.kernel_refs import relative_error

BLOCK = 16
CONFIG = {
    "architectures": ["Gemma2ForCausalLM"], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 48, "num_hidden_layers": 2, "vocab_size": 61,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
    "tie_word_embeddings": True, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 1.5,
    "final_logit_softcapping": 4.0, "hidden_activation": "gelu_pytorch_tanh",
}


@torch.inference_mode()
def _run(model, device: torch.device, prompt: list[int], decode: list[int]) -> torch.Tensor:
    caches = allocate_kv_caches(model.spec, 16, BLOCK, torch.float32, device)
    blocks = list(range(1, 16))
    ids, pos, meta = build_step([StepRequest(prompt, 0, blocks)], BLOCK, device)
    rows = [model.compute_logits(model(ids, pos, caches, meta)[-1:])]
    for i, token in enumerate(decode):
        ids, pos, meta = build_step([StepRequest([token], len(prompt) + i, blocks)], BLOCK, device)
        rows.append(model.compute_logits(model(ids, pos, caches, meta)))
    return torch.cat(rows)


def _pair(config: dict, device: torch.device, context: int):
    """(torch-set model, Triton-set model) with the same dummy weights, built for `context` tokens."""
    spec = spec_for_context(spec_from_hf_config(config, "test config"), context)
    cls = get_model_class(config["architectures"])
    ref = cls(spec, torch.float32, device, kernels="torch")
    init_dummy_weights(ref, seed=7)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            param.mul_(10.0 if not name.endswith("norm.weight") else 1.0)  # scores the caps bend
    triton_model = cls(spec, torch.float32, device, kernels="triton")
    triton_model.load_state_dict(ref.state_dict())
    for model in (ref, triton_model):
        model.finalize_weights()
        model.eval()
    return ref, triton_model


# Interpreted, the windowed case alone: its second layer is the unwindowed one. (A GPU runs both.)
@pytest.mark.parametrize("window", [native_only(0, reason="window 20's second layer has no window"), 20])
def test_gemma2_on_triton_kernels_matches_torch(kernel_device, monkeypatch, window):
    """Interpreted, a 48-token prompt (past the window, two query tiles) reaches the prefill kernel
    (tests/helpers/interpreter.py)."""
    prompt_len = interpreted_or(130, 48)
    launches = prefill_kernel_from(monkeypatch, prompt_len)
    config = CONFIG | ({"sliding_window": window} if window else {})
    ref, triton_model = _pair(config, kernel_device, 512)
    assert triton_model.model.layers[0].self_attn.window == window
    assert triton_model.model.layers[1].self_attn.window == 0
    assert triton_model.backend.name == "triton" and triton_model.backend.softcap == 1.5
    prompt = [(7 * i + 3) % 61 for i in range(prompt_len)]
    expected = _run(ref, kernel_device, prompt, [11, 42, 5])
    got = _run(triton_model, kernel_device, prompt, [11, 42, 5])
    assert len(launches) == 2  # the prompt's step, in each layer (a score cap keeps the Triton kernels)
    assert relative_error(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_windowed_mistral_fused_one_token_path_matches_torch(kernel_device):
    """Mistral v0.1's shape: every layer windowed, decoded by the fused one-token kernels (attend with the
    window) past the window's edge."""
    from ferrox.attention.fused_decode import FusedOneTokenDecode

    config = CONFIG | {"architectures": ["MistralForCausalLM"], "sliding_window": 5, "tie_word_embeddings": False}
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation"):
        config.pop(key)
    ref, triton_model = _pair(config, kernel_device, 512)
    path = triton_model.model.decode_path
    assert isinstance(path, FusedOneTokenDecode) and [layer.window for layer in path.layers] == [5, 5]
    prompt = [(5 * i + 2) % 61 for i in range(12)]
    expected = _run(ref, kernel_device, prompt, [11, 42, 5, 9])
    got = _run(triton_model, kernel_device, prompt, [11, 42, 5, 9])
    assert relative_error(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
