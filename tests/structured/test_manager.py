"""StructuredOutputManager on the embedded SmolLM2 tokenizer, driven by random allowed tokens."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import llguidance
import llguidance.numpy as llg_np
import numpy as np
import pytest
import torch
from ferrox.structured.backend import validate_params
from ferrox.structured.manager import StructuredOutputManager
from ferrox.structured.params import StructuredOutputsParams as P

from .conftest import SMOLLM2_EOS, SMOLLM2_VOCAB
from .schemas import SCHEMAS
from .walk import random_walk

PADDED_VOCAB = SMOLLM2_VOCAB + 64  # logits wider than the tokenizer, as with padded embeddings


@pytest.fixture(scope="module")
def manager(tokenizer_json):
    m = StructuredOutputManager(tokenizer_json, PADDED_VOCAB, [SMOLLM2_EOS])
    yield m
    m.shutdown()


def ready(manager: StructuredOutputManager, ids: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    got: list[str] = []
    while set(got) != set(ids):
        assert time.monotonic() < deadline, f"grammars not ready: {set(ids) - set(got)}"
        manager.wait_for_pending(0.1)
        got += manager.poll_ready()
        assert not manager.take_failures()


def decode(manager: StructuredOutputManager, tokens: list[int]) -> str:
    return manager.tokenizer.decode_str(tokens)


def test_json_schemas_random_walk_parse_and_validate(manager):
    ids = []
    for name, schema in SCHEMAS.items():
        for k in range(3):
            manager.submit(f"{name}-{k}", P(json=schema))
            ids.append(f"{name}-{k}")
    ready(manager, ids)
    assert manager.cache_misses >= len(SCHEMAS)
    results = random_walk(manager, ids, SMOLLM2_EOS, seed=1, max_steps=300)
    for request_id, (tokens, finished) in results.items():
        text = decode(manager, tokens)
        assert finished, f"{request_id} did not finish: {text!r}"
        jsonschema.validate(json.loads(text), SCHEMAS[request_id.rsplit("-", 1)[0]])
    manager.free(ids)
    assert not manager.has_active()


LARK = """
start: pair ("," pair)?
pair: KEY "=" VALUE
KEY: /[a-z]{1,3}/
VALUE: /[0-9]{1,2}/ | "true" | "false"
"""
CHOICES = ['say "yes"', "no", "maybe ☂", "no way"]
CASES = {
    "regex": (P(regex=r"[0-9]{3}-[a-z]{2,4}"), r"[0-9]{3}-[a-z]{2,4}"),
    "choice": (P(choice=CHOICES), "|".join(re.escape(c) for c in CHOICES)),
    "lark": (P(grammar=LARK), r"[a-z]{1,3}=([0-9]{1,2}|true|false)(,[a-z]{1,3}=([0-9]{1,2}|true|false))?"),
    "gbnf": (P(grammar='root ::= "ab" [0-9] ("x" | "y")'), r"ab[0-9][xy]"),
}


def test_regex_choice_lark_gbnf_random_walk(manager):
    ids = [f"{name}-{k}" for name in CASES for k in range(5)]
    for request_id in ids:
        manager.submit(request_id, CASES[request_id.rsplit("-", 1)[0]][0])
    ready(manager, ids)
    results = random_walk(manager, ids, SMOLLM2_EOS, seed=2, max_steps=60)
    seen_choices = set()
    for request_id, (tokens, finished) in results.items():
        text = decode(manager, tokens)
        pattern = CASES[request_id.rsplit("-", 1)[0]][1]
        assert finished and re.fullmatch(pattern, text), f"{request_id}: {text!r}"
        if request_id.startswith("choice"):
            seen_choices.add(text)
    assert len(seen_choices) >= 2  # the walk is random: not always the same alternative
    manager.free(ids)


def allowed_ids(manager: StructuredOutputManager, request_id: str) -> set[int]:
    bitmask = manager.fill_bitmask([request_id])
    assert bitmask is not None
    logits = torch.zeros(1, manager.vocab_size)
    manager.apply_bitmask(logits, bitmask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_eos_allowed_exactly_when_grammar_accepts(manager):
    manager.submit("eos", P(regex="ab|abcd"))
    ready(manager, ["eos"])
    tok = manager.tokenizer
    a, b, c, d = (tok.tokenize_str(ch)[0] for ch in "abcd")
    assert SMOLLM2_EOS not in allowed_ids(manager, "eos")
    assert not manager.accept_tokens(["eos"], [a])[0]
    assert SMOLLM2_EOS not in allowed_ids(manager, "eos")
    assert not manager.accept_tokens(["eos"], [b])[0]
    allowed = allowed_ids(manager, "eos")  # "ab" matches, "abcd" may still come
    assert SMOLLM2_EOS in allowed and c in allowed and d not in allowed
    assert not manager.accept_tokens(["eos"], [c])[0]
    assert SMOLLM2_EOS not in allowed_ids(manager, "eos")
    # "abcd" is complete and nothing may follow: force_stop finishes the request with 'stop'.
    assert manager.accept_tokens(["eos"], [d])[0]
    assert allowed_ids(manager, "eos") == {SMOLLM2_EOS}
    manager.free(["eos"])


def test_padded_vocab_rows_and_free_batches(manager):
    manager.submit("c1", P(choice=["x", "y"]))
    ready(manager, ["c1"])
    assert manager.fill_bitmask(["free1", "free2"]) is None  # no constrained row: nothing to pay
    bitmask = manager.fill_bitmask(["free1", "c1", "free2"], np.array([True, True, True]))
    assert bitmask.shape == (3, (PADDED_VOCAB + 31) // 32) and bitmask.dtype == torch.int32
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()
    allowed = llg_np.allocate_token_bitmask(1, PADDED_VOCAB)
    bits = np.unpackbits(bitmask[1].numpy().view(np.uint8), bitorder="little")
    assert bits[SMOLLM2_VOCAB:].sum() == 0  # padded logits are never allowed
    assert bits.sum() >= 2 and allowed.shape[1] == bitmask.shape[1]
    # A partial prefill chunk (sample dropped) gets an all-ones row and its matcher does not move.
    assert manager.fill_bitmask(["c1"], np.array([False])) is None
    assert not manager.accept_tokens(["c1"], [12345], np.array([False]))[0]
    manager.free(["c1"])


def test_compile_cache_shares_grammar_not_matcher_state(manager):
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    hits = manager.cache_hits
    manager.submit("s1", P(json=schema))
    manager.submit("s2", P(json=json.dumps(schema)))  # same constraint as text: same cache entry
    ready(manager, ["s1", "s2"])
    assert manager.cache_hits == hits + 1
    brace = manager.tokenizer.tokenize_str("{")[0]
    manager.accept_tokens(["s1"], [brace])
    assert allowed_ids(manager, "s1") != allowed_ids(manager, "s2")
    manager.free(["s1", "s2"])


@pytest.mark.parametrize(
    ("params", "field", "fragment"),
    [
        (P(json={"type": "foo"}), "structured_outputs.json", "Invalid type"),
        (P(json='{"type": '), "structured_outputs.json", "not valid JSON"),
        (P(json={"properties": {"a": {"$ref": "#/nowhere"}}}), "structured_outputs.json", "nowhere"),
        (P(regex="[a-z"), "structured_outputs.regex", "unclosed character class"),
        (P(grammar="start: foo\n"), "structured_outputs.grammar", "unknown name"),
        (P(grammar='start: ( "a"'), "structured_outputs.grammar", "Expected token"),
    ],
)
def test_bad_constraints_fail_alone_with_llguidance_message(manager, params, field, fragment):
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        validate_params(params)
    assert fragment in str(info.value)
    manager.submit("bad", params)
    manager.submit("good", P(choice=["ok"]))
    deadline = time.monotonic() + 10
    failures, ready_ids = [], []
    while not failures or not ready_ids:
        assert time.monotonic() < deadline
        manager.wait_for_pending(0.1)
        ready_ids += manager.poll_ready()
        failures += manager.take_failures()
    assert ready_ids == ["good"] and [f[0] for f in failures] == ["bad"]
    assert failures[0][1].startswith(field) and fragment in failures[0][1]
    manager.free(["bad", "good"])


def test_params_contract_errors():
    with pytest.raises(ValueError, match="exactly one"):
        P(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="choice"):
        P(choice=[])


def test_bad_tokenizer_and_eos():
    with pytest.raises(ValueError, match="eos_token_ids"):
        StructuredOutputManager("{}", 10, [])
    with pytest.raises(ValueError, match="tokenizer_json"):
        StructuredOutputManager("not a tokenizer", 10, [0])


def test_llguidance_version():
    assert llguidance.__version__ >= "1"


def test_several_eos_ids_like_llama3(tokenizer_json):
    """Llama 3.x configs list several EOS ids; llguidance < 1.7 refused a list. Both ids must end a
    finished grammar, and neither may appear before it is finished."""
    second_eos = 0  # SmolLM2's <|endoftext|>; its EOS for chat is SMOLLM2_EOS
    m = StructuredOutputManager(tokenizer_json, PADDED_VOCAB, [SMOLLM2_EOS, second_eos])
    try:
        m.submit("r", P(choice=["yes"]))
        ready(m, ["r"])
        mask = m.fill_bitmask(["r"]).clone()
        bits = lambda t: bool((int(mask[0, t // 32]) >> (t % 32)) & 1)  # noqa: E731
        assert not bits(SMOLLM2_EOS) and not bits(second_eos)
        text_ids = m.tokenizer.tokenize_str("yes")
        for t in text_ids:
            assert not m.accept_tokens(["r"], [t])[0] or t == text_ids[-1]
        mask = m.fill_bitmask(["r"]).clone()
        assert bits(SMOLLM2_EOS) and bits(second_eos)
    finally:
        m.shutdown()


def test_thinking_budget_rows_in_every_fill_path(manager, tokenizer_json):
    """A spent thinking budget's row allows `</think>` alone in each path the engine fills masks by:
    fill_bitmask (CPU / synchronous), fill_rows (the CUDA mask gate's pinned rows), and the rows of
    a step that verifies drafts; a grammar beside it keeps its own row."""
    import tokenizers
    from ferrox.structured.bitmask import unpack_bitmask
    from ferrox.structured.thinking_budget import ThinkingBudget

    seven, eight = (tokenizers.Tokenizer.from_str(tokenizer_json).token_to_id(d) for d in "78")

    start, end = 100, 2047  # 2047 % 32 == 31: the word's sign bit
    manager.add_budget("b", ThinkingBudget(1, start, end, [5, start]))
    manager.submit("g", P(regex="[0-9]+"))
    ready(manager, ["g"])
    ids = ["free", "b", "g"]
    assert manager.is_constrained("b") and not manager.is_constrained("free")
    assert manager.fill_bitmask(ids) is not None
    assert manager.constrained_rows(ids) == [(manager._matchers["g"], 2)]  # one token left: not forced yet
    manager.accept_tokens(ids, np.array([1, 7, seven], dtype=np.int64))  # "b" thinks one token ("g" takes a digit)
    assert manager.constrained_rows(ids, [True, False, True]) == [(manager._matchers["g"], 2)]  # "b" not sampling
    rows = manager.constrained_rows(ids)
    assert [(e if isinstance(e, int) else "matcher", i) for e, i in rows] == [(end, 1), ("matcher", 2)]
    mask = manager.fill_bitmask(ids)
    allowed = unpack_bitmask(mask, PADDED_VOCAB)
    assert allowed[0].all() and allowed[1].nonzero().flatten().tolist() == [end]
    assert 0 < int(allowed[2].sum()) < 100  # the digits' tokens
    pinned = torch.empty((len(rows), manager.mask_words), dtype=torch.int32)
    manager.fill_rows([e for e, _ in rows], pinned)
    assert torch.equal(pinned[0], mask[1]) and torch.equal(pinned[1], mask[2])
    drafts = manager.fill_bitmask_with_drafts(ids, np.ones(3, dtype=np.bool_), np.array([2, 0, 0], dtype=np.int32),
                                              np.array([3, 4], dtype=np.int64))
    assert drafts.shape[0] == 5 and torch.equal(drafts[3], mask[1]) and (drafts[:3] == -1).all()
    manager.accept_tokens(ids, np.array([1, end, eight], dtype=np.int64))  # the forced `</think>`
    assert not manager.is_constrained("b") and manager.constrained_rows(["b"]) == []
    manager.free(ids)
    assert not manager.has_active()
