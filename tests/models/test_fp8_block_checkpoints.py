"""Block-wise FP8 checkpoints (layers/quant/fp8_block.py; the layout of DeepSeek-V3 and Qwen3-*-FP8)
end to end: a tiny Llama written by tests/helpers/fp8_block_checkpoints.py with two block shapes, run
by `LLM`, against transformers on the dequantized weights with every projection's input rounded
through E4M3 per token and group (greedy tokens identical, logprobs to float32 rounding); settings
and tensors refused by name; tensor-parallel shards against the whole layer; dummy weights; on a GPU,
the engine (Triton kernels, CUDA graphs) against the same reference.
"""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.linear import Linear
from ferrox.layers.quant.config import resolve_quant_config
from ferrox.layers.quant.fp8 import Fp8Config
from ferrox.layers.quant.fp8_block import Fp8BlockConfig, Fp8BlockLinear
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model

from tests.helpers.fp8_block_checkpoints import block_config, block_tensors, quantize_blocks, reference_model
from tests.helpers.quant_checkpoints import (
    assert_follows_reference,
    edited_copy,
    engine_greedy,
    load_checkpoint,
    make_llm,
    reference_greedy,
    write_checkpoint,
)
from tests.helpers.tp_layers import SHARDS, ranks_output, whole_and_ranks

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[5, 9, 33, 7, 100, 41], list(range(40, 53)), [17]]
NEW_TOKENS = 8
# The tiny Llama's shards: q 64 rows, k and v 32, gate and up 128; inputs 64 (down: 128). Blocks of
# 32 x 32 split every K into several groups; 16 x 64 gives o_proj and the qkv one group a row.
BLOCKS = [(32, 32), (16, 64)]
# (layout, block): the fp8 layout in both block shapes, and compressed-tensors' FP8_BLOCK scheme.
CASES = [("fp8", BLOCKS[0]), ("fp8", BLOCKS[1]), ("compressed-tensors", BLOCKS[0])]
SCALE_NAME = {"fp8": "weight_scale_inv", "compressed-tensors": "weight_scale"}


def _case_id(case) -> str:
    return f"{case[0]}-{case[1][0]}x{case[1][1]}"


@pytest.fixture(scope="module")
def checkpoints(float_folder, float_weights, tmp_path_factory):
    """(layout, block) -> (folder, tensors), written on first use."""
    built: dict[tuple[str, tuple[int, int]], tuple[str, dict[str, torch.Tensor]]] = {}

    def get(layout: str, block: tuple[int, int]) -> tuple[str, dict[str, torch.Tensor]]:
        if (layout, block) not in built:
            tensors = block_tensors(float_weights, block, SCALE_NAME[layout])
            folder = write_checkpoint(float_folder, tmp_path_factory.mktemp(_case_id((layout, block))),
                                      block_config(block, layout), tensors)
            built[layout, block] = folder, tensors
        return built[layout, block]

    return get


# ---- end to end -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_checkpoint_matches_the_fake_quantized_reference(float_folder, checkpoints, case):
    layout, block = case
    folder, tensors = checkpoints(layout, block)
    llm = make_llm(folder)
    runners = [m.quant for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert runners and all(isinstance(r, Fp8BlockLinear) and r.block == block for r in runners)
    got = engine_greedy(llm, PROMPTS)
    reference = reference_model(float_folder, tensors, block)
    for prompt, (tokens, logprobs) in zip(PROMPTS, got, strict=True):
        ref_tokens, ref_logprobs = reference_greedy(reference, prompt, NEW_TOKENS)
        assert tokens == ref_tokens, prompt
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


def test_the_fake_quantization_is_not_a_no_op(float_folder, checkpoints):
    """The reference differs from the float model, and from a reference quantized with other blocks,
    by more than the tolerance above (a test that passed on floats would prove nothing)."""
    from transformers import AutoModelForCausalLM

    prompt = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        logits = [m(prompt).logits[0].log_softmax(-1) for m in (
            reference_model(float_folder, checkpoints("fp8", BLOCKS[0])[1], BLOCKS[0]),
            reference_model(float_folder, checkpoints("fp8", BLOCKS[1])[1], BLOCKS[1]),
            AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval())]
    assert (logits[0] - logits[1]).abs().max() > 1e-3
    assert (logits[0] - logits[2]).abs().max() > 1e-3


# ---- configs --------------------------------------------------------------------------------------
def test_settings_read(checkpoints):
    cfg = Fp8Config.from_hf(block_config((128, 128)))
    assert isinstance(cfg, Fp8BlockConfig) and cfg.block == (128, 128)
    assert cfg.describe() == ("fp8 (checkpoint): E4M3 weights, a scale per 128 x 128 block, activations per token "
                              "and group of 128 (dynamic)")
    for layout, name in (("fp8", "fp8"), ("compressed-tensors", "compressed-tensors")):
        folder, _ = checkpoints(layout, BLOCKS[0])
        spec = load_model_spec(resolve_model(folder))
        cfg = resolve_quant_config(name, spec)  # the argument agrees with the checkpoint
        assert isinstance(cfg, Fp8BlockConfig) and cfg.block == BLOCKS[0] and cfg.name == name
        assert cfg.scale_param == SCALE_NAME[layout]


@pytest.mark.parametrize("change,field", [
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"weight_block_size": [128]}, "weight_block_size"),
    ({"weight_block_size": [128, 100]}, "weight_block_size"),
    ({"weight_block_size": [8, 8]}, "weight_block_size"),
    ({"weight_block_size": "128x128"}, "weight_block_size"),
    ({"fmt": "e5m2"}, "fmt"),
    ({"block_layout": "tiles"}, r" field\(s\) block_layout"),
])
def test_unsupported_settings_are_refused_by_name(change, field):
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{field}"):
        Fp8Config.from_hf({**block_config((128, 128)), **change})


_CT = "config_groups.group_0"


@pytest.mark.parametrize("weights,inputs,field", [
    ({"dynamic": True}, {}, f"{_CT}.weights.dynamic"),
    ({"block_structure": [128, 100]}, {}, f"{_CT}.weights.block_structure"),
    ({"group_size": 128}, {}, f"{_CT}.weights.group_size"),
    ({}, None, f"{_CT}.input_activations"),
    ({}, {"group_size": 64}, f"{_CT}.input_activations: .*group_size 64"),
    ({}, {"dynamic": False}, f"{_CT}.input_activations: .*dynamic False"),
    ({}, {"strategy": "token", "group_size": None}, f"{_CT}.input_activations: strategy 'token'"),
    ({}, {"block_structure": [1, 128]}, f"{_CT}.input_activations.block_structure"),
])
def test_compressed_tensors_block_refusals(weights, inputs, field):
    from ferrox.layers.quant.compressed_tensors import CompressedTensorsScheme

    cfg = block_config((128, 128), "compressed-tensors")
    group = cfg["config_groups"]["group_0"]
    group["weights"].update(weights)
    if inputs is None:
        group["input_activations"] = None
    else:
        group["input_activations"].update(inputs)
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{field}"):
        CompressedTensorsScheme.from_hf(cfg)


# ---- tensors --------------------------------------------------------------------------------------
def test_missing_and_mistyped_tensors_are_named(checkpoints, float_weights, tmp_path):
    folder, _ = checkpoints("fp8", BLOCKS[0])
    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    with pytest.raises(ModelLoadError, match=r"missing .*o_proj\.weight_scale_inv"):
        load_checkpoint(edited_copy(folder, tmp_path / "no-scale", lambda t: t.pop(scale)))
    with pytest.raises(ModelLoadError, match=r"o_proj\.weight_scale_inv.*shape"):
        load_checkpoint(edited_copy(folder, tmp_path / "scale", lambda t: t.update({scale: torch.ones(2, 3)})))
    weight = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight.*float8_e4m3fn"):
        load_checkpoint(edited_copy(folder, tmp_path / "float", lambda t: t.update({weight: float_weights[weight]})))


def test_shards_off_the_block_edges_are_refused(float_folder, float_weights, checkpoints, tmp_path):
    """Blocks of 64 rows: k_proj and v_proj (32 rows each) would share a block row in the merged
    q/k/v layer, which has one scale row per 64 of its rows: refused naming the tensor. So is a
    tensor-parallel cut inside a block (two ranks: 16 of k's 32 rows, in blocks of 32)."""
    folder = write_checkpoint(float_folder, tmp_path / "b64", block_config((64, 32)),
                              block_tensors(float_weights, (64, 32)))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight_scale_inv.*64-row weight blocks"):
        load_checkpoint(folder)
    folder, _ = checkpoints("fp8", BLOCKS[0])
    with pytest.raises(Exception, match=r"k_proj\.weight_scale_inv.*rows 0\.\.16 of 32.*32-row weight blocks"):
        make_llm(folder, tensor_parallel_size=2)


# ---- tensor parallelism ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "down"])
def test_tensor_parallel_shards_match_the_whole_layer(tmp_path, kind):
    """Two ranks' layers read their parts of one safetensors file (lazy slices): their block rows
    (column parallel) or block columns (row parallel) of the scales, so column-parallel outputs
    concatenate to the whole layer's and row-parallel partial sums add up to it (each rank's input
    groups are the whole layer's: the cut falls on a group edge)."""
    torch.manual_seed(0)
    block = (16, 32)
    tensors: dict[str, torch.Tensor] = {}
    in_features = 128 if kind == "down" else 64
    for i, (shard, rows) in enumerate(SHARDS[kind].items()):
        prefix = f"{shard}." if shard else ""
        tensors[f"{prefix}weight"], tensors[f"{prefix}weight_scale_inv"] = quantize_blocks(
            torch.randn(rows, in_features) * 0.1 * (i + 1), block)
        tensors[f"{prefix}bias"] = torch.randn(rows)
    whole, ranks = whole_and_ranks(kind, Fp8BlockConfig(block), tensors, tmp_path / "layer.safetensors")
    for tokens in (1, 5):
        x = torch.randn(tokens, in_features)
        expected = whole(x)
        got = ranks_output(kind, ranks, x)
        torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


def test_tensor_parallel_engine_matches_one_rank(checkpoints):
    """Two rank processes (gloo) run a block checkpoint as one process does: q/k/v and gate/up block
    rows, o/down block columns. Blocks of 16 x 32: each rank's 16 k rows and 32 of o_proj's inputs are
    whole blocks (the other shapes' cuts would fall inside one: refused, test below)."""
    folder, _ = checkpoints("fp8", (16, 32))
    one, two = (engine_greedy(make_llm(folder, tensor_parallel_size=tp), PROMPTS) for tp in (1, 2))
    for (tokens, logprobs), (tp_tokens, tp_logprobs) in zip(one, two, strict=True):
        assert tp_tokens == tokens
        torch.testing.assert_close(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


# ---- dummy weights --------------------------------------------------------------------------------
def test_dummy_weights(float_folder, tmp_path):
    """load_format="dummy" fills the fp8 codes and block scales with random weights (std ~0.02)."""
    folder = write_checkpoint(float_folder, tmp_path / "dummy", block_config((32, 32)), {})
    llm = make_llm(folder, load_format="dummy")
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.quant
    (tokens, logprobs), *_ = engine_greedy(llm, PROMPTS)
    assert len(tokens) == NEW_TOKENS and all(lp == lp and lp <= 0 for lp in logprobs)  # no NaN
    assert isinstance(qkv, Fp8BlockLinear) and qkv.weight_scale_inv.shape == (4, 2)
    assert 0.015 < float(qkv.dequantize().std()) < 0.025


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES[:2], ids=_case_id)
def test_gpu_engine_matches_the_reference(float_folder, checkpoints, case):
    """The engine on CUDA in float32 (the Triton group quantizer and block GEMM at every step size,
    CUDA graphs for decode batches, piecewise ones for the prompts): each prompt alone, then 24 at once. The GPU's float32 attention
    and norms differ from the CPU reference's by ~1e-6, which can move an activation code now and
    then: the reference is fed the engine's tokens, each of which must be its best up to 0.15 nats,
    with logprobs within 0.15. (Measured on an H200, Dec 3: worst gap 0.065, worst logprob difference
    0.1017 in the 16 x 64 case, one of the 24 batched prompts, the same with and without piecewise
    CUDA graphs; the other prompts' worst 0.067. A wrong scale or code moves them by nats.)"""
    layout, block = case
    folder, tensors = checkpoints(layout, block)
    prompts = [*PROMPTS, list(range(60, 100))]
    batch = [[(7 * i + j * 13) % 300 + 3 for j in range(5 + i % 9)] for i in range(24)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM(model=folder, dtype="float32", max_model_len=256, kv_cache_memory=64 << 20)
    try:
        assert all(isinstance(m.quant, Fp8BlockLinear) and m.quant.weight.is_cuda
                   for m in llm.engine.runner.model.modules() if isinstance(m, Linear))
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        outs += [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in batch], params,
                                                     use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    reference = reference_model(float_folder, tensors, block)
    for prompt, out in zip(prompts + batch, outs, strict=True):
        tokens = list(out.token_ids)
        logprobs = [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)]
        assert_follows_reference(reference, prompt, tokens, logprobs, nats=0.15)
