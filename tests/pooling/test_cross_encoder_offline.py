"""LLM.score and LLM.classify on sequence classifiers: vLLM's output shapes, a multi-label classifier's softmax and
id2label, the activations config.json names (sentence-transformers' activation_fn, the older
sbert_ce_default_activation_function, problem_type), and the refusals, by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM, ClassificationRequestOutput, PoolingParams, ScoringRequestOutput
from ferrox.errors import InvalidArgumentError, PromptTooLongError, UnsupportedModelError

from tests.pooling.conftest import hf_classifier_logits, make_tiny_classifier

transformers = pytest.importorskip("transformers")

TEXTS = ["paris is the capital of france", "hi", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def three_labels(tmp_path_factory):
    """A BERT classifier of three labels (class_0..class_2) and transformers' model of it."""
    folder = make_tiny_classifier(tmp_path_factory.mktemp("three"), num_labels=3)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    return LLM(folder), model


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> LLM:
    return LLM(make_tiny_classifier(tmp_path_factory.mktemp("reranker"), seed=1))


def test_classify_softmax_over_labels(three_labels):
    llm, model = three_labels
    assert llm.engine.pooler_config.labels == ["class_0", "class_1", "class_2"]
    outs = llm.classify(TEXTS, use_tqdm=False)
    assert all(isinstance(o, ClassificationRequestOutput) and o.finished for o in outs)
    logits = hf_classifier_logits(model, [o.prompt_token_ids for o in outs])
    probs = torch.tensor([o.outputs.probs for o in outs])
    torch.testing.assert_close(probs, torch.softmax(logits, -1), atol=1e-5, rtol=1e-4)
    assert [o.outputs.num_classes for o in outs] == [3, 3, 3]
    # One prompt (a string) is a list of one; token ids are prompts as in embed().
    (one,) = llm.classify({"prompt_token_ids": outs[1].prompt_token_ids}, use_tqdm=False)
    assert one.outputs.probs == pytest.approx(outs[1].outputs.probs, abs=1e-6)
    # encode() gives the model's own output: the same scores, as an array.
    assert np.allclose(llm.encode(TEXTS[:1], use_tqdm=False)[0].outputs.data, outs[0].outputs.probs, atol=1e-6)


def test_a_multi_label_classifier_does_not_score_or_embed(three_labels):
    llm, _ = three_labels
    with pytest.raises(InvalidArgumentError, match="scoring needs one score per pair.*3 labels") as info:
        llm.score("a", "b", use_tqdm=False)
    assert info.value.param == "task"
    with pytest.raises(InvalidArgumentError, match="does not embed") as info:
        llm.embed(TEXTS, use_tqdm=False)
    assert info.value.param == "task"


def test_score_output_shape_and_refusals(reranker):
    outs = reranker.score("where is paris", TEXTS, use_tqdm=False)
    assert all(isinstance(o, ScoringRequestOutput) and o.finished for o in outs)
    assert len({o.request_id for o in outs}) == len(TEXTS) and all(0.0 < o.outputs.score < 1.0 for o in outs)
    cases = [
        (lambda: reranker.score("a", [[5, 6, 7]]), InvalidArgumentError, "data_2", "give a text"),
        (lambda: reranker.score("a", "b", pooling_params=PoolingParams(normalize=True)), InvalidArgumentError,
         "normalize", "sequence-classification model"),
        (lambda: reranker.score("a", "b", pooling_params=PoolingParams(dimensions=4)), InvalidArgumentError,
         "dimensions", "sequence-classification model"),
        (lambda: reranker.score(TEXTS[:2], TEXTS), InvalidArgumentError, "data_1", "2 texts against 3"),
        (lambda: reranker.score("a", ["fine", "word " * 80]), PromptTooLongError, "prompt",
         r"the pair data_1 \+ data_2\[1\] has"),
    ]
    for call, error, param, needle in cases:
        with pytest.raises(error, match=needle) as info:
            call()
        assert info.value.param == param
    assert reranker.score("a", "b", use_tqdm=False)[0].finished  # still serves


def test_an_embedding_model_does_not_classify(tiny_bert_folder):
    llm = LLM(tiny_bert_folder)
    with pytest.raises(InvalidArgumentError, match="embedding model: it does not support 'classify'") as info:
        llm.classify(["hi"], use_tqdm=False)
    assert info.value.param == "task"
    with pytest.raises(InvalidArgumentError, match="use_activation: applies to a sequence-classification model"):
        llm.embed(["hi"], use_tqdm=False, pooling_params=PoolingParams(use_activation=False))


@pytest.mark.parametrize(("extra", "score_fn", "classify_fn"), [
    # sentence-transformers v4+ (vLLM reads it): a raw-logit reranker; /classify keeps the sigmoid.
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity", "version": "4.0.1"}},
     lambda x: x, torch.sigmoid),
    # Older CrossEncoder exports (the MS MARCO MiniLM rerankers name Identity here).
    ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, torch.tanh, torch.sigmoid),
    # transformers' problem_type decides /classify's activation.
    ({"problem_type": "regression"}, torch.sigmoid, lambda x: x),
])
def test_config_activations(tmp_path, extra, score_fn, classify_fn):
    folder = make_tiny_classifier(tmp_path / "m", config_extra=extra)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(folder)
    (cls,) = llm.classify(TEXTS[:1], use_tqdm=False)
    logit = hf_classifier_logits(model, [cls.prompt_token_ids])[0]
    assert cls.outputs.probs == pytest.approx(classify_fn(logit).tolist(), abs=1e-5)
    ((ids, start),) = llm.get_tokenizer().encode_pairs([("a man", TEXTS[0])])
    pair_logit = hf_classifier_logits(model, [ids], [[0] * start + [1] * (len(ids) - start)])[0, 0]
    (out,) = llm.score("a man", TEXTS[0], use_tqdm=False)
    assert out.outputs.score == pytest.approx(float(score_fn(pair_logit)), abs=1e-5)


def test_unknown_activation_is_refused_by_name(tmp_path):
    folder = make_tiny_classifier(tmp_path / "m", config_extra={
        "sentence_transformers": {"activation_fn": "torch.nn.modules.activation.ReLU"}})
    with pytest.raises(UnsupportedModelError, match="sentence_transformers.activation_fn "
                                                    "'torch.nn.modules.activation.ReLU' is not supported"):
        LLM(folder)
