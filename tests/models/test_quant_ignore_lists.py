"""Ignore lists that name decoder layers (layers/quant/excluded_modules.py), end to end: the fp8 layout's
`modules_to_not_convert` / `ignored_layers` (substring entries, on whole dotted components) and
compressed-tensors' `ignore` (exact module names and `re:` regexes, vLLM's should_ignore_layer) keep the layers
they name in the model dtype; the rest load quantized.

The tiny Llama of tests/models/conftest.py is quantized here with some projections left float, as an export
that ignores them writes them (the float weight, no scales). The engine (`LLM`, CPU) must match transformers
with the quantized projections dequantized (their inputs rounded as the scheme says) and the ignored ones as
they are: greedy tokens identical, logprobs to float32 rounding -- for FP8 (both layouts), int8 W8A8 and int4
W4A16 (against its dequantized folder). Entries ferrox cannot honour are refused by name: a merged layer
(q/k/v, gate/up) named shard by shard but not whole, experts, compressed-tensors' class name "Linear", a regex
that does not compile. On a GPU, the FP8 and int8 cases against the same references.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from ferrox.errors import UnsupportedModelError
from ferrox.layers.linear import Linear
from ferrox.layers.quant.compressed_tensors import CompressedTensorsConfig, CompressedTensorsScheme
from ferrox.layers.quant.excluded_modules import ExcludeList
from ferrox.layers.quant.fp8 import Fp8Config
from ferrox.layers.quant.fp8_linear import Fp8Linear
from ferrox.layers.quant.int4_pack import Int4Linear
from ferrox.layers.quant.int8_linear import Int8Linear
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from safetensors.torch import load_file, save_file

from tests.helpers import int8_checkpoints as int8
from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.helpers.int4_checkpoints import make_int4_checkpoint
from tests.helpers.quant_checkpoints import (
    assert_follows_reference,
    engine_greedy,
    load_checkpoint,
    make_llm,
    reference_greedy,
    with_float_modules,
    write_checkpoint,
)
from tests.models.test_fp8_quant import _ct, quantized_tensors, reference_model

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[5, 9, 33, 7, 100, 41], list(range(40, 53)), [17]]
NEW_TOKENS = 8
_QKV = {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}
# The checkpoint name of a ferrox layer's first shard (a merged layer is float when its shards all are).
_FIRST_SHARD = {"qkv_proj": "q_proj", "gate_up_proj": "gate_proj"}

# case -> (quantization_config, the projections its entries name by checkpoint module name)
CASES = {
    # `mlp.gate` is a router's name: it must not reach gate_up_proj's gate shard (and so refuse the merged
    # layer); `layers.1.mlp` is layer 1's MLP, by parent; `o_proj` every layer's, by its last component.
    "fp8-modules_to_not_convert": (
        {"quant_method": "fp8", "activation_scheme": "dynamic",
         "modules_to_not_convert": ["lm_head", "mlp.gate", "layers.1.mlp", "o_proj"]},
        lambda m: m.startswith("model.layers.1.mlp.") or m.endswith(".o_proj")),
    # llm-compressor's float8 list: `re:.*mlp.gate$` (routers, here none), layer 0's q/k/v by one regex, layer
    # 1's down_proj by exact name.
    "ct-float8-ignore": (
        _ct(ignore=["lm_head", "re:.*mlp.gate$", r"re:model\.layers\.0\.self_attn\.[qkv]_proj$",
                    "model.layers.1.mlp.down_proj"]),
        lambda m: m in _QKV or m == "model.layers.1.mlp.down_proj"),
    # int8 W8A8 with every down_proj ignored by one regex.
    "ct-int8-ignore": (
        {**int8.int8_config("channel", "token"), "ignore": ["lm_head", "re:.*down_proj"]},
        lambda m: m.endswith(".down_proj")),
}


def _checkpoint(folder, float_folder: str, float_weights, case: str):
    """(checkpoint folder, the runner its quantized layers take, the reference) of CASES[case]."""
    config, named = CASES[case]
    if case.startswith("ct-int8"):
        tensors = with_float_modules(int8.int8_tensors(float_weights, "channel"), float_weights, named)
        runner, reference = Int8Linear, int8.reference_model(float_folder, tensors, "token")
    else:
        per_row = case.startswith("ct-")  # (compressed-tensors' channel scales, the fp8 layout's per tensor)
        quantized = quantized_tensors(float_weights, per_row=per_row, scale_shape="column" if per_row else "flat")
        tensors = with_float_modules(quantized, float_weights, named)
        runner, reference = Fp8Linear, reference_model(float_folder, tensors, "token")
    return write_checkpoint(float_folder, folder, config, tensors), runner, reference


def _assert_float_where_named(model, named, runner: type) -> None:
    """Each decoder linear layer float (the model dtype, no runner) exactly where the ignore list names it."""
    kept = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.startswith("model.layers."):
            parent, leaf = name.rsplit(".", 1)
            if named(f"{parent}.{_FIRST_SHARD.get(leaf, leaf)}"):
                assert module.quant is None and module.weight.dtype == torch.float32, name
                kept += 1
            else:
                assert isinstance(module.quant, runner), name
    assert kept > 0


@pytest.mark.parametrize("case", list(CASES))
def test_layers_named_run_in_float(tmp_path, float_folder, float_weights, case):
    folder, runner, reference = _checkpoint(tmp_path / case, float_folder, float_weights, case)
    llm = make_llm(folder)
    _assert_float_where_named(llm.engine.runner.model, CASES[case][1], runner)
    for prompt, (tokens, logprobs) in zip(PROMPTS, engine_greedy(llm, PROMPTS, NEW_TOKENS), strict=True):
        ref_tokens, ref_logprobs = reference_greedy(reference, prompt, NEW_TOKENS)
        assert tokens == ref_tokens, prompt
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-4)


def test_int4_layers_named_run_in_float(tmp_path, float_folder, float_weights):
    """compressed-tensors W4A16 with layer 0's gate/up ignored by exact names, against the dequantized
    reference folder with those two left float."""
    named = {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}
    qdir, rdir = make_int4_checkpoint(float_folder, str(tmp_path), "ct", group=32, sym=True)
    for folder in (qdir, rdir):
        path = os.path.join(folder, "model.safetensors")
        tensors = {k: v for k, v in load_file(path).items() if k.rsplit(".", 1)[0] not in named}
        save_file({**tensors, **{f"{m}.weight": float_weights[f"{m}.weight"] for m in named}}, path)
    with open(os.path.join(qdir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["ignore"] = ["lm_head", *sorted(named)]
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(config, f)
    quant, ref = load_checkpoint(qdir), load_checkpoint(rdir)
    _assert_float_where_named(quant, lambda m: m in named, Int4Linear)
    q_tokens, q_logits = run_greedy(quant, PROMPTS, NEW_TOKENS, return_prefill_logits=True)
    r_tokens, r_logits = run_greedy(ref, PROMPTS, NEW_TOKENS, return_prefill_logits=True)
    torch.testing.assert_close(q_logits, r_logits, rtol=1e-4, atol=1e-4)
    assert q_tokens == r_tokens


# ---- matching -------------------------------------------------------------------------------------
@pytest.mark.parametrize("syntax,entry,named,not_named", [
    ("substring", "mlp.gate", ["model.layers.0.mlp.gate"], ["model.layers.0.mlp.gate_proj"]),
    ("substring", "layers.1", ["model.layers.1", "model.layers.1.mlp.down_proj"], ["model.layers.10.mlp.down_proj"]),
    ("substring", "down_proj", ["model.layers.3.mlp.down_proj"], ["model.layers.3.mlp.down_projection"]),
    ("compressed-tensors", "model.layers.0.mlp.down_proj", ["model.layers.0.mlp.down_proj"],
     ["model.layers.10.mlp.down_proj", "layers.0.mlp.down_proj"]),
    ("compressed-tensors", "model.layers.0.mlp", ["model.layers.0.mlp"], ["model.layers.0.mlp.down_proj"]),
    ("compressed-tensors", "re:.*mlp.gate$", ["model.layers.3.mlp.gate"], ["model.layers.3.mlp.gate_proj"]),
    # (re.match: from the start of the name, open at its end, as vLLM matches them)
    ("compressed-tensors", r"re:model\.layers\.1", ["model.layers.1.mlp.down_proj", "model.layers.10.self_attn"],
     ["x.model.layers.1"]),
])
def test_entries_name_modules_as_vllm_reads_them(syntax, entry, named, not_named):
    excluded = ExcludeList([entry], "test", syntax)
    assert [excluded.names(n) for n in named + not_named] == [True] * len(named) + [False] * len(not_named)


def test_both_fp8_fields_are_read():
    """vLLM reads modules_to_not_convert only without ignored_layers; exports write one, and both are taken."""
    cfg = Fp8Config.from_hf({"quant_method": "fp8", "ignored_layers": ["lm_head"], "modules_to_not_convert": ["o_proj"]})
    assert cfg.excluded is not None and cfg.excluded.entries == ("lm_head", "o_proj")
    assert cfg.excluded.where.endswith("quantization_config.ignored_layers / modules_to_not_convert")


# ---- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("config,message", [
    (_ct(ignore=["model.layers.0.self_attn.q_proj"]),
     r"ignore: 'model\.layers\.0\.self_attn\.q_proj' leaves model\.layers\.0\.self_attn\.q_proj unquantized but not "
     r"model\.layers\.0\.self_attn\.k_proj"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["up_proj"]},
     r"modules_to_not_convert: 'up_proj' leaves model\.layers\.0\.mlp\.up_proj unquantized but not .*gate_proj"),
    (_ct(ignore=["lm_head", "Linear"]), r"ignore: 'Linear' names every linear layer"),
    (_ct(ignore=["re:(model"]), r"ignore: 're:\(model' is not a regular expression"),
])
def test_entries_ferrox_cannot_honour_are_refused(float_folder, config, message):
    source = resolve_model(float_folder)
    with pytest.raises(UnsupportedModelError, match=message):
        quant = (Fp8Config if config["quant_method"] == "fp8" else CompressedTensorsScheme).from_hf(config)
        load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu", quant_config=quant)


@pytest.mark.parametrize("config,message", [
    (_ct(ignore=["lm_head", "re:.*experts.3.down_proj"]),
     r"ignore: 're:\.\*experts\.3\.down_proj' leaves the experts model\.layers\.0\.mlp\.experts\.3\.down_proj"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["mlp.gate", "experts"]},
     r"modules_to_not_convert: 'experts' leaves the experts model\.layers\.0\.mlp\.experts"),
])
def test_named_experts_are_refused(tmp_path, config, message):
    """Experts take their FP8 method when built, with no way back to float (a router entry alone is fine)."""
    source = resolve_model(tiny_models.make_tiny_qwen3_moe(tmp_path / "moe", seed=2))
    quant = (Fp8Config if config["quant_method"] == "fp8" else CompressedTensorsConfig).from_hf(config)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu", quant_config=quant)


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_float_layers_among_quantized_ones(tmp_path, float_folder, float_weights, case, enforce_eager):
    """The CUDA kernels with float layers among FP8 / int8 ones (the fused one-token path runs both kinds), in
    float32, against the CPU reference."""
    folder, runner, reference = _checkpoint(tmp_path / case, float_folder, float_weights, case)
    llm = make_llm(folder, device="cuda", dtype="float32", enforce_eager=enforce_eager)
    _assert_float_where_named(llm.engine.runner.model, CASES[case][1], runner)
    for prompt, (tokens, logprobs) in zip(PROMPTS, engine_greedy(llm, PROMPTS, NEW_TOKENS), strict=True):
        assert_follows_reference(reference, prompt, tokens, logprobs)
