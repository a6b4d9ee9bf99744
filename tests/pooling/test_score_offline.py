"""LLM.score on all-MiniLM-L6-v2 (vLLM's offline scoring for an embedding model): 1:N and N:N against the
cosine similarity of transformers' embeddings, vLLM's output shape, every distinct prompt embedded once in
one engine pass, and the refusals, by name."""

from __future__ import annotations

import numpy as np
import pytest
from ferrox import LLM, ScoringRequestOutput
from ferrox.errors import InvalidArgumentError, PromptTooLongError
from ferrox.pooling.params import PoolingParams

from tests.pooling.conftest import SENTENCES, hf_sentence_embeddings


@pytest.fixture(scope="module")
def llm(minilm_folder) -> LLM:
    return LLM(minilm_folder)


def _reference(hf_minilm, texts_1: list[str], texts_2: list[str]) -> list[float]:
    tokenizer, model = hf_minilm
    a = hf_sentence_embeddings(tokenizer, model, texts_1).double()
    b = hf_sentence_embeddings(tokenizer, model, texts_2).double()
    return (a * b).sum(-1).tolist()


def _prompt_tokens(llm: LLM) -> int:
    return llm.engine.stats()["num_prompt_tokens"]


def test_one_against_many_matches_transformers(llm, hf_minilm):
    """1:N: data_1 against every data_2, in order; data_1 is also among data_2 and is embedded once (the
    engine computes each distinct prompt's tokens once, in one pass)."""
    tokenizer, _ = hf_minilm
    before = _prompt_tokens(llm)
    outs = llm.score(SENTENCES[0], SENTENCES, use_tqdm=False)
    assert _prompt_tokens(llm) - before == sum(len(tokenizer(t)["input_ids"]) for t in SENTENCES)
    assert all(isinstance(o, ScoringRequestOutput) and o.finished for o in outs)
    np.testing.assert_allclose([o.outputs.score for o in outs],
                               _reference(hf_minilm, [SENTENCES[0]] * len(SENTENCES), SENTENCES), atol=1e-5)
    # vLLM's shape of a pair: "<id 1>_<id 2>", the first prompt's tokens, the pad token, the second's.
    ids = [tokenizer(t)["input_ids"] for t in SENTENCES]
    for out, second in zip(outs, ids, strict=True):
        assert out.prompt_token_ids == ids[0] + [tokenizer.pad_token_id] + second
    assert len({o.request_id for o in outs}) == len(SENTENCES) and all("_" in o.request_id for o in outs)
    # A list of one is 1:N too; token ids are prompts as in embed().
    again = llm.score([{"prompt_token_ids": ids[0]}], SENTENCES[1:3], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in again], [o.outputs.score for o in outs[1:3]], atol=1e-6)


def test_pairwise_matches_transformers(llm, hf_minilm):
    first, second = SENTENCES[:3], [SENTENCES[3], SENTENCES[4], SENTENCES[0]]
    outs = llm.score(first, second, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in outs], _reference(hf_minilm, first, second), atol=1e-5)
    # Normalising or not leaves a cosine as it is; `dimensions` reaches the pooling (MiniLM refuses it).
    raw = llm.score(first, second, use_tqdm=False, pooling_params=PoolingParams(normalize=False))
    np.testing.assert_allclose([o.outputs.score for o in raw], [o.outputs.score for o in outs], atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="Matryoshka") as info:
        llm.score(first, second, use_tqdm=False, pooling_params=PoolingParams(dimensions=8))
    assert info.value.param == "dimensions"


def test_refusals_name_the_argument(llm):
    cases = [
        (lambda: llm.score(SENTENCES[:2], SENTENCES[:3]), "data_1", "2 texts against 3 in data_2"),
        (lambda: llm.score([], SENTENCES[:1]), "data_1", "at least one text"),
        (lambda: llm.score("hi", []), "data_2", "at least one text"),
        (lambda: llm.score("hi", {"content": [{"type": "text", "text": "x"}]}), "data_2", "multimodal"),
        (lambda: llm.score("hi", "there", chat_template="{{ x }}"), "chat_template", "not supported"),
        (lambda: llm.score("hi", "there", tokenization_kwargs={"truncation": True}), "tokenization_kwargs", "not supported"),
        (lambda: llm.score("hi", "there", pooling_params=[PoolingParams()]), "pooling_params", "one PoolingParams"),
    ]
    for call, param, needle in cases:
        with pytest.raises(InvalidArgumentError, match=needle) as info:
            call()
        assert info.value.param == param
    with pytest.raises(PromptTooLongError, match=r"data_2\[1\] has"):
        llm.score("hi", ["fine", "word " * 300], use_tqdm=False)
    assert llm.score("hi", "hi", use_tqdm=False)[0].outputs.score == pytest.approx(1.0, abs=1e-6)  # still serves
