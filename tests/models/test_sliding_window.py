"""Sliding-window attention against transformers: Mistral v0.1's shape (every layer windowed), Phi-3's,
and Gemma 2's (every other layer), with windows much shorter than the prompts -- logits and greedy
tokens through chunked prefill over paged blocks and decode past the window -- then through the engine,
whose served max_model_len turns the windows on (a context within the window needs none)."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import spec_for_context

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.models.conftest import assert_cuda_engine_matches_cpu, cut_at_eos, hf_greedy, hf_last_logits

transformers = pytest.importorskip("transformers")

WINDOW = 16
PROMPTS = [[5, 9, 11], list(range(3, 43)), [7, 100, 45] * 19]  # 3, 40 and 57 tokens; 12 more generated
BUILDERS = {
    "mistral": lambda d: tiny_models.make_tiny_mistral(d, sliding_window=WINDOW, seed=41),
    "phi3": lambda d: tiny_models.make_tiny_phi3(d, sliding_window=WINDOW, seed=42),
    "gemma2": lambda d: tiny_models.make_tiny_gemma2(d, sliding_window=WINDOW, seed=43),
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """name -> (folder, ferrox model built for a 256-token context: windows on, transformers model)."""
    root = tmp_path_factory.mktemp("sliding")
    out = {}
    for name, build in BUILDERS.items():
        folder = build(root / name)
        source = resolve_model(folder)
        spec = spec_for_context(load_model_spec(source), 256)
        model = load_model(source, spec, dtype=torch.float32, device="cpu")
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[name] = (folder, model, ref)
    return out


@pytest.mark.parametrize("name", list(BUILDERS))
@torch.inference_mode()
def test_windowed_models_match_transformers(windowed, name):
    _, model, ref = windowed[name]
    windows = model.spec.attention_windows
    assert windows == ((WINDOW, 0) if name == "gemma2" else (WINDOW, WINDOW))
    ours, logits = run_greedy(model, PROMPTS, 12, block_size=8, prefill_chunk=7, return_prefill_logits=True)
    for i, ids in enumerate(PROMPTS):
        torch.testing.assert_close(logits[i], hf_last_logits(ref, ids), atol=1e-4, rtol=1e-4)
        assert cut_at_eos(ours[i], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 12), (name, i)


@torch.inference_mode()
def test_the_window_changes_the_output(windowed):
    """A guard for the comparisons above: the same weights attending fully answer otherwise."""
    folder, model, _ = windowed["mistral"]
    source = resolve_model(folder)
    full = load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")
    assert full.spec.attention_windows == () and full.spec.sliding_window == WINDOW
    _, a = run_greedy(model, PROMPTS[1:], 1, return_prefill_logits=True)
    _, b = run_greedy(full, PROMPTS[1:], 1, return_prefill_logits=True)
    assert (a - b).abs().max() > 1e-2


def test_engine_serves_past_the_window(windowed):
    """The engine's default context is max_position_embeddings (no longer capped at the window), with
    preemption-free chunked prefill of 16-token steps; a context within the window builds no windows."""
    folder, _, ref = windowed["mistral"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        assert llm.engine.max_model_len == 2048
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert cut_at_eos(list(out.outputs[0].token_ids), [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, prompt, 12)
    spec = load_model_spec(resolve_model(folder))
    assert spec_for_context(spec, WINDOW).attention_windows == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", [*BUILDERS, "gemma3", "gemma3-multimodal", "gemma2-head-dim-256"])
def test_cuda_engine_matches_cpu_engine(windowed, tmp_path, name):
    """On CUDA (CUDA graphs, the Triton kernels' window and soft cap, the fused one-token path for Mistral
    and Phi-3; the CUDA decode kernel and cuDNN step aside): in float32 every greedy token equals the CPU
    float32 engine's, batched and one prompt at a time; in bfloat16 the first tokens do and the first
    logprob is close. A 200-token prompt takes the Triton prefill kernel's windowed tiles. Real Gemmas have
    256-dim heads (twice what the Triton configs were tuned on): one variant has them."""
    if name == "gemma3":
        folder = tiny_models.make_tiny_gemma3(tmp_path / "gemma3", sliding_window=WINDOW, seed=51)
    elif name == "gemma3-multimodal":
        folder = tiny_models.make_tiny_gemma3_multimodal(tmp_path / "gemma3mm", sliding_window=WINDOW, seed=54)
    elif name == "gemma2-head-dim-256":
        folder = tiny_models.make_tiny_gemma2(tmp_path / "gemma2-256", head_dim=256, sliding_window=WINDOW, seed=52)
    else:
        folder = windowed[name][0]
    prompts = [*PROMPTS, [(13 * i + 4) % 300 + 3 for i in range(200)]]
    assert_cuda_engine_matches_cpu(folder, prompts, max_tokens=12, max_model_len=256)


def test_disable_sliding_window_caps_the_context_at_the_window(windowed):
    """vLLM's disable_sliding_window: the served context ends at the window (so no layer needs one) and a longer
    max_model_len is refused by name; within it the answers are transformers'."""
    folder, _, ref = windowed["mistral"]
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, disable_sliding_window=True)
    try:
        assert llm.engine.max_model_len == WINDOW
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=12,
                                                                              ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert cut_at_eos(list(out[0].outputs[0].token_ids), [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, PROMPTS[0], 12)
    with pytest.raises(Exception, match="max_model_len: 64 exceeds the model's sliding window"):
        LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, disable_sliding_window=True, max_model_len=64)
