"""config.json edits of tiny checkpoints: the refusal tests' edited copies, the builders' after-save tweaks."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any


def edit_config(folder: str, **fields: Any) -> None:
    """config.json of `folder` with `fields` set (None: removed)."""
    path = os.path.join(str(folder), "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def copy_with_config(folder: str, dest, **fields: Any) -> str:
    """A copy of checkpoint `folder` at `dest` whose config.json has `fields` set (None: removed)."""
    shutil.copytree(folder, dest)
    edit_config(str(dest), **fields)
    return str(dest)
