"""Which runner a model gets ("generate" or "pooling") and how a pooling model pools, read from its
folder the way sentence-transformers (and vLLM) read it:

    modules.json                 the module list: Transformer (""), Pooling ("1_Pooling"), Normalize
    1_Pooling/config.json        pooling_mode_mean_tokens / pooling_mode_cls_token / pooling_mode_lasttoken
    sentence_bert_config.json    max_seq_length: the longest input the model was trained for
    config.json                  matryoshka_dimensions / is_matryoshka (vLLM's reading)

Without modules.json a model pools by vLLM's default for its kind: CLS for an encoder (BertModel and
relatives), the last token for a decoder used as an embedder; both L2-normalised. --pooler-config
overrides pooling_type and normalize. A sequence classifier (*ForSequenceClassification: an encoder
cross-encoder, or a decoder reward model / reranker) does not pool into a vector: its head reads the first
token (encoders) or the last (decoders), and its config.json's id2label, activation settings
(pooling/classify.py) and use_pad_token (how a pair is encoded) make its PoolerConfig (modules.json is not
read for it: the head is in the checkpoint); a --pooler-config is refused for it. Anything a folder declares
that ferrox cannot reproduce (max pooling, a Dense projection after the pooling) is refused by name rather
than silently dropped.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ferrox.config import RUNNERS, EngineConfig
from ferrox.config_fields import to_int
from ferrox.loader.errors import ModelLoadError, UnsupportedModelError
from ferrox.loader.json_file import read_json
from ferrox.loader.source import ModelSource
from ferrox.model_spec import ModelSpec
from ferrox.models.registry import (
    CLASSIFIER_ARCHITECTURES,
    DECODER_CLASSIFIER_ARCHITECTURES,
    ENCODER_ONLY_ARCHITECTURES,
    POOLING_ONLY_ARCHITECTURES,
    get_model_class,
)
from ferrox.pooling.classify import classifier_labels, classify_activation, score_activation
from ferrox.pooling.convert import runner_for
from ferrox.pooling.params import PoolerConfig, parse_pooler_overrides

logger = logging.getLogger(__name__)

# 1_Pooling/config.json flag -> pooling type; the other sentence-transformers modes are refused.
_POOLING_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
                  "pooling_mode_lasttoken": "LAST"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")
# sentence-transformers modules that change nothing ferrox computes (the Transformer is the model itself).
_TRANSPARENT_MODULES = ("Transformer",)


def resolve_runner(requested: str, architecture: str) -> str:
    """runner "auto" -> "pooling" for an architecture without a language-model head (an encoder, a sequence
    classifier), else "generate" (vLLM's --runner)."""
    pooling_only = architecture in POOLING_ONLY_ARCHITECTURES
    if requested == "auto":
        return "pooling" if pooling_only else "generate"
    if requested == "generate" and pooling_only:
        what = "a sequence classifier" if architecture in CLASSIFIER_ARCHITECTURES else "an encoder-only model"
        raise ValueError(f"runner: 'generate' cannot run {architecture}: it is {what}, which embeds or classifies "
                         "text and has no language-model head (use runner 'pooling', or leave runner 'auto')")
    if requested not in RUNNERS:
        raise ValueError(f"runner: {requested!r} is not one of {', '.join(RUNNERS)}")
    return requested


def pooling_setup(config: EngineConfig, source: ModelSource, spec: ModelSpec, tp_size: int) -> PoolerConfig | None:
    """The PoolerConfig when the engine runs the model for pooling, None for generation; a setting a
    pooling engine cannot honour is a ValueError naming it (before any weight is read)."""
    if resolve_runner(runner_for(config.runner, config.convert), spec.architecture) != "pooling":
        return None
    refused = (
        ("tensor_parallel_size", tp_size > 1, "a pooling model runs on one rank in this version"),
        ("async_scheduling", config.async_scheduling is True,
         "pooling steps run synchronously (no sampled token feeds the next step, so there is nothing to overlap)"),
        ("enable_lora", bool(getattr(config, "enable_lora", False)), "LoRA adapters apply to generation only"),
    )
    for name, bad, why in refused:
        if bad:
            raise ValueError(f"{name}: not supported with runner 'pooling' ({why})")
    pooler = load_pooler_config(source, spec, config.pooler_config)
    what = (f"{pooler.pooling_type} pooling{', normalized' if pooler.normalize else ''}" if pooler.task == "embed"
            else f"classify (scores: {pooler.classify_activation}; pair scores: {pooler.score_activation})")
    logger.info("runner pooling: %s (from %s)%s", what, pooler.declared_by,
                "; prefix caching off (every prompt is computed whole)" if config.enable_prefix_caching else "")
    return pooler


def pooling_token_budget(requested: int | None, default: int, max_model_len: int,
                         why: str = "a pooling model computes each prompt in one step") -> int:
    """A step's token budget when prompts are never split (pooling models; enable_chunked_prefill off):
    one step must hold the longest (vLLM's rule without chunked prefill); the default grows to
    max_model_len, an explicit smaller value is refused."""
    if requested is None:
        return max(default, max_model_len)
    if requested < max_model_len:
        raise ValueError(f"max_num_batched_tokens: {requested} is less than max_model_len ({max_model_len}); "
                         f"{why}, so the budget must hold the longest")
    return requested


def load_pooler_config(source: ModelSource, spec: ModelSpec, overrides: dict[str, Any] | None = None) -> PoolerConfig:
    """The pooling the folder declares (module docstring), with --pooler-config on top."""
    if spec.architecture in CLASSIFIER_ARCHITECTURES:
        return _classifier_config(source, spec, overrides)
    declared = _sentence_transformers_pooling(source.folder) if source.format == "hf" else None
    if declared is None:
        encoder = spec.architecture in ENCODER_ONLY_ARCHITECTURES
        pooling_type, normalize = ("CLS" if encoder else "LAST"), True
        declared_by = f"the default for {spec.architecture} (no modules.json)"
    else:
        pooling_type, normalize, declared_by = declared
    extra = parse_pooler_overrides(overrides)
    if extra:
        pooling_type = extra.get("pooling_type", pooling_type)
        normalize = extra.get("normalize", normalize)
        declared_by = "pooler_config"
    dims, is_matryoshka = _matryoshka(spec, os.path.join(source.folder, "config.json"))
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize, hidden_size=spec.hidden_size,
                        is_matryoshka=is_matryoshka, matryoshka_dimensions=dims, declared_by=declared_by)


def _classifier_config(source: ModelSource, spec: ModelSpec, overrides: dict[str, Any] | None) -> PoolerConfig:
    """A sequence classifier's PoolerConfig: its labels, activations and pair encoding from config.json."""
    decoder = spec.architecture in DECODER_CLASSIFIER_ARCHITECTURES
    if parse_pooler_overrides(overrides):
        raise ValueError(f"pooler_config: not supported for {spec.architecture} (a sequence classifier's head reads "
                         f"the {'last' if decoder else 'first'} token, as transformers' does)")
    where = os.path.join(source.folder, "config.json")
    labels = classifier_labels(spec.hf_config, where)
    # vLLM's use_pad_token (default true): false marks an "LLM as reranker" model, whose pair is the two texts
    # joined into one string rather than the tokenizer's pair encoding.
    use_pad_token = spec.hf_config.get("use_pad_token", True)
    if not isinstance(use_pad_token, bool):
        raise ModelLoadError(f"{where}: field 'use_pad_token' must be true or false, got {use_pad_token!r}")
    return PoolerConfig(pooling_type="LAST" if decoder else "CLS", normalize=False, hidden_size=spec.hidden_size,
                        task="classify", labels=labels,
                        classify_activation=classify_activation(spec.hf_config, len(labels)),
                        score_activation=score_activation(spec.hf_config, len(labels), where),
                        join_pair_texts=not use_pad_token,
                        declared_by=f"{spec.architecture}'s classification head ({len(labels)} labels)")


def pooling_max_model_len(requested: int | None, source: ModelSource, spec: ModelSpec) -> int:
    """The longest input: the model's positions (an encoder's own count, e.g. RoBERTa's after its pad
    offset), capped by sentence_bert_config.json's max_seq_length as vLLM caps it; an explicit
    max_model_len may lower it, not raise it."""
    cls = get_model_class([spec.architecture], spec.hf_config)
    positions = getattr(cls, "max_positions", None)
    limit = positions(spec) if positions is not None else spec.max_position_embeddings
    what = f"the model's {limit} positions"
    if spec.sliding_window is not None and positions is None and spec.sliding_window < limit:
        # A pooling model attends without windows (its spec is not built for a context: worker/model_setup.py),
        # which is exact up to the window.
        limit = spec.sliding_window
        what = f"its sliding_window of {limit} in config.json, which full attention equals up to that length"
    path = os.path.join(source.folder, "sentence_bert_config.json")
    if source.format == "hf" and os.path.isfile(path):
        value = read_json(path).get("max_seq_length")
        if value is not None:
            seq_len = to_int(value, f"{path}: field 'max_seq_length'")
            if seq_len < limit:
                limit, what = seq_len, f"max_seq_length {seq_len} in {path}"
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len: {requested} is more than this pooling model takes ({what})")
    return requested


def _sentence_transformers_pooling(folder: str) -> tuple[str, bool, str] | None:
    """(pooling type, normalize, the file that said so) from modules.json, or None without one."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return None
    modules = read_json(path, list)
    pooling: tuple[str, str] | None = None
    normalize = False
    for i, module in enumerate(modules):
        if not isinstance(module, dict) or not isinstance(module.get("type"), str):
            raise ModelLoadError(f"{path}: entry {i} must be an object with a 'type' string")
        kind = module["type"].rsplit(".", 1)[-1]
        sub = str(module.get("path") or "")
        if kind == "Pooling":
            pooling = (_pooling_mode(os.path.join(folder, sub, "config.json")), os.path.join(sub, "config.json"))
        elif kind == "Normalize":
            normalize = True
        elif kind in _TRANSPARENT_MODULES:
            if sub:
                raise UnsupportedModelError(f"{path}: the Transformer module lives in {sub!r}; ferrox loads the "
                                            "model from the folder itself")
        else:
            raise UnsupportedModelError(f"{path}: module {module['type']} ({sub or 'entry ' + str(i)}) is not "
                                        "supported (ferrox applies Transformer, Pooling and Normalize modules only)")
    if pooling is None:
        return None
    kind, file = pooling
    return kind, normalize, f"modules.json + {file}"


def _pooling_mode(path: str) -> str:
    config = read_json(path)
    modes = [kind for key, kind in _POOLING_MODES.items() if config.get(key)]
    bad = [key for key in _UNSUPPORTED_MODES if config.get(key)]
    if bad:
        raise UnsupportedModelError(f"{path}: {', '.join(bad)} is not supported (ferrox pools by mean, CLS or the "
                                    "last token)")
    if len(modes) != 1:
        raise ModelLoadError(f"{path}: exactly one of {', '.join(_POOLING_MODES)} must be true, found "
                             f"{len(modes)}")
    return modes[0]


def _matryoshka(spec: ModelSpec, where: str) -> tuple[list[int] | None, bool]:
    dims = spec.hf_config.get("matryoshka_dimensions")
    if dims is not None:
        if not isinstance(dims, list) or not dims:
            raise ModelLoadError(f"{where}: field 'matryoshka_dimensions' must be a non-empty list of sizes")
        dims = [to_int(d, f"{where}: field 'matryoshka_dimensions'") for d in dims]
    return dims, bool(dims) or bool(spec.hf_config.get("is_matryoshka", False))


