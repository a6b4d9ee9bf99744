"""Which file of a model folder describes the model: config.json (Hugging Face) or params.json (Mistral's native
layout, loader/mistral_config.py) -- vLLM's --config-format.

  'hf'      config.json
  'mistral' params.json, read as the config.json it stands for
  'auto'    config.json when the folder has one, else params.json

vLLM's 'auto' takes params.json first whenever the folder also holds consolidated*.safetensors; ferrox keeps a
config.json that is there (a Mistral repository that ships both describes the same model in each, and a Llama
download flattened from `original/` holds Meta's params.json beside Hugging Face's files, which vLLM's rule then
misreads) and reads params.json only when it is all the folder has. Torch-free: the API server reads configs.

A ModelOpt export's hf_quant_config.json stands for config.json's quantization_config when that has none.
"""

from __future__ import annotations

import os
from typing import Any

from ferrox.loader.errors import ModelNotFoundError
from ferrox.loader.json_file import read_json
from ferrox.loader.mistral_config import PARAMS_FILE, read_params_config

CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"  # NVIDIA ModelOpt's older exports: the quantization config
CONFIG_FORMATS = ("auto", "hf", "mistral")


def resolve_config_format(folder: str, config_format: str = "auto") -> str:
    """'hf' or 'mistral': the file `config_format` reads in `folder` ('auto': module docstring)."""
    if config_format not in CONFIG_FORMATS:
        raise ValueError(f"config_format {config_format!r} is unknown (choose one of {', '.join(CONFIG_FORMATS)})")
    if config_format != "auto":
        return config_format
    if not os.path.isfile(os.path.join(folder, CONFIG_FILE)) and os.path.isfile(os.path.join(folder, PARAMS_FILE)):
        return "mistral"
    return "hf"


def read_model_config(folder: str, config_format: str = "auto") -> tuple[dict[str, Any], str]:
    """(the model's config.json dict, the file it was read from) of a model folder; a ModelNotFoundError naming the
    file the format needs when the folder lacks it."""
    if resolve_config_format(folder, config_format) == "mistral":
        return read_params_config(folder)
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        also = "" if config_format == "hf" else f" (nor Mistral's {PARAMS_FILE})"
        raise ModelNotFoundError(f"model folder {folder} has no {CONFIG_FILE}{also}")
    return _with_hf_quant_config(read_json(path), folder), path


def _with_hf_quant_config(config: dict[str, Any], folder: str) -> dict[str, Any]:
    """config.json with the folder's hf_quant_config.json as its quantization_config when it has none: ModelOpt
    0.29 and before wrote its quantization config in that file (vLLM's rule: config.json's own wins). A ModelOpt
    one is marked quant_method "modelopt", as vLLM marks it; another producer's is kept as read, for the
    quantization resolver to refuse by name (layers/quant/config.py)."""
    path = os.path.join(folder, HF_QUANT_CONFIG_FILE)
    if "quantization_config" in config or "compression_config" in config or not os.path.isfile(path):
        return config
    quant = read_json(path)
    producer = quant.get("producer")
    if isinstance(producer, dict) and producer.get("name") == "modelopt" and "quant_method" not in quant:
        quant = {**quant, "quant_method": "modelopt"}
    return {**config, "quantization_config": quant}
