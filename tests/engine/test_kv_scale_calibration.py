"""calculate_kv_scales (vLLM's): an FP8 KV cache's per-layer scales measured on the first step that
serves requests (attention/kv_scale_calibration.py).

- the measure itself: rows past the step's tokens ignored, vLLM's divisors (200, 100) and their
  environment variables, a layer of zeros keeps its scale, a layer not armed is left alone;
- a tiny Llama on CPU: nothing is measured before the first request; its prefill measures every layer
  as transformers' K/V maxima over that prompt say; later requests change nothing; the engine then
  computes what transformers computes with K/V rounded through FP8 at those scales, closer to the
  float32 cache than the unmeasured 1.0;
- tensor parallelism (2 ranks, gloo): each rank measures its own KV heads -- the other rank is told by
  the step -- checked through the outputs against transformers with one scale per KV head;
- DeepSeek's latent cache measures its latent rows, for both scales;
- refused by name with kv_cache_dtype "auto" and for a pooling model;
- GPU: the CUDA engine (graphs, warm-up) measures the CPU engine's scales.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import KVCacheScales
from ferrox.attention.kv_scale_calibration import KvScaleCalibration, calibrate_if_armed
from ferrox.config import EngineConfig

from tests.helpers.fp8_kv_reference import engine_prompt_logprobs, kv_head_maxima, prompt_logprobs_with_fp8_kv
from tests.helpers.tiny_deepseek import make_tiny_deepseek
from tests.helpers.tiny_models import make_tiny_llama

FIRST = "The quick brown fox jumps over the lazy dog. " * 3
PROMPTS = ["Paris is the capital of", "def add(a, b):\n    return", "Numbers: 0 1 2 3 4 5"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("kvcal") / "llama", num_layers=2, seed=5)


def _llm(model: str, kv_cache_dtype: str = "fp8", **kwargs) -> LLM:
    return LLM(model=model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=4 << 20, max_model_len=512, seed=0,
               **kwargs)


def _scales(llm: LLM) -> list[tuple[float, float]]:
    return [(m.k_scale, m.v_scale) for m in llm.engine.runner.model.modules() if isinstance(m, KVCacheScales)]


_prompt_logprobs = engine_prompt_logprobs


# ---- the measure ----------------------------------------------------------------------------------
def test_measure_takes_the_step_rows_and_vllm_divisors(monkeypatch):
    scales = KVCacheScales("cpu")
    k = torch.tensor([[[0.5, -3.0]], [[1.0, 2.0]], [[900.0, 0.0]]])  # row 2 is padding past the step
    v = torch.tensor([[[0.25, 0.1]], [[-5.0, 1.0]], [[-700.0, 0.0]]])
    calibrate_if_armed(scales, k, v, 2)
    assert (scales.k_scale, scales.v_scale) == (1.0, 1.0), "a layer not armed is left alone"
    scales.calibrating = True
    calibrate_if_armed(scales, k, v, 2)
    assert (scales.k_scale, scales.v_scale) == (3.0 / 200, 5.0 / 100)
    assert scales.scales.tolist() == pytest.approx([3.0 / 200, 5.0 / 100])
    assert not scales.calibrating and scales.calibrated
    calibrate_if_armed(scales, 2 * k, 2 * v, 2)  # measured once
    assert scales.k_scale == 3.0 / 200
    monkeypatch.setenv("K_SCALE_CONSTANT", "50")
    monkeypatch.setenv("V_SCALE_CONSTANT", "25")
    scales.calibrating = True
    calibrate_if_armed(scales, k, v, 2)
    assert (scales.k_scale, scales.v_scale) == (3.0 / 50, 5.0 / 25)


def test_a_layer_of_zeros_keeps_its_scale_and_bad_divisors_are_named(monkeypatch):
    scales = KVCacheScales("cpu")
    scales.set_scale("k", 0.5)
    scales.calibrating = True
    calibrate_if_armed(scales, torch.zeros(4, 1, 2), torch.ones(4, 1, 2), 4)
    assert (scales.k_scale, scales.v_scale) == (0.5, 1.0 / 100)
    monkeypatch.setenv("V_SCALE_CONSTANT", "0")
    scales.calibrating = True
    with pytest.raises(ValueError, match="V_SCALE_CONSTANT"):
        calibrate_if_armed(scales, torch.ones(4, 1, 2), torch.ones(4, 1, 2), 4)


def test_refused_without_an_fp8_cache():
    with pytest.raises(ValueError, match="calculate_kv_scales.*'auto'"):
        EngineConfig(calculate_kv_scales=True)


# ---- engines ----------------------------------------------------------------------------------------
def test_first_request_measures_every_layer_as_transformers_says(folder):
    pytest.importorskip("transformers")
    llm = _llm(folder, calculate_kv_scales=True)
    assert _scales(llm) == [(1.0, 1.0)] * 2, "measured before any request"
    first = llm.generate([FIRST], GREEDY, use_tqdm=False)[0]
    maxima = kv_head_maxima(folder, first.prompt_token_ids)
    measured = _scales(llm)
    for (k_scale, v_scale), (k_max, v_max) in zip(measured, maxima, strict=True):
        assert k_scale == pytest.approx(float(k_max.max()) / 200, rel=1e-5)
        assert v_scale == pytest.approx(float(v_max.max()) / 100, rel=1e-5)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _scales(llm) == measured, "a later step measured again"

    tokenizer = llm.engine.tokenizer
    got = _prompt_logprobs(llm, PROMPTS)
    ref = prompt_logprobs_with_fp8_kv(folder, PROMPTS, tokenizer, [k for k, _ in measured], [v for _, v in measured])
    for g, r in zip(got, ref, strict=True):
        assert float((g - r).abs().max()) < 5e-3


def _loud_copy(folder: str, dest: str, factor: float = 1000.0) -> str:
    """The same function with keys and values `factor` times larger (q_proj and o_proj divided by it): the
    scores and the outputs are unchanged, but K/V run far past FP8's +-448."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    path = os.path.join(dest, "model.safetensors")
    tensors = load_file(path)
    for name in list(tensors):
        for proj, f in (("k_proj", factor), ("v_proj", factor), ("q_proj", 1 / factor), ("o_proj", 1 / factor)):
            if f".self_attn.{proj}." in name:
                tensors[name] = tensors[name] * f
    save_file(tensors, path, metadata={"format": "pt"})
    return dest


def test_measured_scales_keep_large_keys_and_values(folder, tmp_path):
    """What the measuring is for: keys and values past +-448 saturate at scale 1.0 and wreck the
    output; measured, the cache rounds them as it rounds ordinary ones."""
    loud = _loud_copy(folder, str(tmp_path / "loud"))
    exact = _prompt_logprobs(_llm(loud, "auto"), PROMPTS)
    unit = _prompt_logprobs(_llm(loud), PROMPTS)
    llm = _llm(loud, calculate_kv_scales=True)
    llm.generate([FIRST], GREEDY, use_tqdm=False)
    measured = _prompt_logprobs(llm, PROMPTS)
    err = sum(float((m - e).abs().mean()) for m, e in zip(measured, exact, strict=True)) / len(PROMPTS)
    err_unit = sum(float((u - e).abs().mean()) for u, e in zip(unit, exact, strict=True)) / len(PROMPTS)
    # Measured: 0.021 nats against 0.63 (a mean over the prompts' tokens).
    assert err < 0.05 and err_unit > 10 * err, (err, err_unit)


@pytest.mark.slow
def test_tensor_parallel_ranks_measure_their_own_heads(folder):
    """Two ranks, one KV head each: rank r's scales are its head's maxima over the first prompt."""
    pytest.importorskip("transformers")
    llm = _llm(folder, calculate_kv_scales=True, tensor_parallel_size=2)
    try:
        first = llm.generate([FIRST], GREEDY, use_tqdm=False)[0]
        got = _prompt_logprobs(llm, PROMPTS)
        driver = _scales(llm)
        tokenizer = llm.engine.tokenizer
    finally:
        llm.engine.shutdown()
    maxima = kv_head_maxima(folder, first.prompt_token_ids, ranks=2)
    for (k_scale, v_scale), (k_max, v_max) in zip(driver, maxima, strict=True):
        assert k_scale == pytest.approx(float(k_max[0]) / 200, rel=1e-5)  # rank 0 holds KV head 0
        assert v_scale == pytest.approx(float(v_max[0]) / 100, rel=1e-5)
    ref = prompt_logprobs_with_fp8_kv(folder, PROMPTS, tokenizer, [k / 200 for k, _ in maxima],
                                      [v / 100 for _, v in maxima])
    # Rank 1 unmeasured (its scales 1.0) would put head 1's small keys and values among FP8's
    # subnormals: far outside this bound (the single-rank test above shows the gap).
    for g, r in zip(got, ref, strict=True):
        assert float((g - r).abs().max()) < 5e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_latent_cache_measures_its_rows_for_both_scales(tmp_path, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = make_tiny_deepseek(tmp_path / "deepseek", version=2, q_lora_rank=None, num_layers=2)
    llm = _llm(model, calculate_kv_scales=True, device=device)
    llm.generate([FIRST], GREEDY, use_tqdm=False)
    scales = _scales(llm)
    assert len(scales) == 2
    for k_scale, v_scale in scales:
        assert k_scale != 1.0
        assert v_scale == pytest.approx(2 * k_scale, rel=1e-6)  # one latent row, divided by 200 and by 100


def test_pooling_model_is_refused(folder):
    with pytest.raises(ValueError, match="calculate_kv_scales: a pooling model"):
        _llm(folder, calculate_kv_scales=True, runner="pooling")


def test_a_layer_the_step_never_reaches_is_logged(folder, caplog):
    llm = _llm(folder)
    with caplog.at_level("WARNING", logger="ferrox.attention.kv_scale_calibration"):
        with KvScaleCalibration(llm.engine.runner.model):
            pass
    assert "2 of 2 attention layers wrote no K/V" in caplog.text
    assert _scales(llm) == [(1.0, 1.0)] * 2


@pytest.mark.gpu
def test_cuda_engine_measures_the_cpu_scales(folder):
    """With CUDA graphs captured and the warm-up run over the FP8 cache, the first request still
    measures (eagerly), as the CPU engine does; later steps replay graphs reading the new scales."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cpu = _llm(folder, calculate_kv_scales=True, device="cpu")
    cpu.generate([FIRST], GREEDY, use_tqdm=False)
    gpu = _llm(folder, calculate_kv_scales=True, device="cuda", dtype="float32", max_num_seqs=8)
    assert gpu.engine.runner.decode_graph_sizes(), "no CUDA graphs"
    gpu.generate([FIRST], GREEDY, use_tqdm=False)
    for (gk, gv), (ck, cv) in zip(_scales(gpu), _scales(cpu), strict=True):
        assert gk == pytest.approx(ck, rel=1e-3) and gv == pytest.approx(cv, rel=1e-3)
    assert torch.equal(next(m for m in gpu.engine.runner.model.modules() if isinstance(m, KVCacheScales)).scales.cpu(),
                       torch.tensor(_scales(gpu)[0], dtype=torch.float32))
    for g, c in zip(_prompt_logprobs(gpu, PROMPTS), _prompt_logprobs(cpu, PROMPTS), strict=True):
        assert float((g - c).abs().max()) < 5e-2
