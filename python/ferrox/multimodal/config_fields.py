"""Reading an image processor's config: the files it may be in and its fields' checks, shared by every
family's processor (image_processor.py, idefics3_processing.py, qwen2_vl_processing.py, pixtral_processing.py).

A field of the wrong kind is a ModelLoadError naming the file (`where`) and the field, raised when the model
loads, never at a request.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ferrox.errors import ModelLoadError

PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # transformers 5 nests the image processor's fields here


def read_json_object(file: str) -> dict[str, Any]:
    """The JSON object in `file`; {} when there is no such file."""
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse {file}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} must hold a JSON object, found {type(data).__name__}")
    return data


def image_processor_fields(path: str | os.PathLike[str]) -> tuple[Mapping[str, Any], str] | None:
    """(the image processor's fields, where they were) from a model folder: preprocessor_config.json, else
    processor_config.json's image_processor (transformers 5 saves only that); None when it has neither."""
    file = os.path.join(path, PREPROCESSOR_FILE)
    if os.path.isfile(file):
        return read_json_object(file), PREPROCESSOR_FILE
    nested = read_json_object(os.path.join(path, PROCESSOR_FILE)).get("image_processor")
    if isinstance(nested, Mapping):
        return nested, f"{PROCESSOR_FILE}: image_processor"
    return None


def positive_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{where}: {name} must be a positive integer, got {value!r}")
    return value


def number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"{where}: {name} must be a number, got {value!r}")
    return float(value)


def flag(fields: Mapping[str, Any], name: str, where: str) -> bool:
    value = fields[name]
    if not isinstance(value, bool):
        raise ModelLoadError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def per_channel(value: Any, name: str, where: str) -> list[float]:
    """Three numbers, one per RGB channel; a single number applies to all three (as transformers)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ModelLoadError(f"{where}: {name} must be 3 numbers (R, G, B), got {value!r}")
    return [number(v, name, where) for v in value]
