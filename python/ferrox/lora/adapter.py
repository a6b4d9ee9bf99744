"""Reading a PEFT LoRA adapter folder: adapter_config.json + adapter_model.safetensors.

A LoRA adapter adds, to a linear layer y = W x, a low-rank term: y = W x + scaling * B (A x),
A [r, in], B [out, r], scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). PEFT's
`save_pretrained` writes one A and one B per adapted module, named after the module path of the
base model under `base_model.model.` (e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`).

This file knows the PEFT format only, not any model: it returns each module's A, B and scaling as
float32 CPU tensors. Whether the modules exist in a model, their shapes, and the rank limit are
checked where the adapter meets the model (lora/packed.py). Config fields that change what the
adapter computes and that ferrox does not implement are refused here by name, so an adapter never
runs with a silently different meaning.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import torch

from ferrox.errors import RequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
_PREFIX = "base_model.model."
_TENSOR_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
# Modules PEFT can adapt in a causal LM that ferrox never runs with LoRA (its delta applies to the
# decoder layers' projections only).
UNSUPPORTED_TARGETS = ("lm_head", "embed_tokens")
# target_parameters PEFT may name that ferrox reads: the stacked experts' gate_up_proj (non-gated experts: up_proj) /
# down_proj, as a dot-suffix of `model.layers.{i}.mlp.experts.{param}` (Llama 4's MoE block: `feed_forward`,
# Nemotron-H's `mixer`, Gemma 4's none: `model.layers.{i}.experts`; a vision-language model's text layers under their
# prefix), as PEFT matches a target equal to, or ending ".target" of, that path.
_EXPERT_PARAMETER = re.compile(r"^(?:(?:[\w.]*\.)?experts\.)?(?:gate_up_proj|up_proj|down_proj)$")
# The module a target_parameters pair is saved under (nested ParamWrappers add base_layer).
_STACKED_EXPERTS = re.compile(r"^.*\.experts(?:\.base_layer)*$")
# The stacked experts' parameters a target_parameters pair may adapt (up_proj: non-gated experts').
_STACKED_PARAMETERS = ("gate_up_proj", "up_proj", "down_proj")


class LoRAAdapterError(RequestError):
    """An adapter folder ferrox cannot load: the message names the file and the field (or tensor)."""

    def __init__(self, message: str, *, param: str | None = "lora_path") -> None:
        super().__init__(message, param=param)


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapted module: delta(x) = scaling * (x @ lora_a.T) @ lora_b.T."""

    name: str  # module path in the base model, e.g. "model.layers.0.self_attn.q_proj"
    lora_a: torch.Tensor  # [rank, in] float32
    lora_b: torch.Tensor  # [out, rank] float32
    scaling: float
    a_key: str  # the tensors' names in the weights file (for error messages)
    b_key: str

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass(frozen=True, slots=True)
class StackedExpertLoRA:
    """One pair PEFT's target_parameters wrote for a layer's stacked experts (lora/expert_params.py unpacks it per
    expert): lora_a [rank * E, in] expert-major rows, lora_b [out, rank * E] expert-minor columns. Which parameter it
    adapts, and so its rank, only the model's shapes tell: ranks and scalings are each parameter's (r, or its
    rank_pattern / alpha_pattern entry, as PEFT resolves them for `<experts module>.<parameter>`)."""

    name: str  # the module the pair sits on, e.g. "model.layers.0.mlp.experts.base_layer"
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    ranks: dict[str, int]  # by parameter: "gate_up_proj" (non-gated experts: "up_proj"), "down_proj"
    scalings: dict[str, float]
    a_key: str
    b_key: str

    @property
    def rank(self) -> int:
        """The largest rank the pair may have (its parameter decides which: lora/expert_params.py)."""
        return max(self.ranks.values())


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    path: str
    config_file: str  # full paths, for error messages
    weights_file: str
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # a list of names, or PEFT's regex / "all-linear" string
    modules: dict[str, LoRAModule]  # by module path
    # target_parameters' pairs on stacked experts, by the module path they were saved under
    stacked: dict[str, StackedExpertLoRA] = dataclass_field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()

    @property
    def max_rank(self) -> int:
        """The largest rank of its modules (of a stacked pair, the largest its parameter may have)."""
        return max([m.rank for m in self.modules.values()] + [p.rank for p in self.stacked.values()])


# Fields whose non-default value changes what the adapter computes, and that ferrox does not
# implement: (field, is it in use?, what to say).
_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("use_dora", lambda v: bool(v), "DoRA adapters are not supported"),
    ("bias", lambda v: v not in (None, "none"), "trained biases are not supported (only bias='none')"),
    ("lora_bias", lambda v: bool(v), "a bias on lora_B is not supported"),
    ("modules_to_save", lambda v: bool(v), "fully trained extra modules are not supported"),
    ("fan_in_fan_out", lambda v: bool(v), "transposed (Conv1D-style) weights are not supported"),
    ("layer_replication", lambda v: bool(v), "replicated layers are not supported"),
    ("trainable_token_indices", lambda v: bool(v), "trained token embeddings are not supported"),
    ("use_qalora", lambda v: bool(v), "QA-LoRA adapters are not supported"),
    ("alora_invocation_tokens", lambda v: bool(v), "activated LoRA (aLoRA) is not supported"),
)


def _fail(file: str, message: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"{file}: {message}")


def read_peft_adapter(path: str | os.PathLike[str]) -> PeftAdapter:
    """Parse a PEFT LoRA folder into float32 CPU tensors; LoRAAdapterError names what is wrong."""
    folder = os.fspath(path)
    if not folder or not os.path.isdir(folder):
        what = "no such folder" if not os.path.exists(folder) else "not a folder"
        raise LoRAAdapterError(f"lora_path {folder!r}: {what} (a PEFT adapter is a folder with {CONFIG_FILE} "
                               f"and {WEIGHTS_FILE})")
    config_file = os.path.join(folder, CONFIG_FILE)
    config = _read_config(config_file)
    weights_file = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(weights_file):
        pickle_file = os.path.join(folder, PICKLE_WEIGHTS_FILE)
        if os.path.isfile(pickle_file):
            raise _fail(pickle_file, f"pickled weights are not loaded; save the adapter as {WEIGHTS_FILE} "
                                     "(PEFT save_pretrained(..., safe_serialization=True))")
        raise _fail(weights_file, "missing (the adapter's weights)")

    r = _positive_int(config.get("r", 8), config_file, "r")
    alpha = _number(config.get("lora_alpha", 8), config_file, "lora_alpha")
    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern = _pattern(config, "rank_pattern", config_file)
    alpha_pattern = _pattern(config, "alpha_pattern", config_file)
    for key, value in rank_pattern.items():
        _positive_int(value, config_file, f"rank_pattern[{key!r}]")
    for key, value in alpha_pattern.items():
        _number(value, config_file, f"alpha_pattern[{key!r}]")
    targets = config.get("target_modules")
    parameters = _target_parameters(config, config_file)
    if isinstance(targets, str):
        target_modules: tuple[str, ...] | str = targets
    # (an adapter of the stacked experts alone lists no modules: target_parameters name what it adapts)
    elif isinstance(targets, list) and (targets or parameters) and all(isinstance(t, str) for t in targets):
        target_modules = tuple(targets)
    else:
        raise _fail(config_file, f"target_modules must be a list of module names or a regex string, got {targets!r}")
    for name in target_modules if isinstance(target_modules, tuple) else ():
        if name.rsplit(".", 1)[-1] in UNSUPPORTED_TARGETS:
            raise _fail(config_file, f"target_modules {name!r}: LoRA on the LM head or the embeddings is not supported "
                                     "(only the decoder layers' projections)")

    tensors = _read_tensors(weights_file)
    pairs: dict[str, dict[str, str]] = {}
    for key in tensors:
        match = _TENSOR_KEY.match(key[len(_PREFIX):]) if key.startswith(_PREFIX) else None
        if match is None:
            raise _fail(weights_file, f"tensor {key!r} is not a LoRA weight (expected "
                                      f"'{_PREFIX}<module>.lora_A.weight' / '.lora_B.weight')")
        pairs.setdefault(match["module"], {})[match["which"]] = key
    if not pairs:
        raise _fail(weights_file, "holds no LoRA tensors")

    modules: dict[str, LoRAModule] = {}
    stacked: dict[str, StackedExpertLoRA] = {}
    for name, keys in pairs.items():
        for which in "AB":
            if which not in keys:
                raise _fail(weights_file, f"module {name!r} has no lora_{which}.weight tensor")
        a, b = tensors[keys["A"]], tensors[keys["B"]]
        if parameters and _STACKED_EXPERTS.match(name):
            stacked[name] = _stacked_pair(name, keys, a, b, r, alpha, use_rslora, rank_pattern, alpha_pattern,
                                          weights_file)
            continue
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _fail(weights_file, f"tensors {keys['A']!r} {tuple(a.shape)} and {keys['B']!r} {tuple(b.shape)} "
                                      "are not a LoRA pair ([r, in] and [out, r])")
        rank_key = _pattern_key(rank_pattern, name)
        rank = int(rank_pattern[rank_key]) if rank_key is not None else r
        if a.shape[0] != rank:
            field = f"rank_pattern[{rank_key!r}]" if rank_key is not None else "r"
            raise _fail(weights_file, f"tensor {keys['A']!r} has rank {a.shape[0]}, {CONFIG_FILE} {field} says {rank}")
        alpha_key = _pattern_key(alpha_pattern, name)
        module_alpha = float(alpha_pattern[alpha_key]) if alpha_key is not None else alpha
        scaling = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        text_name = text_model_name(name)
        if text_name in modules:
            raise _fail(weights_file, f"modules {modules[text_name].a_key!r} and {keys['A']!r} both adapt "
                                      f"{text_name!r} (two spellings of one module)")
        modules[text_name] = LoRAModule(text_name, a.float().contiguous(), b.float().contiguous(), scaling, keys["A"],
                                        keys["B"])
    if parameters and not stacked:
        raise _fail(weights_file, f"holds no experts' tensors, while {CONFIG_FILE} names target_parameters")
    return PeftAdapter(folder, config_file, weights_file, r, alpha, use_rslora, target_modules, modules, stacked,
                       parameters)


# A vision-language checkpoint's text model under its own prefix (transformers 5's `model.language_model.`, older
# LLaVA-layout `language_model.model.`), as PEFT names an adapter trained on the whole model: the same module as
# the text model's `model.` one, which vLLM maps the same way (its hf_to_vllm_mapper).
_TEXT_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")


def text_model_name(name: str) -> str:
    """`name` with a vision-language checkpoint's text-model prefix read as the text model's `model.`."""
    for prefix in _TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name


def _target_parameters(config: dict[str, Any], config_file: str) -> tuple[str, ...]:
    """target_parameters, each the experts' gate_up_proj / down_proj (refused by name otherwise)."""
    value = config.get("target_parameters")
    if not value:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise _fail(config_file, f"target_parameters must be a list of parameter names, got {value!r}")
    for name in value:
        if _EXPERT_PARAMETER.match(name) is None:
            raise _fail(config_file, f"target_parameters {name!r}: LoRA on raw parameters is supported on the MoE "
                                     "experts' stacked gate_up_proj / down_proj only (non-gated experts: up_proj / "
                                     "down_proj; e.g. 'mlp.experts.gate_up_proj')")
    return tuple(value)


def _stacked_pair(name: str, keys: dict[str, str], a: torch.Tensor, b: torch.Tensor, r: int, alpha: float,
                  use_rslora: bool, rank_pattern: dict[str, Any], alpha_pattern: dict[str, Any],
                  weights_file: str) -> StackedExpertLoRA:
    """One target_parameters pair, with each parameter's rank and scaling as PEFT gives them to the parameter's
    ParamWrapper: the patterns matched against `<experts module>.<parameter>` (the expert count and so which parameter
    the pair adapts are the model's, checked at packing)."""
    unwrapped = re.sub(r"(\.base_layer)+$", "", name)
    ranks, scalings = {}, {}
    for param in _STACKED_PARAMETERS:
        rank_key = _pattern_key(rank_pattern, f"{unwrapped}.{param}")
        alpha_key = _pattern_key(alpha_pattern, f"{unwrapped}.{param}")
        ranks[param] = int(rank_pattern[rank_key]) if rank_key is not None else r
        param_alpha = float(alpha_pattern[alpha_key]) if alpha_key is not None else alpha
        scalings[param] = param_alpha / (math.sqrt(ranks[param]) if use_rslora else ranks[param])
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or all(a.shape[0] % k for k in ranks.values()):
        at = " or ".join(sorted({f"r={k}" for k in ranks.values()}))
        raise _fail(weights_file, f"tensors {keys['A']!r} {tuple(a.shape)} and {keys['B']!r} {tuple(b.shape)} are not "
                                  f"a stacked experts' pair at {at} ([r * experts, in] and [out, r * experts])")
    return StackedExpertLoRA(name, a.float().contiguous(), b.float().contiguous(), ranks, scalings, keys["A"],
                             keys["B"])


def _read_config(config_file: str) -> dict[str, Any]:
    if not os.path.isfile(config_file):
        raise _fail(config_file, "missing (a PEFT adapter folder needs its config)")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(config_file, f"unreadable ({e})") from e
    if not isinstance(config, dict):
        raise _fail(config_file, "must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(config_file, f"peft_type={peft_type!r} is not a LoRA adapter (only 'LORA')")
    for field, in_use, why in _REFUSED:
        value = config.get(field)
        if value is not None and in_use(value):
            raise _fail(config_file, f"{field}={value!r}: {why}")
    return config


def _read_tensors(weights_file: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(weights_file, device="cpu")
    except (OSError, SafetensorError, ValueError, RuntimeError) as e:
        raise _fail(weights_file, f"unreadable ({e})") from e


def _positive_int(value: Any, file: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(file, f"{field}={value!r} must be a positive integer")
    return value


def _number(value: Any, file: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(file, f"{field}={value!r} must be a number")
    return float(value)


def _pattern(config: dict[str, Any], field: str, file: str) -> dict[str, Any]:
    value = config.get(field) or {}
    if not isinstance(value, dict):
        raise _fail(file, f"{field} must be an object (module pattern -> value), got {value!r}")
    return value


def _pattern_key(patterns: dict[str, Any], module: str) -> str | None:
    """PEFT's rule for rank_pattern / alpha_pattern: the first key that, as a regex, matches the
    module path's tail at a dot boundary."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None
