"""The BERT-family encoders (ferrox/models/bert.py) against transformers on the same weights: the
all-MiniLM-L6-v2 folder end to end (tokenizer, encoder, the folder's mean pooling + Normalize), every
token's hidden state on a flat batch of unequal prompts, and tiny random BERT / RoBERTa folders (the
pooling their modules.json declares, RoBERTa's position offset)."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM
from ferrox.errors import InvalidArgumentError
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.models.bert import BertModel

from tests.helpers.driver import StepRequest, build_step
from tests.pooling.conftest import SENTENCES, cosine, hf_sentence_embeddings, make_tiny_encoder


@pytest.fixture(scope="module")
def minilm_llm(minilm_folder):
    return LLM(minilm_folder)


def test_minilm_matches_sentence_transformers_computation(minilm_llm, hf_minilm):
    """One batch of sentences of different lengths: the same token ids as transformers' tokenizer
    ([CLS] ... [SEP], no padding, no truncation) and cosine >= 0.999 with its mean-pooled, normalised
    vectors (float32 on the CPU: ~1.0)."""
    tokenizer, model = hf_minilm
    outs = minilm_llm.embed(SENTENCES, use_tqdm=False)
    ref = hf_sentence_embeddings(tokenizer, model, SENTENCES)
    for text, out, expected in zip(SENTENCES, outs, ref, strict=True):
        assert out.prompt_token_ids == tokenizer(text)["input_ids"]
        assert len(out.outputs.embedding) == 384
        assert cosine(out.outputs.embedding, expected) >= 0.999
        assert torch.allclose(torch.tensor(out.outputs.embedding), expected, atol=1e-5)


@torch.inference_mode()
def test_every_token_matches_transformers_hidden_states(minilm_folder, hf_minilm):
    """The encoder alone on a flat batch (requests concatenated, as the runner gives it): unequal lengths
    (the padded attention path) and equal lengths (no padding) both give transformers' last hidden state."""
    tokenizer, model = hf_minilm
    source = resolve_model(minilm_folder)
    ours = load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")
    assert isinstance(ours, BertModel)
    for texts in (SENTENCES[:3], ["same length one", "same length two"]):
        _assert_hidden_rows_match(ours, model, [tokenizer(t)["input_ids"] for t in texts])


def test_tiny_bert_declared_cls_pooling_without_normalize(tiny_bert_folder):
    """modules.json declares CLS pooling and no Normalize module: the vector is the [CLS] row, as is;
    sentence_bert_config.json's max_seq_length caps max_model_len."""
    transformers = pytest.importorskip("transformers")
    llm = LLM(tiny_bert_folder)
    assert llm.engine.max_model_len == 48
    pooler = llm.engine.pooler_config
    assert (pooler.pooling_type, pooler.normalize) == ("CLS", False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_bert_folder)
    model = transformers.AutoModel.from_pretrained(tiny_bert_folder, dtype=torch.float32).eval()
    texts = ["the quick brown fox", "paris is the capital of france and a city"]
    outs = llm.embed(texts, use_tqdm=False)
    ref = hf_sentence_embeddings(tokenizer, model, texts, pooling="cls", normalize=False)
    for text, out, expected in zip(texts, outs, ref, strict=True):
        assert out.prompt_token_ids == tokenizer(text)["input_ids"]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=1e-4)
        assert abs(float(expected.norm()) - 1.0) > 1e-3  # really not normalised


@torch.inference_mode()
def test_tiny_roberta_positions_start_after_the_padding_index(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = make_tiny_encoder(tmp_path / "roberta", family="roberta", pooling=None, max_seq_length=None)
    source = resolve_model(folder)
    spec = load_model_spec(source)
    ours = load_model(source, spec, dtype=torch.float32, device="cpu")
    assert type(ours).max_positions(spec) == 64  # 66 positions, the first two reserved (pad_token_id 1)
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    _assert_hidden_rows_match(ours, model, [[0, 7, 9, 30, 2], list(range(5, 64))])
    llm = LLM(folder)  # no modules.json: vLLM's default for an encoder, CLS + normalize
    assert (llm.engine.pooler_config.pooling_type, llm.engine.pooler_config.normalize) == ("CLS", True)
    assert llm.engine.max_model_len == 64


def test_an_encoder_cannot_generate(minilm_folder, minilm_llm):
    with pytest.raises(ValueError, match="runner: 'generate' cannot run BertModel"):
        LLM(minilm_folder, runner="generate")
    with pytest.raises(InvalidArgumentError, match="runner 'pooling'") as info:
        minilm_llm.generate(["Hello"], use_tqdm=False)
    assert info.value.param == "runner"


def _assert_hidden_rows_match(ours, model, prompts: list[list[int]]) -> None:
    """The prompts as one flat step through ferrox: each request's rows equal transformers' run of it alone."""
    input_ids, positions, meta = build_step([StepRequest(p, 0, [0]) for p in prompts], 1024)
    hidden = ours.forward(input_ids, positions, [], meta)
    start = 0
    for ids in prompts:
        expected = model(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(hidden[start:start + len(ids)], expected, atol=2e-5, rtol=1e-4)
        start += len(ids)
