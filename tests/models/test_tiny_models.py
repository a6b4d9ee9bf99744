"""Tiny random Llama / Qwen2 / Qwen3 checkpoints (safetensors + config.json + tokenizer.json) built
in a temp folder: ferrox's loader and model against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.models.conftest import cut_at_eos, hf_greedy, hf_last_logits

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 123 and 3.14159, unicode café 東京 🙂",
]

BUILDERS = {
    "llama": lambda d: tiny_models.make_tiny_llama(d),
    # Llama 3.1 long-context rope (original context 64, so every frequency band is exercised).
    "llama31": lambda d: tiny_models.make_tiny_llama(d, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, num_kv_heads=1, seed=1),
    "llama_sharded_tied": lambda d: tiny_models.make_tiny_llama(d, tie_word_embeddings=True, max_shard_size="60KB",
                                                                seed=2),
    "qwen2": lambda d: tiny_models.make_tiny_qwen2(d, seed=3),
    "qwen3": lambda d: tiny_models.make_tiny_qwen3(d, seed=4),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model); built once for the module."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("tiny"), BUILDERS)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    folder, model, ref = tiny[name]
    tok = load_tokenizer(resolve_model(folder))
    prompts = [tok.encode(t) for t in TEXTS]
    prompts.append(list(range(3, 83)))  # 80 tokens: several blocks, positions past the rope's original context
    ours, logits = run_greedy(model, prompts, 10, block_size=16, return_prefill_logits=True)
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_last_logits(ref, ids), atol=1e-4, rtol=1e-4)
        assert cut_at_eos(ours[i], tok.eos_token_ids) == hf_greedy(ref, ids, 10), (name, i)


def test_chunked_prefill_and_block_size_invariance(tiny):
    _, model, _ = tiny["qwen3"]
    prompts = [list(range(5, 60)), list(range(100, 103)), list(range(7, 40))]
    base = run_greedy(model, prompts, 8)
    assert run_greedy(model, prompts, 8, block_size=8, prefill_chunk=9) == base
    assert run_greedy(model, prompts[1:2], 8, block_size=32) == base[1:2]  # alone == in a batch


def test_specs_read_from_config(tiny):
    spec = load_model_spec(resolve_model(tiny["llama31"][0]))
    assert spec.rope_scaling and spec.rope_scaling["rope_type"] == "llama3"
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 1, 16)
    spec = load_model_spec(resolve_model(tiny["qwen3"][0]))
    assert spec.architecture == "Qwen3ForCausalLM" and spec.head_dim == 32 and spec.tie_word_embeddings
    assert spec.rope_theta == 1e6


def test_hf_folder_tokenizer_matches_transformers(tiny):
    folder = tiny["llama"][0]
    ours = load_tokenizer(resolve_model(folder))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}]
    assert ours.apply_chat_template(conv) == theirs.apply_chat_template(conv, tokenize=False,
                                                                       add_generation_prompt=True)
    assert ours.eos_token_ids == [tiny_models.EOS_TOKEN_ID]
    assert ours.bos_token_id == 1 and ours.pad_token_id == 0
    assert ours.vocab_size == len(theirs)


def test_dummy_weights_need_only_config(tiny, tmp_path):
    import shutil

    folder = tmp_path / "cfg_only"
    folder.mkdir()
    shutil.copy(f"{tiny['llama'][0]}/config.json", folder / "config.json")
    source = resolve_model(str(folder))
    spec = load_model_spec(source)
    a = load_model(source, spec, dtype=torch.float32, device="cpu", load_format="dummy", seed=7)
    b = load_model(source, spec, dtype=torch.float32, device="cpu", load_format="dummy", seed=7)
    out_a = run_greedy(a, [[1, 2, 3, 4]], 4, return_prefill_logits=True)
    out_b = run_greedy(b, [[1, 2, 3, 4]], 4, return_prefill_logits=True)
    assert out_a[0] == out_b[0] and torch.equal(out_a[1], out_b[1])  # seeded: reproducible
    assert torch.isfinite(out_a[1]).all()
    std = a.model.layers[0].self_attn.qkv_proj.weight.std().item()
    assert 0.015 < std < 0.025


def test_pytorch_bin_checkpoint(tiny, tmp_path):
    # Older checkpoints ship pytorch_model.bin; auto picks it when there is no safetensors file.
    from safetensors.torch import load_file

    folder, model, _ = tiny["llama"]
    import shutil

    dst = tmp_path / "bin"
    shutil.copytree(folder, dst)
    torch.save(load_file(str(dst / "model.safetensors")), dst / "pytorch_model.bin")
    (dst / "model.safetensors").unlink()
    source = resolve_model(str(dst))
    loaded = load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")
    prompts = [list(range(3, 30))]
    assert run_greedy(loaded, prompts, 4, return_prefill_logits=True)[1].equal(
        run_greedy(model, prompts, 4, return_prefill_logits=True)[1])
