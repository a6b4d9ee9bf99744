"""Grammars behind a reasoning model's `</think>` (StructuredOutputManager's gate), and grammars over
a tokenizer whose tags are added tokens that are text (Qwen's `<tool_call>`, `<think>`)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from ferrox.structured.backend import compile_matcher, get_tokenizer, grammar_text
from ferrox.structured.guidance_vocab import SPECIAL_NAME_PREFIX, guidance_tokenizer_json
from ferrox.structured.manager import StructuredOutputManager
from ferrox.structured.params import StructuredOutputsParams as P
from ferrox.structured.tools import tool_choice_constraint

from tests.helpers.tiny_models import EOS_TOKEN_ID, QWEN_TEXT_TOKENS, build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(qwen_tokens=True)


@pytest.fixture(scope="module")
def ids(tok):
    return {t: tok.token_to_id(t) for t in QWEN_TEXT_TOKENS}


@pytest.fixture
def manager(tok):
    m = StructuredOutputManager(tok.to_str(), tok.get_vocab_size(), [EOS_TOKEN_ID])
    yield m
    m.shutdown()


def allowed(mask: torch.Tensor) -> list[int]:
    return [t for t in range(mask.shape[-1] * 32) if (int(mask.view(-1)[t // 32]) >> (t % 32)) & 1]


def ready(manager: StructuredOutputManager, request_ids: list[str]) -> None:
    deadline, got = time.monotonic() + 30, []
    while set(got) != set(request_ids):
        assert time.monotonic() < deadline
        manager.wait_for_pending(0.1)
        got += manager.poll_ready()
        assert not manager.take_failures()


def test_added_text_tokens_are_text_to_the_grammar(tok, ids):
    """The Hermes tool-call constraint begins with the text `<tool_call>`: the model's single
    `<tool_call>` token must be accepted (llguidance took every added token for a special one, allowed
    it from the forced text and then rejected it, failing every `tool_choice: "required"` request on a
    Qwen tokenizer)."""
    lt = get_tokenizer(tok.to_str(), tok.get_vocab_size(), [EOS_TOKEN_ID])
    required = tool_choice_constraint(TOOLS, "required", parallel_tool_calls=True).structured_outputs
    assert required is not None
    matcher = compile_matcher(lt, grammar_text(required))
    assert matcher.consume_token(ids["<tool_call>"]), matcher.get_error()
    text = '\n{"name": "f", "arguments": {"a": 1}}\n'
    for t in tok.encode(text).ids + [ids["</tool_call>"]]:
        assert matcher.consume_token(t), matcher.get_error()
    # ... and spelled out in characters it is the same text.
    matcher = compile_matcher(lt, grammar_text(P(regex="x<think>y")))
    for t in tok.encode("x").ids + tok.encode("<thi").ids + tok.encode("nk>y").ids:
        assert matcher.consume_token(t), matcher.get_error()
    assert matcher.is_accepting()
    # Special tokens stay special (their names hidden from text); only the added text tokens moved into
    # the vocabulary.
    rewritten, special = guidance_tokenizer_json(tok.to_str())
    added = {t["content"] for t in json.loads(rewritten)["added_tokens"]}
    assert added == {SPECIAL_NAME_PREFIX + t for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert set(special) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}


def test_gate_opens_at_the_end_of_thinking(manager, ids):
    end = ids["</think>"]
    manager.submit("gated", P(choice=["yes", "no"]), gate_token=end)
    manager.submit("plain", P(choice=["yes", "no"]))
    ready(manager, ["gated", "plain"])
    assert manager.is_constrained("gated") and manager.is_gated("gated")
    # Only the plain request's row is masked while the gated one thinks.
    mask = manager.fill_bitmask(["gated", "plain"])
    assert mask is not None
    assert len(allowed(mask[0])) >= manager.vocab_size - 31  # all ones
    assert len(allowed(mask[1])) < 10
    assert manager.fill_bitmask(["gated"]) is None  # a batch of thinking requests has no mask
    # Tokens of the thinking do not reach the grammar; </think> opens it (and is not the grammar's).
    thinking = manager.tokenizer.tokenize_str("hmm")
    stop = manager.accept_tokens(["gated"], np.array(thinking[:1]))
    assert not stop.any() and manager.is_gated("gated")
    manager.accept_tokens(["gated"], np.array([end]))
    assert not manager.is_gated("gated") and manager.is_constrained("gated")
    mask = manager.fill_bitmask(["gated"])
    assert mask is not None and len(allowed(mask[0])) < 10
    manager.free(["gated", "plain"])
    assert not manager.has_active()


def test_drafts_after_the_gate_token_are_dropped(manager, ids):
    """Verified drafts after `</think>` were sampled without the mask: the step keeps up to the gate
    token and the next step samples under the grammar."""
    end = ids["</think>"]
    manager.submit("r", P(regex="[0-9]+"), gate_token=end)
    ready(manager, ["r"])
    a = manager.tokenizer.tokenize_str("a")[0]
    num_sampled = np.array([4], dtype=np.int32)
    stop = manager.accept_tokens(["r"], np.array([a, end, a, a]), num_sampled=num_sampled)
    assert not stop.any()
    assert num_sampled.tolist() == [2]
    assert not manager.is_gated("r")
    manager.free(["r"])


def test_gated_request_freed_before_its_grammar_compiled(manager, ids):
    manager.submit("early", P(json={"type": "object"}), gate_token=ids["</think>"])
    manager.free(["early"])
    manager.wait_for_pending(1)
    assert manager.poll_ready() == []
    assert not manager.has_active()
