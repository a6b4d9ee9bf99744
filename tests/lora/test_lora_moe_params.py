"""LoRA adapters in PEFT's `target_parameters` format (lora/expert_params.py): LoRA on gpt-oss's stacked expert
parameters `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, as OpenAI's fine-tuning recipe writes them and vLLM
serves them (is_3d_moe_weight); the same format on Qwen3-VL-MoE and the multimodal Qwen3.5-MoE (gate rows then up
rows, pairs under model.language_model.layers), text prompts through the multimodal class against peft's merge.

- The adapters are written by peft itself on a tiny random gpt-oss (tests/helpers/tiny_gpt_oss.py: float experts
  with biases, the clamped SwiGLU, gate / up interleaved in gate_up_proj), one on every layer's gate_up and down
  with q / v attention modules, one on every layer's gate_up and layer 1's down (two ParamWrappers nested there, one
  alone elsewhere) with o_proj, of another rank. The real engine serves them beside base-model requests in one
  batch (2 slots, 16-token budget): each request's greedy tokens and logprobs equal transformers' with the adapter
  merged by peft (merge_and_unload).
- Refused by name: target_parameters naming anything but the experts' two parameters, an MXFP4 gpt-oss.
- On a GPU: the CUDA engine (the Triton path of lora/moe.py with gpt-oss's biases and activation) against the CPU
  engine.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from ferrox import LLM
from ferrox.lora.adapter import LoRAAdapterError, read_peft_adapter
from ferrox.lora.request import LoRARequest

from tests.helpers import tiny_gpt_oss
from tests.helpers.tiny_models import EOS_TOKEN_ID
from tests.lora.adapters import load_hf_model, make_peft_adapter, merged_reference, write_adapter
from tests.lora.mixed_batch import generate_mixed, hf_logprobs
from tests.models.conftest import cut_at_eos, hf_greedy

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[(7 * i) % 300 + 3 for i in range(30)], [1, 77, 78, 5], [5, 9, 11, 40, 41]]
MAX_TOKENS = 6
NAMES = ["p1", "base", "p2", "p2", "p1"]
COMMON = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
              max_num_batched_tokens=16, kv_cache_memory=8 << 20)
ADAPTERS = {
    "p1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], seed=1),
    "p2": dict(r=8, lora_alpha=4, target_modules=["o_proj"],
               target_parameters=["experts.gate_up_proj", "1.mlp.experts.down_proj"], seed=2),
}



@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(checkpoint folder, {name: LoRARequest}, {"base" / name: [(tokens, logprobs) per prompt]})."""
    root = tmp_path_factory.mktemp("lora_gpt_oss")
    folder = tiny_gpt_oss.make_tiny_gpt_oss(root / "base", seed=5)
    base = load_hf_model(folder)
    adapters, refs = {}, {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        path = make_peft_adapter(base, root / name, **config)
        adapters[name] = LoRARequest(name, i + 1, path)
    with torch.inference_mode():
        for name, model in {"base": base, **{n: merged_reference(base, r.lora_path)
                                              for n, r in adapters.items()}}.items():
            tokens = [cut_at_eos(hf_greedy(model, p, MAX_TOKENS), [EOS_TOKEN_ID]) for p in PROMPTS]
            refs[name] = [(t, hf_logprobs(model, p, t)) for p, t in zip(PROMPTS, tokens, strict=True)]
    return folder, adapters, refs



def test_peft_saves_nested_pairs_under_the_experts_module(gpt_oss):
    """The layout the unpacking relies on: one stacked pair per adapted parameter, the second one on a module under
    base_layer (p2's layer 1), rank * experts rows."""
    _, adapters, _ = gpt_oss
    adapter = read_peft_adapter(adapters["p2"].lora_path)
    assert sorted(adapter.stacked) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts",
                                       "model.layers.1.mlp.experts.base_layer", "model.layers.2.mlp.experts"]
    assert {tuple(p.lora_a.shape) for p in adapter.stacked.values()} == {(8 * 8, 64), (8 * 8, 32)}
    assert adapter.max_rank == 8


def test_engine_mixed_batch_matches_peft_merged(gpt_oss):
    folder, adapters, refs = gpt_oss
    for name in ADAPTERS:
        assert [t for t, _ in refs[name]] != [t for t, _ in refs["base"]], name  # (each adapter changes answers)
    llm = LLM(folder, **COMMON)
    try:
        got = generate_mixed(llm, adapters, NAMES, PROMPTS, MAX_TOKENS)
    finally:
        llm.engine.shutdown()
    for i, (name, (tokens, logprobs)) in enumerate(zip(NAMES, got, strict=True)):
        want_tokens, want_logprobs = refs[name][i % len(PROMPTS)]
        assert tokens == want_tokens, (i, name)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-3, (i, name)


def _edited_copy(src: str, dst, **fields) -> str:
    import shutil

    shutil.copytree(src, dst)
    config_file = os.path.join(dst, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump(config | fields, f)
    return os.fspath(dst)


# The multimodal Qwens (their text layers under model.language_model.: the stacked pairs' names too): gate_up_proj
# [E, 2I, H] holding the gate rows then the up rows, down_proj [E, H, I] (transformers 5's layout, which peft's
# ParamWrapper reads as [E, out, in]). Qwen3-VL-MoE (layers 0 and 2 sparse, 6 experts of 16 over hidden 64) takes
# expert adapters alone (its attention modules' multimodal names have no lora_rewrite to strip the prefix);
# Qwen3.5-MoE's (every layer sparse, 8 experts of 32) with the attention's q / o projections.
MULTIMODAL = {
    "qwen3_vl_moe": ({"p1": dict(r=4, lora_alpha=8, target_modules=[],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], seed=3),
                      "p2": dict(r=8, lora_alpha=4, target_modules=[],
                                 target_parameters=["2.mlp.experts.down_proj"], seed=4)}),
    "qwen3_5_moe_vl": ({"p1": dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                   target_parameters=["experts.gate_up_proj", "experts.down_proj"], seed=5),
                        "p2": dict(r=8, lora_alpha=4, target_modules=["o_proj"],
                                   target_parameters=["mlp.experts.gate_up_proj"], seed=6)}),
}


@pytest.fixture(scope="module", params=sorted(MULTIMODAL))
def multimodal(request, tmp_path_factory):
    """(family, checkpoint folder, {name: LoRARequest}, references) as gpt_oss's, on the multimodal class."""
    from transformers import AutoModelForImageTextToText

    from tests.helpers.tiny_qwen3_5 import make_tiny_qwen3_5_moe_multimodal
    from tests.helpers.tiny_qwen3_vl import make_tiny_qwen3_vl_moe

    family = request.param
    root = tmp_path_factory.mktemp(family)
    make = make_tiny_qwen3_vl_moe if family == "qwen3_vl_moe" else make_tiny_qwen3_5_moe_multimodal
    folder = make(root / "base", seed=7)
    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    adapters, refs = {}, {}
    for i, (name, config) in enumerate(MULTIMODAL[family].items()):
        adapters[name] = LoRARequest(name, i + 1, make_peft_adapter(base, root / name, **config))
    with torch.inference_mode():
        for name, model in {"base": base, **{n: merged_reference(base, r.lora_path)
                                              for n, r in adapters.items()}}.items():
            tokens = [cut_at_eos(hf_greedy(model, p, MAX_TOKENS), [EOS_TOKEN_ID]) for p in PROMPTS]
            refs[name] = [(t, hf_logprobs(model, p, t)) for p, t in zip(PROMPTS, tokens, strict=True)]
    return family, folder, adapters, refs


def test_multimodal_mixed_batch_matches_peft_merged(multimodal):
    """Text prompts through the multimodal class: the stacked pairs saved under model.language_model.layers (gate
    rows then up rows in gate_up's B) serve beside base requests, equal to peft's merge_and_unload."""
    family, folder, adapters, refs = multimodal
    stacked = read_peft_adapter(adapters["p1"].lora_path).stacked
    assert stacked and all(n.startswith("model.language_model.layers.") for n in stacked), family
    for name in adapters:
        assert [t for t, _ in refs[name]] != [t for t, _ in refs["base"]], (family, name)
    llm = LLM(folder, **COMMON)
    try:
        got = generate_mixed(llm, adapters, NAMES, PROMPTS, MAX_TOKENS)
    finally:
        llm.engine.shutdown()
    for i, (name, (tokens, logprobs)) in enumerate(zip(NAMES, got, strict=True)):
        want_tokens, want_logprobs = refs[name][i % len(PROMPTS)]
        assert tokens == want_tokens, (family, i, name)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-3, (family, i, name)


def test_multimodal_per_expert_modules_are_refused_by_name(multimodal, tmp_path):
    """One module per expert (the text models' format) on the multimodal classes: refused, naming the tensor and
    vLLM's stacked format."""
    family, folder, _, _ = multimodal
    inter = 16 if family == "qwen3_vl_moe" else 32
    module = "model.language_model.layers.0.mlp.experts.1.gate_proj"
    path = write_adapter(tmp_path / "a", {module: (inter, 64)})
    llm = LLM(folder, **COMMON)
    try:
        with pytest.raises(LoRAAdapterError, match=rf"tensor 'base_model\.model\.{re.escape(module)}\.lora_A\.weight' "
                                                   r"adapts .*vLLM reads its expert adapters in the stacked format "
                                                   r"only .*not one module per expert"):
            generate_mixed(llm, {"x": LoRARequest("x", 9, path)}, ["x"], PROMPTS, MAX_TOKENS)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name", ["mlp.router.weight", "self_attn.sinks", "experts.gate_up_proj_bias"])
def test_other_target_parameters_are_refused_by_name(gpt_oss, tmp_path, name):
    _, adapters, _ = gpt_oss
    path = _edited_copy(adapters["p1"].lora_path, tmp_path / "a", target_parameters=[name])
    with pytest.raises(LoRAAdapterError, match=rf"target_parameters '{name}': LoRA on raw parameters is supported "
                                               r"on the MoE experts' stacked gate_up_proj / down_proj only"):
        read_peft_adapter(path)


def test_mxfp4_gpt_oss_is_refused_by_name(gpt_oss, tmp_path):
    folder, adapters, _ = gpt_oss
    mxfp4 = tiny_gpt_oss.write_mxfp4_copy(folder, str(tmp_path / "mxfp4"))
    llm = LLM(mxfp4, **COMMON)
    try:
        with pytest.raises(LoRAAdapterError, match=r"quantized \(MXFP4\); float experts only"):
            generate_mixed(llm, adapters, ["p1"], PROMPTS, MAX_TOKENS)
    finally:
        llm.engine.shutdown()


def _cuda_matches_cpu(folder: str, adapters: dict[str, LoRARequest]) -> None:
    """The same mixed batch on the CPU engine and on CUDA (default settings: CUDA graphs, the Triton path of
    lora/moe.py): each request's greedy tokens equal, logprobs within 2e-3."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    got = {}
    for device in ("cpu", "cuda"):
        settings = {k: v for k, v in COMMON.items() if k != "max_num_batched_tokens"}
        llm = LLM(folder, device=device, **dict(settings, kv_cache_memory=32 << 20))
        try:
            got[device] = generate_mixed(llm, adapters, NAMES, PROMPTS, MAX_TOKENS)
        finally:
            llm.engine.shutdown()
    for (cpu_tokens, cpu_lp), (cuda_tokens, cuda_lp) in zip(got["cpu"], got["cuda"], strict=True):
        assert cuda_tokens == cpu_tokens
        assert max(abs(a - b) for a, b in zip(cpu_lp, cuda_lp, strict=True)) < 2e-3


@pytest.mark.gpu
def test_cuda_engine_matches_cpu(gpt_oss):
    """gpt-oss's stacked adapters on CUDA (its expert biases and clamped SwiGLU on the LoRA path) against the CPU
    engine."""
    folder, adapters, _ = gpt_oss
    _cuda_matches_cpu(folder, adapters)


@pytest.mark.gpu
def test_multimodal_cuda_engine_matches_cpu(multimodal):
    """Qwen3-VL-MoE's and the multimodal Qwen3.5-MoE's stacked adapters (gate|up halves) on CUDA against the CPU
    engine."""
    _, folder, adapters, _ = multimodal
    _cuda_matches_cpu(folder, adapters)
