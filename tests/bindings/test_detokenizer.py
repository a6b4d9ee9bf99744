"""The incremental detokenizer (ferrox._core.Detokenizer), compared with the `tokenizers`
package's full decode of the same ids."""

from __future__ import annotations

import random

import pytest
from ferrox._core import Detokenizer, InvalidArgumentError, TokenizerError

from .conftest import make_corpus

TEXTS = [
    "hello world, the answer is 42.",
    "héllo naïve café über — 日本語 中文字符 東京 한국어",
    "🦀🚀 emoji 👍🏽 and a family 👨‍👩‍👧 ∑∫√…",
    "line one\nline two\n\n  indented",
]


def stream(detok: Detokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    deltas = []
    for i in ids:
        delta, stop = detok.step(i)
        deltas.append(delta)
        if stop is not None:
            return deltas, stop
    deltas.append(detok.flush())
    return deltas, None


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_never_splits_a_char(byte_level_tokenizer, tokenizer_json, text):
    ids = byte_level_tokenizer.encode(text).ids
    d = Detokenizer(tokenizer_json)
    deltas, _ = stream(d, ids)
    assert "".join(deltas) == byte_level_tokenizer.decode(ids) == text
    assert d.output_text == text
    for delta in deltas:
        assert "\ufffd" not in delta


def test_multibyte_chars_split_across_tokens_are_held_until_complete(byte_level_tokenizer, tokenizer_json):
    # Feed the raw byte tokens of "🦀世" one at a time: only the completing byte yields text.
    vocab = byte_level_tokenizer.get_vocab()
    byte_to_char = {b: c for b, c in zip(range(256), _gpt2_chars(), strict=True)}
    ids = [vocab[byte_to_char[b]] for b in "🦀世".encode()]
    d = Detokenizer(tokenizer_json)
    deltas = [d.step(i)[0] for i in ids]
    assert deltas == ["", "", "", "🦀", "", "", "世"]


def _gpt2_chars() -> list[str]:
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, n = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


def test_random_ids_match_lossy_full_decode(byte_level_tokenizer, tokenizer_json):
    rng = random.Random(0)
    n = byte_level_tokenizer.get_vocab_size()
    for _ in range(20):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 60))]
        for skip in (True, False):
            d = Detokenizer(tokenizer_json, skip_special_tokens=skip)
            deltas, _ = stream(d, ids)
            assert "".join(deltas) == byte_level_tokenizer.decode(ids, skip_special_tokens=skip)


def test_skip_special_tokens(byte_level_tokenizer, tokenizer_json):
    text = "<|im_start|>user hello<|im_end|>"
    ids = byte_level_tokenizer.encode(text).ids
    assert byte_level_tokenizer.token_to_id("<|im_start|>") in ids
    kept, _ = stream(Detokenizer(tokenizer_json, skip_special_tokens=False), ids)
    skipped, _ = stream(Detokenizer(tokenizer_json, skip_special_tokens=True), ids)
    assert "".join(kept) == text
    assert "".join(skipped) == "user hello" == byte_level_tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens_is_trimmed_and_never_streamed(byte_level_tokenizer, tokenizer_json):
    text = "hello world, the answer is 42. and more text"
    ids = byte_level_tokenizer.encode(text).ids
    d = Detokenizer(tokenizer_json, stop=["answer is 4"])
    deltas, stop = stream(d, ids)
    assert stop == "answer is 4"
    assert "".join(deltas) == "hello world, the "
    assert d.output_text == "hello world, the "
    # The stop string covers several tokens, so some steps had to hold text back.
    assert len(byte_level_tokenizer.encode("answer is 4").ids) > 1


def test_include_stop_str_in_output(byte_level_tokenizer, tokenizer_json):
    ids = byte_level_tokenizer.encode("the capital of france is paris. the end").ids
    d = Detokenizer(tokenizer_json, stop=["paris", "france"], include_stop_str_in_output=True)
    deltas, stop = stream(d, ids)
    assert stop == "france"
    assert "".join(deltas) == "the capital of france"


def test_stop_string_with_multibyte_chars(byte_level_tokenizer, tokenizer_json):
    ids = byte_level_tokenizer.encode("café 日本語 東京 🦀 end").ids
    d = Detokenizer(tokenizer_json, stop=["本語 東"])
    deltas, stop = stream(d, ids)
    assert stop == "本語 東"
    assert "".join(deltas) == "café 日"
    assert all("\ufffd" not in x for x in deltas)


def test_held_prefix_is_released_when_no_stop_follows(byte_level_tokenizer, tokenizer_json):
    ids = byte_level_tokenizer.encode("the answer").ids
    d = Detokenizer(tokenizer_json, stop=["answer is"])
    deltas = [d.step(i)[0] for i in ids]
    assert "".join(deltas) in ("the ", "the")  # "answer" (and maybe its space) held back
    assert "".join(deltas) + d.flush() == "the answer"


def test_random_streams_with_stops_agree_with_a_reference(byte_level_tokenizer, tokenizer_json):
    """For random corpus lines and stop strings, the streamed result equals the full text
    truncated at the first occurrence of any stop string."""
    rng = random.Random(3)
    lines = make_corpus(60, seed=7)
    for line in lines:
        words = line.split()
        stops = [rng.choice(words)[: rng.randint(1, 6)] for _ in range(2)] if words else ["zz"]
        ids = byte_level_tokenizer.encode(line).ids
        full = byte_level_tokenizer.decode(ids)
        d = Detokenizer(tokenizer_json, stop=stops)
        deltas, stop = stream(d, ids)
        hits = [(full.find(s), s) for s in stops if full.find(s) >= 0]
        if hits:
            # Stops are checked as tokens arrive: the first stop string to be completed wins,
            # which is the one whose match ends first.
            end_first = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))
            assert stop is not None
            assert "".join(deltas) == full[: full.find(stop)]
            assert full.find(stop) + len(stop) == end_first[0] + len(end_first[1])
        else:
            assert stop is None and "".join(deltas) == full


def test_metaspace_tokenizer_stream_matches_full_decode(metaspace_tokenizer):
    js = metaspace_tokenizer.to_str()
    for text in ["hello world the answer", "café über naïve the model"]:
        ids = metaspace_tokenizer.encode(text).ids
        deltas, _ = stream(Detokenizer(js), ids)
        assert "".join(deltas) == metaspace_tokenizer.decode(ids) == text


def test_byte_fallback_tokenizer_streams_multibyte_text(byte_fallback_tokenizer):
    """Llama 2 style: CJK and emoji are spelled in <0xNN> byte pieces; each character appears
    once its last byte arrives, and the whole equals the full decode."""
    tok = byte_fallback_tokenizer
    js = tok.to_str()
    for text in TEXTS + ["the 東京 🦀 end", "日本"]:
        ids = tok.encode(text).ids
        assert any(tok.id_to_token(i).startswith("<0x") for i in ids) or text.isascii()
        d = Detokenizer(js)
        deltas, _ = stream(d, ids)
        assert "".join(deltas) == tok.decode(ids)
        assert all("\ufffd" not in x for x in deltas)
    # A byte run cut short by a text piece: one U+FFFD per byte, like the ByteFallback decoder.
    ids = [tok.token_to_id("<0xE6>"), tok.token_to_id("<0x97>"), tok.token_to_id("a")]
    deltas, _ = stream(Detokenizer(js), ids)
    assert "".join(deltas) == tok.decode(ids) == "\ufffd\ufffda"


def test_other_decoders_use_the_crates_streaming_decoder(wordpiece_tokenizer):
    js = wordpiece_tokenizer.to_str()
    for line in make_corpus(20, seed=5):
        ids = wordpiece_tokenizer.encode(line).ids
        deltas, _ = stream(Detokenizer(js), ids)
        assert "".join(deltas) == wordpiece_tokenizer.decode(ids)


def test_errors(tokenizer_json):
    with pytest.raises(TokenizerError, match="tokenizer_json"):
        Detokenizer("{not json")
    d = Detokenizer(tokenizer_json)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        d.step(10**6)
    with pytest.raises(TokenizerError):
        d.step(-1)
    with pytest.raises(InvalidArgumentError, match="stop"):
        Detokenizer(tokenizer_json, stop=[""])


def test_embedded_model_tokenizer_stream_matches_full_decode(smollm2_tokenizer):
    """The real target: SmolLM2's byte-level tokenizer takes the byte-table path, and a long
    stream of random ids (invalid UTF-8 included) decodes exactly like a full decode."""
    js = smollm2_tokenizer.to_str()
    rng = random.Random(1)
    ids = [rng.randrange(smollm2_tokenizer.get_vocab_size()) for _ in range(3000)]
    text = "Привет, мир! 你好，世界 🦀 <|im_start|>assistant\nThe capital of France is Paris.<|im_end|>"
    ids += smollm2_tokenizer.encode(text).ids
    for skip in (True, False):
        d = Detokenizer(js, skip_special_tokens=skip)
        deltas, _ = stream(d, ids)
        assert "".join(deltas) == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
