"""The whole engine path (tokenize -> Rust scheduler -> paged KV -> sampler -> detokenize) against
transformers on the same GGUF in float32: the same greedy tokens, the same logprobs."""

from __future__ import annotations

import math

import torch
from ferrox import SamplingParams

from tests.engine.prompts import PROMPTS, greedy_ids

MAX_TOKENS = 20


def _hf_greedy(hf_model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, attention_mask=None,
            pad_token_id=0, eos_token_id=None,
        )
    return out[0, len(prompt_ids):].tolist()


def test_greedy_matches_transformers(llm, hf_model):
    prompts = PROMPTS[:9]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts  # input order
    for out, ids in zip(outs, greedy_ids(outs), strict=True):
        assert len(ids) == MAX_TOKENS and out.outputs[0].finish_reason == "length"
        assert ids == _hf_greedy(hf_model, out.prompt_token_ids, MAX_TOKENS), out.prompt
        assert out.outputs[0].text == llm.get_tokenizer().decode(ids)


def test_logprobs_match_transformers(llm, hf_model):
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    sample = out.outputs[0]
    full = out.prompt_token_ids + sample.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].double(), dim=-1)
    n_prompt = len(out.prompt_token_ids)
    assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
    for i, (tok, lps) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        row = ref[n_prompt - 1 + i]
        assert math.isclose(lps[tok].logprob, row[tok].item(), abs_tol=2e-3)
        assert lps[tok].rank == 1  # greedy picks the top token
        top = torch.topk(row, 3).indices.tolist()
        assert set(top) <= set(lps)
        assert lps[tok].decoded_token == llm.get_tokenizer().decode([tok], skip_special_tokens=False)
    total = sum(lps[tok].logprob for tok, lps in zip(sample.token_ids, sample.logprobs, strict=True))
    assert math.isclose(sample.cumulative_logprob, total, abs_tol=1e-4)
    # prompt logprobs: None for the first token, then the log-prob of each prompt token given its prefix
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == n_prompt
    for pos in range(1, n_prompt):
        tok = out.prompt_token_ids[pos]
        entry = out.prompt_logprobs[pos]
        assert entry is not None and len(entry) >= 2
        assert math.isclose(entry[tok].logprob, ref[pos - 1, tok].item(), abs_tol=2e-3)


def test_chat_capital_of_france(llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # it ends by itself (EOS / <|im_end|>)
    two = llm.chat(
        [[{"role": "user", "content": "What is the capital of France?"}], [{"role": "user", "content": "Hi!"}]],
        params, use_tqdm=False,
    )
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_named_logprob_token_ids_match_transformers(llm, hf_model):
    # vLLM's logprob_token_ids: each generated position reports exactly these ids' logprobs (the model's
    # raw ones: not moved by the penalty) besides the sampled token's, in one batch with a top-N request.
    named = [0, 17, 4000, 49151, 17]
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True, logprob_token_ids=named,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)]
    outs = llm.generate(["The capital of France is", "def fibonacci(n):"], params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        sample = out.outputs[0]
        with torch.inference_mode():
            ids = out.prompt_token_ids + sample.token_ids
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1)
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids) == 5
        for i, (tok, lps) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
            row = ref[len(out.prompt_token_ids) - 1 + i]
            assert math.isclose(lps[tok].logprob, row[tok].item(), abs_tol=2e-3)
            assert lps[tok].rank == int((row > row[tok]).sum()) + 1 or math.isclose(
                row[tok].item(), row.max().item(), abs_tol=1e-4)
            if p.logprob_token_ids:
                assert set(lps) == set(named) | {tok}
                for t in set(named) - {tok}:
                    assert math.isclose(lps[t].logprob, row[t].item(), abs_tol=2e-3) and lps[t].rank is None
            else:
                assert set(lps) == set(torch.topk(row, 2).indices.tolist()) | {tok}
