"""compressed-tensors int8 checkpoints (layers/quant/compressed_tensors_int8.py, int8_linear.py) end to
end: a tiny Llama written by tests/helpers/int8_checkpoints.py in each supported scheme (per-channel
weights with dynamic per-token activations, per-tensor weights with static input scales, dynamic
per-tensor activations, weight-only), run by `LLM`, against transformers on the dequantized weights
with every projection's input rounded through int8 as the scheme says (greedy tokens identical,
logprobs to float32 rounding); refusals by field; zero points; tensor-parallel shards against the
whole layer and the two-rank engine against one rank; dummy weights.
"""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.decode_path import DecodePath
from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.linear import Linear
from ferrox.layers.quant.compressed_tensors import CompressedTensorsScheme
from ferrox.layers.quant.compressed_tensors_int8 import CompressedTensorsInt8Config
from ferrox.layers.quant.config import resolve_quant_config
from ferrox.layers.quant.int8_linear import Int8Linear, quantize_int8_torch
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model

from tests.helpers.int8_checkpoints import (
    fake_quantize,
    int8_config,
    int8_tensors,
    pack_int8,
    packed_int8_tensors,
    quantize_weight,
    reference_model,
)
from tests.helpers.quant_checkpoints import (
    assert_follows_reference,
    calibrate_input_amax,
    edited_copy,
    engine_greedy,
    load_checkpoint,
    make_llm,
    reference_greedy,
    write_checkpoint,
)
from tests.helpers.tp_layers import SHARDS, ranks_output, whole_and_ranks

# transformers 5 renames past_key_values; the old name keeps the reference loop working on 4.x too.
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[5, 9, 33, 7, 100, 41], list(range(40, 53)), [17]]  # [17]: a one-token prefill
NEW_TOKENS = 8
# Static input scales differ between a merged layer's shards (calibrated on the same input, they would
# not), so the test sees which one the engine takes: the largest.
INPUT_SCALE_FACTOR = {"k_proj": 1.5, "v_proj": 2.0, "up_proj": 1.75}

# case -> (weights strategy, activations, format, weight_scale dtype, all-zero zero points stored)
SCHEMES = {
    "w-channel-a-token": ("channel", "token", "int-quantized", torch.bfloat16, False),
    "w-tensor-a-static": ("tensor", "static", "int-quantized", torch.float32, True),
    "w-channel-a-tensor": ("channel", "tensor", "int-quantized", torch.bfloat16, False),
    "w-channel-weight-only": ("channel", None, "naive-quantized", torch.bfloat16, False),
    "w-channel-packed": ("channel", None, "pack-quantized", torch.bfloat16, False),
}
ACTIVATIONS = {"token": "dynamic-token", "tensor": "dynamic-tensor", "static": "static", None: "weight-only"}


@pytest.fixture(scope="module")
def static_scales(float_folder) -> dict[str, float]:
    """Calibrated input scales (the float model's input absmax over the prompts / 127), uneven per shard."""
    return {name: amax / 127.0 * INPUT_SCALE_FACTOR.get(name.rsplit(".", 1)[1], 1.0)
            for name, amax in calibrate_input_amax(float_folder, PROMPTS).items()}


@pytest.fixture(scope="module")
def checkpoints(float_folder, float_weights, static_scales, tmp_path_factory):
    """Case name -> (folder, tensors), written on first use."""
    built: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}

    def get(case: str) -> tuple[str, dict[str, torch.Tensor]]:
        if case not in built:
            weights, activations, fmt, scale_dtype, zero_points = SCHEMES[case]
            tensors = int8_tensors(float_weights, weights, scale_dtype=scale_dtype, zero_points=zero_points,
                                   input_scales=static_scales if activations == "static" else None)
            stored = packed_int8_tensors(tensors) if fmt == "pack-quantized" else tensors
            folder = write_checkpoint(float_folder, tmp_path_factory.mktemp(case), int8_config(weights, activations,
                                                                                             fmt=fmt), stored)
            built[case] = folder, tensors
        return built[case]

    return get


# ---- end to end -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(SCHEMES))
def test_checkpoint_matches_the_fake_quantized_reference(float_folder, checkpoints, case):
    folder, tensors = checkpoints(case)
    llm = make_llm(folder)
    model = llm.engine.runner.model
    runners = [m.quant for m in model.modules() if isinstance(m, Linear)]
    assert runners and all(isinstance(r, Int8Linear) and r.weight.dtype == torch.int8 for r in runners)
    assert {r.activations for r in runners} == {ACTIVATIONS[SCHEMES[case][1]]}
    assert type(model.model.decode_path) is DecodePath  # (the CPU runs the general path)
    got = engine_greedy(llm, PROMPTS)
    reference = reference_model(float_folder, tensors, SCHEMES[case][1])
    for prompt, (tokens, logprobs) in zip(PROMPTS, got, strict=True):
        ref_tokens, ref_logprobs = reference_greedy(reference, prompt, NEW_TOKENS)
        assert tokens == ref_tokens, prompt
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


def test_the_fake_quantization_is_not_a_no_op(float_folder, checkpoints):
    """The references differ from each other by more than the tolerance above: int8 activations from
    weight-only, and int8 weights from the float model (a test that passed on floats would prove
    nothing)."""
    from transformers import AutoModelForCausalLM

    _, tensors = checkpoints("w-channel-a-token")
    prompt = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        logits = [m(prompt).logits[0].log_softmax(-1) for m in (
            reference_model(float_folder, tensors, "token"), reference_model(float_folder, tensors, None),
            AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval())]
    assert (logits[0] - logits[1]).abs().max() > 1e-3
    assert (logits[1] - logits[2]).abs().max() > 1e-3


def test_int8_rounding_is_half_to_even():
    """The runner's CPU quantizer (and the reference's) round exact halves to even and clamp at -128
    and 127; per token, each row's absmax maps to 127."""
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, 127.5, -128.5, -300.0]])
    q, scale = quantize_int8_torch(x, torch.ones(1))
    assert q.tolist() == [[0, 2, 2, 0, -2, 127, -128, -128]] and scale.tolist() == [[1.0]]
    q, scale = quantize_int8_torch(torch.tensor([[2.0, -1.0, 0.01]]))
    assert q.tolist() == [[127, -64, 1]] and torch.equal(scale, torch.tensor([[2.0 / 127]]))
    assert torch.equal(fake_quantize(x, 1.0, False), q.new_tensor([[0, 2, 2, 0, -2, 127, -128, -128]]).float())


# ---- configs --------------------------------------------------------------------------------------
def test_settings_read():
    for (weights, activations), mode in {("channel", "token"): "dynamic-token", ("tensor", "static"): "static",
                                         ("tensor", "tensor"): "dynamic-tensor",
                                         ("channel", None): "weight-only"}.items():
        for fmt in ("int-quantized", "naive-quantized"):
            cfg = CompressedTensorsScheme.from_hf(int8_config(weights, activations, fmt=fmt))
            assert isinstance(cfg, CompressedTensorsInt8Config)
            assert (cfg.activations, cfg.weight_strategy, cfg.packed) == (mode, weights, False)
    for weights in ("channel", "tensor"):
        cfg = CompressedTensorsScheme.from_hf(int8_config(weights, None, fmt="pack-quantized"))
        assert isinstance(cfg, CompressedTensorsInt8Config)
        assert (cfg.activations, cfg.weight_strategy, cfg.packed) == ("weight-only", weights, True)
    assert CompressedTensorsScheme.from_hf(int8_config("channel", "token")).describe() == (
        "compressed-tensors: int8 weights, per-channel scales, W8A8, activations int8 per token (dynamic)")


def test_quantization_argument_must_match(checkpoints):
    folder, _ = checkpoints("w-channel-a-token")
    spec = load_model_spec(resolve_model(folder))
    assert isinstance(resolve_quant_config("compressed-tensors", spec), CompressedTensorsInt8Config)
    with pytest.raises(UnsupportedModelError, match="does not match"):
        resolve_quant_config("fp8", spec)


_G = "config_groups.group_0"
_W, _A = f"{_G}.weights", f"{_G}.input_activations"


@pytest.mark.parametrize("weights,inputs,top,field", [
    ({"symmetric": False}, {}, {}, f"{_W}.symmetric"),
    ({}, {"symmetric": False}, {}, f"{_A}.symmetric"),
    ({"strategy": "group", "group_size": 128}, {}, {}, f"{_W}.group_size"),
    ({"strategy": "group"}, {}, {}, f"{_W}.strategy"),
    ({"strategy": "block", "block_structure": [128, 128]}, {}, {}, f"{_W}.block_structure"),
    ({}, {"strategy": "group", "group_size": 32}, {}, f"{_A}.group_size"),
    ({"num_bits": 4}, {}, {}, f"{_W}.num_bits"),
    ({}, {"num_bits": 4}, {}, f"{_A}.num_bits"),
    ({}, {"type": "float"}, {}, f"{_A}.type"),
    ({"actorder": "group"}, {}, {}, f"{_W}.actorder"),
    ({"actorder": "weight"}, {}, {}, f"{_W}.actorder"),
    ({}, {"actorder": "static"}, {}, f"{_A}.actorder"),
    ({"dynamic": True}, {}, {}, f"{_W}.dynamic"),
    ({}, {"strategy": "token", "dynamic": False}, {}, f"{_A}.strategy"),
    ({}, {"strategy": "channel"}, {}, f"{_A}.strategy"),
    ({}, {"dynamic": "local"}, {}, f"{_A}.dynamic"),
    ({"zero_point_dtype": "int8"}, {}, {}, _W),
    ({}, {"hadamard": True}, {}, _A),
    ({}, {}, {"format": "float-quantized"}, "format"),
    ({}, {}, {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
    ({}, {}, {"unknown_field": 1}, r" field\(s\) unknown_field"),
])
def test_unsupported_settings_are_refused_by_name(float_folder, weights, inputs, top, field):
    cfg = int8_config("channel", "token")
    group = cfg["config_groups"]["group_0"]
    group = {**group, "weights": {**group["weights"], **weights},
             "input_activations": {**group["input_activations"], **inputs}}
    cfg = {**cfg, **top, "config_groups": {"group_0": group}}
    spec = load_model_spec(resolve_model(float_folder))
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{field}"):
        CompressedTensorsScheme.from_hf(cfg).check(spec, torch.device("cpu"), 1)


def test_int4_and_float8_routing_is_unchanged():
    """8-bit ints in the packed format are weight-only (int8 activations refused by name); 4-bit in
    int-quantized names the format; other bit widths in the packed format stay the int4 reader's
    refusal."""
    with pytest.raises(UnsupportedModelError, match=r"group_0\.input_activations: 8-bit ints in the 'pack-quantized'"):
        CompressedTensorsScheme.from_hf(int8_config("channel", "token", fmt="pack-quantized"))
    cfg = int8_config("channel", None, fmt="pack-quantized")
    cfg["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    with pytest.raises(UnsupportedModelError, match=r"weights\.num_bits 2: ferrox runs 4-bit and 8-bit"):
        CompressedTensorsScheme.from_hf(cfg)
    cfg = int8_config("channel", None)
    cfg["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(UnsupportedModelError, match=r"quantization_config\.format"):
        CompressedTensorsScheme.from_hf(cfg)


# ---- tensors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,words", [
    ("model.layers.1.mlp.down_proj.weight_zero_point", r"down_proj\.weight_zero_point.*weight_zero_point is not zero"),
    ("model.layers.0.self_attn.k_proj.input_zero_point", r"k_proj\.input_zero_point.*input_zero_point is not zero"),
])
def test_nonzero_zero_points_are_refused(checkpoints, tmp_path, name, words):
    folder, _ = checkpoints("w-tensor-a-static")  # stores all-zero zero points (accepted: it runs above)
    edited = edited_copy(folder, tmp_path / "zp", lambda t: t.update({name: torch.full_like(t[name], 3)}))
    with pytest.raises(ModelLoadError, match=words):
        load_checkpoint(edited)


def test_missing_and_mistyped_tensors_are_named(checkpoints, float_weights, tmp_path):
    folder, _ = checkpoints("w-tensor-a-static")
    scale = "model.layers.1.self_attn.o_proj.input_scale"
    with pytest.raises(ModelLoadError, match=r"missing .*o_proj\.input_scale"):
        load_checkpoint(edited_copy(folder, tmp_path / "no-input-scale", lambda t: t.pop(scale)))
    weight = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight.*int8"):
        load_checkpoint(edited_copy(folder, tmp_path / "float", lambda t: t.update({weight: float_weights[weight]})))
    ws = "model.layers.0.mlp.down_proj.weight_scale"
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight_scale.*shape"):
        load_checkpoint(edited_copy(folder, tmp_path / "scale", lambda t: t.update({ws: torch.ones(3)})))


def test_packed_tensors_are_checked(checkpoints, tmp_path):
    """The packed layout's weight_shape must be the layer's, and weight_packed hold its words."""
    folder, _ = checkpoints("w-channel-packed")
    shape = "model.layers.0.mlp.down_proj.weight_shape"
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight_shape.*the model's layer"):
        load_checkpoint(edited_copy(folder, tmp_path / "shape", lambda t: t.update({shape: torch.tensor([7, 7])})))
    packed = "model.layers.0.mlp.down_proj.weight_packed"
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight_packed.*words a row"):
        load_checkpoint(edited_copy(folder, tmp_path / "words", lambda t: t.update({packed: t[packed][:, :-1].contiguous()})))


# ---- tensor parallelism ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("scheme", ["w-tensor-a-static", "w-channel-a-token", "w-channel-packed"])
def test_tensor_parallel_shards_match_the_whole_layer(tmp_path, kind, scheme):
    """Two ranks' layers read their parts of one safetensors file (lazy slices, as the engine's sharded
    load does): column-parallel outputs concatenate to the whole layer's, per-tensor scales landing in
    their shard's rows and a merged layer's static input scale the largest; row-parallel partial sums
    add up to it (exactly with a static scale, to int8 rounding with per-token scales, which each
    rank takes over its own input columns)."""
    torch.manual_seed(0)
    weights, activations, fmt = SCHEMES[scheme][:3]
    tensors: dict[str, torch.Tensor] = {}
    in_features = 128 if kind == "down" else 64
    for i, (shard, rows) in enumerate(SHARDS[kind].items()):
        prefix = f"{shard}." if shard else ""
        codes, scale = quantize_weight(torch.randn(rows, in_features) * 0.1 * (i + 1), weights)
        tensors[f"{prefix}weight_scale"] = scale
        if fmt == "pack-quantized":
            tensors[f"{prefix}weight_packed"] = pack_int8(codes)
            tensors[f"{prefix}weight_shape"] = torch.tensor([rows, in_features])
        else:
            tensors[f"{prefix}weight"] = codes
        tensors[f"{prefix}weight_zero_point"] = torch.zeros(scale.shape, dtype=torch.int8)
        tensors[f"{prefix}input_scale"] = torch.tensor([0.01 * (1 + i)])
        tensors[f"{prefix}bias"] = torch.randn(rows)
    config = CompressedTensorsScheme.from_hf(int8_config(weights, activations, fmt=fmt))
    whole, ranks = whole_and_ranks(kind, config, tensors, tmp_path / "layer.safetensors")
    if activations == "static":
        assert float(whole.quant.input_scale) == pytest.approx(0.01 * len(SHARDS[kind]))
    for tokens in (1, 5):
        x = torch.randn(tokens, in_features)
        expected = whole(x)
        got = ranks_output(kind, ranks, x)
        tolerance = 0.05 if kind == "down" and activations == "token" else 1e-5
        torch.testing.assert_close(got, expected, atol=tolerance * expected.abs().max().item(), rtol=0)


def test_tensor_parallel_engine_matches_one_rank(checkpoints):
    """Two rank processes (gloo) run a W8A8 static checkpoint as one process does: q/k/v and gate/up
    rows, o/down input columns, per-tensor scales and the merged layers' largest input scale."""
    folder, _ = checkpoints("w-tensor-a-static")
    one, two = (engine_greedy(make_llm(folder, tensor_parallel_size=tp), PROMPTS) for tp in (1, 2))
    for (tokens, logprobs), (tp_tokens, tp_logprobs) in zip(one, two, strict=True):
        assert tp_tokens == tokens
        torch.testing.assert_close(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


# ---- dummy weights --------------------------------------------------------------------------------
def test_dummy_weights(float_folder, tmp_path):
    """load_format="dummy" fills the int8 tensors with random codes and scales (std ~0.02)."""
    folder = write_checkpoint(float_folder, tmp_path / "dummy", int8_config("tensor", "static"), {})
    llm = make_llm(folder, load_format="dummy")
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.quant
    (tokens, logprobs), *_ = engine_greedy(llm, PROMPTS)
    assert len(tokens) == NEW_TOKENS and all(lp == lp and lp <= 0 for lp in logprobs)  # no NaN
    assert isinstance(qkv, Int8Linear) and qkv.weight.dtype == torch.int8 and qkv.input_scale is not None
    assert 0.015 < float(qkv.dequantize().std()) < 0.025


# ---- GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(SCHEMES))
def test_gpu_engine_matches_the_reference(float_folder, checkpoints, case):
    """The engine on CUDA in float32 (CUDA graphs for decode batches), each prompt alone -- prefills of
    1-40 tokens (the Triton int8 GEMM's decode and mid-size tiles) and one-token decode steps -- then,
    where the scheme's rounding does not depend on the batch (not per-tensor dynamic), 24 prompts at
    once (decode batches in the captured graphs). The GPU's int8 sums are exact,
    but its float32 attention and norms differ from the CPU reference's by ~1e-6, which can move an
    activation code now and then: the reference is fed the engine's tokens, each of which must be its
    best up to 0.1 nats, with logprobs within 0.1 (as the fp8 GPU test)."""
    folder, tensors = checkpoints(case)
    activations = SCHEMES[case][1]
    prompts = [*PROMPTS, list(range(60, 100))]
    batch = [[(7 * i + j * 13) % 300 + 3 for j in range(5 + i % 9)] for i in range(24)] if activations != "tensor" else []
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM(model=folder, dtype="float32", max_model_len=256, kv_cache_memory=64 << 20)
    try:
        assert all(isinstance(m.quant, Int8Linear) and m.quant.weight.is_cuda
                   for m in llm.engine.runner.model.modules() if isinstance(m, Linear))
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        if batch:
            outs += [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in batch], params,
                                                         use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    reference = reference_model(float_folder, tensors, activations)
    for prompt, out in zip(prompts + batch, outs, strict=True):
        tokens = list(out.token_ids)
        logprobs = [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)]
        assert_follows_reference(reference, prompt, tokens, logprobs)
