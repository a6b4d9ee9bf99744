"""The models on CUDA (Triton attention backend, Triton norms): tiny Llama / Qwen3 against
transformers on the same GPU in float32, and bf16 close to the float32 reference. GPU only."""

from __future__ import annotations

import pytest
import torch
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.models.conftest import cut_at_eos, hf_greedy, hf_last_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [list(range(3, 90)), [5, 9, 11], list(range(100, 140))]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    return {
        "llama": tiny_models.make_tiny_llama(root / "llama", hidden_size=128, num_heads=4, num_kv_heads=2),
        "qwen3": tiny_models.make_tiny_qwen3(root / "qwen3", hidden_size=128, num_heads=4, num_kv_heads=1,
                                             head_dim=64),
    }


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_cuda_float32_matches_transformers(folders, name):
    transformers = pytest.importorskip("transformers")
    source = resolve_model(folders[name])
    model = load_model(source, load_model_spec(source), dtype=torch.float32, device="cuda")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).to("cuda").eval()
    ours, logits = run_greedy(model, PROMPTS, 8, return_prefill_logits=True)
    for i, ids in enumerate(PROMPTS):
        torch.testing.assert_close(logits[i], hf_last_logits(ref, ids), atol=2e-3, rtol=1e-3)
        assert cut_at_eos(ours[i], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 8)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_cuda_bf16_close_to_float32(folders, name):
    source = resolve_model(folders[name])
    spec = load_model_spec(source)
    fp32 = load_model(source, spec, dtype=torch.float32, device="cuda")
    bf16 = load_model(source, spec, dtype=torch.bfloat16, device="cuda")
    _, ref = run_greedy(fp32, PROMPTS, 1, return_prefill_logits=True)
    _, got = run_greedy(bf16, PROMPTS, 1, return_prefill_logits=True)
    err = (got - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item(), err
