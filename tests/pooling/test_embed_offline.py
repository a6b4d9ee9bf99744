"""LLM.embed / LLM.encode: decoders used as embedders (last-token pooling against transformers' final
hidden state), continuous batching (a batch bigger than max_num_seqs and the token budget gives what one
prompt at a time gives), per-request pooling params, --pooler-config, and the refusals, by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM
from ferrox.errors import InvalidArgumentError, PromptTooLongError
from ferrox.pooling.params import PoolingParams

from tests.helpers import tiny_models
from tests.pooling.conftest import SENTENCES, hf_sentence_embeddings, make_tiny_encoder

PROMPTS = [[5, 9, 11, 40], list(range(3, 60)), [7], list(range(100, 130))]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoder_as_embedder_pools_the_last_token(tmp_path, family):
    """runner 'pooling' on a decoder folder without modules.json: vLLM's default, the last token's final
    (normed) hidden state, L2-normalised."""
    transformers = pytest.importorskip("transformers")
    make = {"llama": tiny_models.make_tiny_llama, "qwen3": tiny_models.make_tiny_qwen3}[family]
    folder = make(tmp_path / family)
    llm = LLM(folder, runner="pooling", max_num_seqs=2)
    assert (llm.engine.pooler_config.pooling_type, llm.engine.pooler_config.normalize) == ("LAST", True)
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs.data.dtype == np.float32 and out.finished and out.error is None
        with torch.inference_mode():
            last = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        expected = torch.nn.functional.normalize(last, dim=-1)
        torch.testing.assert_close(torch.from_numpy(out.outputs.data), expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidArgumentError, match="runner 'pooling'") as info:
        llm.generate([PROMPTS[0]], use_tqdm=False)
    assert info.value.param == "runner"


def test_the_warm_up_step_leaves_no_trace(tmp_path, monkeypatch):
    """A pooling engine runs one step of its own before ready (the first request then pays no lazy
    device start or kernel compile); afterwards the engine holds no request of it and embeds exactly
    what an engine without the warm-up embeds."""
    folder = tiny_models.make_tiny_llama(tmp_path / "llama")
    warm = LLM(folder, runner="pooling", max_num_seqs=2)
    assert warm.engine.pooling_warmup_s is not None and warm.engine.pooling_warmup_s > 0
    assert not warm.engine.runner._requests
    monkeypatch.setenv("FERROX_WARMUP", "0")
    cold = LLM(folder, runner="pooling", max_num_seqs=2)
    assert cold.engine.pooling_warmup_s is None
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for a, b in zip(warm.encode(prompts, use_tqdm=False), cold.encode(prompts, use_tqdm=False), strict=True):
        np.testing.assert_array_equal(a.outputs.data, b.outputs.data)
    assert warm.engine.stats()["num_prompt_tokens"] == sum(len(p) for p in PROMPTS)


def test_continuous_batching_gives_what_one_at_a_time_gives(minilm_folder):
    """24 prompts through 4 sequences and a 256-token budget a step (the scheduler splits them over many
    steps, prompts whole) equal the same prompts embedded alone."""
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {'more words ' * (i % 7)}sentence {i}" for i in range(24)]
    llm = LLM(minilm_folder, max_num_seqs=4, max_num_batched_tokens=256)
    batched = llm.embed(texts, use_tqdm=False)
    assert [o.prompt_token_ids for o in batched] == [llm.get_tokenizer().encode(t) for t in texts]
    stats = llm.engine.stats()
    assert stats["num_prompt_tokens"] == sum(len(o.prompt_token_ids) for o in batched)
    assert stats["num_preemptions"] == 0
    for text, out in zip(texts, batched, strict=True):
        alone = llm.embed(text, use_tqdm=False)[0]
        np.testing.assert_allclose(out.outputs.embedding, alone.outputs.embedding, atol=2e-6)


def test_pooling_params_normalize_and_matryoshka_dimensions(tmp_path, hf_minilm, minilm_folder):
    tokenizer, model = hf_minilm
    llm = LLM(minilm_folder)
    raw = llm.embed(SENTENCES[:2], pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    ref = hf_sentence_embeddings(tokenizer, model, SENTENCES[:2], normalize=False)
    for out, expected in zip(raw, ref, strict=True):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidArgumentError, match="Matryoshka") as info:
        llm.embed("hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    assert info.value.param == "dimensions"

    # A Matryoshka model (config.json matryoshka_dimensions): the first d values, renormalised.
    folder = make_tiny_encoder(tmp_path / "mrl", pooling="mean", normalize=True, matryoshka=[16, 32])
    mrl = LLM(folder)
    full, short = mrl.encode(["the quick brown fox", "the quick brown fox"],
                             [PoolingParams(), PoolingParams(dimensions=16)], use_tqdm=False)
    head = full.outputs.data[:16]
    np.testing.assert_allclose(short.outputs.data, head / np.linalg.norm(head), atol=1e-6)
    with pytest.raises(InvalidArgumentError, match=r"\[16, 32\]") as info:
        mrl.embed("fox", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    assert info.value.param == "dimensions"


def test_pooler_config_overrides_the_folder(minilm_folder, hf_minilm):
    tokenizer, model = hf_minilm
    llm = LLM(minilm_folder, pooler_config={"pooling_type": "cls", "normalize": False})
    outs = llm.embed(SENTENCES[:2], use_tqdm=False)
    ref = hf_sentence_embeddings(tokenizer, model, SENTENCES[:2], pooling="cls", normalize=False)
    for out, expected in zip(outs, ref, strict=True):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="pooler_config: softmax not supported"):
        LLM(minilm_folder, pooler_config={"softmax": True})


def test_bad_prompts_and_runners_are_refused_by_name(minilm_folder, tmp_path):
    llm = LLM(minilm_folder)
    with pytest.raises(PromptTooLongError, match="256 tokens") as info:
        llm.embed("word " * 300, use_tqdm=False)
    assert info.value.param == "prompt"
    assert len(llm.embed({"prompt_token_ids": [101] + [2000] * 254 + [102]}, use_tqdm=False)) == 1  # exactly 256
    with pytest.raises(InvalidArgumentError, match="must not be empty"):
        llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        llm.embed([[101, 40000, 102]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len: 512 is more than this pooling model takes"):
        LLM(minilm_folder, max_model_len=512)
    with pytest.raises(ValueError, match="max_num_batched_tokens: 128 is less than max_model_len"):
        LLM(minilm_folder, max_num_batched_tokens=128)
    generator = LLM(tiny_models.make_tiny_llama(tmp_path / "llama"))
    with pytest.raises(InvalidArgumentError, match="runner 'generate'") as info:
        generator.embed("hello", use_tqdm=False)
    assert info.value.param == "runner"
