"""The sequence classifiers (ferrox/models/bert_classifier.py: cross-encoder rerankers) against transformers'
AutoModelForSequenceClassification on the same weights, for BERT, RoBERTa and XLM-RoBERTa: pairs read as one
sequence in the tokenizer's pair encoding (BERT's token types 0 then 1), single texts, ragged batches in one
engine step, and the activations (a sigmoid of the one logit by default)."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, PoolingParams

from tests.pooling.conftest import CLASSIFIER_FAMILIES, hf_classifier_logits, make_tiny_classifier

transformers = pytest.importorskip("transformers")

FAMILIES = list(CLASSIFIER_FAMILIES)
QUERY = "where is paris"
# Unequal lengths: one engine step holds them all, so the encoder's padded attention path runs.
DOCUMENTS = ["paris is the capital of france", "hi", "the quick brown fox jumps over the lazy dog", "a man is eating food"]
RAW = PoolingParams(use_activation=False)


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory) -> dict:
    """family -> (LLM, transformers model, pad id) on one tiny random reranker (num_labels 1) each."""
    out = {}
    for family in FAMILIES:
        folder = make_tiny_classifier(tmp_path_factory.mktemp(family), family=family)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
        assert type(model).__name__ == CLASSIFIER_FAMILIES[family][1]
        out[family] = (LLM(folder), model, 0 if family == "bert" else 1)
    return out


def _types(ids: list[int], start: int | None) -> list[int]:
    return [0] * len(ids) if start is None else [0] * start + [1] * (len(ids) - start)


@pytest.mark.parametrize("family", FAMILIES)
def test_pair_scores_match_transformers(classifiers, family):
    """1:N and N:N pairs: ferrox's logits (use_activation off) and default scores (their sigmoid) equal
    transformers' on the same pair encoding; the engine ran as many requests as pairs."""
    llm, model, pad = classifiers[family]
    tokenizer = llm.get_tokenizer()
    pairs = [(QUERY, d) for d in DOCUMENTS]
    encoded = tokenizer.encode_pairs(pairs)
    expected = hf_classifier_logits(model, [ids for ids, _ in encoded], [_types(*e) for e in encoded], pad)[:, 0]
    raw = llm.score(QUERY, DOCUMENTS, use_tqdm=False, pooling_params=RAW)
    assert [o.prompt_token_ids for o in raw] == [ids for ids, _ in encoded]
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in raw]), expected, atol=2e-5, rtol=1e-4)
    scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in scores]), torch.sigmoid(expected), atol=1e-5,
                               rtol=1e-4)
    assert len({round(o.outputs.score, 4) for o in scores}) == len(DOCUMENTS)  # the documents really differ
    pairwise = llm.score(DOCUMENTS[:2], [QUERY, QUERY], use_tqdm=False, pooling_params=RAW)
    encoded = tokenizer.encode_pairs([(DOCUMENTS[0], QUERY), (DOCUMENTS[1], QUERY)])
    expected = hf_classifier_logits(model, [ids for ids, _ in encoded], [_types(*e) for e in encoded], pad)[:, 0]
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairwise]), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_texts_classify_like_transformers(classifiers, family):
    llm, model, pad = classifiers[family]
    outs = llm.classify(DOCUMENTS, use_tqdm=False, pooling_params=RAW)
    expected = hf_classifier_logits(model, [o.prompt_token_ids for o in outs], None, pad)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), expected, atol=2e-5, rtol=1e-4)
    probs = llm.classify(DOCUMENTS, use_tqdm=False)
    assert all(o.outputs.num_classes == 1 for o in probs)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in probs]), torch.sigmoid(expected), atol=1e-5,
                               rtol=1e-4)


def test_pair_encodings_are_the_tokenizers(classifiers):
    """BERT: transformers' tokenizer(text, text_pair), ids and token types; RoBERTa / XLM-R: <s> a </s></s> b </s>
    (their one-row token-type table makes types moot, so none are carried)."""
    bert = classifiers["bert"][0].get_tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(classifiers["bert"][0].config.model)
    # A first text holding the [SEP] token is still typed 0 up to the pair's own separator.
    for query, doc in [(QUERY, d) for d in DOCUMENTS] + [("paris [SEP] city", "a man")]:
        ((ids, start),) = bert.encode_pairs([(query, doc)])
        ref = hf(query, doc)
        assert ids == ref["input_ids"] and _types(ids, start) == ref["token_type_ids"]
    for family in ("roberta", "xlm-roberta"):
        tokenizer = classifiers[family][0].get_tokenizer()
        a, b = tokenizer.encode(QUERY), tokenizer.encode(DOCUMENTS[0])
        ((ids, _),) = tokenizer.encode_pairs([(QUERY, DOCUMENTS[0])])
        assert a[0] == 0 and a[-1] == 2 and ids == a + [2] + b[1:]
        assert not classifiers[family][0].engine.runner.model.uses_token_types


def test_bert_token_types_change_the_score(classifiers):
    """The same pair with all-zero token types scores differently in transformers; ferrox gives the typed
    score, also when a pair shares its step with single texts (types built per request)."""
    llm, model, pad = classifiers["bert"]
    ((ids, start),) = llm.get_tokenizer().encode_pairs([(QUERY, DOCUMENTS[0])])
    typed = float(hf_classifier_logits(model, [ids], [_types(ids, start)], pad)[0, 0])
    untyped = float(hf_classifier_logits(model, [ids], None, pad)[0, 0])
    # (well above the 2e-5 the scores are compared at below; the margin itself depends on the random weights)
    assert abs(typed - untyped) > 1e-3
    (out,) = llm.score(QUERY, DOCUMENTS[0], use_tqdm=False, pooling_params=RAW)
    assert out.outputs.score == pytest.approx(typed, abs=2e-5)
    # One step of the pair with its types, the same ids without, and a single text: each row gets its own.
    params = [PoolingParams(use_activation=False, second_text_start=start), RAW, RAW]
    outs = llm.encode([ids, ids, DOCUMENTS[1]], params, use_tqdm=False)
    assert [float(o.outputs.data[0]) for o in outs[:2]] == pytest.approx([typed, untyped], abs=2e-5)
