"""vLLM's `bad_words`: words a request must not produce, as token sequences.

Each word is encoded twice, as written without leading whitespace and after one space (a word in the
middle of text), as vLLM does; the spaced form is kept only when it is a different token sequence of
the same length (a tokenizer that splits the space off would otherwise ban the space's token too).
The sampler then bans a one-token word's token at every step, and a longer word's last token at a step
whose output so far ends with the word's other tokens (worker/input_batch.py: the output only, not the
prompt, as vLLM's V1 sampler).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ferrox._core import InvalidArgumentError

if TYPE_CHECKING:
    from ferrox.sampling_params import SamplingParams

# vLLM's bounds on one request's bad words (its model runner's BadWordsState).
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024


def check_bad_words(words: Sequence[str]) -> None:
    if len(words) > MAX_BAD_WORDS:
        raise InvalidArgumentError(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}", param="bad_words")
    for w in words:
        if not isinstance(w, str) or not w.strip():
            raise InvalidArgumentError(f"bad_words: every word must be a non-empty string, got {w!r}",
                                       param="bad_words")


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]],
                        vocab_size: int) -> list[list[int]]:
    """The token sequences of `words` (encode: text -> ids without special tokens)."""
    sequences: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        sequences.append(bare)
        spaced = encode(" " + word.lstrip())
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    total = sum(len(s) for s in sequences)
    if total > MAX_BAD_WORDS_TOKENS:
        raise InvalidArgumentError(f"bad_words: {total} tokens in all; at most {MAX_BAD_WORDS_TOKENS}",
                                   param="bad_words")
    for s in sequences:
        if not s or max(s) >= vocab_size:
            raise InvalidArgumentError(f"bad_words: {s} is not a token sequence of this model's vocabulary "
                                       f"[0, {vocab_size})", param="bad_words")
    return sequences


def with_bad_words_token_ids(params: SamplingParams, encode: Callable[[str], list[int]],
                             vocab_size: int) -> SamplingParams:
    """params with bad_words encoded (bad_words_token_ids), unless there are none or they already are."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    return params.clone(bad_words_token_ids=bad_words_token_ids(params.bad_words, encode, vocab_size))
