"""Device dispatch: a model picks its ops, attention backend and decode path once, when it is
built, and the model and layer files hold no device branches (CPU; the Triton side is driven in
tests/kernels/test_fused_decode.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from ferrox.attention.decode_path import DecodePath
from ferrox.attention.torch_backend import TorchAttentionBackend
from ferrox.kernels import select_kernels
from ferrox.layers.activation import SiluAndMul
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import CosSinRope, DeviceOps, for_device
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.models.registry import get_model_class

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "ferrox"
# Where a device may be looked at: the dispatch seam itself.
DEVICE_TEST = re.compile(r"\.is_cuda\b|\bdevice\.type\b|\.type\s*==\s*[\"']cuda")


def _spec(arch: str):
    return spec_from_hf_config({
        "architectures": [arch], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 48, "num_hidden_layers": 2, "vocab_size": 50, "tie_word_embeddings": True,
    }, "test config")


def test_cpu_selects_the_torch_kernel_set():
    assert select_kernels("cpu") == "torch" and select_kernels(torch.device("cpu"), "torch") == "torch"
    ops = for_device("cpu")
    assert type(ops) is DeviceOps and ops.name == "torch" and ops.column_major_weights
    assert for_device(None).column_major_weights
    with pytest.raises(ValueError, match="kernel set 'cuda'"):
        for_device("cpu", "cuda")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_a_model_builds_its_layers_on_one_op_set(arch):
    model = get_model_class([arch])(_spec(arch), torch.float32, "cpu")
    assert model.kernels == "torch" and isinstance(model.backend, TorchAttentionBackend)
    assert type(model.model.decode_path) is DecodePath  # no fused kernels on the torch set
    ops_users = [m for m in model.modules() if isinstance(m, (RMSNorm, SiluAndMul))]
    assert len(ops_users) == 2 * 3 + 1 + (4 if arch == "Qwen3ForCausalLM" else 0)
    assert all(m.ops is model.ops for m in ops_users)
    rotary = model.model.rotary
    assert isinstance(rotary, RotaryEmbedding)
    assert isinstance(rotary(torch.arange(3), torch.float32), CosSinRope)


def test_layers_default_to_their_device_op_set():
    assert RMSNorm(8, 1e-6, torch.float32).ops.name == "torch"
    assert SiluAndMul().ops.name == "torch"
    assert RotaryEmbedding(8, 10000.0, None, "cpu").ops.name == "torch"


def test_model_and_layer_files_hold_no_device_branches():
    """Device choices live in kernels/__init__.py (select_kernels) and layers/ops.py (for_device);
    the sampler files, owned elsewhere, are not covered here."""
    seams = {PACKAGE / "layers" / "ops.py", PACKAGE / "layers" / "sampler.py", PACKAGE / "layers" / "logits_processors.py"}
    files = [p for d in ("models", "layers", "attention") for p in sorted((PACKAGE / d).glob("*.py")) if p not in seams]
    found = [f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if DEVICE_TEST.search(line)]
    assert not found, "device branches outside the dispatch seam:\n" + "\n".join(found)
