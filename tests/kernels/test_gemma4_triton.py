"""A tiny Gemma 4 on the Triton kernel set against the same weights on the torch kernel set: a sliding layer
and a full layer of twice the head_dim with one KV head (attention_k_eq_v), each with its own cache shape,
q/k norms and rotary in one kernel, the value norm, proportional RoPE and layer scalars; a prompt past the
window, then decode steps. Runs on CUDA, or on CPU in the Triton interpreter child (conftest.py)."""

from __future__ import annotations

import torch

from tests.kernels.kernel_refs import relative_error
from tests.kernels.test_gemma2_triton import _pair, _run

CONFIG = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "attention_k_eq_v": True, "intermediate_size": 48, "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "vocab_size": 61,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32", "tie_word_embeddings": True,
    "final_logit_softcapping": 4.0, "hidden_activation": "gelu_pytorch_tanh", "hidden_size_per_layer_input": 0,
}


def test_gemma4_on_triton_kernels_matches_torch(kernel_device):
    ref, triton_model = _pair(CONFIG, kernel_device, 512)
    assert triton_model.backend.name == "triton" and not triton_model.backend.uniform_heads
    assert [layer.self_attn.head_dim for layer in triton_model.model.layers] == [16, 32]
    prompt = [(7 * i + 3) % 61 for i in range(20)]
    expected = _run(ref, kernel_device, prompt, [11, 42])
    got = _run(triton_model, kernel_device, prompt, [11, 42])
    assert relative_error(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
