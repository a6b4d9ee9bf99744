"""The embedded SmolLM2-135M-Instruct GGUF through ferrox's loader, tokenizer and model, against
Hugging Face transformers loading the same file (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.driver import run_greedy
from tests.models.conftest import cut_at_eos, hf_greedy, hf_last_logits

TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "Numbers 0 7 42 123 4567 3.14159 1,000,000 and 2024-05-17",
    "Unicode: café naïve Zürich 東京 Москва العربية 🙂🚀 \u00e9\u0301",
    "def f(x):\n\treturn x**2  # comment\n\n\nclass A: pass",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Mixed\r\nline endings\rand tabs\t\tend",
    "<repo_name>a/b<file_sep>x.py <|endoftext|> tail",
    "",
    "don't won't I'll we've they're it's",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Count to 3."}],
    [{"role": "user", "content": "Ünïcödé ✓ and \"quotes\""}],
]

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The dog",
    "Q: What is 2 + 2?\nA:",
    "Translate to French: I like cheese.\n",
    "In a shocking finding, scientists discovered a herd of unicorns living in a remote, previously unexplored "
    "valley in the Andes Mountains. Even more surprising to the researchers was the fact that the unicorns",
]


def test_tokenizer_encodes_like_transformers(smollm_tokenizer, hf_smollm_tokenizer):
    for text in TEXTS:
        ours = smollm_tokenizer.encode(text)
        theirs = hf_smollm_tokenizer.encode(text)
        assert ours == theirs, text
        assert smollm_tokenizer.decode(ours, skip_special_tokens=False) == hf_smollm_tokenizer.decode(
            theirs, skip_special_tokens=False)
    assert smollm_tokenizer.vocab_size == len(hf_smollm_tokenizer)
    # Chat markers are single special tokens, dropped by skip_special_tokens.
    ids = smollm_tokenizer.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm_tokenizer.decode(ids) == "user"


def test_special_tokens_and_eos(smollm_tokenizer):
    assert smollm_tokenizer.bos_token_id == 1
    assert smollm_tokenizer.pad_token_id == 2
    assert smollm_tokenizer.eos_token_ids == [2]
    assert smollm_tokenizer.special_tokens["eos_token"] == "<|im_end|>"


def test_chat_template_renders_like_transformers(smollm_tokenizer, hf_smollm_tokenizer):
    for conv in CONVERSATIONS:
        for gen in (True, False):
            ours = smollm_tokenizer.apply_chat_template(conv, add_generation_prompt=gen)
            theirs = hf_smollm_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs


def test_prefill_logits_match_transformers(smollm_tokenizer, smollm_model, hf_smollm):
    prompts = [smollm_tokenizer.encode(p) for p in PROMPTS[:4]]
    _, logits = run_greedy(smollm_model, prompts, 1, return_prefill_logits=True)
    for i, ids in enumerate(prompts):
        ref = hf_last_logits(hf_smollm, ids)
        diff = (logits[i] - ref).abs().max().item()
        assert diff < 2e-3, f"prompt {i}: max |logit diff| {diff}"


def test_greedy_matches_transformers(smollm_tokenizer, smollm_model, hf_smollm):
    chat = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompts = [smollm_tokenizer.encode(chat)] + [smollm_tokenizer.encode(p) for p in PROMPTS[:7]]
    new_tokens = 10
    ours = run_greedy(smollm_model, prompts, new_tokens)
    for ids, got in zip(prompts, ours, strict=True):
        want = hf_greedy(hf_smollm, ids, new_tokens)
        assert cut_at_eos(got, smollm_tokenizer.eos_token_ids) == want, smollm_tokenizer.decode(ids)
    assert "Paris" in smollm_tokenizer.decode(ours[0])


def test_chunked_prefill_and_odd_block_size_same_tokens(smollm_tokenizer, smollm_model):
    # A long prompt prefilled in chunks over cached context, next to a short one, with 8-token blocks.
    prompts = [smollm_tokenizer.encode(p) for p in (PROMPTS[7], PROMPTS[0])]
    base = run_greedy(smollm_model, prompts, 4)
    assert run_greedy(smollm_model, prompts, 4, block_size=8, prefill_chunk=19) == base


@pytest.mark.parametrize("bad", [None])
def test_model_spec_from_gguf(smollm_source, bad):
    from ferrox.loader.model_loader import load_model_spec

    spec = load_model_spec(smollm_source)
    assert (spec.architecture, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        "LlamaForCausalLM", 30, 9, 3, 64)
    assert spec.vocab_size == 49152 and spec.tie_word_embeddings
    assert spec.hidden_size == 576 and spec.max_position_embeddings == 8192
    assert spec.rope_theta == pytest.approx(100000.0)
    assert smollm_source.name == "SmolLM2-135M-Instruct"
    assert torch.float32 != spec.dtype  # quantized checkpoint: half precision on GPU
