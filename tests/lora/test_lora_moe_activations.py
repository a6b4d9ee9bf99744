"""LoRA on the routed experts of the MoE families whose experts are not SiLU-gated: Gemma 4 (26B-A4B's layout,
enable_moe_block: GELU-tanh gated experts on the decoder layer itself, `model.layers.{i}.experts`, beside the dense
MLP) and Nemotron-H (Nemotron 3 Nano / Super: ReLU^2 experts that are NOT gated, an up and a down projection in the
`mixer`, a ReLU^2 shared expert beside them; Super's latent projections fc1 / fc2_latent_proj around them).

- Adapters written by peft itself on tiny random models: PEFT's target_parameters pairs (`experts.gate_up_proj` /
  `experts.down_proj`; Nemotron-H's `experts.up_proj` / `experts.down_proj`) beside attention, dense-MLP, shared-expert
  and latent-projection modules, and the same pairs rewritten by hand as one module per expert
  (`model.layers.{i}.experts.{e}.gate_proj`; Nemotron-H's in the releases' `backbone.` spelling). The latent model's
  experts are as wide as their intermediate size, so up and down pairs have equal shapes: one adapter's pairs tell
  by PEFT's nesting, the other's (a down_proj pair alone) by its target_parameters.
- The real engine (chunked prefill under a 16-token budget) serves them beside base-model requests in one batch:
  greedy tokens equal transformers' with the adapter merged by peft (merge_and_unload), logprobs within 1e-3.
- One MoE layer's experts under an adapter against a float64 reference of peft's merged weights: equal with the
  family's activation and gate | up order, not with the halves swapped or another activation.
- Gemma 4's lora_rewrite: an attention_k_eq_v layer's k_proj adapter adapts its value rows too (transformers' value
  is that projection), as the loader loads the key weight into both.
- Refused by name: a gate projection on Nemotron-H's non-gated experts; a lone pair that fits both of its parameters
  when target_parameters names both.
- On a GPU: the CUDA engine (the Triton path of lora/moe.py) against the CPU engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ferrox import LLM
from ferrox.lora.adapter import LoRAAdapterError
from ferrox.lora.manager import LoRAManager
from ferrox.lora.request import LoRARequest

from tests.helpers.tiny_gemma4 import make_tiny_gemma4
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_float32
from tests.helpers.tiny_nemotron_h_moe import make_tiny_nemotron_h_moe
from tests.lora.adapters import (
    assert_lora_rows_follow_the_loader,
    load_hf_model,
    make_peft_adapter,
    merged_reference,
    write_adapter,
)
from tests.lora.mixed_batch import generate_mixed, hf_logprobs
from tests.models.conftest import cut_at_eos, hf_greedy

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[(7 * i) % 300 + 3 for i in range(30)], [1, 77, 78, 5], [5, 9, 11, 40, 41]]
MAX_TOKENS = 5
NAMES = ["s1", "base", "s2", "s2", "s1"]
COMMON = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
              max_num_batched_tokens=16, kv_cache_memory=8 << 20)
GATED = ["experts.gate_up_proj", "experts.down_proj"]
UNGATED = ["experts.up_proj", "experts.down_proj"]
INTER = 32  # the tiny models' moe_intermediate_size (their hidden size 64, the latent width 32)


@dataclass(frozen=True)
class Family:
    build: Callable[[Any], str]
    experts: str  # the MoE layers' experts module, {i} the decoder layer (transformers' names)
    moe_layers: tuple[int, ...]
    gated: bool
    adapters: dict[str, dict[str, Any]]  # name -> make_peft_adapter's arguments
    per_expert: str | None = None  # rewrite this adapter's pairs as one module per expert (_as_modules)
    load: Callable[[str], Any] = load_hf_model  # the transformers model of the checkpoint


FAMILIES = {
    # (every layer has experts beside the dense MLP; s2: the dense MLP's modules and the experts one module each)
    "gemma4": Family(lambda d: make_tiny_gemma4(d, moe=True, seed=31), "model.layers.{i}.experts", tuple(range(6)),
                     True, {
        "s1": dict(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj"], target_parameters=GATED, seed=1),
        "s2": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], target_parameters=GATED,
                   seed=2)}, per_expert="s2"),
    # (26B-A4B as published: the multimodal class, adapters naming the text layers under `model.language_model.`)
    "gemma4_multimodal": Family(lambda d: make_tiny_gemma4(d, moe=True, images=True, seed=34),
                                "model.language_model.layers.{i}.experts", tuple(range(6)), True, {
        "s1": dict(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(k_proj|gate_proj)", target_parameters=GATED,
                   seed=7),
        "s2": dict(r=4, lora_alpha=8, target_modules=[], target_parameters=["experts.down_proj"], seed=8)},
                                per_expert="s2", load=lambda folder: _load_multimodal(folder)),
    # (layers M E * E - M: s2 the shared experts and the "-" MLP, and the experts one module each, `backbone.` names)
    "nemotron_h": Family(lambda d: make_tiny_nemotron_h_moe(d, seed=32), "model.layers.{i}.mixer.experts", (1, 3),
                         False, {
        "s1": dict(r=4, lora_alpha=8, target_modules=["o_proj", "in_proj"], target_parameters=UNGATED, seed=3),
        "s2": dict(r=8, lora_alpha=8, target_modules=["up_proj", "down_proj"], target_parameters=UNGATED,
                   use_rslora=True, seed=4)}, per_expert="s2"),
    # (Super's shape: the experts 32 wide behind the latent projections, as wide as their intermediate size)
    "nemotron_h_latent": Family(lambda d: make_tiny_nemotron_h_moe(d, latent=True, seed=33),
                                "model.layers.{i}.mixer.experts", (1, 3), False, {
        "s1": dict(r=4, lora_alpha=8, target_modules=["fc1_latent_proj", "fc2_latent_proj"], target_parameters=UNGATED,
                   seed=5),
        "s2": dict(r=4, lora_alpha=8, target_modules=["shared_experts.up_proj"],
                   target_parameters=["mixer.experts.down_proj"], seed=6)}),
}



def _load_multimodal(folder: str) -> Any:
    import transformers

    return transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def _as_modules(folder: str, dst, family: Family) -> str:
    """A copy of a peft adapter whose target_parameters pairs are rewritten as one module per expert (the usual LoRA
    pair of each expert's gate / up / down projection, as peft's ParamWrapper applies it: lora/expert_params.py), the
    pair's parameter told by its A's columns (hidden: gate_up / up; intermediate: down)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dst)
    file = os.path.join(dst, "adapter_model.safetensors")
    with open(os.path.join(dst, "adapter_config.json")) as f:
        config = json.load(f)
    tensors, out = load_file(file), {}
    pairs = re.compile(r"^base_model\.model\.(model\.(?:language_model\.)?layers\.\d+\.(?:mixer\.)?experts)"
                       r"(?:\.base_layer)*\.lora_A\.weight$")
    for key, a in tensors.items():
        match = pairs.match(key)
        if match is None:
            if ".experts." not in key:  # (the pairs' B: taken with their A)
                out[key] = a
            continue
        b = tensors[key.replace("lora_A", "lora_B")]
        r, inter = config["r"], INTER
        num = a.shape[0] // r
        per_a, per_b = a.view(num, r, a.shape[1]), b.view(b.shape[0], r, num)
        module = match[1].replace("model.", "backbone.", 1) if not family.gated else match[1]
        for e in range(num):
            parts = ({"down_proj": per_b[:, :, e]} if a.shape[1] == inter else
                     {"gate_proj": per_b[:inter, :, e], "up_proj": per_b[inter:, :, e]} if family.gated else
                     {"up_proj": per_b[:, :, e]})
            for proj, b_part in parts.items():
                out[f"base_model.model.{module}.{e}.{proj}.lora_A.weight"] = per_a[e].clone()
                out[f"base_model.model.{module}.{e}.{proj}.lora_B.weight"] = b_part.clone()
    save_file(out, file)
    # (as an adapter trained one module per expert lists them: the projections' names)
    leaves = {key.split(".")[-3] for key in out if re.search(r"\.experts\.\d+\.", key)}
    config.update(target_parameters=None, target_modules=sorted(set(config["target_modules"]) | leaves))
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return os.fspath(dst)


@dataclass
class Built:
    folder: str
    base: Any  # the transformers model
    merged: dict[str, Any]  # adapter name -> peft's merge_and_unload of it
    adapters: dict[str, LoRARequest]
    refs: dict[str, list[tuple[list[int], list[float]]]]  # "base" / adapter name -> (tokens, logprobs) per prompt


class _Families(dict):
    """family -> Built, each built the first time a test asks for it."""

    def __init__(self, tmp_path_factory) -> None:
        super().__init__()
        self._tmp = tmp_path_factory

    def __missing__(self, name: str) -> Built:
        family = FAMILIES[name]
        root = self._tmp.mktemp(f"act_{name}")
        folder = family.build(root / "base")
        base = family.load(folder)
        adapters, merged, refs = {}, {}, {}
        for i, (adapter, config) in enumerate(family.adapters.items()):
            path = make_peft_adapter(base, root / adapter, **config)
            merged[adapter] = merged_reference(base, path)
            if adapter == family.per_expert:
                path = _as_modules(path, root / f"{adapter}_modules", family)
            adapters[adapter] = LoRARequest(adapter, i + 1, path)
        with torch.inference_mode():
            for adapter, model in {"base": base, **merged}.items():
                tokens = [cut_at_eos(hf_greedy(model, p, MAX_TOKENS), [EOS_TOKEN_ID]) for p in PROMPTS]
                refs[adapter] = [(t, hf_logprobs(model, p, t)) for p, t in zip(PROMPTS, tokens, strict=True)]
        self[name] = Built(folder, base, merged, adapters, refs)
        return self[name]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _Families(tmp_path_factory)



@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_mixed_batch_matches_peft_merged(built, family):
    b = built[family]
    for name in b.adapters:
        assert [t for t, _ in b.refs[name]] != [t for t, _ in b.refs["base"]], name  # (each changes answers)
    llm = LLM(b.folder, **COMMON)
    try:
        got = generate_mixed(llm, b.adapters, NAMES, PROMPTS, MAX_TOKENS)
    finally:
        llm.engine.shutdown()
    _assert_match(b, got, family)


def _assert_match(b: Built, got: list[tuple[list[int], list[float]]], family: str) -> None:
    for i, (name, (tokens, logprobs)) in enumerate(zip(NAMES, got, strict=True)):
        want_tokens, want_logprobs = b.refs[name][i % len(PROMPTS)]
        assert tokens == want_tokens, (family, i, name)
        assert max(abs(x - y) for x, y in zip(logprobs, want_logprobs, strict=True)) < 1e-3, (family, i, name)


@pytest.mark.parametrize("family, expert_parallel", [("nemotron_h_latent", False), ("gemma4", True)])
def test_sharded_adapters_match_peft_merged(built, family, expert_parallel):
    """Two gloo ranks: each expert's up (gate) B rows and down A columns of the rank's intermediate rows, or whole
    experts per rank (expert parallelism); Nemotron-H's shared expert cut as a dense MLP and its replicated latent
    projections, fc2's delta joining the rank's partial sum before the layer's one all-reduce."""
    b = built[family]
    llm = LLM(b.folder, tensor_parallel_size=2, device="cpu", enable_expert_parallel=expert_parallel, **COMMON)
    try:
        got = generate_mixed(llm, b.adapters, NAMES, PROMPTS, MAX_TOKENS)
    finally:
        llm.engine.shutdown()
    _assert_match(b, got, family)


def _manager(folder: str, model=None) -> LoRAManager:
    return LoRAManager(model or load_float32(folder), max_loras=1, max_lora_rank=8, max_cpu_loras=None,
                       device="cpu", dtype=torch.float32, max_num_tokens=16)


def _reference(x, w13, w2, weights, ids, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Pair by pair in float64: w2_e activation(w13_e x), weighted and summed over each token's pairs."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            out[t] += weights[t, k].double() * (w2[e].double() @ activation(w13[e].double() @ x[t].double()))
    return out


def _gelu_and_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2)
    return F.gelu(gate, approximate="tanh") * up


@pytest.mark.parametrize("family", list(FAMILIES))
def test_expert_layer_matches_merged_weights_and_nothing_else(built, family):
    """One MoE layer's experts with adapter s1 in slot 0 (every token) against peft's merged weights in float64: equal
    with the family's activation and gate | up order; the same reference with gate and up swapped (Gemma 4) or
    another activation (SiLU-and-mul; ReLU unsquared) is not (so neither mistake could pass the engine test)."""
    b = built[family]
    spec = FAMILIES[family]
    manager = _manager(b.folder)
    manager.add_adapter(b.adapters["s1"])
    layer = spec.moe_layers[-1]
    experts = manager.experts.bases[-1]
    tokens = 9
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, experts.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    manager.prepare_step(np.ones(tokens, dtype=np.int64))
    with torch.inference_mode():
        got = experts(x, weights, ids).double()
    merged = b.merged["s1"].get_submodule(spec.experts.format(i=layer))
    w13 = (merged.gate_up_proj if spec.gated else merged.up_proj).detach()
    w2 = merged.down_proj.detach()
    inter = w2.shape[2]
    if spec.gated:
        right = _gelu_and_mul
        wrong = {"gate and up swapped": lambda h: _gelu_and_mul(torch.cat([h[inter:], h[:inter]])),
                 "SiLU-and-mul": lambda h: F.silu(h[:inter]) * h[inter:]}
    else:
        def right(h):
            return torch.square(F.relu(h))
        wrong = {"ReLU unsquared": F.relu, "SiLU": F.silu}
    want = _reference(x, w13, w2, weights, ids, right)
    base = manager.experts.bases[-1]
    assert base.gated == spec.gated
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    for what, activation in wrong.items():
        assert not torch.allclose(got, _reference(x, w13, w2, weights, ids, activation), atol=1e-2), what
    # (the adapter does move this layer: the base weights' output is not the merged one's)
    unmerged = b.base.get_submodule(spec.experts.format(i=layer))
    base_w13 = (unmerged.gate_up_proj if spec.gated else unmerged.up_proj).detach()
    assert not torch.allclose(want, _reference(x, base_w13, unmerged.down_proj.detach(), weights, ids, right),
                              atol=1e-3)


def test_gemma4_lora_rows_follow_the_loader(built):
    """Gemma 4's lora_rewrite: an attention_k_eq_v layer's k_proj B lands in its k and v rows, as the loader loads
    the key weight into both; every other projection as it is (every wrapped projection reached)."""
    assert_lora_rows_follow_the_loader(built["gemma4"].folder)


def test_gemma4_expert_modules_under_vllms_moe_path(built, tmp_path):
    """vLLM's Gemma 4 holds its experts at `model.layers.{i}.moe.experts`: per-expert modules named so pack as the
    checkpoint-named ones (`model.layers.{i}.experts.{e}...`) do."""
    from safetensors.torch import load_file, save_file

    b = built["gemma4"]
    dst = tmp_path / "moe_path"
    shutil.copytree(b.adapters["s2"].lora_path, dst)
    file = os.path.join(dst, "adapter_model.safetensors")
    tensors = load_file(file)
    renamed = {re.sub(r"\.experts\.(\d+)\.", r".moe.experts.\1.", k): v for k, v in tensors.items()}
    assert renamed != tensors
    save_file(renamed, file)
    manager = LoRAManager(load_float32(b.folder), max_loras=1, max_lora_rank=8, max_cpu_loras=2, device="cpu",
                          dtype=torch.float32, max_num_tokens=16)
    manager.add_adapter(b.adapters["s2"])
    manager.add_adapter(LoRARequest("vllm_path", 9, os.fspath(dst)))
    ours, theirs = manager._cache[b.adapters["s2"].lora_int_id].experts, manager._cache[9].experts
    assert len(ours) == len(FAMILIES["gemma4"].moe_layers) and all(w is not None for w in ours)
    for mine, other in zip(ours, theirs, strict=True):
        assert mine is not None and other is not None
        for x, y in zip((mine.w13_a, mine.w13_b, mine.w2_a, mine.w2_b), (other.w13_a, other.w13_b, other.w2_a,
                                                                          other.w2_b), strict=True):
            assert torch.equal(x, y)


def test_gate_projection_on_non_gated_experts_is_refused_by_name(built, tmp_path):
    b = built["nemotron_h"]
    module = "backbone.layers.1.mixer.experts.2.gate_proj"
    path = write_adapter(tmp_path / "gate", {module: (32, 64)})
    manager = _manager(b.folder)
    with pytest.raises(LoRAAdapterError, match=r"tensor 'base_model\.model\.backbone\.layers\.1\.mixer\.experts\.2\."
                                               r"gate_proj\.lora_A\.weight' adapts 'model\.layers\.1\.mixer\.experts\."
                                               r"2\.gate_proj': NemotronHForCausalLM's experts are not gated \(up_proj "
                                               r"and down_proj only\)"):
        manager.add_adapter(LoRARequest("x", 1, path))
    assert manager.list_adapters() == []


def test_lone_pair_fitting_both_parameters_is_refused_by_name(built, tmp_path):
    """The latent model's experts: up and down pairs have equal shapes. A layer's one pair while target_parameters
    names both parameters cannot be told apart (nothing nests it): refused naming the tensor."""
    from safetensors.torch import load_file, save_file

    b = built["nemotron_h_latent"]
    dst = tmp_path / "lone"
    shutil.copytree(b.adapters["s1"].lora_path, dst)
    file = os.path.join(dst, "adapter_model.safetensors")
    save_file({k: v for k, v in load_file(file).items() if ".base_layer." not in k}, file)
    manager = _manager(b.folder)
    with pytest.raises(LoRAAdapterError, match=r"tensor 'base_model\.model\.model\.layers\.1\.mixer\.experts\.lora_A\."
                                               r"weight' fits both experts\.up_proj and experts\.down_proj of decoder "
                                               r"layer 1"):
        manager.add_adapter(LoRARequest("x", 1, os.fspath(dst)))
    assert manager.list_adapters() == []


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_engine_matches_cpu(built, family):
    """The adapters on CUDA (CUDA graphs, the Triton path of lora/moe.py: GELU-tanh gated and non-gated ReLU^2 rows)
    against the CPU engine: each request's greedy tokens equal, logprobs within 2e-3."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    b = built[family]
    got = {}
    for device in ("cpu", "cuda"):
        settings = {k: v for k, v in COMMON.items() if k != "max_num_batched_tokens"}
        llm = LLM(b.folder, device=device, **dict(settings, kv_cache_memory=32 << 20))
        try:
            got[device] = generate_mixed(llm, b.adapters, NAMES, PROMPTS, MAX_TOKENS)
        finally:
            llm.engine.shutdown()
    for (cpu_tokens, cpu_lp), (cuda_tokens, cuda_lp) in zip(got["cpu"], got["cuda"], strict=True):
        assert cuda_tokens == cpu_tokens
        assert max(abs(x - y) for x, y in zip(cpu_lp, cuda_lp, strict=True)) < 2e-3
