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


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    return tiny_models.make_tiny_qwen2(tmp_path_factory.mktemp("gpu") / "qwen2", hidden_size=128, num_heads=4,
                                       num_kv_heads=2)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_cuda_one_token_kernels_match_transformers_and_unfused(folders, qwen2_folder, name, monkeypatch):
    """One prompt at a time, so every decode step has one token and runs the fused matrix-vector
    kernels (kernels/gemv.py: norm + qkv + rotary + KV write, o_proj, norm + gate_up + SiLU, down,
    lm_head; Qwen3: its q/k norms in kernels/qk_norm_rope.py); float32 greedy must equal
    transformers' and the unfused path's, and bf16 one-token logits must stay close to the
    unfused ones."""
    transformers = pytest.importorskip("transformers")
    from ferrox.attention.decode_path import fused_decode_enabled
    from ferrox.attention.fused_decode import FusedOneTokenDecode

    folder = qwen2_folder if name == "qwen2" else folders[name]  # qwen2: q/k/v bias
    source = resolve_model(folder)
    spec = load_model_spec(source)
    model = load_model(source, spec, dtype=torch.float32, device="cuda")
    assert isinstance(model.model.decode_path, FusedOneTokenDecode) and model.model.decode_path.layers
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    assert fused_decode_enabled()
    for ids in PROMPTS + [[7]]:  # [7]: a one-token prompt runs the fused path for its prefill too
        fused = run_greedy(model, [ids], 8)[0]
        monkeypatch.setenv("FERROX_FUSED_DECODE", "0")
        unfused = run_greedy(model, [ids], 8)[0]
        monkeypatch.delenv("FERROX_FUSED_DECODE")
        assert fused == unfused
        assert cut_at_eos(fused, [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 8)

    bf16 = load_model(source, spec, dtype=torch.bfloat16, device="cuda")
    _, fused_logits = run_greedy(bf16, [[7]], 1, return_prefill_logits=True)
    monkeypatch.setenv("FERROX_FUSED_DECODE", "0")
    _, unfused_logits = run_greedy(bf16, [[7]], 1, return_prefill_logits=True)
    err = (fused_logits - unfused_logits).norm() / unfused_logits.norm()
    assert err < 2e-2, err
