"""NVIDIA's FP8 release of Nemotron 3 Nano (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8: a ModelOpt FP8 export with a
selective recipe) in NemotronHForCausalLM, end to end on a tiny Nemotron 3 (tests/helpers/tiny_nemotron_h_moe.py:
layers M E * E - M).

The float checkpoint is quantized here into ModelOpt's layout as the release's recipe does: the routed experts (per
expert), the shared experts, the "-" MLP and the Mamba in_proj / out_proj of layer 5 in E4M3 with a per-tensor
`weight_scale` and a static `input_scale` (calibrated on the float model; the experts' read and unused); the attention
layer, Mamba layer 0 and every conv1d named in exclude_modules (the release's `backbone.` names) and kept float; the
routers float32; kv_cache_quant_algo FP8 with the attention layer's `k_proj.k_scale` / `v_proj.v_scale`. The real
engine (chunked prefill under a 16-token budget, four prompts batched, an FP8 KV cache from kv_cache_dtype auto)
must give transformers' greedy tokens and logprobs on the same weights dequantized, each quantized projection's
input rounded through E4M3 at its static scale, the experts' input and intermediate per token / pair (as the FP8
expert kernels quantize them), and K / V through FP8 at the checkpoint's scales. Then tensor parallelism (two gloo
ranks) against one rank, and the refusals by name."""

from __future__ import annotations

import functools
import os
import re
import types

import pytest
import torch
import torch.nn.functional as F
from ferrox.errors import UnsupportedModelError
from ferrox.layers.fused_moe import FusedMoE
from ferrox.layers.quant.fp8_linear import Fp8Linear
from ferrox.layers.quant.modelopt import ModelOptConfig
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from safetensors.torch import load_file

from tests.helpers.fp8_kv_reference import fake_fp8
from tests.helpers.quant_checkpoints import write_checkpoint
from tests.helpers.tiny_nemotron_h_moe import EXPERTS, NEMOTRON_MOE_PATTERN, make_tiny_nemotron_h_moe
from tests.models.conftest import assert_outputs_match_transformers, chunked_engine_outputs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

FP8 = torch.float8_e4m3fn
PROMPTS = [[5, 9, 11], list(range(3, 43)), [(7 * i) % 300 + 3 for i in range(30)],
           [(11 * i) % 200 + 7 for i in range(9)]]
ATTENTION = NEMOTRON_MOE_PATTERN.index("*")  # 2
FLOAT_MAMBA = 0  # (the recipe keeps the Mamba layers beside attention in BF16; here layer 0)
FP8_MAMBA = NEMOTRON_MOE_PATTERN.rindex("M")  # 5
EXCLUDE = ["lm_head", *(f"backbone.layers.{ATTENTION}.mixer.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
           f"backbone.layers.{FLOAT_MAMBA}.mixer.in_proj", f"backbone.layers.{FLOAT_MAMBA}.mixer.out_proj",
           "backbone.layers.*.mixer.conv1d", "backbone.layers.*.mixer.gate"]
K_SCALE, V_SCALE = 3 / 448, 5 / 448  # (keys and values of a few units here: some saturate)
EXPERT_INPUT_SCALE = 0.02
_QUANTIZED = re.compile(r"\.mixer\.(in_proj|out_proj|up_proj|down_proj|(shared_experts|experts\.\d+)\.(up|down)_proj)"
                        r"\.weight$")
_EXPERT = re.compile(r"^(?P<layer>.+)\.mixer\.experts\.(?P<e>\d+)\.(?P<proj>up_proj|down_proj)\.weight$")


def _excluded(module: str) -> bool:
    return module.startswith((f"backbone.layers.{FLOAT_MAMBA}.", f"backbone.layers.{ATTENTION}."))


def calibrate(float_folder: str) -> dict[str, float]:
    """Each dense projection's largest input over PROMPTS in the float model (module name -> amax)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def record(name, module, args):
        name = "backbone." + name.removeprefix("model.")  # (transformers' module names, the checkpoint's spelling)
        amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(("in_proj", "out_proj", "up_proj", "down_proj")):
            module.register_forward_pre_hook(functools.partial(record, name))
    with torch.inference_mode():
        for prompt in PROMPTS:
            model(torch.tensor([prompt]))
    return amax


def modelopt_tensors(float_weights: dict[str, torch.Tensor], amax: dict[str, float]) -> dict[str, torch.Tensor]:
    """The float checkpoint as ModelOpt exports it (module docstring): E4M3 codes, float32 [] weight_scale (absmax
    / 448) and input_scale; KV scales on the attention layer."""
    out = {}
    for name, w in float_weights.items():
        module = name.rsplit(".", 1)[0]
        if not _QUANTIZED.search(name) or _excluded(module):
            out[name] = w
            continue
        scale = w.float().abs().amax().clamp(min=1e-12) / 448.0
        out[name] = (w.float() / scale).clamp(-448, 448).to(FP8)
        out[f"{module}.weight_scale"] = scale
        expert = ".experts." in module
        assert expert or module in amax, module
        out[f"{module}.input_scale"] = torch.tensor(EXPERT_INPUT_SCALE if expert else amax[module] / 448.0)
    out[f"backbone.layers.{ATTENTION}.mixer.k_proj.k_scale"] = torch.tensor(K_SCALE)
    out[f"backbone.layers.{ATTENTION}.mixer.v_proj.v_scale"] = torch.tensor(V_SCALE)
    return out


def fake_quantize(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """x rounded through E4M3 at a static scale, or per row (scale None)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0 if scale is None else torch.tensor(scale)
    return ((xf / s).clamp(-448, 448).to(FP8).float() * s).to(x.dtype)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' NemotronHExperts one (token, slot) pair at a time, the input and the relu^2 intermediate
    rounded through E4M3 per row, as the FP8 expert kernels quantize them: the intermediate per each of
    `self.ranks` column blocks (a tensor-parallel rank quantizes its own columns)."""
    out = torch.zeros_like(hidden_states)
    x = fake_quantize(hidden_states, None)
    for t in range(x.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            act = torch.square(F.relu(F.linear(x[t:t + 1], self.up_proj[e])))
            act = torch.cat([fake_quantize(part, None) for part in act.chunk(self.ranks, dim=-1)], dim=-1)
            out[t] += top_k_weights[t, j] * F.linear(act, self.down_proj[e])[0]
    return out


def reference_model(float_folder: str, tensors: dict[str, torch.Tensor], ranks: int = 1):
    """transformers (float32) on `tensors` dequantized, inputs rounded (module docstring), K / V through FP8; the
    experts' intermediate quantized per rank's columns of `ranks`."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, codes in tensors.items():
            if codes.dtype != FP8:
                continue
            module = name.rsplit(".", 1)[0]
            w = codes.float() * tensors[f"{module}.weight_scale"]
            static = float(tensors[f"{module}.input_scale"])
            module = "model." + module.removeprefix("backbone.")  # (transformers' names)
            expert = _EXPERT.match(module + ".weight")
            if expert is not None:
                experts = modules[f"{expert['layer']}.mixer.experts"]
                getattr(experts, expert["proj"]).data[int(expert["e"])] = w
                experts.forward = types.MethodType(_experts_forward, experts)
                experts.ranks = ranks
                continue
            linear = modules[module]
            linear.weight.data = w
            linear.register_forward_pre_hook(lambda m, args, s=static: (fake_quantize(args[0], s),))

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, fake_fp8(key, K_SCALE), fake_fp8(value, V_SCALE),
                                      attention_mask, **kwargs)

    AttentionInterface.register("ferrox_test_nemotron_fp8_kv", attention)
    model.set_attn_implementation("ferrox_test_nemotron_fp8_kv")
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(float folder, FP8 folder, its tensors): config.json quantization_config as the release's ModelOpt writes
    it (quant_algo FP8, kv_cache_quant_algo FP8, exclude_modules)."""
    root = tmp_path_factory.mktemp("nemotron_h_fp8")
    float_folder = make_tiny_nemotron_h_moe(root / "float", seed=3)
    tensors = modelopt_tensors(load_file(os.path.join(float_folder, "model.safetensors")), calibrate(float_folder))
    config = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
              "exclude_modules": EXCLUDE, "producer": {"name": "modelopt", "version": "0.35.0"}}
    return float_folder, write_checkpoint(float_folder, root / "fp8", config, tensors), tensors


def _load_rank(folder: str, rank: int, size: int):
    """Rank `rank` of `size` with the checkpoint's quantization, loaded as its engine process loads it."""
    from ferrox.distributed.parallel_state import TPGroup, use_tp_group
    from ferrox.layers.quant.config import resolve_quant_config

    source = resolve_model(folder)
    spec = load_model_spec(source)
    with use_tp_group(TPGroup(rank=rank, size=size)):
        return load_model(source, spec, dtype=torch.float32, device="cpu", quant_config=resolve_quant_config(None, spec))


def test_layers_take_the_recipe(checkpoint):
    """What the recipe quantized runs FP8 (static W8A8; the experts non-gated [E, I, H] with per-tensor scales in
    every row); what it excluded runs float; the KV scales reach the attention layer."""
    _, folder, tensors = checkpoint
    model = _load_rank(folder, 0, 1)
    layers = model.model.layers
    fp8_mamba = layers[FP8_MAMBA].mixer
    for proj in (fp8_mamba.in_proj, fp8_mamba.out_proj, layers[4].mixer.gate_up_proj,
                 layers[1].mixer.shared_experts.down_proj):
        assert isinstance(proj.quant, Fp8Linear) and proj.quant.activations == "static"
    assert fp8_mamba.in_proj.quant.input_scale.item() == pytest.approx(
        float(tensors[f"backbone.layers.{FP8_MAMBA}.mixer.in_proj.input_scale"]))
    # The per-tensor scale on every row of the five segments.
    assert torch.equal(fp8_mamba.in_proj.weight_scale,
                       tensors[f"backbone.layers.{FP8_MAMBA}.mixer.in_proj.weight_scale"].expand(196))
    float_mamba, attention = layers[FLOAT_MAMBA].mixer, layers[ATTENTION].mixer
    for proj in (float_mamba.in_proj, float_mamba.out_proj, attention.qkv_proj, attention.o_proj):
        assert proj.quant is None and proj.weight.dtype == torch.float32
    assert fp8_mamba.conv1d.weight.dtype == torch.float32 and fp8_mamba.A_log.dtype == torch.float32
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and all(m.w13.dtype == FP8 and m.w13.shape == (EXPERTS, 32, 64) for m in experts)
    up_scale = tensors["backbone.layers.1.mixer.experts.3.up_proj.weight_scale"]
    assert torch.equal(experts[0].w13_scale[3], up_scale.expand(32))
    assert (attention.kv_scales.k_scale, attention.kv_scales.v_scale) == pytest.approx((K_SCALE, V_SCALE))


def test_engine_matches_the_dequantized_reference(checkpoint):
    """The real engine (FP8 KV cache from kv_cache_dtype auto) against transformers on the dequantized weights."""
    float_folder, folder, tensors = checkpoint
    outs = chunked_engine_outputs(folder, PROMPTS)
    # (an FP8 key on a rounding boundary may land one code apart between the two attention paths)
    assert_outputs_match_transformers(reference_model(float_folder, tensors), PROMPTS, outs, abs_tol=2e-3)


def test_a_rank_holds_its_share(checkpoint):
    """Rank 1 of 2 (lazy safetensors slices, as its engine process loads them): the in_proj's E4M3 rows of each of
    its five segments under the one per-tensor scale, out_proj's columns, each expert's up rows and down columns
    with their scales, against the whole model's."""
    _, folder, _ = checkpoint
    whole, part = _load_rank(folder, 0, 1), _load_rank(folder, 1, 2)
    full, mine = whole.model.layers[FP8_MAMBA].mixer, part.model.layers[FP8_MAMBA].mixer
    # z 64, x 64, B 2 x 16, C 2 x 16, dt 4 rows: rank 1 holds heads 2-3 (z / x rows 32-63), group 1 of B / C, dt 2-3.
    rows = torch.cat([torch.arange(o, o + n) for o, n in ((32, 32), (96, 32), (144, 16), (176, 16), (194, 2))])
    assert torch.equal(mine.in_proj.weight.view(torch.uint8), full.in_proj.weight.view(torch.uint8)[rows])
    assert torch.equal(mine.in_proj.weight_scale, full.in_proj.weight_scale[rows])
    assert mine.in_proj.quant.input_scale.item() == full.in_proj.quant.input_scale.item()
    assert torch.equal(mine.out_proj.weight.view(torch.uint8), full.out_proj.weight.view(torch.uint8)[:, 32:])
    e_full, e_mine = whole.model.layers[1].mixer.experts, part.model.layers[1].mixer.experts
    assert torch.equal(e_mine.w13.view(torch.uint8), e_full.w13.view(torch.uint8)[:, 16:])
    assert torch.equal(e_mine.w2.view(torch.uint8), e_full.w2.view(torch.uint8)[:, :, 16:])
    assert torch.equal(e_mine.w13_scale, e_full.w13_scale[:, 16:]) and torch.equal(e_mine.w2_scale, e_full.w2_scale)


def test_tp2_matches_the_dequantized_reference(checkpoint):
    """The engine at tensor_parallel_size 2 (gloo) against the reference whose experts quantize their intermediate
    per half: each rank quantizes its own columns of it (per pair), as vLLM's ranks do, so two ranks do not round
    as one does; every other FP8 input is replicated (the experts' x) or takes its static scale on both ranks."""
    float_folder, folder, tensors = checkpoint
    outs = chunked_engine_outputs(folder, PROMPTS, tensor_parallel_size=2)
    assert_outputs_match_transformers(reference_model(float_folder, tensors, ranks=2), PROMPTS, outs, abs_tol=2e-3)


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}, r"quantization 'modelopt' \(quant_algo FP8_PB_WO\) is "
                                                               r"not supported for NemotronHForCausalLM"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, r"quant_algo 'NVFP4': FP4 weights need Blackwell"),
])
def test_refusals(checkpoint, config, message):
    """Block-wise FP8 (the in_proj's dt segment has a row per head, no whole 128-row blocks) and NVFP4 by name."""
    float_folder = checkpoint[0]
    source = resolve_model(float_folder)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu",
                   quant_config=ModelOptConfig.from_hf(config))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_gpu_engine_follows_the_reference(checkpoint, enforce_eager):
    """The CUDA engine (static FP8 linears, the FP8 non-gated expert kernels, the FP8 KV cache, decode steps in CUDA
    graphs) in float32 against the CPU reference: each greedy token the reference's best within 0.1 nats."""
    from tests.helpers.quant_checkpoints import assert_follows_reference

    float_folder, folder, tensors = checkpoint
    reference = reference_model(float_folder, tensors)
    for prompt, out in zip(PROMPTS, chunked_engine_outputs(folder, PROMPTS, device="cuda",
                                                           enforce_eager=enforce_eager), strict=True):
        sample = out.outputs[0]
        tokens = list(sample.token_ids)
        logprobs = [step[t].logprob for step, t in zip(sample.logprobs, tokens, strict=True)]
        assert_follows_reference(reference, prompt, tokens, logprobs)
