"""A causal LM served as a classifier from its LM-head rows (pooling/seq_cls_conversion.py), with vLLM's
--hf-overrides for the original Qwen3-Reranker, against transformers' causal LM on the same weights:
from_2_way_softmax's logit is logit(true) - logit(false) at each prompt's last token, its score the sigmoid
(= the two tokens' softmax); no_post_processing gives each token's logit. Tied (embedding rows) and untied
(lm_head rows) checkpoints; the malformed settings refused by name."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, PoolingParams

from tests.helpers.tiny_models import build_tokenizer, make_tiny_llama, make_tiny_qwen3

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11, 40], list(range(3, 60)), [7], list(range(100, 130))]
RAW = PoolingParams(use_activation=False)


@pytest.fixture(scope="module")
def vocab() -> list[str]:
    tok = build_tokenizer()
    return [tok.id_to_token(i) for i in (150, 151, 200)]


@pytest.fixture(scope="module", params=["qwen3-tied", "llama-untied"])
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3-tied":
        return "Qwen3ForSequenceClassification", make_tiny_qwen3(path / "m", tie_word_embeddings=True, seed=4)
    return "LlamaForSequenceClassification", make_tiny_llama(path / "m", tie_word_embeddings=False, seed=5)


def _last_token_logits(folder: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS])


def test_lm_head_rows_make_the_classifier(folder, vocab):
    architecture, path = folder
    tok = build_tokenizer()
    ids = [tok.token_to_id(t) for t in vocab]
    logits = _last_token_logits(path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    two_way = LLM(path, max_num_seqs=8, hf_overrides={
        "architectures": [architecture], "classifier_from_token": vocab[:2], "is_original_qwen3_reranker": True})
    assert two_way.engine.pooler_config.labels == ["LABEL_0"]
    expected = (logits[:, ids[1]] - logits[:, ids[0]])[:, None]
    got = torch.tensor([o.outputs.probs for o in two_way.classify(prompts, use_tqdm=False, pooling_params=RAW)])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert len({round(float(x), 3) for x in got[:, 0]}) == len(PROMPTS)
    scores = torch.tensor([o.outputs.probs for o in two_way.classify(prompts, use_tqdm=False)])
    torch.testing.assert_close(scores[:, 0], torch.softmax(logits[:, ids[:2]], dim=-1)[:, 1], atol=1e-5, rtol=1e-4)

    each = LLM(path, max_num_seqs=8, hf_overrides={
        "architectures": [architecture], "classifier_from_token": vocab, "method": "no_post_processing"})
    got = torch.tensor([o.outputs.probs for o in each.classify(prompts, use_tqdm=False, pooling_params=RAW)])
    torch.testing.assert_close(got, logits[:, ids], atol=2e-5, rtol=1e-4)


def test_conversion_settings_refused_by_name(folder, vocab):
    architecture, path = folder
    base = {"architectures": [architecture]}
    cases = [
        ({"classifier_from_token": vocab[:1], "is_original_qwen3_reranker": True}, "is_original_qwen3_reranker"),
        ({"classifier_from_token": vocab, "method": "from_2_way_softmax"}, "takes two classifier_from_token"),
        ({"classifier_from_token": vocab[:2]}, "got None"),
        ({"classifier_from_token": ["no such token"], "method": "no_post_processing"}, "'no such token' is not a token"),
        ({"architectures": ["LlamaForCausalLM"], "classifier_from_token": vocab[:2], "method": "no_post_processing"},
         "architecture is LlamaForCausalLM"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(path, hf_overrides={**base, **overrides})


def test_convert_flag(folder, vocab):
    """vLLM's --convert: 'classify' names the family's classifier (the same scores as the architectures
    override), 'embed' pools a causal LM under runner auto (as runner 'pooling' does), and the conversions
    ferrox cannot make are refused by name."""
    architecture, path = folder
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = {"classifier_from_token": vocab[:2], "is_original_qwen3_reranker": True}
    by_flag = LLM(path, convert="classify", hf_overrides=tokens)
    by_override = LLM(path, hf_overrides={"architectures": [architecture], **tokens})
    assert by_flag.engine.pooler_config.task == "classify"
    assert [o.outputs.probs for o in by_flag.classify(prompts, use_tqdm=False)] == \
        [o.outputs.probs for o in by_override.classify(prompts, use_tqdm=False)]
    embed = LLM(path, convert="embed")
    assert embed.engine.pooler_config.task == "embed"
    assert [o.outputs.embedding for o in embed.embed(prompts[:2], use_tqdm=False)] == \
        [o.outputs.embedding for o in LLM(path, runner="pooling").embed(prompts[:2], use_tqdm=False)]
    refused = [({"convert": "classify", "hf_overrides": {"architectures": ["Phi3ForCausalLM"]}}, "Phi3ForCausalLM has none"),
               ({"convert": "embed", "hf_overrides": {"architectures": [architecture]}}, "is a sequence classifier"),
               ({"convert": "none", "runner": "pooling"}, "'none' keeps"),
               ({"convert": "embed", "runner": "generate"}, "runner is 'generate'")]
    for kwargs, message in refused:
        with pytest.raises(ValueError, match=message):
            LLM(path, **kwargs)
