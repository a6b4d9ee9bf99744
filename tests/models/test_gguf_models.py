"""GGUF weight loading on tiny models: a safetensors checkpoint exported to llama.cpp's layout
(renamed tensors, permuted Q/K rows, optional Q8_0 / rope_freqs / YaRN) must give the same model as the
safetensors original, which test_tiny_models.py ties to transformers."""

from __future__ import annotations

import pytest
import torch
from ferrox.layers.rotary import rope_inv_freq
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
PROMPTS = [list(range(3, 70)), [5, 9, 11], list(range(100, 130))]


def _load(path):
    source = resolve_model(str(path))
    return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return root, tiny_models.make_tiny_llama(root / "hf", rope_scaling=LLAMA31, num_heads=4, num_kv_heads=2, seed=5)


def test_gguf_f32_equals_safetensors_with_rope_freqs(llama31):
    root, folder = llama31
    # llama.cpp stores Llama 3.1's scaling as divisors of the base frequencies.
    base = rope_inv_freq(16, 10000.0, None)
    factors = (base / rope_inv_freq(16, 10000.0, LLAMA31)).tolist()
    path = tiny_models.export_gguf(folder, root / "tiny.gguf", rope_freqs=factors)
    hf_tokens, hf_logits = run_greedy(_load(folder), PROMPTS, 6, return_prefill_logits=True)
    gg_tokens, gg_logits = run_greedy(_load(path), PROMPTS, 6, return_prefill_logits=True)
    torch.testing.assert_close(gg_logits, hf_logits, atol=1e-4, rtol=1e-4)
    assert gg_tokens == hf_tokens
    spec = load_model_spec(resolve_model(path))
    assert spec.rope_scaling["rope_type"] == "freq_factors" and not spec.tie_word_embeddings
    # Tokenizer and chat template come from the GGUF metadata and match the folder's.
    a, b = load_tokenizer(resolve_model(path)), load_tokenizer(resolve_model(folder))
    text = "The quick brown fox 123 café"
    assert a.encode(text) == b.encode(text)
    conv = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(conv) == b.apply_chat_template(conv)
    assert a.eos_token_ids == [tiny_models.EOS_TOKEN_ID]


def test_gguf_without_rope_freqs_differs(llama31):
    # Guard for the test above: without the factors the same weights give other logits.
    root, folder = llama31
    path = tiny_models.export_gguf(folder, root / "plain.gguf")
    _, hf_logits = run_greedy(_load(folder), PROMPTS, 1, return_prefill_logits=True)
    _, gg_logits = run_greedy(_load(path), PROMPTS, 1, return_prefill_logits=True)
    assert (gg_logits - hf_logits).abs().max() > 1e-3


def test_gguf_q8_0_close_to_float(llama31):
    root, folder = llama31
    factors = (rope_inv_freq(16, 10000.0, None) / rope_inv_freq(16, 10000.0, LLAMA31)).tolist()
    path = tiny_models.export_gguf(folder, root / "q8.gguf", tensor_type="Q8_0", rope_freqs=factors)
    _, ref = run_greedy(_load(folder), PROMPTS, 1, return_prefill_logits=True)
    _, q8 = run_greedy(_load(path), PROMPTS, 1, return_prefill_logits=True)
    err = (q8 - ref).abs().max().item()
    assert 0 < err < 0.1 * ref.abs().max().item()  # quantized: close, not equal


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_equals_safetensors(tmp_path, arch):
    # Qwen GGUFs keep q/k rows unpermuted; Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms.
    build = tiny_models.make_tiny_qwen2 if arch == "qwen2" else tiny_models.make_tiny_qwen3
    folder = build(tmp_path / arch, seed=6)
    path = tiny_models.export_gguf(folder, tmp_path / f"{arch}.gguf")
    spec = load_model_spec(resolve_model(path))
    assert spec.architecture == load_model_spec(resolve_model(folder)).architecture
    want_tokens, want = run_greedy(_load(folder), PROMPTS, 4, return_prefill_logits=True)
    got_tokens, got = run_greedy(_load(path), PROMPTS, 4, return_prefill_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens


@pytest.mark.parametrize("build", ["make_tiny_qwen3_moe", "make_tiny_qwen2_moe", "make_tiny_mixtral"])
def test_moe_gguf_equals_safetensors(tmp_path, build):
    """llama.cpp's MoE layout: experts stacked per layer ([experts, rows, cols]), the router, Qwen2-MoE's
    shared expert and its gate vector, Mixtral as a llama file with experts; the model read from the
    GGUF is the folder's model."""
    folder = getattr(tiny_models, build)(tmp_path / build)
    path = tiny_models.export_gguf(folder, tmp_path / f"{build}.gguf")
    spec = load_model_spec(resolve_model(path))
    assert spec.architecture == load_model_spec(resolve_model(folder)).architecture and spec.moe is not None
    want_tokens, want = run_greedy(_load(folder), PROMPTS, 4, return_prefill_logits=True)
    got_tokens, got = run_greedy(_load(path), PROMPTS, 4, return_prefill_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens


def test_yarn_gguf_equals_safetensors_and_runs_in_the_rust_decoder(tmp_path):
    """llama.cpp's YaRN metadata (rope.scaling.type / factor / original_context_length) is the folder's
    rope_scaling; kept quantized (Q8_0), every step runs in the Rust decoder, whose rope rows carry
    YaRN's scaled cos and sin: close to the float model, and further from the same file without YaRN."""
    import json
    import os

    from ferrox.attention.cpu_decode import CpuQuantizedDecode

    folder = tiny_models.make_tiny_qwen2(tmp_path / "hf", seed=6)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                 "rope_theta": 1e6}
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    path = tiny_models.export_gguf(folder, tmp_path / "yarn.gguf")
    spec = load_model_spec(resolve_model(path))
    assert spec.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    want_tokens, want = run_greedy(_load(folder), PROMPTS, 4, return_prefill_logits=True)
    got_tokens, got = run_greedy(_load(path), PROMPTS, 4, return_prefill_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens

    errors = []
    for name, yarn in (("q8-yarn.gguf", True), ("q8-plain.gguf", False)):
        if not yarn:
            config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
            with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f)
        q8 = tiny_models.export_gguf(folder, tmp_path / name, tensor_type="Q8_0")
        source = resolve_model(q8)
        model = load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu", keep_quantized=True)
        assert isinstance(model.model.decode_path, CpuQuantizedDecode)
        _, logits = run_greedy(model, PROMPTS, 1, return_prefill_logits=True)
        errors.append((logits - want).abs().max().item())
    assert errors[0] < 0.1 * want.abs().max().item() and errors[0] < errors[1] / 3, errors


def _phi4_mini_like(folder: str) -> str:
    """A tiny Phi-3 folder turned Phi-4-mini-shaped: LongRoPE over half of each head's dims."""
    import json
    import os

    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(max_position_embeddings=256, original_max_position_embeddings=64, partial_rotary_factor=0.5,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 1.2, 1.5, 2.0],
                                   "long_factor": [1.0, 3.0, 7.0, 15.0]})
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return folder


@pytest.mark.parametrize("family", ["phi3", "phi4_mini", "granite"])
def test_phi3_and_granite_gguf_equal_safetensors(tmp_path, family):
    """llama.cpp's phi3 files (fused attn_qkv / ffn_up, the rotary dims as rope.dimension_count, LongRoPE
    as rope_factors_* tensors) and granite files (q/k permuted as Llama's, the multipliers as *_scale
    keys) give the folder's model."""
    if family == "granite":
        folder = tiny_models.make_tiny_granite(tmp_path / family, seed=8)
    else:
        folder = tiny_models.make_tiny_phi3(tmp_path / family, seed=8)
        if family == "phi4_mini":
            folder = _phi4_mini_like(folder)
    path = tiny_models.export_gguf(folder, tmp_path / f"{family}.gguf")
    want_spec, spec = load_model_spec(resolve_model(folder)), load_model_spec(resolve_model(path))
    assert (spec.architecture, spec.rotary_dim, spec.head_dim) == (
        want_spec.architecture, want_spec.rotary_dim, want_spec.head_dim)
    if family == "phi4_mini":
        assert spec.rotary_dim == 8 and spec.rope_scaling["rope_type"] == "longrope"
        assert spec.rope_scaling["original_max_position_embeddings"] == 64
    want_tokens, want = run_greedy(_load(folder), PROMPTS, 4, return_prefill_logits=True)
    got_tokens, got = run_greedy(_load(path), PROMPTS, 4, return_prefill_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens


def test_phi4_mini_q8_gguf_runs_in_the_rust_decoder(tmp_path):
    """Kept quantized, the fused tensors are cut by rows of blocks and the partial-rotary q/k rows
    reordered as whole rows of blocks; every step runs in the Rust decoder, close to the float model."""
    from ferrox.attention.cpu_decode import CpuQuantizedDecode

    folder = _phi4_mini_like(tiny_models.make_tiny_phi3(tmp_path / "phi4", seed=8))
    path = tiny_models.export_gguf(folder, tmp_path / "q8.gguf", tensor_type="Q8_0")
    source = resolve_model(path)
    model = load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu", keep_quantized=True)
    assert isinstance(model.model.decode_path, CpuQuantizedDecode)
    _, want = run_greedy(_load(folder), PROMPTS, 1, return_prefill_logits=True)
    _, got = run_greedy(model, PROMPTS, 1, return_prefill_logits=True)
    assert (got - want).abs().max().item() < 0.1 * want.abs().max().item()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_gguf_equals_safetensors(tmp_path, family):
    """llama.cpp's gemma2 / gemma3 files: norms stored as 1 + w, its names for the four norms, soft caps and
    the sliding window as metadata, Gemma 3's global RoPE base and linear scaling (its local base fixed);
    F32 gives the folder's model (windows on: spec_for_context); Q8_0 kept quantized (the general path over
    the Rust kernels' quantized matmuls) is close to the same file dequantized, on two layers (random
    deeper models with random norms magnify int8 rounding too much for a meaningful bound)."""
    import json
    import os

    from ferrox.layers.quant import CpuQuantWeight
    from ferrox.model_spec import spec_for_context

    if family == "gemma2":
        folder = tiny_models.make_tiny_gemma2(tmp_path / family, sliding_window=16, seed=9)
    else:
        folder = tiny_models.make_tiny_gemma3(tmp_path / family, sliding_window=16, seed=9,
                                              global_scaling={"rope_type": "linear", "factor": 4.0})
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        head_dim = json.load(f)["head_dim"]
    # The tiny models' query_pre_attn_scalar (24) is not derivable from a GGUF (llama.cpp fixes it by
    # model size): the file's model uses head_dim, so the folder is compared with that value.
    _set_config(folder, query_pre_attn_scalar=head_dim)
    path = tiny_models.export_gguf(folder, tmp_path / f"{family}.gguf")

    def load(p, **kw):
        source = resolve_model(str(p))
        return load_model(source, spec_for_context(load_model_spec(source), 256), dtype=torch.float32, device="cpu",
                          **kw)

    want_model, got_model = load(folder), load(path)
    assert got_model.spec.attention_windows == want_model.spec.attention_windows != ()
    want_tokens, want = run_greedy(want_model, PROMPTS, 4, return_prefill_logits=True)
    got_tokens, got = run_greedy(got_model, PROMPTS, 4, return_prefill_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens
    if family == "gemma3":
        folder = tiny_models.make_tiny_gemma3(tmp_path / "two-layers", num_layers=2, sliding_window=16, seed=9)
    q8 = tiny_models.export_gguf(folder, tmp_path / f"{family}-q8.gguf", tensor_type="Q8_0")
    kept = load(q8, keep_quantized=True)
    assert isinstance(kept.model.layers[0].self_attn.qkv_proj.quant, CpuQuantWeight)
    _, close = run_greedy(kept, PROMPTS, 1, return_prefill_logits=True)
    _, dequantized = run_greedy(load(q8), PROMPTS, 1, return_prefill_logits=True)
    assert (close - dequantized).abs().max().item() < 0.1 * dequantized.abs().max().item()


def _set_config(folder: str, **fields) -> None:
    import json
    import os

    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(fields)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)


def test_windowed_phi3_gguf_runs_in_the_rust_decoder(tmp_path):
    """phi3.attention.sliding_window reaches the Rust decoder: kept quantized, every step (chunked prefill
    over the window's edge, decodes past it) runs there, one token a tile from its window's start, close to
    the same file dequantized through the torch backend's windowed masks, and unlike full attention."""
    from ferrox.attention.cpu_decode import CpuQuantizedDecode
    from ferrox.model_spec import spec_for_context

    folder = tiny_models.make_tiny_phi3(tmp_path / "phi3", sliding_window=16, seed=8)
    path = tiny_models.export_gguf(folder, tmp_path / "q8.gguf", tensor_type="Q8_0")
    source = resolve_model(path)
    spec = load_model_spec(source)
    kept = load_model(source, spec_for_context(spec, 256), dtype=torch.float32, device="cpu", keep_quantized=True)
    assert isinstance(kept.model.decode_path, CpuQuantizedDecode)
    assert [layer.window for layer in kept.model.decode_path.layers] == [16, 16]
    dequantized = load_model(source, spec_for_context(spec, 256), dtype=torch.float32, device="cpu")
    full = load_model(source, spec, dtype=torch.float32, device="cpu", keep_quantized=True)
    prompts = [list(range(3, 70)), [5, 9, 11], list(range(100, 130))]
    got_tokens, got = run_greedy(kept, prompts, 6, block_size=8, prefill_chunk=7, return_prefill_logits=True)
    want_tokens, want = run_greedy(dequantized, prompts, 6, block_size=8, prefill_chunk=7, return_prefill_logits=True)
    _, unwindowed = run_greedy(full, prompts, 1, return_prefill_logits=True)
    error = (got - want).abs().max().item()
    assert error < 0.1 * want.abs().max().item()
    assert (unwindowed - want).abs().max().item() > 3 * error  # the window is what they share
    alone = [run_greedy(kept, [p], 6, block_size=8, prefill_chunk=7)[0] for p in prompts]
    assert alone == got_tokens  # each token's arithmetic is its own (tiles of one token)
