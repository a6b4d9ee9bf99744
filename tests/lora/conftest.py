"""Tiny checkpoints of the families whose loader rewrites projection rows (lora/rewrite.py) with two PEFT
adapters each, built once per test process and shared by the files that use them (model-level parity,
engine, tensor parallelism, GPU)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.lora.adapters import FAMILIES, load_hf_model, make_peft_adapter


@pytest.fixture(scope="session")
def lora_checkpoint(tmp_path_factory):
    """name -> (checkpoint folder, its transformers model, {"a1", "a2": LoRARequest}), built on first use."""
    from ferrox.lora.request import LoRARequest

    built: dict[str, tuple[str, Any, dict[str, Any]]] = {}

    def get(name: str) -> tuple[str, Any, dict[str, Any]]:
        if name not in built:
            build, targets1, targets2 = FAMILIES[name]
            root = tmp_path_factory.mktemp(f"lora_{name}")
            folder = build(root / "base")
            base = load_hf_model(folder)
            a1 = make_peft_adapter(base, root / "a1", r=8, lora_alpha=16, target_modules=targets1, seed=1)
            a2 = make_peft_adapter(base, root / "a2", r=4, lora_alpha=8, use_rslora=True, target_modules=targets2,
                                   seed=2)
            built[name] = (folder, base, {"a1": LoRARequest("a1", 1, a1), "a2": LoRARequest("a2", 2, a2)})
        return built[name]

    return get
