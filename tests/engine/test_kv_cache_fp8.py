"""kv_cache_dtype="fp8" through the engine on a tiny Llama (CPU, float32 model, torch backend).

- the cache is float8_e4m3fn and holds 4x the float32 tokens at the same kv_cache_memory;
- greedy output stays close to the float32 cache (per-token logprobs within a tolerance);
- a checkpoint's k_scale / v_scale (in each name vLLM reads) load and are used: the engine matches
  transformers with K and V rounded through FP8 at those scales by hand; with kv_cache_dtype "auto"
  the same checkpoint loads and its scales are ignored;
- prefix caching and chunked prefill give what one unchunked, uncached prefill gives.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from ferrox import LLM, SamplingParams

from tests.helpers.fp8_kv_reference import engine_prompt_logprobs, prompt_logprobs_with_fp8_kv
from tests.helpers.tiny_models import make_tiny_llama

KV_MEMORY = 4 << 20
PROMPTS = ["The quick brown fox jumps over", "Paris is the capital of", "def add(a, b):\n    return",
           "Numbers: 0 1 2 3 4 5"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
TEACHER = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)  # prompt tokens teacher-forced
# Per-layer scales of the scaled checkpoint: the K scales are small enough that the largest keys
# saturate at 448 * k_scale, so a run that ignored them would differ by far more than rounding.
# Exact in float32 (the checkpoint's dtype) and not powers of two (which would only shift exponents).
K_SCALES, V_SCALES = (5 / 1024, 7 / 1024), (3 / 64, 7 / 64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("fp8kv") / "llama", num_layers=2, seed=3)


def _with_scales(folder: str, dest: str, names: dict[str, str]) -> str:
    """A copy of the checkpoint with the KV scales added under the given names ({"k": suffix, ...}
    relative to model.layers.N.self_attn)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    path = os.path.join(dest, "model.safetensors")
    tensors = load_file(path)
    for i, (k_scale, v_scale) in enumerate(zip(K_SCALES, V_SCALES, strict=True)):
        for kind, value in (("k", k_scale), ("v", v_scale)):
            if kind in names:
                tensors[f"model.layers.{i}.self_attn.{names[kind]}"] = torch.tensor(value)
    save_file(tensors, path, metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def scaled_folder(folder, tmp_path_factory):
    return _with_scales(folder, str(tmp_path_factory.mktemp("fp8kv") / "scaled"), {"k": "k_scale", "v": "v_scale"})


def _llm(model: str, kv_cache_dtype: str, **kwargs) -> LLM:
    return LLM(model=model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=KV_MEMORY, max_model_len=512,
               seed=0, **kwargs)


_prompt_logprobs = engine_prompt_logprobs  # teacher-forced log-probabilities of each prompt's own tokens


@pytest.fixture(scope="module")
def engines(folder):
    return {dtype: _llm(folder, dtype) for dtype in ("auto", "fp8")}


def test_fp8_cache_holds_four_times_the_float32_tokens(folder, engines):
    auto, fp8 = engines["auto"].engine, engines["fp8"].engine
    assert auto.runner.kv_caches[0].dtype == torch.float32
    assert fp8.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8.kv_capacity_tokens == 4 * auto.kv_capacity_tokens
    same = _llm(folder, "fp8_e4m3").engine  # another name for the same cache
    assert same.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert same.kv_capacity_tokens == fp8.kv_capacity_tokens


def test_fp8_greedy_output_close_to_the_float32_cache(engines):
    """Per-token logprobs of the float32 cache's greedy output, teacher-forced through the FP8 cache
    (prompt + output as one prompt): a random tiny model's near-flat distributions make a greedy
    path itself a coin toss at many steps, so the comparison is on the same tokens."""
    ref = engines["auto"].generate(PROMPTS, GREEDY, use_tqdm=False)
    full = [{"prompt_token_ids": list(r.prompt_token_ids) + list(r.outputs[0].token_ids)} for r in ref]
    diffs = []
    for r, o in zip(ref, engines["fp8"].generate(full, TEACHER, use_tqdm=False), strict=True):
        n = len(r.prompt_token_ids)
        for i, token in enumerate(r.outputs[0].token_ids):
            expected = r.outputs[0].logprobs[i][token].logprob
            diffs.append(abs(o.prompt_logprobs[n + i][token].logprob - expected))
    diffs_t = torch.tensor(diffs)
    # Measured: mean 0.025, max 0.09 nats (E4M3 keeps 3 mantissa bits; this model's logits sit
    # within ~0.1 of each other). The exact semantics are checked against transformers below.
    assert 0.0 < float(diffs_t.mean()) < 0.05, f"mean logprob difference {float(diffs_t.mean()):.4f}"
    assert float(diffs_t.max()) < 0.25, f"largest logprob difference {float(diffs_t.max()):.4f}"


def _reference_with_fake_fp8_kv(folder: str, prompts: list[str], tokenizer) -> list[torch.Tensor]:
    """transformers (float32) with each layer's K (after rotary) and V rounded through FP8 at that
    layer's checkpoint scales -- what an FP8 cache stores and reads back -- before attention."""
    pytest.importorskip("transformers")
    return prompt_logprobs_with_fp8_kv(folder, prompts, tokenizer, K_SCALES, V_SCALES)


@pytest.mark.parametrize("names", [
    {"k": "k_scale", "v": "v_scale"},  # llm-compressor, HF fp8 exports
    {"k": "k_proj.output_scale", "v": "v_proj.output_scale"},  # older compressed-tensors
    {"k": "k_proj.k_scale", "v": "v_proj.v_scale"},  # ModelOpt
], ids=["k_scale", "output_scale", "modelopt"])
def test_checkpoint_kv_scales_are_loaded_and_used(folder, engines, tmp_path, names):
    scaled = _with_scales(folder, str(tmp_path / "scaled"), names)
    llm = _llm(scaled, "fp8")
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        scales = layer.self_attn.kv_scales
        assert (scales.k_scale, scales.v_scale) == (K_SCALES[i], V_SCALES[i])
    got = _prompt_logprobs(llm, PROMPTS)
    ref = _reference_with_fake_fp8_kv(scaled, PROMPTS, llm.engine.tokenizer)
    unscaled = _prompt_logprobs(engines["fp8"], PROMPTS)
    for g, r, u in zip(got, ref, unscaled, strict=True):
        # The same arithmetic up to float32 order (a key at an fp8 rounding boundary could round one
        # step apart between the two rotary implementations: the bound leaves room for a few).
        assert float((g - r).abs().max()) < 5e-3
        assert float((u - r).abs().max()) > 0.02, "the scales made no difference"


def test_deprecated_single_kv_scale_sets_both(folder, tmp_path):
    scaled = _with_scales(folder, str(tmp_path / "kv"), {"k": "kv_scale"})  # K_SCALES under the old name
    llm = _llm(scaled, "fp8")
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        assert (layer.self_attn.kv_scales.k_scale, layer.self_attn.kv_scales.v_scale) == (K_SCALES[i], K_SCALES[i])


def test_auto_cache_accepts_and_ignores_checkpoint_scales(scaled_folder, engines):
    llm = _llm(scaled_folder, "auto")
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ref = engines["auto"].generate(PROMPTS, GREEDY, use_tqdm=False)
    for g, r in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].cumulative_logprob == r.outputs[0].cumulative_logprob


def test_fp8_prefix_caching_and_chunked_prefill(scaled_folder):
    """The same requests (sharing a 3-block prefix) through an engine with neither feature and one
    with both (8-token chunks): equal tokens, logprobs equal to float32 noise; the second engine
    does hit the prefix cache."""
    shared = " ".join(["Hello world! How are you today?"] * 4)
    prompts = [shared + " I am fine", shared + " The quick brown", shared + " Paris is"]
    plain = _llm(scaled_folder, "fp8", enable_prefix_caching=False)
    ref = [plain.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    both = _llm(scaled_folder, "fp8", enable_prefix_caching=True, max_num_batched_tokens=8, max_num_seqs=2)
    got = [both.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert both.engine.stats()["prefix_cache_hits"] > 0
    for g, r in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert abs(g.outputs[0].cumulative_logprob - r.outputs[0].cumulative_logprob) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_fp8_cache_on_cuda(scaled_folder, eager):
    """The Triton kernels over an FP8 cache in a float32 engine (with CUDA graphs, warm-up and
    capture run over it too): 4x the float32 cache's tokens, and the prompt logprobs of the CPU
    engine with the same checkpoint scales (the same arithmetic up to float32 order). Batch-1
    decodes (the fused one-token kernels write the cache) start as the batched ones do."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kw = dict(device="cuda", dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, max_num_seqs=8,
              enforce_eager=eager)
    auto = LLM(model=scaled_folder, **kw)
    fp8 = LLM(model=scaled_folder, kv_cache_dtype="fp8", **kw)
    assert fp8.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8.engine.kv_capacity_tokens == 4 * auto.engine.kv_capacity_tokens
    cpu = _prompt_logprobs(_llm(scaled_folder, "fp8"), PROMPTS)
    for g, c in zip(_prompt_logprobs(fp8, PROMPTS), cpu, strict=True):
        # The GPU's conversion lands on the neighbouring fp8 code now and then (test_kv_fp8.py), which
        # moves a tiny random model's logprobs by up to ~0.03 (H200).
        assert float((g - c).abs().max()) < 5e-2
    batched = fp8.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, b in zip(PROMPTS, batched, strict=True):
        alone = fp8.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4]


def test_sixteen_bit_cache_names_are_the_models_dtype(folder, engines):
    """vLLM's kv_cache_dtype "bfloat16" / "float16": a cache in the model's dtype, as "auto" gives; the
    other 16-bit type (or either under a float32 model) is refused naming the --dtype that would give it."""
    bf16 = _llm(folder, "bfloat16", dtype="bfloat16")
    assert bf16.engine.runner.kv_caches[0].dtype == torch.bfloat16
    auto = _llm(folder, "auto", dtype="bfloat16")
    assert [o.outputs[0].token_ids for o in bf16.generate(PROMPTS[:2], GREEDY)] == \
        [o.outputs[0].token_ids for o in auto.generate(PROMPTS[:2], GREEDY)]
    for cache, model in (("float16", "bfloat16"), ("bfloat16", "float32")):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{cache}'.*--dtype {cache}"):
            _llm(folder, cache, dtype=model)
