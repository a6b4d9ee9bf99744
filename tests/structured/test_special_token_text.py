"""Grammars whose text spells a special token (structured/guidance_vocab.py).

The Hugging Face tokenizer splits a special token's text out of any input, so llguidance forced such
text as the special token and then refused it: the request failed after the first forced token. The
text must be forced as text, and a grammar that names the special token must still get the token."""

from __future__ import annotations

import numpy as np
import pytest
from ferrox.structured.backend import compile_matcher, get_tokenizer, grammar_text
from ferrox.structured.guidance_vocab import special_tokens_by_id
from ferrox.structured.params import StructuredOutputsParams as P

from tests.helpers.tiny_models import EOS_TOKEN_ID, build_tokenizer

KIMI_SECTION = "<|tool_calls_section_begin|>"  # a special token past the trained vocabulary, as Kimi's


@pytest.fixture(scope="module")
def tok():
    from tokenizers import AddedToken

    t = build_tokenizer(qwen_tokens=True)  # <|im_start|> is special and in the BPE vocabulary (id 1)
    t.add_special_tokens([AddedToken(KIMI_SECTION, special=True, normalized=False)])
    return t


@pytest.fixture(scope="module")
def lt(tok):
    return get_tokenizer(tok.to_str(), tok.get_vocab_size(), [EOS_TOKEN_ID])


def allowed(matcher) -> list[int]:
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
    return [t for t in range(len(words) * 32) if (int(words[t // 32]) >> (t % 32)) & 1]


def generate(matcher, pick) -> list[int]:
    """Decode as the engine does: each step's mask, one allowed token (pick), until the grammar ends."""
    out: list[int] = []
    while not matcher.is_stopped() and len(out) < 64:
        mask = allowed(matcher)
        assert mask, matcher.get_error()
        token = pick(mask)
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    return out


@pytest.mark.parametrize("special", ["<|im_start|>", KIMI_SECTION])
def test_forced_text_spelling_a_special_token_is_text(tok, lt, special):
    text = f"x{special}y"
    regex = "x" + "".join("\\" + c if c in "|[]" else c for c in special) + "y"
    for params in (P(regex=regex), P(choice=[text]), P(json={"type": "string", "const": text})):
        matcher = compile_matcher(lt, grammar_text(params))
        # The lowest allowed id each step: the special token (1 / 390) would be first if it were allowed.
        tokens = generate(matcher, min)
        assert matcher.is_accepting() and tok.token_to_id(special) not in tokens
        decoded = tok.decode([t for t in tokens if t != EOS_TOKEN_ID], skip_special_tokens=True)
        assert decoded == (f'"{text}"' if params.json else text)


def test_a_grammar_naming_a_special_token_gets_the_token(tok, lt):
    sid = tok.token_to_id(KIMI_SECTION)
    matcher = compile_matcher(lt, grammar_text(P(grammar=f'start: "x" {KIMI_SECTION} "y"')))
    assert matcher.consume_token(tok.token_to_id("x")), matcher.get_error()
    assert allowed(matcher) == [sid]
    assert matcher.consume_token(sid), matcher.get_error()
    assert matcher.consume_token(tok.token_to_id("y")), matcher.get_error()
    assert matcher.is_accepting()
    # By id as well; and the text alone does not stand for it.
    matcher = compile_matcher(lt, grammar_text(P(grammar=f'start: "x" <[{sid}]> "y"')))
    assert matcher.consume_tokens([tok.token_to_id("x"), sid, tok.token_to_id("y")]), matcher.get_error()
    matcher = compile_matcher(lt, grammar_text(P(grammar=f'start: "x" {KIMI_SECTION} "y"')))
    matcher.consume_token(tok.token_to_id("x"))
    assert not matcher.consume_token(tok.token_to_id("<")), "a special token's text matched its name"


def test_unknown_special_names_are_refused_by_llguidance(lt):
    from ferrox.structured.backend import GrammarCompileError

    with pytest.raises(GrammarCompileError, match="structured_outputs.grammar"):
        compile_matcher(lt, grammar_text(P(grammar='start: "x" <|no_such_token|>')))


def test_special_names_rewritten_only_where_lark_reads_a_token():
    names = {"<|a|>": 7}
    lark = ('start: "<|a|>" <|a|> /<|a|>/ x  // <|a|> in a comment\n'
            'x: %json {"const": "<|a|>"} <|a|> # <|a|>\n<|b|>')
    assert special_tokens_by_id(lark, names) == (
        'start: "<|a|>" <[7]> /<|a|>/ x  // <|a|> in a comment\n'
        'x: %json {"const": "<|a|>"} <[7]> # <|a|>\n<|b|>')


def test_the_engine_writes_a_special_tokens_text_a_regex_forces(llm):
    """End to end on the embedded SmolLM2 (its GGUF-built tokenizer lists <|im_start|> both as a special
    token and in the vocabulary): the request used to end in an error after `Tag: `."""
    from ferrox import SamplingParams

    text = "Tag: <|im_start|> and <|im_end|> done"
    regex = text.replace("|", "\\|")
    (out,) = llm.generate(["Write a tag."], SamplingParams(temperature=0, max_tokens=40,
                                                           structured_outputs=P(regex=regex)))
    assert out.outputs[0].text == text
    assert out.outputs[0].finish_reason == "stop"
