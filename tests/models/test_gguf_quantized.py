"""Quantized GGUF weights kept quantized on the CPU (layers/quant): the block decoders against the
gguf package's dequantizer, the packed int4 matmul against a float matmul, whole tiny models
against their dequantized selves, the dtype dispatch, and the embedded SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox.config import EngineConfig
from ferrox.layers.linear import Linear
from ferrox.layers.quant import Int4GroupWeight, decode_gguf
from ferrox.loader.model_loader import load_model, load_model_spec, quantized_gguf_runs
from ferrox.loader.source import resolve_model
from ferrox.models.llama import LlamaForCausalLM
from ferrox.worker.model_setup import load_everything

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

EXACT_BY_GGUF = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # the gguf package quantizes these
PROMPTS = [list(range(3, 40)), [5, 9, 11], list(range(100, 130))]


def _blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    if type_name in ("Q4_K", "Q6_K"):
        return tiny_models.random_kquant_blocks(type_name, rows, cols, seed=seed)
    if type_name == "Q5_K":  # same head as Q4_K (d, dmin), then 5-bit quants
        block, size = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q5_K]
        raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        raw[..., 0:4] = np.array([0.001, 0.0005], dtype=np.float16).view(np.uint8)
        return raw.reshape(rows, -1)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.02
    return quantize(w, gguf.GGMLQuantizationType[type_name])


def _reference(type_name: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return np.asarray(dequantize(raw, gguf.GGMLQuantizationType[type_name]), dtype=np.float32).reshape(rows, cols)


def test_int4_kernel_formula():
    """What int4_weight.py builds on: torch's op computes x @ ((q - 8) * s + z).T per group."""
    n, k, group = 32, 128, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    s, z = torch.rand(n, k // group), torch.randn(n, k // group)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([s, z], -1).transpose(0, 1).contiguous()
    x = torch.randn(3, k)
    w = (q - 8) * s.repeat_interleave(group, 1) + z.repeat_interleave(group, 1)
    torch.testing.assert_close(torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz), x @ w.T,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_name", [*EXACT_BY_GGUF, "Q4_K", "Q5_K"])
def test_exact_formats_decode_like_gguf(type_name):
    rows, cols = 48, 512
    raw = _blocks(type_name, rows, cols)
    ga = decode_gguf(type_name, raw, (rows, cols))
    assert ga.exact and ga.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    np.testing.assert_array_equal(ga.dequantize(), _reference(type_name, raw, rows, cols))


def test_q6_k_requantized_within_half_a_step():
    """Q6_K (16-wide sub-blocks) has no exact int4-group form: it is requantized to 8-bit groups
    of 32. The added error stays under half a step and well under Q6_K's own step."""
    rows, cols = 48, 512
    raw = _blocks("Q6_K", rows, cols)
    ref = _reference("Q6_K", raw, rows, cols)
    ga = decode_gguf("Q6_K", raw, (rows, cols))
    assert not ga.exact and ga.bits == 8
    err = np.abs(ga.dequantize() - ref).reshape(rows, cols // 32, 32).max(axis=-1)
    assert (err <= ga.scale * 0.5 + 1e-7).all()
    # Q6_K's step is d * |sc| per 16; the requantization error is a fraction of it.
    assert np.sqrt(np.mean((ga.dequantize() - ref) ** 2)) < 0.1 * np.abs(ref).max() / 63


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_packed_matmul_matches_float(type_name):
    """One plane (4-bit) and two planes (8-bit), rows padded to 16 (72 rows), a bias: close to the
    float matmul up to the bfloat16 activations/scales the fast kernel uses."""
    rows, cols = 72, 512
    raw = _blocks(type_name, rows, cols, seed=3)
    w = torch.from_numpy(_reference(type_name, raw, rows, cols))
    packed = Int4GroupWeight([decode_gguf(type_name, raw, (rows, cols))])
    assert packed.planes == (1 if type_name in ("Q4_1", "Q4_K") else 2)
    x, bias = torch.randn(5, cols), torch.randn(rows)
    y, ref = packed(x, bias), x @ w.T + bias
    assert y.shape == (5, rows) and y.dtype == torch.float32
    assert (y - ref).abs().max() <= 0.02 * (x.abs() @ w.abs().T).max()


def _load(path, keep_quantized: bool):
    source = resolve_model(str(path))
    return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu", keep_quantized=keep_quantized)


@pytest.mark.parametrize("type_name,tied", [("Q4_0", False), ("Q4_1", True), ("Q8_0", False), ("Q4_K", True),
                                            ("Q6_K", False)])
def test_tiny_quantized_model_matches_dequantized(tmp_path, type_name, tied):
    kquant = type_name.endswith("_K")
    size = {"hidden_size": 256, "intermediate_size": 512} if kquant else {}  # K-quants: 256-wide rows
    folder = tiny_models.make_tiny_llama(tmp_path / "hf", tie_word_embeddings=tied, seed=7, **size)
    path = tiny_models.export_gguf(folder, tmp_path / "tiny.gguf", tensor_type=type_name)
    quant, ref = _load(path, True), _load(path, False)
    linears = [m for m in quant.modules() if isinstance(m, Linear)]
    assert linears and all(m.quant is not None and m.weight.numel() == 0 for m in linears)
    assert quant.lm_head_quant is not None and ref.lm_head_quant is None
    assert all(m.quant is None for m in ref.modules() if isinstance(m, Linear))
    q_tokens, q_logits = run_greedy(quant, PROMPTS, 8, return_prefill_logits=True)
    r_tokens, r_logits = run_greedy(ref, PROMPTS, 8, return_prefill_logits=True)
    for a, b in zip(q_logits, r_logits, strict=True):
        assert (a - b).abs().max() <= 0.03 * b.abs().max() + 1e-3
    assert [t[0] for t in q_tokens] == [t[0] for t in r_tokens]


def test_mixed_float_and_quantized_shards_fall_back_to_float():
    """A merged layer whose shards come part float, part quantized runs dequantized, in one matmul."""
    from ferrox.layers.linear import MergedLinear
    from ferrox.layers.quant import QuantizedTensor

    layer = MergedLinear(64, {"gate": 32, "up": 32}, bias=False, dtype=torch.float32)
    raw = _blocks("Q8_0", 32, 64)
    layer.load_weight("weight", QuantizedTensor("Q8_0", raw, (32, 64)), "gate")
    up = torch.randn(32, 64)
    layer.load_weight("weight", up, "up")
    layer.finalize_quantized()
    assert layer.quant is None
    torch.testing.assert_close(layer.weight[:32], torch.from_numpy(_reference("Q8_0", raw, 32, 64)))
    torch.testing.assert_close(layer.weight[32:], up)


def test_quantized_only_on_cpu_with_one_rank():
    assert quantized_gguf_runs(LlamaForCausalLM, torch.device("cpu"), 1)
    assert not quantized_gguf_runs(LlamaForCausalLM, torch.device("cpu"), 2)
    assert not quantized_gguf_runs(LlamaForCausalLM, torch.device("cuda"), 1)


@pytest.mark.parametrize("dtype,quantized", [("auto", True), ("float32", False)])
def test_engine_dtype_dispatch(tmp_path, dtype, quantized):
    """dtype 'auto' keeps a quantized GGUF quantized on the CPU; an explicit dtype dequantizes."""
    folder = tiny_models.make_tiny_llama(tmp_path / "hf", seed=2)
    path = tiny_models.export_gguf(folder, tmp_path / "tiny.gguf", tensor_type="Q4_1")
    loaded = load_everything(EngineConfig(model=path, dtype=dtype, device="cpu", kv_cache_memory=64 << 20,
                                          max_model_len=256))
    assert loaded.dtype == torch.float32
    assert (loaded.model.model.layers[0].mlp.gate_up_proj.quant is not None) is quantized
    assert (loaded.model.lm_head_quant is not None) is quantized


@pytest.fixture(scope="module")
def smollm_quantized(smollm_source):
    return load_model(smollm_source, load_model_spec(smollm_source), dtype=torch.float32, device="cpu",
                      keep_quantized=True)


def test_embedded_model_quantized_greedy_close_to_dequantized(smollm_tokenizer, smollm_model, smollm_quantized):
    """The embedded Q4_1 SmolLM2 kept quantized answers as the dequantized one; over a few prompts
    the greedy tokens agree up to the first near-tie (bfloat16 activations in the int4 kernel)."""
    prompts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
               "The quick brown fox", "def fibonacci(n):", "Once upon a time"]
    ids = [smollm_tokenizer.encode(p) for p in prompts]
    q_tokens = run_greedy(smollm_quantized, ids, 24)
    r_tokens = run_greedy(smollm_model, ids, 24)
    assert smollm_tokenizer.decode(q_tokens[0]).startswith("The capital of France is Paris.")
    agree = sum(a == b for q, r in zip(q_tokens, r_tokens, strict=True) for a, b in zip(q, r, strict=True))
    assert agree / sum(len(r) for r in r_tokens) >= 0.75, (q_tokens, r_tokens)
