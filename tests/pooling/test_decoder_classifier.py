"""Decoder sequence classifiers (ferrox/models/decoder_classifier.py: reward models, decoder rerankers) against
transformers' AutoModelForSequenceClassification on the same weights, for Llama, Mistral, Qwen2, Qwen3 and
Gemma 2 with 1 and 3 labels: ragged prompts in one engine step (the head reads each request's last token),
the activations, LLM.score's pair prompts (the tokenizer's pair encoding, or the texts joined when config.json
sets use_pad_token false, as vLLM does), and the refusals, by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from ferrox import LLM, PoolingParams
from ferrox.errors import InvalidArgumentError, ModelLoadError

from tests.pooling.decoder_classifiers import (
    DECODER_FAMILIES,
    PAD_TOKEN_ID,
    hf_decoder_logits,
    make_tiny_decoder_classifier,
)

transformers = pytest.importorskip("transformers")

FAMILIES = list(DECODER_FAMILIES)
LABELS = (1, 3)
# Unequal lengths in one step: a request's last row is not at a fixed offset.
PROMPTS = [[5, 9, 11, 40], list(range(3, 60)), [7], list(range(100, 130))]
QUERY = "Where is Paris?"
DOCUMENTS = ["Paris is the capital of France.", "Hello world!", "The quick brown fox jumps over the lazy dog."]
RAW = PoolingParams(use_activation=False)


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory) -> dict:
    """(family, num_labels) -> (LLM, transformers model) on one tiny random classifier each."""
    out = {}
    for family in FAMILIES:
        for n in LABELS:
            folder = make_tiny_decoder_classifier(tmp_path_factory.mktemp(f"{family}{n}"), family=family,
                                                  num_labels=n, seed=n)
            model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
            assert type(model).__name__ == DECODER_FAMILIES[family][1]
            out[family, n] = (LLM(folder, max_num_seqs=8), model.eval())
    return out


@pytest.mark.parametrize("n", LABELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(classifiers, family, n):
    """Token-id prompts of four lengths in one step: the logits (use_activation off) equal transformers' of
    each prompt's last token; the default scores are their sigmoid (one label) or softmax (three), and the
    labels are config.json's id2label."""
    llm, model = classifiers[family, n]
    assert llm.engine.pooler_config.pooling_type == "LAST" and llm.engine.pooler_config.task == "classify"
    assert not any(PAD_TOKEN_ID in p for p in PROMPTS)
    expected = hf_decoder_logits(model, PROMPTS)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    raw = llm.classify(prompts, use_tqdm=False, pooling_params=RAW)
    got = torch.tensor([o.outputs.probs for o in raw])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert len({round(float(x), 3) for x in got[:, 0]}) == len(PROMPTS)  # the prompts really score apart
    probs = torch.tensor([o.outputs.probs for o in llm.classify(prompts, use_tqdm=False)])
    activated = torch.sigmoid(expected) if n == 1 else torch.softmax(expected, dim=-1)
    torch.testing.assert_close(probs, activated, atol=1e-5, rtol=1e-4)
    assert llm.engine.pooler_config.labels == ([f"class_{i}" for i in range(n)] if n > 1 else ["LABEL_0"])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_texts_classify_like_transformers(classifiers, family):
    llm, model = classifiers[family, 3]
    outs = llm.classify(DOCUMENTS, use_tqdm=False, pooling_params=RAW)
    tokenizer = transformers.AutoTokenizer.from_pretrained(llm.config.model)
    assert [o.prompt_token_ids for o in outs] == [tokenizer(d)["input_ids"] for d in DOCUMENTS]
    expected = hf_decoder_logits(model, [o.prompt_token_ids for o in outs])
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), expected, atol=2e-5, rtol=1e-4)


def test_score_reads_each_pair_as_one_sequence(classifiers):
    """LLM.score on a one-label model: each pair is transformers' tokenizer(text, text_pair) (this byte-level
    BPE adds no special tokens: the two token runs back to back), scored by its last token's logit and a
    sigmoid by default; 1:N and N:N."""
    llm, model = classifiers["qwen2", 1]
    tokenizer = transformers.AutoTokenizer.from_pretrained(llm.config.model)
    encoded = [tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS]
    expected = hf_decoder_logits(model, encoded)[:, 0]
    raw = llm.score(QUERY, DOCUMENTS, use_tqdm=False, pooling_params=RAW)
    assert [o.prompt_token_ids for o in raw] == encoded
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in raw]), expected, atol=2e-5, rtol=1e-4)
    scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in scores]), torch.sigmoid(expected), atol=1e-5,
                               rtol=1e-4)
    pairwise = llm.score(DOCUMENTS[:2], [QUERY, QUERY], use_tqdm=False, pooling_params=RAW)
    expected = hf_decoder_logits(model, [tokenizer(d, QUERY)["input_ids"] for d in DOCUMENTS[:2]])[:, 0]
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairwise]), expected, atol=2e-5, rtol=1e-4)
    with pytest.raises(InvalidArgumentError, match="3 labels"):
        classifiers["qwen2", 3][0].score(QUERY, DOCUMENTS, use_tqdm=False)


def test_a_bos_tokenizer_encodes_each_text_of_a_pair_with_its_bos(tmp_path):
    """tokenizer_config.json add_bos_token true over a tokenizer.json without it: ferrox rebuilds the
    post-processor as transformers does with that flag, pair template included (`<bos> a <bos> b`)."""
    folder = make_tiny_decoder_classifier(tmp_path / "bos", family="llama")
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**config, "add_bos_token": True}, f)
    llm = LLM(folder)
    # (transformers 5's generic fast tokenizer reads the flag as an argument, not from the file.)
    hf = transformers.AutoTokenizer.from_pretrained(folder, add_bos_token=True)
    ((ids, _),) = llm.get_tokenizer().encode_pairs([(QUERY, DOCUMENTS[0])])
    assert ids == hf(QUERY, DOCUMENTS[0])["input_ids"] and ids.count(hf.bos_token_id) == 2 and ids[0] == 1
    (out,) = llm.score(QUERY, DOCUMENTS[0], use_tqdm=False)
    assert out.prompt_token_ids == ids


def test_use_pad_token_false_joins_the_texts(tmp_path):
    """vLLM's "LLM as reranker" rule: config.json use_pad_token false makes a pair the string text_1 + text_2,
    encoded as one text."""
    folder = make_tiny_decoder_classifier(tmp_path / "joined", family="qwen3",
                                          config_extra={"use_pad_token": False})
    llm = LLM(folder)
    assert llm.engine.pooler_config.join_pair_texts
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    # A first text cut mid-word: joined, the word is one token again.
    first, seconds = "Paris is the cap", ["ital of France.", "ital letters", DOCUMENTS[1]]
    joined = [tokenizer(first + d)["input_ids"] for d in seconds]
    assert joined[0] != tokenizer(first, seconds[0])["input_ids"]
    outs = llm.score(first, seconds, use_tqdm=False, pooling_params=RAW)
    assert [o.prompt_token_ids for o in outs] == joined
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), hf_decoder_logits(model, joined)[:, 0],
                               atol=2e-5, rtol=1e-4)


def test_refusals_name_what_they_refuse(classifiers, tmp_path):
    llm, _ = classifiers["llama", 1]
    with pytest.raises(InvalidArgumentError, match="runner 'pooling'"):
        llm.generate(["hi"], use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="does not embed") as info:
        llm.embed(["hi"], use_tqdm=False)
    assert info.value.param == "task"
    folder = llm.config.model
    with pytest.raises(ValueError, match="runner: 'generate' cannot run LlamaForSequenceClassification: it is a "
                                         "sequence classifier"):
        LLM(folder, runner="generate")
    with pytest.raises(ValueError, match="pooler_config: .* reads the last token"):
        LLM(folder, pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="classifier_from_token.*method"):  # (tests/pooling/test_lm_head_classifier.py)
        LLM(folder, hf_overrides={"classifier_from_token": ["no", "yes"]})
    with pytest.raises(ModelLoadError, match="'score.weight': checkpoint shape \\(1, 64\\), model expects \\(2, 64\\)"):
        LLM(folder, hf_overrides={"id2label": {"0": "bad", "1": "good"}})
