"""Reading the small JSON files of a model folder (config.json, tokenizer_config.json, modules.json...).

One reader, with one set of errors that name the file; torch-free, so the API server process (which
reads tokenizer files) can use it too."""

from __future__ import annotations

import json
from typing import Any

from ferrox.loader.errors import ModelLoadError, ModelNotFoundError


def read_json(path: str, kind: type[dict] | type[list] = dict) -> Any:
    """The file's JSON value, which must be a `kind` (an object or a list)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, kind):
        raise ModelLoadError(f"{path} must hold a JSON {'object' if kind is dict else 'list'}, "
                             f"found {type(data).__name__}")
    return data
