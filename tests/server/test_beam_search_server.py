"""`use_beam_search` on /v1/completions and /v1/chat/completions through the `openai` client (the shared
embedded-model server): n beams, best first, each beam's cumulative logprob the sum of its tokens'
logprobs as the server scores them one by one, and the beam scores in order; fields beam search would
not apply are refused by name. The search itself is checked against transformers in
tests/engine/test_beam_search.py."""

from __future__ import annotations

import openai
import pytest

MODEL = "smol"
PROMPT = "The best way to learn a language is"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def token_logprobs(client: openai.OpenAI, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """Each of `ids`' logprob after prompt_ids and the ids before it (the server's prompt_logprobs)."""
    resp = client.completions.create(model=MODEL, prompt=prompt_ids + ids, max_tokens=1,
                                     extra_body={"prompt_logprobs": 0})
    entries = resp.choices[0].model_extra["prompt_logprobs"]
    return [entries[len(prompt_ids) + i][str(t)]["logprob"] for i, t in enumerate(ids)]


def test_completions_beams_best_first(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=0,
                                     extra_body={"use_beam_search": True, "return_token_ids": True,
                                                 "length_penalty": 1.0})
    choices = resp.choices
    assert [c.index for c in choices] == [0, 1, 2]
    prompt_ids = choices[0].model_extra["prompt_token_ids"]
    beams = [c.model_extra["token_ids"] for c in choices]
    assert len({tuple(b) for b in beams}) == 3
    scores = []
    for choice, ids in zip(choices, beams, strict=True):
        assert choice.finish_reason in ("stop", "length")
        lps = token_logprobs(client, prompt_ids, ids)
        # The score's length leaves out a final end-of-sequence token.
        scores.append(sum(lps) / (len(prompt_ids) + len(ids) - (choice.finish_reason == "stop")))
        assert all(lp <= 0 for lp in lps)
    assert scores == sorted(scores, reverse=True), scores
    assert resp.usage.completion_tokens == sum(len(b) for b in beams)
    # Several prompts: n beams each, indexed prompt * n + beam.
    two = client.completions.create(model=MODEL, prompt=[PROMPT, "Paris is"], n=2, max_tokens=4, temperature=0,
                                    extra_body={"use_beam_search": True})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert all(c.text for c in two.choices) and two.choices[0].text != two.choices[1].text


def test_chat_beams(client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=8, temperature=0,
                                          extra_body={"use_beam_search": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.content for c in resp.choices)
    assert resp.choices[0].message.content != resp.choices[1].message.content


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": True}, "stream"),
    ({"top_p": 0.5}, "top_p"),
    ({"logprobs": 2}, "logprobs"),
    ({"stop": ["."]}, "stop"),
    ({"n": 11}, "n"),  # 2 * 11 logprobs a step: more than max_logprobs (20)
])
def test_fields_beam_search_would_not_apply_are_refused(client, extra, param):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2, "extra_body": {"use_beam_search": True}}
    body.update(extra)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**body)
    assert e.value.body["param"] == param, e.value.body


def test_length_penalty_needs_beam_search(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"length_penalty": 2.0})
    assert e.value.body["param"] == "length_penalty" and "beam search" in e.value.body["message"]
