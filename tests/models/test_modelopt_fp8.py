"""NVIDIA ModelOpt FP8 checkpoints (layers/quant/modelopt.py, excluded_modules.py) end to end.

A tiny Llama and a tiny Qwen3-MoE are quantized here into ModelOpt's layout -- per linear layer `weight` E4M3,
a per-tensor `weight_scale` (q/k/v and gate/up each their own) and a static `input_scale` (calibrated on the
float model, q/k/v and gate/up given different ones), experts per expert; FP8_PER_CHANNEL_PER_TOKEN's scale per
output channel and no input scale -- with the config in config.json's quantization_config or in
hf_quant_config.json, and exclude lists that keep lm_head, the routers and one layer's MLP (or one layer's
q/k/v) in float. The engine (`LLM`, CPU) must match transformers on the same weights dequantized, each
quantized projection's input rounded through E4M3 with its static scale (a merged layer's: the largest of its
shards') or per token (the experts, and the per-channel format): greedy tokens identical, logprobs to float32
rounding. The KV-scales case adds each attention layer's `k_proj.k_scale` / `v_proj.v_scale` with
kv_cache_quant_algo FP8: kv_cache_dtype "auto" then gives an FP8 cache with those scales, and the reference
rounds K and V through FP8 at them. FP8_PB_WO (128 x 128 block scales stored [out / 128, 1, in / 128, 1]) on a
Llama of whole blocks, against the block reference (inputs rounded per token and group of 128, as vLLM runs it).
Refusals by name; on a GPU, the same checkpoints against the references.
"""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
import torch
from ferrox.errors import UnsupportedModelError
from ferrox.layers.fused_moe import FusedMoE
from ferrox.layers.quant.config import resolve_quant_config
from ferrox.layers.quant.excluded_modules import ExcludeList
from ferrox.layers.quant.fp8_block import Fp8BlockLinear
from ferrox.layers.quant.fp8_linear import Fp8Linear
from ferrox.layers.quant.modelopt import ModelOptBlockConfig, ModelOptConfig
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from safetensors.torch import load_file

from tests.helpers import tiny_models
from tests.helpers.fp8_block_checkpoints import block_tensors
from tests.helpers.fp8_block_checkpoints import reference_model as block_reference_model
from tests.helpers.fp8_kv_reference import fake_fp8
from tests.helpers.fp8_moe_checkpoints import reference_model as moe_reference_model
from tests.helpers.quant_checkpoints import (
    MERGED,
    assert_follows_reference,
    calibrate_input_amax,
    dequantized_reference,
    engine_greedy,
    make_llm,
    reference_greedy,
    with_float_modules,
    write_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

FP8 = torch.float8_e4m3fn
PROMPTS = [[5, 9, 33, 7, 100, 41], list(range(40, 53)), [17]]  # [17]: a one-token prefill
NEW_TOKENS = 8
_PROJECTION = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$")
# Static input scales that differ between a merged layer's shards, so the test sees which one the engine takes.
INPUT_SCALE_FACTOR = {"k_proj": 1.5, "v_proj": 2.0, "up_proj": 1.75}
EXPERT_INPUT_SCALE = 0.02  # (read and unused by the engine: its experts quantize per token)
# The KV case's per-layer scales: small enough that the largest keys saturate (module docstring).
K_SCALES, V_SCALES = (5 / 1024, 7 / 1024), (3 / 64, 7 / 64)
PRODUCER = {"name": "modelopt", "version": "0.29.0"}
FP8_GROUPS = {"group_0": {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                          "weights": {"dynamic": False, "num_bits": 8, "type": "float"}, "targets": ["Linear"]}}


# ---- the reference quantizer ----------------------------------------------------------------------
def modelopt_tensors(float_weights: dict[str, torch.Tensor], input_amax: dict[str, float], keep_float,
                     per_channel: bool = False) -> dict[str, torch.Tensor]:
    """The float checkpoint as ModelOpt exports it: every projection not kept float (keep_float(module)) with
    E4M3 codes, a float32 `weight_scale` ([] per tensor, absmax / 448; [out] per channel) and, per tensor, a
    static `input_scale` (calibrated absmax / 448, times INPUT_SCALE_FACTOR)."""
    out = {}
    for name, w in float_weights.items():
        module = name.rsplit(".", 1)[0]
        if not name.endswith(".weight") or not _PROJECTION.search(module) or keep_float(module):
            out[name] = w
            continue
        wf = w.float()
        scale = (wf.abs().amax(dim=1) if per_channel else wf.abs().amax()).clamp(min=1e-12) / 448.0
        out[name] = (wf / (scale[:, None] if per_channel else scale)).clamp(-448, 448).to(FP8)
        out[f"{module}.weight_scale"] = scale.float()
        if not per_channel:
            proj = module.rsplit(".", 1)[1]
            amax = input_amax.get(module)
            value = EXPERT_INPUT_SCALE if amax is None else amax / 448.0 * INPUT_SCALE_FACTOR.get(proj, 1.0)
            out[f"{module}.input_scale"] = torch.tensor(value, dtype=torch.float32)
    return out


def fake_quantize(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """x rounded through E4M3 with a static scale, or per token (scale None)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0 if scale is None else torch.tensor(scale)
    return (xf / s).clamp(-448, 448).to(FP8).float() * s


def with_static_inputs(model, tensors: dict[str, torch.Tensor]):
    """The MoE reference's dense projections re-hooked to round their input with the static input scale (a
    merged layer's: the largest of its shards'); the experts keep their per-token rounding."""
    static: dict[str, float] = {}
    for name, value in tensors.items():
        if name.endswith(".input_scale") and ".experts." not in name:
            layer, proj = name.rsplit(".", 1)[0].rsplit(".", 1)
            key = f"{layer}.{MERGED.get(proj, proj)}"
            static[key] = max(static.get(key, 0.0), float(value))
    for name, module in model.named_modules():
        if _PROJECTION.search(name) and f"{name}.weight_scale" in tensors:
            layer, proj = name.rsplit(".", 1)
            module._forward_pre_hooks.clear()
            module.register_forward_pre_hook(functools.partial(_rounded, static[f"{layer}.{MERGED.get(proj, proj)}"]))
    return model


def _rounded(scale: float, module, args):
    return (fake_quantize(args[0], scale).to(args[0].dtype),)


def with_fp8_kv(model, k_scales, v_scales):
    """The reference's attention reading K and V rounded through FP8 at each layer's scales (an FP8 cache)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        i = module.layer_idx
        return sdpa_attention_forward(module, query, fake_fp8(key, k_scales[i]), fake_fp8(value, v_scales[i]),
                                      attention_mask, **kwargs)

    AttentionInterface.register("ferrox_test_modelopt_kv", attention)
    model.set_attn_implementation("ferrox_test_modelopt_kv")
    return model


def as_hf_quant_config(folder: str, quantization: dict) -> str:
    """The checkpoint with its quantization config moved to hf_quant_config.json (ModelOpt before 0.31)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(path, "w") as f:
        json.dump(config, f)
    with open(os.path.join(folder, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": PRODUCER, "quantization": quantization}, f)
    return folder


def assert_matches(llm, reference, *, atol: float = 1e-4) -> None:
    for prompt, (tokens, logprobs) in zip(PROMPTS, engine_greedy(llm, PROMPTS, NEW_TOKENS), strict=True):
        ref_tokens, ref_logprobs = reference_greedy(reference, prompt, NEW_TOKENS)
        assert tokens == ref_tokens, prompt
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=atol, rtol=1e-4)


# ---- checkpoints ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def input_amax(float_folder) -> dict[str, float]:
    return calibrate_input_amax(float_folder, PROMPTS)


def _layer1_mlp(module: str) -> bool:
    return module.startswith("model.layers.1.mlp.")


def _layer0_qkv(module: str) -> bool:
    return module in {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}


@pytest.fixture(scope="module")
def kv_checkpoint(tmp_path_factory, float_folder, float_weights, input_amax):
    """hf_quant_config.json, kv_cache_quant_algo FP8 with ModelOpt's k_proj.k_scale / v_proj.v_scale; layer 0's
    q/k/v (named one by one) and lm_head left in float."""
    tensors = modelopt_tensors(float_weights, input_amax, _layer0_qkv)
    for i, (k, v) in enumerate(zip(K_SCALES, V_SCALES, strict=True)):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(v)
    folder = write_checkpoint(float_folder, tmp_path_factory.mktemp("modelopt") / "kv", {}, tensors)
    quantization = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                    "exclude_modules": ["lm_head", *(f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj",
                                                                                               "v_proj"))]}
    return as_hf_quant_config(folder, quantization), tensors


# ---- end to end -----------------------------------------------------------------------------------
def test_config_json_fp8_with_an_excluded_mlp(tmp_path, float_folder, float_weights, input_amax):
    """config.json's form (ModelOpt 0.31+): static FP8, lm_head and layer 1's MLP (`module_path*`) in float."""
    tensors = modelopt_tensors(float_weights, input_amax, _layer1_mlp)
    config = {"quant_method": "modelopt", "quant_algo": "FP8", "config_groups": FP8_GROUPS, "kv_cache_scheme": None,
              "ignore": ["lm_head", "model.layers.1.mlp*"], "producer": PRODUCER}
    llm = make_llm(write_checkpoint(float_folder, tmp_path / "modelopt", config, tensors))
    layers = llm.engine.runner.model.model.layers
    qkv, kept = layers[0].self_attn.qkv_proj, layers[1].mlp.gate_up_proj
    assert isinstance(qkv.quant, Fp8Linear) and qkv.quant.activations == "static"
    assert qkv.quant.input_scale.item() == pytest.approx(max(
        float(tensors[f"model.layers.0.self_attn.{p}.input_scale"]) for p in ("q_proj", "k_proj", "v_proj")))
    assert kept.quant is None and kept.weight.dtype == torch.float32 and layers[1].mlp.down_proj.quant is None
    assert llm.engine.runner.kv_caches[0].dtype == torch.float32  # (no KV-cache quantization)
    assert_matches(llm, dequantized_reference(float_folder, tensors, fake_quantize))


def test_hf_quant_config_with_kv_scales_gives_an_fp8_cache(kv_checkpoint, float_folder):
    """hf_quant_config.json's form with kv_cache_quant_algo FP8: kv_cache_dtype auto is an FP8 cache at the
    checkpoint's k_proj.k_scale / v_proj.v_scale, and layer 0's q/k/v, excluded shard by shard, run in float."""
    folder, tensors = kv_checkpoint
    llm = make_llm(folder)
    runner = llm.engine.runner
    assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert llm.engine._cache_config_info["cache_dtype"] == "fp8"  # (the cache_config_info gauge's label)
    layers = runner.model.model.layers
    assert [(lay.self_attn.kv_scales.k_scale, lay.self_attn.kv_scales.v_scale) for lay in layers] == list(
        zip(K_SCALES, V_SCALES, strict=True))
    assert layers[0].self_attn.qkv_proj.quant is None and isinstance(layers[1].self_attn.qkv_proj.quant, Fp8Linear)
    reference = dequantized_reference(float_folder, tensors, fake_quantize)
    unscaled = _prompt_logprobs(reference)
    # (an FP8 key on a rounding boundary may land one code apart between the two rotary implementations)
    assert_matches(llm, with_fp8_kv(reference, K_SCALES, V_SCALES), atol=5e-3)
    assert float((_prompt_logprobs(reference) - unscaled).abs().max()) > 0.02, "the KV scales made no difference"


@torch.inference_mode()
def _prompt_logprobs(model) -> torch.Tensor:
    return model(torch.tensor([PROMPTS[1]])).logits[0].float().log_softmax(-1)


def test_per_channel_per_token(tmp_path, float_folder, float_weights, input_amax):
    """FP8_PER_CHANNEL_PER_TOKEN: a scale per output channel, activations per token at run time."""
    tensors = modelopt_tensors(float_weights, input_amax, lambda m: False, per_channel=True)
    config = {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "ignore": ["lm_head"]}
    llm = make_llm(write_checkpoint(float_folder, tmp_path / "pcpt", config, tensors))
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.quant.activations == "dynamic-token"
    assert_matches(llm, dequantized_reference(float_folder, tensors, fake_quantize))


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> str:
    """A tiny float Qwen3-MoE: layers 0 and 2 sparse, layer 1 dense."""
    return tiny_models.make_tiny_qwen3_moe(tmp_path_factory.mktemp("modelopt-moe") / "float", seed=21)


def test_qwen3_moe_experts(tmp_path, moe_folder):
    """Qwen3-MoE: per-expert per-tensor scales (and unused input scales), routers and layer 1's dense MLP
    excluded by ModelOpt's wildcards."""
    float_folder = moe_folder
    float_weights = load_file(os.path.join(float_folder, "model.safetensors"))
    tensors = modelopt_tensors(float_weights, calibrate_input_amax(float_folder, PROMPTS), _layer1_mlp)
    config = {"quant_method": "modelopt", "quant_algo": "FP8", "config_groups": FP8_GROUPS,
              "ignore": ["lm_head", "model.layers.*.mlp.gate", "model.layers.1.mlp*"], "producer": PRODUCER}
    llm = make_llm(write_checkpoint(float_folder, tmp_path / "modelopt", config, tensors))
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and all(m.w13.dtype == FP8 and m.block is None for m in experts)
    assert model.model.layers[1].mlp.gate_up_proj.quant is None
    reference = with_static_inputs(moe_reference_model(float_folder, tensors, None, "weight_scale"), tensors)
    assert_matches(llm, reference)


PER_BLOCK = (128, 128)


@pytest.fixture(scope="module")
def per_block_checkpoint(tmp_path_factory):
    """(float folder, FP8_PB_WO folder, its tensors with 2-D scales): a tiny Llama whose every shard is whole
    128-row blocks (q 256 rows, k and v 128, gate and up 256), lm_head and layer 1's MLP excluded."""
    root = tmp_path_factory.mktemp("modelopt-pb")
    float_folder = tiny_models.make_tiny_llama(root / "float", hidden_size=256, num_heads=4, num_kv_heads=2,
                                               intermediate_size=256, seed=5)
    float_weights = load_file(os.path.join(float_folder, "model.safetensors"))
    tensors = with_float_modules(block_tensors(float_weights, PER_BLOCK, "weight_scale"), float_weights, _layer1_mlp)
    stored = {k: v.reshape(v.shape[0], 1, v.shape[1], 1) if k.endswith(".weight_scale") else v
              for k, v in tensors.items()}
    config = {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO", "ignore": ["lm_head", "model.layers.1.mlp*"],
              "producer": PRODUCER}
    return float_folder, write_checkpoint(float_folder, root / "pb-wo", config, stored), tensors


def test_per_block_weight_only(per_block_checkpoint):
    """FP8_PB_WO: a float32 `weight_scale` per 128 x 128 block, stored [out / 128, 1, in / 128, 1], no input
    scales; run as vLLM runs it, fp8_block.py's method with activations rounded per token and group of 128 (the
    reference's too); kv_cache_scheme FP8 read as an FP8 cache."""
    float_folder, folder, tensors = per_block_checkpoint
    llm = make_llm(folder)
    layers = llm.engine.runner.model.model.layers
    runner = layers[0].self_attn.qkv_proj.quant
    assert isinstance(runner, Fp8BlockLinear) and runner.block == PER_BLOCK and runner.weight_scale_inv.shape == (4, 2)
    assert layers[1].mlp.gate_up_proj.quant is None and layers[1].mlp.down_proj.quant is None
    assert_matches(llm, block_reference_model(float_folder, tensors, PER_BLOCK))
    config = ModelOptConfig.from_hf(_flat(quant_algo="fp8_pb_wo", kv_cache_scheme="FP8"))
    assert isinstance(config, ModelOptBlockConfig) and config.kv_cache_dtype == "fp8"


def test_per_block_experts_are_refused(moe_folder):
    """vLLM's ModelOpt experts read per-tensor scales, which FP8_PB_WO's blocks are not."""
    source = resolve_model(moe_folder)
    with pytest.raises(UnsupportedModelError, match=r"quant_algo FP8_PB_WO\): mixture-of-experts layers"):
        load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu",
                   quant_config=ModelOptConfig.from_hf(_flat(quant_algo="FP8_PB_WO")))


# ---- refusals -------------------------------------------------------------------------------------
def _flat(**changes) -> dict:
    return {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"], **changes}


@pytest.mark.parametrize("config,message", [
    (_flat(quant_algo="NVFP4"), r"quant_algo 'NVFP4': FP4 weights need Blackwell"),
    (_flat(quant_algo="w4a16_nvfp4"), "Blackwell"),
    (_flat(quant_algo="MXFP8"), "MXFP8.*Blackwell"),
    (_flat(quant_algo="W4A8_AWQ"), "integer and AWQ"),
    (_flat(quant_algo="MIXED_PRECISION"), "scheme per layer"),
    (_flat(quant_algo="FP6"), r"quant_algo 'FP6': it is not one of ModelOpt's formats"),
    (_flat(quant_algo=None), "quant_algo is missing"),
    (_flat(kv_cache_scheme={"num_bits": 4, "type": "float", "group_size": 16}), r"kv_cache_scheme .*NVFP4 KV cache"),
    (_flat(kv_cache_quant_algo="INT8"), r"kv_cache_quant_algo 'INT8': only an FP8 KV cache"),
    (_flat(weight_bits=8), r"field\(s\) weight_bits"),
    (_flat(config_groups={"g": {"weights": {"num_bits": 4, "type": "float"}}}), r"config_groups\.g\.weights"),
    (_flat(ignore="lm_head"), r"ignore: expected a list"),
    ({"producer": PRODUCER, "quantization": {"quant_algo": "FP8", "has_zero_point": True}}, "has_zero_point"),
    ({"producer": PRODUCER, "quantization": {"quant_algo": "FP8", "awq_block_size": 128}},
     r"hf_quant_config\.json quantization: field\(s\) awq_block_size"),
    ({"producer": PRODUCER, "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "NVFP4"}},
     r"hf_quant_config\.json quantization\.quant_algo 'NVFP4'"),
])
def test_refusals(config, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelOptConfig.from_hf(config)


def test_config_spellings_vllm_reads():
    """kv_cache_scheme as ModelOpt's converter writes it (a dict, or "FP8" in older versions), quant_algo in
    lower case, hf_quant_config.json's names in config.json, the older `quant_library` marker."""
    for kv in ({"dynamic": False, "num_bits": 8, "type": "float"}, "FP8"):
        assert ModelOptConfig.from_hf(_flat(kv_cache_scheme=kv)).kv_cache_dtype == "fp8"
    config = ModelOptConfig.from_hf(_flat(quant_algo="fp8", ignore=None, exclude_modules=["lm_head"],
                                          kv_cache_quant_algo="fp8"))
    assert (config.algo, config.kv_cache_dtype, config.excluded.entries) == ("FP8", "fp8", ("lm_head",))
    assert ModelOptConfig.from_hf(_flat(kv_cache_scheme=None)).kv_cache_dtype is None


def test_resolver(tmp_path, float_folder, kv_checkpoint):
    """quantization "modelopt" must agree with the checkpoint (and needs one); another producer's
    hf_quant_config.json is refused naming the file."""
    spec = load_model_spec(resolve_model(kv_checkpoint[0]))
    assert isinstance(resolve_quant_config("modelopt", spec), ModelOptConfig)
    with pytest.raises(UnsupportedModelError, match="does not match"):
        resolve_quant_config("fp8", spec)
    with pytest.raises(UnsupportedModelError, match="needs a checkpoint quantized that way"):
        resolve_quant_config("modelopt", load_model_spec(resolve_model(float_folder)))
    other = as_hf_quant_config(write_checkpoint(float_folder, tmp_path / "other", {}, {}), {"quant_algo": "FP8"})
    with open(os.path.join(other, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "someone"}, "quantization": {"quant_algo": "FP8"}}, f)
    with pytest.raises(UnsupportedModelError, match="hf_quant_config.json: .*producer is not NVIDIA ModelOpt"):
        resolve_quant_config(None, load_model_spec(resolve_model(other)))


@pytest.mark.parametrize("entry,named,not_named", [
    ("lm_head", ["lm_head", "model.lm_head"], ["model.lm_head_x"]),
    ("model.layers.1*", ["model.layers.1", "model.layers.1.mlp.down_proj"], ["model.layers.10.mlp.down_proj"]),
    ("model.layers.*.mlp.gate", ["model.layers.7.mlp.gate"], ["model.layers.7.mlp.gate_up_proj"]),
    ("*self_attn*", ["model.layers.0.self_attn.o_proj"], ["model.layers.0.mlp.down_proj"]),
    ("model.layers.2.mlp", ["model.layers.2.mlp.down_proj"], ["model.layers.2.mlp_norm", "model.layers.20.mlp.x"]),
    ("down_proj", ["model.layers.3.mlp.down_proj"], ["model.layers.3.mlp.down_projection"]),
])
def test_exclude_entries_name_modules_on_dot_boundaries(entry, named, not_named):
    """ModelOpt's wildcards over whole names, `path*` as that module's subtree, plain entries as whole dotted
    components anywhere in the name (excluded_modules.py)."""
    excluded = ExcludeList([entry], "test")
    assert [excluded.names(n) for n in named + not_named] == [True] * len(named) + [False] * len(not_named)


@pytest.mark.parametrize("entries,message", [
    (["model.layers.0.self_attn.q_proj"], r"leaves model\.layers\.0\.self_attn\.q_proj unquantized but not "
                                          r"model\.layers\.0\.self_attn\.k_proj"),
    (["model.layers.0.mlp*"], r"'model\.layers\.0\.mlp\*' leaves the experts model\.layers\.0\.mlp\.experts"),
    (["model.layers.2.mlp.experts.5.down_proj"], r"experts model\.layers\.2\.mlp\.experts\.5\.down_proj"),
])
def test_exclusions_ferrox_cannot_run_are_refused(moe_folder, entries, message):
    """A merged layer excluded shard by shard but not wholly; experts excluded (no float fallback for them)."""
    source = resolve_model(moe_folder)
    config = ModelOptConfig.from_hf(_flat(ignore=entries))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu", quant_config=config)


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_gpu_engine_follows_the_reference(kv_checkpoint, float_folder, enforce_eager):
    """The FP8 kernels (static W8A8, the fused one-token path with a float layer among FP8 ones) and the FP8 KV
    cache at the checkpoint's scales, in float32, against the CPU reference."""
    folder, tensors = kv_checkpoint
    llm = make_llm(folder, device="cuda", dtype="float32", enforce_eager=enforce_eager)
    assert llm.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    reference = with_fp8_kv(dequantized_reference(float_folder, tensors, fake_quantize), K_SCALES, V_SCALES)
    for prompt, (tokens, logprobs) in zip(PROMPTS, engine_greedy(llm, PROMPTS, NEW_TOKENS), strict=True):
        assert_follows_reference(reference, prompt, tokens, logprobs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_per_block_follows_the_reference(per_block_checkpoint):
    """FP8_PB_WO on the block kernels (Triton group quantizer and block GEMM, the one-token product, a float MLP
    among block-FP8 layers), float32, CUDA graphs, against the CPU block reference."""
    float_folder, folder, tensors = per_block_checkpoint
    llm = make_llm(folder, device="cuda", dtype="float32")
    reference = block_reference_model(float_folder, tensors, PER_BLOCK)
    for prompt, (tokens, logprobs) in zip(PROMPTS, engine_greedy(llm, PROMPTS, NEW_TOKENS), strict=True):
        assert_follows_reference(reference, prompt, tokens, logprobs, nats=0.15)
