"""A `tokenizers.Tokenizer` rebuilt from GGUF metadata (a GGUF has no tokenizer.json).

tokenizer.ggml.model says which kind:
  * "gpt2": byte-level BPE from `tokens` + `merges`; the split regex comes from tokenizer.ggml.pre
    (the name llama.cpp gives each model family's pre-tokenizer).
  * "llama": SentencePiece-style BPE with byte fallback (`tokens` + `scores`, merges given or
    derived from the scores), "▁" for spaces.
Tokens typed CONTROL become special added tokens, USER_DEFINED ones plain added tokens, so that
chat markers like <|im_start|> are matched whole.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ferrox.loader.errors import ModelLoadError, UnsupportedModelError

logger = logging.getLogger(__name__)

TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_BYTE = 1, 2, 3, 4, 6

# Split patterns by tokenizer.ggml.pre. Each is the regex the model family's original tokenizer used.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX = {
    "gpt-4o": _GPT4O, "llama4": _GPT4O, "tekken": _TEKKEN,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
}
# Families whose tokenizer splits every digit apart, then applies GPT-2's byte-level regex.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the alphabet byte-level vocabularies use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_gguf_tokenizer(gguf: Any) -> Tokenizer:
    meta = gguf.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = gguf.array("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise UnsupportedModelError(f"GGUF file {gguf.path} carries no tokenizer (tokenizer.ggml.model/tokens)")
    token_types = gguf.array("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(gguf, tokens, meta.get("tokenizer.ggml.pre", "default"))
    elif kind == "llama":
        tok = _sentencepiece_bpe(gguf, tokens, token_types, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    else:
        raise UnsupportedModelError(
            f"GGUF file {gguf.path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)"
        )
    _add_special_tokens(tok, kind, tokens, token_types)
    _set_post_processor(tok, meta, tokens)
    return tok


def _bpe(gguf: Any, vocab: dict[str, int], merges: list, **options: bool) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, **options)
    except Exception as e:  # the tokenizers package raises a bare Exception ("Token `x` out of vocabulary")
        raise ModelLoadError(f"GGUF file {gguf.path}: tokenizer.ggml.merges does not fit the vocabulary: {e}") from e


def _byte_level_bpe(gguf: Any, tokens: list[str], pre: str) -> Tokenizer:
    merges_raw = gguf.array("tokenizer.ggml.merges")
    if not merges_raw:
        raise UnsupportedModelError(f"GGUF file {gguf.path}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # Tokens outside the byte alphabet (rare: some special tokens) are spelled in it, as HF does.
        spelled = token if set(token) <= letters else "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, i)
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tok = Tokenizer(_bpe(gguf, vocab, merges, fuse_unk=False, byte_fallback=False))
    if pre in _SPLIT_REGEX:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:  # "gpt2", "default" and families llama.cpp maps to GPT-2's own regex
        if pre not in ("gpt2", "gpt-2", "default"):
            # transformers falls back the same way; say so, since the split may differ from the model's.
            logger.warning("GGUF file %s: pre-tokenizer %r is not known to ferrox; using GPT-2's split "
                           "(tokenization may differ from the original model)", gguf.path, pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(gguf: Any, tokens: list[str], token_types: list[int], add_space_prefix: bool) -> Tokenizer:
    scores = gguf.array("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    merges_raw = gguf.array("tokenizer.ggml.merges")
    if merges_raw:
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    else:
        merges = _merges_from_scores(vocab, scores)
    # No unk token: byte fallback spells anything outside the vocabulary as <0xNN> pieces.
    tok = Tokenizer(_bpe(gguf, vocab, merges, fuse_unk=True, byte_fallback=True))
    # "▁" stands for a space; one is prepended to the text's first piece unless it starts with one
    # (what transformers' Llama tokenizer does with a GGUF vocabulary).
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if add_space_prefix
                                                 else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE files store no merges: a token is a merge of two vocabulary pieces, and its
    score (higher = learned earlier) orders the merges."""
    found: list[tuple[float, int, str, str]] = []
    for token, idx in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[idx], vocab[left], left, right))
    found.sort(key=lambda item: (item[0], item[1]))
    return [(left, right) for _, _, left, right in found]


def _add_special_tokens(tok: Tokenizer, kind: str, tokens: list[str], token_types: list[int]) -> None:
    letters = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, token_types, strict=False)
        # A "control" token spelled outside the byte alphabet in a byte-level vocabulary is a
        # converter mislabel; adding it would create an id the model does not have.
        if ty == TOKEN_TYPE_CONTROL and (letters is None or set(t) <= letters)
    ]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, token_types, strict=False) if ty == TOKEN_TYPE_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def _set_post_processor(tok: Tokenizer, meta: dict[str, Any], tokens: list[str]) -> None:
    """BOS/EOS around an encoding when the file asks for them (add_special_tokens=True)."""
    kind = meta.get("tokenizer.ggml.model")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    single, special = ["$A"], []
    if add_bos and bos_id is not None:
        single.insert(0, tokens[int(bos_id)])
        special.append((tokens[int(bos_id)], int(bos_id)))
    if add_eos and eos_id is not None:
        single.append(tokens[int(eos_id)])
        special.append((tokens[int(eos_id)], int(eos_id)))
    if special:
        tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=special)
