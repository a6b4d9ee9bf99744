"""Tokenizers rebuilt from GGUF metadata, for tokenizer kinds the embedded model does not cover:
SentencePiece-style ("llama": scores, byte fallback, no merges stored) and byte-level BPE ("gpt2")
with the llama3 and qwen2 split regexes. Each must encode like transformers' tokenizer loaded
from the same GGUF file."""

from __future__ import annotations

import numpy as np
import pytest
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer

from tests.helpers import tiny_models

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEXTS = [
    "The quick brown fox", " leading space", "Paris  is\nthe capital 123 45678", "héllo wörld café ✓ 東京 🙂",
    "x <s> y </s> z", "", "don't STOP   now\t\ttabs\r\n", "<|im_start|>user\nhi<|im_end|>",
]


def _writer(path, tokenizer_model: str, tokens, types, **extra):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if "scores" in extra:
        w.add_token_scores(extra["scores"])
    if "merges" in extra:
        w.add_token_merges(extra["merges"])
    if "pre" in extra:
        w.add_tokenizer_pre(extra["pre"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(extra.get("add_bos", False))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _assert_same_as_transformers(path):
    folder, name = str(path).rsplit("/", 1)
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ours = load_tokenizer(resolve_model(str(path)))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    return ours


def test_sentencepiece_gguf(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    # Train SentencePiece-like pieces ("▁" for spaces); store them the way llama.cpp does:
    # <unk> <s> </s>, 256 byte tokens, then pieces with score = -rank and no merges.
    sp = Tokenizer(models.BPE())
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    sp.train_from_iterator(tiny_models._CORPUS, trainer=trainers.BpeTrainer(vocab_size=300, show_progress=False))
    vocab = sp.get_vocab()
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(sorted(vocab, key=vocab.get)):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank))
    path = _writer(tmp_path / "sp.gguf", "llama", tokens, types, scores=scores, add_bos=True)
    ours = _assert_same_as_transformers(path)
    assert ours.encode("hi")[0] == 1  # add_bos_token
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2]


# ("smollm" is covered by the embedded model's test: ferrox splits digits one by one as the original
# SmolLM tokenizer and llama.cpp do, transformers does not; the real vocabulary has no multi-digit
# tokens, so both agree there, but not on this test vocabulary trained with GPT-2's split.)
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2", "gpt-4o", "tekken"])
def test_byte_level_gguf_split_regexes(tmp_path, pre):
    bpe = tiny_models.build_tokenizer(vocab_size=400)
    vocab = bpe.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    import json

    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(bpe.to_str())["model"]["merges"]]
    types = [3 if t in tiny_models.SPECIAL_TOKENS else 1 for t in tokens]
    path = _writer(tmp_path / f"{pre}.gguf", "gpt2", tokens, types, merges=merges, pre=pre)
    ours = _assert_same_as_transformers(path)
    assert ours.encode("<|im_start|>")[0] == tokens.index("<|im_start|>")
