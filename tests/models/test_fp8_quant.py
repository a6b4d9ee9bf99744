"""FP8 weights end to end (layers/quant/fp8.py, compressed_tensors.py): a tiny Llama quantized online
(`quantization="fp8"`), and written as checkpoints in the "fp8" layout and in llm-compressor's
compressed-tensors float8 layout, each run by `LLM` and compared with transformers on the
dequantized weights; refusals by name; tensor-parallel shards against the unsharded layer.

The reference quantizer is written here. The reference model is transformers with every decoder
projection's weight dequantized and its input fake-quantized to fp8 per token (or with the static
input scale) -- the engine's W8A8 path, at every step size as in vLLM (one-token steps included).
Greedy tokens must then be identical and logprobs equal to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.quant.compressed_tensors import CompressedTensorsConfig
from ferrox.layers.quant.fp8 import Fp8Config
from ferrox.layers.quant.fp8_linear import Fp8Linear

from tests.helpers.quant_checkpoints import (
    PROJ,
    assert_follows_reference,
    calibrate_input_amax,
    dequantized_reference,
    reference_greedy,
    write_checkpoint,
)
from tests.helpers.tp_layers import SHARDS, ranks_output, tp_layer, whole_and_ranks

# transformers 5 renames past_key_values; the old name keeps the reference loop working on 4.x too.
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

FP8 = torch.float8_e4m3fn
PROMPTS = [[5, 9, 33, 7, 100, 41], list(range(40, 53)), [17]]  # [17]: a one-token prefill
NEW_TOKENS = 8
# Static input scales differ between a merged layer's shards (calibrated on the same input, they
# would not), so the test sees which one the engine takes: the largest.
INPUT_SCALE_FACTOR = {"k_proj": 1.5, "v_proj": 2.0, "up_proj": 1.75}
CT_FLOAT8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
             "actorder": None, "observer": "minmax", "observer_kwargs": {}}


# ---- the reference quantizer --------------------------------------------------------------------
def quantize_ref(w: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes, float32 scales [rows] or []): absmax of each row (or of the tensor) -> 448."""
    amax = w.float().abs().amax(dim=1) if per_row else w.float().abs().amax()
    scale = amax.clamp(min=1e-12) / 448.0
    codes = (w.float() / (scale[:, None] if per_row else scale)).clamp(-448, 448).to(FP8)
    return codes, scale


def fake_quantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x rounded through fp8 per token (scale None) or with a per-tensor scale."""
    xf = x.float()
    if scale is None:
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (xf / scale).clamp(-448, 448).to(FP8).float() * scale


def _module(tensor_name: str) -> str:
    return tensor_name.rsplit(".", 1)[0]


# ---- checkpoints --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def input_amax(float_folder) -> dict[str, float]:
    """Calibration: each projection's largest input over the test prompts, in the float model."""
    return calibrate_input_amax(float_folder, PROMPTS)


def static_input_scales(input_amax: dict[str, float]) -> dict[str, float]:
    return {name: amax / 448.0 * INPUT_SCALE_FACTOR.get(name.rsplit(".", 1)[1], 1.0)
            for name, amax in input_amax.items()}


def quantized_tensors(float_weights, *, per_row: bool, input_scale: dict[str, float] | None = None,
                      scale_shape: str = "flat", scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The float checkpoint with every decoder projection in fp8: weight, weight_scale (shape "flat":
    [rows] or [], "column": [rows, 1] or [1]) and input_scale (one value) where given."""
    out = {}
    for name, w in float_weights.items():
        module = _module(name)
        if not module.endswith(PROJ) or not name.endswith(".weight"):
            out[name] = w
            continue
        codes, scale = quantize_ref(w, per_row)
        if scale_shape == "column":
            scale = scale.reshape(-1, 1) if per_row else scale.reshape(1)
        out[name] = codes
        out[f"{module}.weight_scale"] = scale.to(scale_dtype)
        if input_scale is not None:
            out[f"{module}.input_scale"] = torch.tensor(input_scale[module], dtype=torch.float32)
    return out


# ---- the reference model ------------------------------------------------------------------------
def reference_model(float_folder: str, tensors: dict[str, torch.Tensor], activations: str):
    """transformers with the dequantized projections of `tensors`; activations: "token" (dynamic per
    token), "static" (the checkpoint's input scales, the largest of a merged layer's shards), or
    "weight-only"."""
    if activations == "weight-only":
        return dequantized_reference(float_folder, tensors)
    return dequantized_reference(float_folder, tensors, lambda x, static: fake_quantize(
        x, torch.tensor(static) if activations == "static" else None))


def engine_greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Each prompt alone, its greedy tokens and their logprobs."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    results = []
    for prompt in PROMPTS:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        results.append((list(out.token_ids), [step[t].logprob for step, t in zip(out.logprobs, out.token_ids,
                                                                                   strict=True)]))
    return results


def make_llm(folder: str, **kw) -> LLM:
    return LLM(model=folder, device="cpu", kv_cache_memory=8 << 20, max_model_len=256, **kw)


def assert_matches_reference(llm: LLM, reference) -> None:
    try:
        got = engine_greedy(llm)
    finally:
        llm.engine.shutdown()
    for prompt, (tokens, logprobs) in zip(PROMPTS, got, strict=True):
        ref_tokens, ref_logprobs = reference_greedy(reference, prompt, NEW_TOKENS)
        assert tokens == ref_tokens, prompt
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


# ---- the runner ---------------------------------------------------------------------------------
def test_scaled_mm_call_computes_the_dequantized_product():
    """The GPU's W8A8 call (torch._scaled_mm with row-wise scales, weight transposed, bias after a
    float32 output) on torch's CPU kernel, against the product of the dequantized operands."""
    from ferrox.layers.quant.fp8_linear import quantize_activations_torch, scaled_mm

    torch.manual_seed(2)
    x, w, bias = torch.randn(7, 64), torch.randn(48, 64) * 0.1, torch.randn(48)
    xq, x_scale = quantize_activations_torch(x)
    wq, w_scale = quantize_ref(w, per_row=True)
    try:
        got = scaled_mm(xq, x_scale, wq, w_scale, bias, torch.float32, fast_accum=False)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch has no CPU kernel for row-wise torch._scaled_mm ({e})")
    expected = (xq.double() * x_scale.double()) @ (wq.double() * w_scale.double()[:, None]).t() + bias.double()
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_runner_checks_its_inputs():
    codes, scale = quantize_ref(torch.randn(16, 32), per_row=True)
    with pytest.raises(ValueError, match="static activations need an input_scale"):
        Fp8Linear(codes, scale, activations="static")
    with pytest.raises(ValueError, match="activations must be one of"):
        Fp8Linear(codes, scale, activations="per-block")
    with pytest.raises(ValueError, match="need an fp8 weight"):
        Fp8Linear(codes.float(), scale, activations="dynamic-token")


# ---- end to end ---------------------------------------------------------------------------------
def test_online_fp8_matches_the_dequantized_model(float_folder, float_weights):
    llm = make_llm(float_folder, quantization="fp8")
    runner = llm.engine.runner.model.model.layers[0].mlp.gate_up_proj.quant
    assert isinstance(runner, Fp8Linear) and runner.weight.dtype == FP8 and runner.activations == "dynamic-token"
    assert_matches_reference(llm, reference_model(float_folder, quantized_tensors(float_weights, per_row=True),
                                                  "token"))


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_fp8_layout_checkpoint(tmp_path, float_folder, float_weights, input_amax, scheme):
    """AutoFP8-style: per-tensor scales (q/k/v and gate/up each their own), static input scales or none."""
    static = scheme == "static"
    scales = static_input_scales(input_amax) if static else None
    tensors = quantized_tensors(float_weights, per_row=False, input_scale=scales)
    config = {"quant_method": "fp8", "activation_scheme": scheme, "ignored_layers": ["lm_head"]}
    folder = write_checkpoint(float_folder, tmp_path / scheme, config, tensors)
    assert_matches_reference(make_llm(folder), reference_model(float_folder, tensors, scheme.replace("dynamic",
                                                                                                     "token")))


@pytest.mark.parametrize("weights,inputs", [("channel", "token"), ("tensor", None), ("tensor", "static")],
                         ids=["w-channel-a-token", "w-tensor-weight-only", "w-tensor-a-static"])
def test_compressed_tensors_float8_checkpoint(tmp_path, float_folder, float_weights, input_amax, weights, inputs):
    """llm-compressor's float8 layout: scales [rows, 1] or [1] in the model dtype."""
    static = inputs == "static"
    scales = static_input_scales(input_amax) if static else None
    tensors = quantized_tensors(float_weights, per_row=weights == "channel", input_scale=scales,
                                scale_shape="column", scale_dtype=torch.bfloat16)
    activations = None if inputs is None else {**CT_FLOAT8, "strategy": "token" if inputs == "token" else "tensor",
                                               "dynamic": not static}
    config = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**CT_FLOAT8, "strategy": weights,
                                                                         "dynamic": False},
                                      "input_activations": activations, "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": 1.2,
    }
    folder = write_checkpoint(float_folder, tmp_path / "ct", config, tensors)
    mode = {"token": "token", "static": "static", None: "weight-only"}[inputs]
    assert_matches_reference(make_llm(folder), reference_model(float_folder, tensors, mode))


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_dummy_weights_of_an_fp8_checkpoint(tmp_path, float_folder, scheme):
    """load_format="dummy" (benchmarks) fills the checkpoint method's fp8 tensors with random ones."""
    folder = write_checkpoint(float_folder, tmp_path / "dummy", {"quant_method": "fp8", "activation_scheme": scheme},
                              {})
    llm = make_llm(folder, load_format="dummy")
    try:
        (tokens, logprobs), *_ = engine_greedy(llm)
        qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    finally:
        llm.engine.shutdown()
    assert len(tokens) == NEW_TOKENS and all(lp == lp and lp <= 0 for lp in logprobs)  # no NaN
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.min() > 0
    assert 0.01 < float(qkv.quant.dequantize().std()) < 0.04  # the float dummy weights' std, 0.02


# ---- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("config,field", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 96]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "fp8", "activation_scheme": "per-group"}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "static", "kv_cache_scheme": "static"}, "kv_cache_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_bits": 8}, "weight_bits"),
])
def test_fp8_layout_refusals(config, field):
    with pytest.raises(UnsupportedModelError, match=field):
        Fp8Config.from_hf(config)


def _ct(**changes):
    group = {"targets": ["Linear"], "weights": {**CT_FLOAT8, "strategy": "channel", "dynamic": False},
             "input_activations": {**CT_FLOAT8, "strategy": "token", "dynamic": True}}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": group}}
    for key, value in changes.items():
        if key in ("weights", "input_activations"):
            group[key] = {**group[key], **value}
        elif key in ("targets", "output_activations"):
            group[key] = value
        else:
            config[key] = value
    return config


@pytest.mark.parametrize("config,field", [
    (_ct(format="pack-quantized", weights={"num_bits": 4, "type": "int"}), "format"),
    (_ct(weights={"num_bits": 4, "type": "int"}), "4-bit int"),
    (_ct(weights={"num_bits": 8, "type": "int"}), "8-bit int"),
    (_ct(weights={"strategy": "group", "group_size": 128}), "group_size"),
    (_ct(weights={"strategy": "block", "block_structure": [128, 128]}), "input_activations: strategy 'token'"),
    (_ct(weights={"strategy": "block", "block_structure": [128, 100]}), "block_structure"),
    (_ct(weights={"symmetric": False}), "symmetric"),
    (_ct(input_activations={"strategy": "token", "dynamic": False}), "input_activations"),
    (_ct(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}), "sparsity_config"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "channel"}), "kv_cache_scheme"),
    (_ct(targets=["re:.*q_proj"]), "targets"),
    (_ct(output_activations={**CT_FLOAT8, "strategy": "token"}), "output_activations"),
    (_ct(transform_config={"config_groups": {}}), "transform_config"),
    (_ct(config_groups={"a": {}, "b": {}}), "config_groups"),
    (_ct(weights={"zero_point_dtype": "int8"}), "zero_point_dtype"),
])
def test_compressed_tensors_refusals(config, field):
    with pytest.raises(UnsupportedModelError, match=field):
        CompressedTensorsConfig.from_hf(config)


def test_kv_cache_scheme_per_tensor_fp8_is_taken_others_refused():
    CompressedTensorsConfig.from_hf(_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}))
    with pytest.raises(UnsupportedModelError, match="please report"):
        CompressedTensorsConfig.from_hf(_ct(kv_cache_scheme={"num_bits": 4, "type": "int"}))


def test_a_float_weight_in_an_fp8_checkpoint_is_named(tmp_path, float_folder, float_weights):
    tensors = quantized_tensors(float_weights, per_row=False)
    tensors["model.layers.1.mlp.down_proj.weight"] = float_weights["model.layers.1.mlp.down_proj.weight"]
    folder = write_checkpoint(float_folder, tmp_path / "mixed", {"quant_method": "fp8",
                                                                 "activation_scheme": "dynamic"}, tensors)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*float8_e4m3fn"):
        make_llm(folder)


def test_static_scheme_needs_input_scales(tmp_path, float_folder, float_weights):
    folder = write_checkpoint(float_folder, tmp_path / "no-input-scale",
                              {"quant_method": "fp8", "activation_scheme": "static"},
                              quantized_tensors(float_weights, per_row=False))
    with pytest.raises(ModelLoadError, match="missing .*input_scale"):
        make_llm(folder)


# ---- tensor parallelism (the layers of two ranks, built in this process) ------------------------
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("layout", ["fp8-static-tensor", "ct-channel"])
def test_tensor_parallel_shards_match_the_whole_layer(tmp_path, kind, layout):
    """Two ranks' layers read their parts of the same safetensors file (lazy slices, as the engine's
    sharded load does); column-parallel outputs concatenate, row-parallel ones sum, to the whole
    layer's (exact, except W8A8 row-parallel ranks, which each scale their own input columns)."""
    torch.manual_seed(0)
    per_row = layout == "ct-channel"
    tensors: dict[str, torch.Tensor] = {}
    in_features = 128 if kind == "down" else 64
    for shard, rows in SHARDS[kind].items():
        prefix = f"{shard}." if shard else ""
        codes, scale = quantize_ref(torch.randn(rows, in_features) * 0.1, per_row)
        tensors[f"{prefix}weight"] = codes
        tensors[f"{prefix}weight_scale"] = scale.reshape(-1, 1) if per_row else scale
        tensors[f"{prefix}input_scale"] = torch.tensor(0.01 * (1 + len(tensors)))
        tensors[f"{prefix}bias"] = torch.randn(rows)
    if per_row:
        config = CompressedTensorsConfig.from_hf(_ct())
    else:
        config = Fp8Config.from_hf({"quant_method": "fp8", "activation_scheme": "static"})
    whole, ranks = whole_and_ranks(kind, config, tensors, tmp_path / "layer.safetensors")
    for tokens in (1, 5):
        x = torch.randn(tokens, in_features)
        expected = whole(x)
        got = ranks_output(kind, ranks, x)
        tolerance = 1e-5 if kind != "down" else 0.05
        torch.testing.assert_close(got, expected, atol=tolerance * expected.abs().max().item(), rtol=0)


def test_online_fp8_column_shards_equal_the_whole_layer():
    """Online quantization is per row, so a column-parallel shard quantizes exactly as the whole."""
    torch.manual_seed(1)
    weight = torch.randn(256, 64) * 0.05
    whole = tp_layer("gate_up", 0, 1, Fp8Config.online())
    ranks = [tp_layer("gate_up", r, 2, Fp8Config.online()) for r in range(2)]
    for layer in (whole, *ranks):
        layer.load_weight("weight", weight[:128], "gate")
        layer.load_weight("weight", weight[128:], "up")
        layer.finalize_quantized()
    assert whole.weight.dtype == FP8 and whole.weight_scale.shape == (256,)
    assert torch.equal(torch.cat([ranks[0].weight[:64], ranks[1].weight[:64]]).float(), whole.weight[:128].float())
    assert torch.equal(torch.cat([ranks[0].weight_scale[64:], ranks[1].weight_scale[64:]]), whole.weight_scale[128:])


def test_tensor_parallel_engine_matches_one_rank(tmp_path, float_folder, float_weights):
    """Two rank processes (gloo) run a weight-only FP8 checkpoint as one process does: every rank
    reads its rows / columns and per-row scales of the same fp8 tensors."""
    tensors = quantized_tensors(float_weights, per_row=True, scale_shape="column", scale_dtype=torch.bfloat16)
    group = {"targets": ["Linear"], "weights": {**CT_FLOAT8, "strategy": "channel", "dynamic": False},
             "input_activations": None}
    folder = write_checkpoint(float_folder, tmp_path / "w8a16", {"quant_method": "compressed-tensors",
                              "format": "naive-quantized", "config_groups": {"group_0": group}}, tensors)
    results = []
    for tp in (1, 2):
        llm = make_llm(folder, tensor_parallel_size=tp)
        try:
            results.append(engine_greedy(llm))
        finally:
            llm.engine.shutdown()
    for (tokens, logprobs), (tp_tokens, tp_logprobs) in zip(*results, strict=True):
        assert tp_tokens == tokens
        torch.testing.assert_close(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_online_fp8_on_cuda(float_folder, float_weights, enforce_eager):
    """On the GPU in float32: W8A8 prefill through cuBLASLt, one-token steps through the fused fp8
    GEMVs (or, eager, the same kernels layer by layer), against the same reference."""
    llm = LLM(model=float_folder, quantization="fp8", dtype="float32", enforce_eager=enforce_eager,
              max_model_len=256, kv_cache_memory=64 << 20)
    reference = reference_model(float_folder, quantized_tensors(float_weights, per_row=True), "token")
    try:
        got = engine_greedy(llm)
    finally:
        llm.engine.shutdown()
    for prompt, (tokens, logprobs) in zip(PROMPTS, got, strict=True):
        # W8A8 prefill on cuBLASLt (fast accumulation) differs from the CPU reference by ~1e-3, and
        # with every step's activations rounded to fp8 such a difference moves a few input codes
        # a step: logprobs differ by up to ~0.045 nats (H200; the fused and the layer-by-layer
        # one-token paths alike), enough to flip a near-tie. So the reference is fed the engine's
        # tokens, each of which must be its best up to 0.1 nats, with logprobs within 0.1.
        assert_follows_reference(reference, prompt, tokens, logprobs)
