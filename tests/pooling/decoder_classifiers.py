"""Tiny random decoder sequence classifiers (transformers' Llama/Mistral/Qwen2/Qwen3/Gemma2
*ForSequenceClassification, saved with save_pretrained beside tests/helpers/tiny_models.py's byte-level BPE
tokenizer) and transformers' logits of token-id prompts, one prompt at a time (no padding: the last token is
the one the head reads, as in ferrox)."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.helpers import tiny_models

# family -> (config class, model class, config fields of the family).
DECODER_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForSequenceClassification", {}),
    "mistral": ("MistralConfig", "MistralForSequenceClassification", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification", {"head_dim": 32}),
    "gemma2": ("Gemma2Config", "Gemma2ForSequenceClassification", {
        "head_dim": 32, "sliding_window": 128, "max_position_embeddings": 256, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "hidden_activation": "gelu_pytorch_tanh"}),
}
PAD_TOKEN_ID = 0  # <|endoftext|>: no text prompt of the tests encodes to it, and no id prompt holds it


def make_tiny_decoder_classifier(folder, *, family: str = "llama", num_labels: int = 1, seed: int = 0,
                                 config_extra: dict[str, Any] | None = None) -> str:
    """A random 2-layer *ForSequenceClassification folder; pad_token_id set, as transformers needs one to find
    the last token of a padded batch. Norms, Qwen2's q/k/v biases and the score head are spread wider than
    transformers' init so the labels and the prompts score apart."""
    import transformers

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    config_name, model_name, fields = DECODER_FAMILIES[family]
    tok = tiny_models.build_tokenizer()
    params = tiny_models._common(tok, 64, 2, 4, 2, 128, 2048, family == "gemma2")
    params.update(fields)
    params["pad_token_id"] = PAD_TOKEN_ID
    params.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    config = getattr(transformers, config_name)(**params, num_labels=num_labels)
    if num_labels > 1:
        config.id2label = {i: f"class_{i}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    for key, value in (config_extra or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    tiny_models._randomize_norms(model)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.normal_(0.0, 0.1)
    return tiny_models._save(folder, model, tok, max_shard_size=None, generation=None)


@torch.inference_mode()
def hf_decoder_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' logits [n, num_labels], each prompt alone (its last token is not the pad token)."""
    return torch.cat([model(input_ids=torch.tensor([p])).logits.float() for p in prompts])
