"""int4 AWQ and GPTQ checkpoints (layers/quant/awq.py, gptq.py, int4_pack.py) end to end: a tiny Llama
quantized by the reference quantizer of tests/helpers/int4_checkpoints.py into each layout, loaded by
ferrox, against the same model with the dequantized weights as a plain float checkpoint (logits to
float rounding, identical greedy tokens); the engine (`LLM`) on one of them; refusals by name;
tensor-parallel shards against the unsharded weight; dummy weights; and on a GPU the Triton path
against the float model.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.layers.linear import Linear, QKVLinear, RowParallelLinear
from ferrox.layers.quant.awq import AWQConfig
from ferrox.layers.quant.compressed_tensors import CompressedTensorsScheme
from ferrox.layers.quant.compressed_tensors_int4 import CompressedTensorsInt4Config
from ferrox.layers.quant.config import resolve_quant_config
from ferrox.layers.quant.gptq import GPTQConfig
from ferrox.layers.quant.int4_pack import Int4Linear
from ferrox.layers.quant.method import use_quant_config
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from safetensors.torch import load_file, save_file

from tests.helpers.driver import run_greedy, teacher_forced_logprobs
from tests.helpers.gptq import gptq_quantize
from tests.helpers.int4_checkpoints import (
    LINEAR_SUFFIXES,
    make_int4_checkpoint,
    quantization_config,
    quantize_groups,
)
from tests.helpers.quant_checkpoints import edited_copy, load_checkpoint
from tests.helpers.tiny_models import make_tiny_llama

PROMPTS = [[5, 9, 33, 7, 100, 41], list(range(40, 53)), [17]]
NEW_TOKENS = 8
# hidden 128 / intermediate 256: groups of 32, 64 and 128 all fit (and the kernels' blocks).
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2}

CASES = {
    "awq-g32": dict(fmt="awq", group=32),
    "awq-g128": dict(fmt="awq", group=128),
    "gptq-g32-asym": dict(fmt="gptq", group=32),
    "gptq-g64-sym-actorder": dict(fmt="gptq", group=64, sym=True, act_order=True),
    "gptq-v2-per-column": dict(fmt="gptq", group=-1, checkpoint_format="gptq_v2"),
    "gptq-g32-actorder-zero-bias": dict(fmt="gptq", group=32, act_order=True, zero_bias=True),
    # GPTQ-solved (tests/helpers/gptq.py) with calibration Hessians: act-order follows diag(H), the
    # same permutation for q/k/v and for gate/up (they read one input), as real exports are.
    "gptq-calibrated-g64-actorder": dict(fmt="gptq", group=64, act_order=True, calibrated=True),
    "awq-calibrated-g32": dict(fmt="awq", group=32, calibrated=True),
    # llm-compressor's compressed-tensors W4A16 ("pack-quantized"), the layout most int4 checkpoints on
    # the hub are published in now.
    "ct-g32-sym": dict(fmt="ct", group=32, sym=True),
    "ct-g64-asym-actorder": dict(fmt="ct", group=64, act_order=True),
    "ct-per-channel-asym": dict(fmt="ct", group=-1),
}


def synthetic_hessians(folder: str) -> dict[str, torch.Tensor]:
    """sum(x x^T) of correlated random inputs with uneven feature scales, one per input of each layer
    (q/k/v share one, gate/up share one), keyed by module name."""
    weights = load_file(os.path.join(folder, "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    by_input: dict[tuple[str, int], torch.Tensor] = {}
    out = {}
    for name, w in weights.items():
        prefix, _, leaf = name.rpartition(".")
        proj = prefix.rpartition(".")[2]
        if leaf != "weight" or proj not in LINEAR_SUFFIXES:
            continue
        shared = (prefix.rpartition(".")[0], {"k_proj": 0, "v_proj": 0, "q_proj": 0, "up_proj": 1, "gate_proj": 1}.get(proj, proj))
        if shared not in by_input:
            k = w.shape[1]
            x = torch.randn(4 * k, k, generator=gen, dtype=torch.float64) @ torch.randn(k, k, generator=gen, dtype=torch.float64)
            x *= torch.rand(k, generator=gen, dtype=torch.float64) * 3 + 0.1
            by_input[shared] = x.t() @ x
        out[prefix] = by_input[shared]
    return out


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("int4") / "float", seed=3, **SHAPE)


@pytest.fixture(scope="module")
def checkpoints(float_folder, tmp_path_factory):
    """Case name -> (quantized folder, dequantized reference folder), built on first use."""
    built: dict[str, tuple[str, str]] = {}

    def get(name: str) -> tuple[str, str]:
        if name not in built:
            case = dict(CASES[name])
            if case.pop("calibrated", False):
                case["hessians"] = synthetic_hessians(float_folder)
            built[name] = make_int4_checkpoint(float_folder, str(tmp_path_factory.mktemp(name)), **case)
        return built[name]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_dequantized_model(checkpoints, case):
    qdir, rdir = checkpoints(case)
    quant, ref = load_checkpoint(qdir), load_checkpoint(rdir)
    linears = [m for m in quant.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.quant, Int4Linear) and m.weight.numel() == 0 for m in linears)
    act_order = CASES[case].get("act_order", False)
    assert quant.model.layers[0].mlp.gate_up_proj.quant.act_order == act_order
    q_tokens, q_logits = run_greedy(quant, PROMPTS, NEW_TOKENS, return_prefill_logits=True)
    r_tokens, r_logits = run_greedy(ref, PROMPTS, NEW_TOKENS, return_prefill_logits=True)
    torch.testing.assert_close(q_logits, r_logits, rtol=1e-4, atol=1e-4)
    assert q_tokens == r_tokens


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct"])
def test_short_last_group(tmp_path, fmt):
    """Widths that are not a multiple of the group size (hidden 96, intermediate 160, groups of 64):
    the last group of each row is short, as in SmolLM2 (576 inputs) with groups of 128."""
    folder = make_tiny_llama(tmp_path / "float", hidden_size=96, intermediate_size=160, num_heads=4,
                             num_kv_heads=2, num_layers=1, seed=5)
    qdir, rdir = make_int4_checkpoint(folder, str(tmp_path), fmt, group=64)
    q_tokens, q_logits = run_greedy(load_checkpoint(qdir), PROMPTS, 4, return_prefill_logits=True)
    r_tokens, r_logits = run_greedy(load_checkpoint(rdir), PROMPTS, 4, return_prefill_logits=True)
    torch.testing.assert_close(q_logits, r_logits, rtol=1e-4, atol=1e-4)
    assert q_tokens == r_tokens


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reference_solver_beats_round_to_nearest(act_order):
    """The reference GPTQ solver (what the accuracy benchmark's int4-gptq checkpoints are made with)
    moves a layer's outputs on its calibration inputs less than round-to-nearest does, and its g_idx
    puts `group` columns in each group."""
    gen = torch.Generator().manual_seed(0)
    k, n, group = 256, 48, 64
    x = torch.randn(1024, k, generator=gen, dtype=torch.float64) @ torch.randn(k, k, generator=gen, dtype=torch.float64)
    x *= torch.rand(k, generator=gen, dtype=torch.float64) * 3 + 0.1
    w = torch.randn(n, k, generator=gen) * 0.05

    def output_error(codes, scales, zeros, g_idx):
        deq = (codes.double() - zeros.double()[g_idx].t()) * scales.double()[g_idx].t()
        return float(torch.linalg.norm(x @ (deq - w.double()).t()))

    codes, scales, zeros, g_idx = gptq_quantize(w, x.t() @ x, group, act_order=act_order)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert torch.equal(torch.bincount(g_idx), torch.full((k // group,), group))
    rtn = quantize_groups(w, group, sym=False)
    assert output_error(codes, scales, zeros, g_idx) < 0.7 * output_error(*rtn, torch.arange(k) // group)


def test_quantization_is_not_a_no_op(checkpoints, float_folder):
    """The reference differs from the float model by int4 rounding (a test that passed on the float
    weights would prove nothing)."""
    _, rdir = checkpoints("awq-g32")
    ref = load_file(os.path.join(rdir, "model.safetensors"))
    orig = load_file(os.path.join(float_folder, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    err = (ref[name] - orig[name]).abs()
    assert 0 < err.max() < orig[name].abs().max() / 10


def test_engine_generates_like_the_dequantized_model(checkpoints):
    qdir, rdir = checkpoints("gptq-g32-asym")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = [LLM(model=folder, device="cpu", kv_cache_memory=16 << 20).generate(prompts, params, use_tqdm=False)
            for folder in (qdir, rdir)]
    for q, r in zip(*outs, strict=True):
        assert q.outputs[0].token_ids == r.outputs[0].token_ids
        for qa, ra in zip(q.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
            for tok, lp in ra.items():
                assert abs(qa[tok].logprob - lp.logprob) < 1e-3


def test_quantization_argument_must_match(checkpoints):
    qdir, _ = checkpoints("awq-g32")
    spec = load_model_spec(resolve_model(qdir))
    assert isinstance(resolve_quant_config("awq_marlin", spec), AWQConfig)  # vLLM's kernel-named spelling
    with pytest.raises(UnsupportedModelError, match="does not match"):
        resolve_quant_config("gptq", spec)


# ---- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,change,field", [
    ("awq", {"bits": 8}, "bits"),
    ("awq", {"bits": 3}, "bits"),
    ("awq", {"version": "gemv"}, "version"),
    ("awq", {"version": "exllama"}, "version"),
    ("awq", {"version": "marlin"}, "version"),
    ("awq", {"zero_point": False}, "zero_point"),
    ("awq", {"group_size": 48}, "group_size"),
    ("awq", {"modules_to_not_convert": ["mlp.down_proj"]}, "modules_to_not_convert"),
    ("gptq", {"bits": 8}, "bits"),
    ("gptq", {"bits": 2}, "bits"),
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format"),
    ("gptq", {"lm_head": True}, "lm_head"),
    ("gptq", {"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
    ("gptq", {"group_size": 16}, "group_size"),
])
def test_unsupported_settings_are_refused_by_name(fmt, change, field):
    cfg = {**quantization_config(fmt, 32), **change}
    cls = AWQConfig if fmt == "awq" else GPTQConfig
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{field}"):
        cls.from_hf(cfg)


_CT_WEIGHTS = "config_groups.group_0.weights"


@pytest.mark.parametrize("weights,scheme,top,field", [
    ({"num_bits": 8}, {}, {}, f"{_CT_WEIGHTS}.symmetric"),  # to the int8 reader, which takes no zero points
    ({"num_bits": 2}, {}, {}, f"{_CT_WEIGHTS}.num_bits"),
    ({"strategy": "tensor"}, {}, {}, f"{_CT_WEIGHTS}.strategy"),
    ({"group_size": 48}, {}, {}, f"{_CT_WEIGHTS}.group_size"),
    ({"dynamic": True}, {}, {}, f"{_CT_WEIGHTS}.dynamic"),
    ({"actorder": "sideways"}, {}, {}, f"{_CT_WEIGHTS}.actorder"),
    ({"block_structure": [128, 128]}, {}, {}, f"{_CT_WEIGHTS}.block_structure"),
    ({"zp_dtype": None, "hadamard": True}, {}, {}, _CT_WEIGHTS),
    ({}, {"input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}, {},
     "config_groups.group_0.input_activations"),
    ({}, {"targets": ["re:.*down_proj"]}, {}, "config_groups.group_0.targets"),
    ({}, {}, {"format": "int-quantized"}, "format"),
])
def test_compressed_tensors_int_schemes_refused_by_name(float_folder, weights, scheme, top, field):
    cfg = quantization_config("ct", 32)
    group = cfg["config_groups"]["group_0"]
    cfg = {**cfg, **top, "config_groups": {"group_0": {**group, **scheme, "weights": {**group["weights"], **weights}}}}
    spec = load_model_spec(resolve_model(float_folder))
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{field}"):
        CompressedTensorsScheme.from_hf(cfg).check(spec, torch.device("cpu"), 1)


def test_compressed_tensors_settings_read():
    for group, sym, act_order in ((128, True, False), (-1, False, True)):
        cfg = CompressedTensorsScheme.from_hf(quantization_config("ct", group, sym=sym, act_order=act_order))
        assert isinstance(cfg, CompressedTensorsInt4Config)
        assert (cfg.group_size, cfg.symmetric, cfg.group_order) == (group, sym, act_order)
    weights = quantization_config("ct", 64)["config_groups"]["group_0"]["weights"]
    for order in ("weight", "static"):  # the order guided quantization only: nothing stored
        cfg = CompressedTensorsScheme.from_hf(quantization_config("ct", 64) | {"config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {**weights, "actorder": order}}}})
        assert not cfg.group_order


def test_accepted_settings():
    assert AWQConfig.from_hf({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM",
                              "modules_to_not_convert": ["lm_head"]}).group_size == 64
    cfg = GPTQConfig.from_hf(quantization_config("gptq", -1, act_order=True, checkpoint_format="gptq_v2"))
    assert cfg.desc_act and cfg.group_size == -1 and cfg.checkpoint_format == "gptq_v2"


@pytest.mark.parametrize("case,words", [("gptq-g64-sym-actorder", "desc_act"),
                                        ("ct-g64-asym-actorder", "actorder 'group'")])
def test_act_order_refuses_tensor_parallel(checkpoints, case, words):
    qdir, _ = checkpoints(case)
    spec = load_model_spec(resolve_model(qdir))
    config = resolve_quant_config(None, spec)
    config.check(spec, torch.device("cpu"), 1)
    with pytest.raises(UnsupportedModelError, match=f"{words}.*tensor_parallel_size"):
        config.check(spec, torch.device("cpu"), 2)


def test_shapes_that_cannot_split_are_refused(float_folder):
    spec = load_model_spec(resolve_model(float_folder))
    # intermediate 256 over 4 ranks: 64 columns per rank, not whole groups of 128.
    with pytest.raises(UnsupportedModelError, match="intermediate_size.*group_size=128"):
        AWQConfig(128).check(spec, torch.device("cpu"), 4)


def test_missing_and_misshapen_tensors_name_the_tensor(checkpoints, tmp_path):
    qdir, _ = checkpoints("awq-g32")
    tensors = load_file(os.path.join(qdir, "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.scales"
    for label, edit in (("missing", lambda t: t.pop(name)), ("shape", lambda t: t.update({name: t[name][:, :8].contiguous()}))):
        folder = tmp_path / label
        folder.mkdir()
        for f in os.listdir(qdir):
            if not f.endswith(".safetensors"):
                (folder / f).write_bytes(open(os.path.join(qdir, f), "rb").read())
        broken = dict(tensors)
        edit(broken)
        save_file(broken, str(folder / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.(k_proj\.scales|qkv_proj\.scales shard k)"):
            load_checkpoint(str(folder))


def test_nonzero_bias_for_a_biasless_layer_is_refused(checkpoints, tmp_path):
    qdir, _ = checkpoints("gptq-g32-actorder-zero-bias")
    name = "model.layers.0.mlp.down_proj.bias"
    folder = edited_copy(qdir, tmp_path / "bias", lambda t: t.update({name: torch.ones_like(t[name])}))
    with pytest.raises(ModelLoadError, match="down_proj.bias.*non-zero"):
        load_checkpoint(folder)


def test_compressed_tensors_tensors_checked_by_name(checkpoints, tmp_path):
    """weight_shape must be the layer's; a symmetric scheme's zero points, when stored, must be zero."""
    qdir, _ = checkpoints("ct-g32-sym")
    name = "model.layers.1.mlp.down_proj.weight_shape"
    folder = edited_copy(qdir, tmp_path / "shape", lambda t: t.update({name: t[name].flip(0).contiguous()}))
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight_shape.*\[128, 256\]"):
        load_checkpoint(folder)
    zp = "model.layers.0.mlp.down_proj.weight_zero_point"
    for label, value in (("zero", 0), ("nonzero", 3)):
        folder = edited_copy(qdir, tmp_path / label, lambda t, v=value: t.update({zp: torch.full((16, 8), v, dtype=torch.int32)}))
        if value:
            with pytest.raises(ModelLoadError, match="weight_zero_point is not zero"):
                load_checkpoint(folder)
        else:
            assert isinstance(load_checkpoint(folder).model.layers[0].mlp.down_proj.quant, Int4Linear)


def test_bad_act_order_indexes_are_refused(checkpoints, tmp_path):
    """A merged layer's shards with different g_idx, and a g_idx whose groups are not all group_size
    columns, name the tensor."""
    qdir, _ = checkpoints("gptq-g64-sym-actorder")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    folder = edited_copy(qdir, tmp_path / "differ", lambda t: t.update({name: t[name].flip(0).contiguous()}))
    with pytest.raises(ModelLoadError, match=r"self_attn\.[qkv]_proj\.g_idx.*differs from shard"):
        load_checkpoint(folder)
    name = "model.layers.0.mlp.down_proj.g_idx"
    folder = edited_copy(qdir, tmp_path / "uneven", lambda t: t.update({name: torch.zeros_like(t[name])}))
    with pytest.raises(ModelLoadError, match="down_proj.g_idx.*every group"):
        load_checkpoint(folder)


# ---- tensor parallelism, layer by layer ---------------------------------------------------------------
def _rank_layers(cls, config, size, *args):
    layers = []
    for rank in range(size):
        with use_tp_group(TPGroup(rank=rank, size=size)), use_quant_config(config):
            layers.append(cls(*args, bias=False, dtype=torch.float32, device="cpu"))
    return layers


_PARAMS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
           "ct": ("weight_packed", "weight_scale", "weight_shape")}


@pytest.mark.parametrize("case", ["awq-g32", "gptq-g32-asym", "ct-g32-sym", "ct-per-channel-asym"])
def test_tensor_parallel_shards_match_the_full_weight(checkpoints, case):
    """Column-parallel q/k/v (with KV heads replicated over 4 ranks) and row-parallel down_proj: each
    rank's runner computes its slice of the float reference (its rows; its input columns' partial sum)."""
    qdir, rdir = checkpoints(case)
    spec = load_model_spec(resolve_model(qdir))
    config = resolve_quant_config(None, spec)
    qt, rt = load_file(os.path.join(qdir, "model.safetensors")), load_file(os.path.join(rdir, "model.safetensors"))
    fmt, sym = CASES[case]["fmt"], CASES[case].get("sym", False)
    params = _PARAMS[fmt] + (("weight_zero_point",) if fmt == "ct" and not sym else ())
    x_attn = torch.randn(3, spec.hidden_size)
    pre = "model.layers.1"
    for size in (2, 4):
        layers = _rank_layers(QKVLinear, config, size, spec.hidden_size, spec.num_heads, spec.num_kv_heads,
                              spec.head_dim)
        for layer in layers:
            for shard in ("q", "k", "v"):
                for p in params:
                    layer.load_weight(p, qt[f"{pre}.self_attn.{shard}_proj.{p}"], shard)
            layer.finalize_quantized()
        for layer in layers:
            want = []
            for shard in ("q", "k", "v"):
                start, held, _ = layer.checkpoint_rows[shard]
                want.append(rt[f"{pre}.self_attn.{shard}_proj.weight"][start:start + held])
            torch.testing.assert_close(layer(x_attn), x_attn @ torch.cat(want).t(), rtol=1e-5, atol=1e-5)
    x_mlp = torch.randn(3, spec.intermediate_size)
    w_down = rt[f"{pre}.mlp.down_proj.weight"]
    layers = _rank_layers(RowParallelLinear, config, 2, spec.intermediate_size, spec.hidden_size)
    total = torch.zeros(3, spec.hidden_size)
    for layer in layers:
        for p in params:
            layer.load_weight(p, qt[f"{pre}.mlp.down_proj.{p}"])
        layer.finalize_quantized()
        cols = slice(layer.in_start, layer.in_start + layer.in_features)
        part = layer.quant(x_mlp[:, cols], None)
        torch.testing.assert_close(part, x_mlp[:, cols] @ w_down[:, cols].t(), rtol=1e-5, atol=1e-5)
        total += part
    torch.testing.assert_close(total, x_mlp @ w_down.t(), rtol=1e-5, atol=1e-5)


# ---- dummy weights ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["awq", "ct"])
def test_dummy_weights(float_folder, tmp_path, fmt):
    """load_format="dummy" with an int4 config: random codes and scales with the float dummy's spread."""
    folder = tmp_path / "dummy"
    folder.mkdir()
    for f in os.listdir(float_folder):
        if not f.endswith(".safetensors"):
            (folder / f).write_bytes(open(os.path.join(float_folder, f), "rb").read())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, 64)
    (folder / "config.json").write_text(json.dumps(config))
    source = resolve_model(str(folder))
    spec = load_model_spec(source)
    model = load_model(source, spec, dtype=torch.float32, device="cpu", load_format="dummy", seed=1,
                       quant_config=resolve_quant_config(None, spec))
    w = model.model.layers[0].mlp.gate_up_proj.quant.weight
    assert w.shape == (2 * spec.intermediate_size, spec.hidden_size)
    assert 0.015 < float(w.std()) < 0.025
    tokens = run_greedy(model, PROMPTS[:1], 4)
    assert len(tokens[0]) == 4


# ---- GPU: the Triton kernels in the model ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["awq-g128", "gptq-g64-sym-actorder", "gptq-v2-per-column", "ct-g32-sym",
                                  "ct-g64-asym-actorder"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_checkpoint_matches_dequantized_model(checkpoints, case, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    qdir, rdir = checkpoints(case)
    quant, ref = load_checkpoint(qdir, dtype, "cuda"), load_checkpoint(rdir, dtype, "cuda")
    assert all(m.quant.kernels for m in quant.modules() if isinstance(m, Linear))
    # A batch of prompts (prefills of 1-1200 tokens: GEMM and dequantize + cuBLAS; decode steps of 5
    # tokens: GEMM), then one prompt of one token alone (prefill and decode steps of 1 token: GEMV).
    batch = [*PROMPTS, list(range(3, 300)), [i % 300 for i in range(1200)]]
    for prompts in (batch, [[17]]):
        q_tokens, q_logits = run_greedy(quant, prompts, NEW_TOKENS, return_prefill_logits=True)
        r_tokens, r_logits = run_greedy(ref, prompts, NEW_TOKENS, return_prefill_logits=True)
        scale = r_logits.abs().max()
        assert (q_logits - r_logits).abs().max() <= 0.03 * scale
        # Greedy tokens agree up to bf16/fp16 noise on near-ties of a random model: every first token,
        # and most of the batch's rest (one flipped near-tie changes the rest of its prompt's tokens).
        assert [q[0] for q in q_tokens] == [r[0] for r in r_tokens]
        if len(prompts) > 1:
            agree = sum(a == b for q, r in zip(q_tokens, r_tokens, strict=True) for a, b in zip(q, r, strict=True))
            assert agree >= 0.5 * sum(len(r) for r in r_tokens)
            continue
        # One prompt alone: a single flip would decide the whole chain (an H200 kept 2 to 5 of 8), so
        # its one-token decode steps (the GEMV) are compared teacher-forced on the reference's tokens:
        # log-softmax within twice the logits' tolerance.
        lq = teacher_forced_logprobs(quant, prompts[0], r_tokens[0], decode_steps=True)
        lr = teacher_forced_logprobs(ref, prompts[0], r_tokens[0], decode_steps=True)
        assert (lq - lr).abs().max() <= 0.06 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["awq-g128", "gptq-g32-asym", "gptq-g64-sym-actorder", "ct-per-channel-asym"])
def test_gpu_engine_one_token_steps_take_the_fused_path(checkpoints, case, monkeypatch):
    """The engine on CUDA, one prompt at a time (every decode step has one token), in float32: the
    one-token steps run the fused int4 GEMVs (attention/fused_decode.py; act-order layers keep the
    general path, layers/quant/int4_pack.py) and give the greedy tokens and logprobs of the same
    engine with FERROX_FUSED_DECODE=0; eager, so the fused steps can be counted, then with CUDA
    graphs (the fused steps captured) the same tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ferrox.attention.decode_path import DecodePath
    from ferrox.attention.fused_decode import FusedOneTokenDecode

    from tests.kernels.test_fused_decode import _count_calls

    qdir, _ = checkpoints(case)
    act_order = CASES[case].get("act_order", False)
    steps = _count_calls(monkeypatch, "forward")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)

    def greedy(**engine_args) -> tuple[list[list[int]], list[list[float]], int]:
        llm = LLM(model=qdir, dtype="float32", max_model_len=256, kv_cache_memory=64 << 20, **engine_args)
        try:
            assert type(llm.engine.runner.model.model.decode_path) is (DecodePath if act_order else FusedOneTokenDecode)
            steps.clear()  # (the warm-up's steps)
            outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in PROMPTS]
        finally:
            llm.engine.shutdown()
        logprobs = [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)] for o in outs]
        return [list(o.token_ids) for o in outs], logprobs, len(steps)

    tokens, logprobs, fused_steps = greedy(enforce_eager=True)
    # A decode step per new token after the first, and the one-token prompt's prefill.
    assert (fused_steps == 0) if act_order else (fused_steps >= len(PROMPTS) * (NEW_TOKENS - 1) + 1)
    assert greedy(enforce_eager=False)[0] == tokens
    monkeypatch.setenv("FERROX_FUSED_DECODE", "0")
    general_tokens, general_logprobs, general_steps = greedy(enforce_eager=True)
    assert general_steps == 0
    assert general_tokens == tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(general_logprobs), atol=1e-3, rtol=0)
