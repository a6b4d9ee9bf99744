"""A `tokenizers.Tokenizer` with the ids and bytes of a Mistral tekken tokenizer (tekken.json), for the
Rust core's incremental detokenizer and llguidance, which both read a tokenizer.json.

Tekken is tiktoken's byte-level BPE. Ids: the special tokens first (0 .. num_special - 1: <unk>, <s>,
</s>, [INST]... then <SPECIAL_i> fillers), then the vocabulary in rank order (id = num_special + rank),
the first 256 ranks being the single bytes. tiktoken encodes a piece whole when it is a token, else
merges, again and again, the adjacent pair whose concatenation has the lowest rank. That is BPE with
every split of a token into two tokens as a merge, merges ordered by the merged token's rank, and
`ignore_merges` (a whole-token piece stays whole). The pre-tokenizer is the file's split pattern, then
GPT-2's byte-to-character spelling that byte-level vocabularies use.

mistral_common stays the encoder of text and chats (loader/mistral_tokenizer.py): this tokenizer decodes.
Its special tokens are matched in text as a tokenizer.json's are (mistral_common encodes them as text), so
its encode agrees with mistral_common's on text that spells no special token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ferrox.loader.errors import ModelLoadError
from ferrox.loader.gguf_tokenizer import _bytes_to_unicode


def build_tekken_tokenizer(specials: Sequence[str], vocab: Sequence[bytes], pattern: str, *,
                           kept_in_text: Iterable[str] = (), bos: str | None = None,
                           where: str = "tekken.json") -> Tokenizer:
    """specials: the special tokens' strings by id; vocab: the regular tokens' bytes by rank; pattern: the
    split regex. kept_in_text: specials that decoding keeps under skip_special_tokens (vLLM keeps Mistral's
    [TOOL_CALLS], [ARGS], [THINK], [/THINK] for the tool and reasoning parsers): added as non-special tokens.
    bos: prepended by encode(add_special_tokens=True), as mistral_common's encode(bos=True)."""
    spell = _bytes_to_unicode()
    num_special = len(specials)
    pieces = ["".join(spell[b] for b in token) for token in vocab]
    ids: dict[str, int] = {}
    for rank, piece in enumerate(pieces):
        if ids.setdefault(piece, num_special + rank) != num_special + rank:
            raise ModelLoadError(f"{where}: vocabulary rank {rank} repeats token {vocab[rank]!r}")
    for i, name in enumerate(specials):
        if name in ids:  # a regular token spelled like a special one: one string, two ids
            raise ModelLoadError(f"{where}: special token {name!r} (id {i}) is also a regular token (id "
                                 f"{ids[name]}); ferrox cannot give one string two ids")
        ids[name] = i
    tok = Tokenizer(models.BPE(ids, _merges(vocab, pieces), fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    kept = set(kept_in_text)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials if s not in kept])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in specials if s in kept])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, specials.index(bos))])
    return tok


def _merges(vocab: Sequence[bytes], pieces: Sequence[str]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ordered by the token's rank (then by the halves' ranks)."""
    rank_of = {token: rank for rank, token in enumerate(vocab)}
    merges: list[tuple[str, str]] = []
    for token in vocab:
        splits = []
        for cut in range(1, len(token)):
            left = rank_of.get(token[:cut])
            if left is not None and (right := rank_of.get(token[cut:])) is not None:
                splits.append((left, right))
        splits.sort()
        merges.extend((pieces[left], pieces[right]) for left, right in splits)
    return merges
