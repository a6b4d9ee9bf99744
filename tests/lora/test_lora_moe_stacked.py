"""LoRA adapters on stacked experts in PEFT's `target_parameters` format (lora/expert_params.py) on the families that
take expert adapters one module per expert too: transformers 5 stacks every MoE family's experts
(`mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]), so PEFT 0.22 adapts them only so, and turns
`gate_proj` / `up_proj` / `down_proj` targets into these parameters there (gate_up_proj at twice the rank and alpha,
by rank_pattern / alpha_pattern). And Llama 4, whose experts take this format only: `feed_forward.experts`, stored
[E, in, out] without saying so (PEFT's A and B are the usual LoRA pair's B^T and A^T), the router's sigmoid score
scaling the experts' input (the adapter's too), experts on every other layer (interleave_moe_layer_step 2) beside a
shared expert (module format), chunked / NoPE attention layers around them.

- Adapters written by peft itself on tiny random Qwen3-MoE (a dense middle layer), Mixtral (transformers 5's `mlp`
  block; its checkpoint's `block_sparse_moe`), DeepSeek-V3 (a dense first layer, shared experts) and Llama 4 models,
  with attention and shared-expert modules beside the pairs. The real engine (chunked prefill under a 16-token budget)
  serves them beside base-model requests in one batch: greedy tokens equal transformers' with the adapter merged by
  peft (merge_and_unload), logprobs within 1e-3.
- The unpacked pairs against peft's merged weights, expert by expert: gate rows then up rows in every family (the
  halves swapped do not match), Llama 4's factors swapped and transposed.
- Refused by name: one layer's experts adapted in both formats, Llama 4's per-expert modules, a pair under the wrong
  MoE block, pairs fitting neither parameter, a stacked rank above max_lora_rank.
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

import pytest
import torch
from ferrox import LLM
from ferrox.lora.adapter import LoRAAdapterError, read_peft_adapter
from ferrox.lora.manager import LoRAManager
from ferrox.lora.request import LoRARequest

from tests.helpers import tiny_llama4, tiny_models
from tests.helpers.tiny_deepseek import make_tiny_deepseek
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_float32
from tests.lora.adapters import load_hf_model, make_peft_adapter, merged_reference, write_adapter
from tests.lora.mixed_batch import generate_mixed, hf_logprobs
from tests.models.conftest import cut_at_eos, hf_greedy

pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[(7 * i) % 300 + 3 for i in range(30)], [1, 77, 78, 5], [5, 9, 11, 40, 41]]
MAX_TOKENS = 5
NAMES = ["s1", "base", "s2", "s2", "s1"]
COMMON = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
              max_num_batched_tokens=16, kv_cache_memory=8 << 20)
BOTH = ["experts.gate_up_proj", "experts.down_proj"]
# peft's own conversion of MLP targets on a transformers-5 MoE model: the routed experts' stacked parameters (gate_up
# at rank 2r, alpha 2 alpha), the dense layers' and shared experts' MLPs as modules.
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Family:
    build: Callable[[Any], str]
    block: str  # the MoE block holding `experts`
    moe_layers: tuple[int, ...]
    adapters: dict[str, dict[str, Any]]  # name -> make_peft_adapter's arguments


FAMILIES = {
    # (layer 1 dense: mlp_only_layers; s2 as peft converts MLP targets, layer 1's MLP in module format)
    "qwen3_moe": Family(lambda d: tiny_models.make_tiny_qwen3_moe(d, seed=21), "mlp", (0, 2), {
        "s1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=BOTH, seed=1),
        "s2": dict(r=4, lora_alpha=8, target_modules=MLP, seed=2)}),
    # (transformers 5's block is `mlp`, the checkpoint's block_sparse_moe; peft refuses MLP targets on it: no module)
    "mixtral": Family(lambda d: tiny_models.make_tiny_mixtral(d, seed=22), "mlp", (0, 1), {
        "s1": dict(r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=BOTH, seed=3),
        "s2": dict(r=8, lora_alpha=16, target_modules=[], target_parameters=["0.mlp.experts.gate_up_proj"],
                   use_rslora=True, seed=4)}),
    # (the first layer dense, two shared experts' MLP beside the routed ones: module format)
    "deepseek_v3": Family(lambda d: make_tiny_deepseek(d, num_layers=2, seed=24), "mlp", (1,), {
        "s1": dict(r=4, lora_alpha=8, target_modules=["q_a_proj", "kv_a_proj_with_mqa"],
                   target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], seed=5),
        "s2": dict(r=4, lora_alpha=8, target_modules=MLP, seed=6)}),
    # (MoE on layers 1 and 3, layer 2 NoPE, chunked attention elsewhere; q / k rows reordered by lora_rewrite)
    "llama4": Family(lambda d: tiny_llama4.make_tiny_llama4(d, num_layers=4, interleave_moe_layer_step=2, seed=7),
                     "feed_forward", (1, 3), {
        "s1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"],
                   target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"], seed=8),
        "s2": dict(r=8, lora_alpha=8, target_modules=["shared_expert.gate_proj", "shared_expert.up_proj",
                                                      "shared_expert.down_proj"],
                   target_parameters=["3.feed_forward.experts.down_proj"], seed=9)}),
}



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

    def __missing__(self, family: str) -> Built:
        root = self._tmp.mktemp(f"stacked_{family}")
        folder = FAMILIES[family].build(root / "base")
        base = load_hf_model(folder)
        adapters, merged, refs = {}, {}, {}
        for i, (name, config) in enumerate(FAMILIES[family].adapters.items()):
            adapters[name] = LoRARequest(name, i + 1, make_peft_adapter(base, root / name, **config))
            merged[name] = merged_reference(base, adapters[name].lora_path)
        with torch.inference_mode():
            for name, model in {"base": base, **merged}.items():
                tokens = [cut_at_eos(hf_greedy(model, p, MAX_TOKENS), [EOS_TOKEN_ID]) for p in PROMPTS]
                refs[name] = [(t, hf_logprobs(model, p, t)) for p, t in zip(PROMPTS, tokens, strict=True)]
        self[family] = Built(folder, base, merged, adapters, refs)
        return self[family]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _Families(tmp_path_factory)



def _assert_match(b: Built, got: list[tuple[list[int], list[float]]], family: str) -> None:
    for i, (name, (tokens, logprobs)) in enumerate(zip(NAMES, got, strict=True)):
        want_tokens, want_logprobs = b.refs[name][i % len(PROMPTS)]
        assert tokens == want_tokens, (family, i, name)
        assert max(abs(x - y) for x, y in zip(logprobs, want_logprobs, strict=True)) < 1e-3, (family, i, name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_mixed_batch_matches_peft_merged(built, family):
    b = built[family]
    for name in b.adapters:
        assert [t for t, _ in b.refs[name]] != [t for t, _ in b.refs["base"]], name  # (each changes answers)
    # (what peft wrote: stacked pairs on the MoE layers only; s2's MLP targets converted so on Qwen3-MoE / DeepSeek)
    for name, request in b.adapters.items():
        stacked = read_peft_adapter(request.lora_path).stacked
        assert stacked and {int(n.split(".")[2]) for n in stacked} <= set(FAMILIES[family].moe_layers), name
    llm = LLM(b.folder, **COMMON)
    try:
        _assert_match(b, generate_mixed(llm, b.adapters, NAMES, PROMPTS, MAX_TOKENS), family)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family, expert_parallel", [("qwen3_moe", False), ("llama4", True)])
def test_sharded_stacked_adapters_match_peft_merged(built, family, expert_parallel):
    """Two gloo ranks: the unpacked pairs cut as per-expert modules are (each expert's gate / up B rows and down A
    columns of the rank's intermediate rows), or whole experts per rank (expert parallelism); Llama 4's shared expert
    cut as a dense MLP."""
    b = built[family]
    llm = LLM(b.folder, tensor_parallel_size=2, device="cpu", enable_expert_parallel=expert_parallel, **COMMON)
    try:
        _assert_match(b, generate_mixed(llm, b.adapters, NAMES, PROMPTS, MAX_TOKENS), family)
    finally:
        llm.engine.shutdown()


def _manager(folder: str, max_lora_rank: int = 8) -> LoRAManager:
    return LoRAManager(load_float32(folder), max_loras=1, max_lora_rank=max_lora_rank, max_cpu_loras=None,
                       device="cpu", dtype=torch.float32, max_num_tokens=8)


def _expert_weights(model, family: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) of a transformers model's layer, as y = W x (Llama 4 stores x @ W)."""
    experts = model.get_submodule(f"model.layers.{layer}.{FAMILIES[family].block}.experts")
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    return (gate_up.transpose(1, 2), down.transpose(1, 2)) if family == "llama4" else (gate_up, down)


def _delta(modules: dict[str, Any], prefix: str, proj: str) -> torch.Tensor | None:
    module = modules.get(f"{prefix}.{proj}")
    return None if module is None else module.scaling * module.lora_b @ module.lora_a


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unpacked_pairs_are_peft_merged_deltas_gate_half_first(built, family):
    """Each expert's unpacked gate / up / down pairs (scaling * B A) equal peft's merged weights minus the base's,
    gate rows first; the same pairs with gate and up swapped do not (the family's order along 2I matters)."""
    b = built[family]
    manager = _manager(b.folder)
    for name in b.adapters:
        modules = manager.experts.unstack(read_peft_adapter(b.adapters[name].lora_path), {})
        for layer in FAMILIES[family].moe_layers:
            base_gate_up, base_down = _expert_weights(b.base, family, layer)
            merged_gate_up, merged_down = _expert_weights(b.merged[name], family, layer)
            for e in range(base_gate_up.shape[0]):
                prefix = f"model.layers.{layer}.{FAMILIES[family].block}.experts.{e}"
                gate, up = _delta(modules, prefix, "gate_proj"), _delta(modules, prefix, "up_proj")
                down = _delta(modules, prefix, "down_proj")
                if gate is None or up is None:  # (an adapter of down_proj alone here)
                    assert torch.equal(merged_gate_up[e], base_gate_up[e]), (name, layer)
                else:
                    want = merged_gate_up[e] - base_gate_up[e]
                    torch.testing.assert_close(torch.cat([gate, up]), want, atol=1e-5, rtol=1e-4)
                    assert not torch.allclose(torch.cat([up, gate]), want, atol=1e-3), (name, layer, e)
                if down is None:
                    assert torch.equal(merged_down[e], base_down[e]), (name, layer)
                else:
                    torch.testing.assert_close(down, merged_down[e] - base_down[e], atol=1e-5, rtol=1e-4)


def _copy(src: str, dst, *, config: dict[str, Any] | None = None, rename: tuple[str, str] | None = None,
          extra: dict[str, torch.Tensor] | None = None) -> str:
    """A copy of an adapter folder with config fields changed, tensor names edited, or tensors added."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "adapter_model.safetensors")
    tensors = load_file(file)
    if rename is not None:
        tensors = {k.replace(*rename): v for k, v in tensors.items()}
    save_file({**tensors, **(extra or {})}, file)
    config_file = os.path.join(dst, "adapter_config.json")
    with open(config_file) as f:
        fields = json.load(f)
    with open(config_file, "w") as f:
        json.dump(fields | (config or {}), f)
    return os.fspath(dst)


def test_both_formats_on_one_layers_experts_are_refused_by_name(built, tmp_path):
    """A per-expert module beside a stacked pair of the same layer's experts (one would be ignored, or two deltas
    added), here Mixtral's checkpoint name for expert 1's down projection beside layer 0's gate_up pair: refused
    naming both tensors. The same module on layer 1, which the pairs leave alone, is taken."""
    b = built["mixtral"]  # (s2: layer 0's gate_up_proj alone, r 8)

    def with_module(layer: int) -> str:
        module = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts.1.w2"
        extra = {f"{module}.lora_A.weight": torch.randn(8, 48), f"{module}.lora_B.weight": torch.randn(64, 8)}
        return _copy(b.adapters["s2"].lora_path, tmp_path / f"layer{layer}", extra=extra)

    manager = _manager(b.folder)
    with pytest.raises(LoRAAdapterError, match=r"tensors 'base_model\.model\.model\.layers\.0\.block_sparse_moe\."
                                               r"experts\.1\.w2\.lora_A\.weight' \(one module per expert\) and "
                                               r"'base_model\.model\.model\.layers\.0\.mlp\.experts\.lora_A\.weight' "
                                               r"\(target_parameters\) both adapt decoder layer 0's experts"):
        manager.add_adapter(LoRARequest("x", 1, with_module(0)))
    manager.add_adapter(LoRARequest("y", 2, with_module(1)))
    assert [r.lora_name for r in manager.list_adapters()] == ["y"]


@pytest.mark.parametrize("case", ["llama4 per-expert module", "llama4 block", "fit neither", "rank"])
def test_stacked_adapter_errors_name_the_tensor(built, tmp_path, case):
    if case.startswith("llama4"):
        b = built["llama4"]
        if case == "llama4 per-expert module":
            module = "model.layers.1.feed_forward.experts.0.gate_proj"
            path = write_adapter(tmp_path / "a", {module: (32, 64)})
            match = (rf"adapts '{re.escape(module)}', not a projection .*Llama4ForCausalLM's experts take adapters in "
                     r"PEFT's target_parameters format only .*not one module per expert")
        else:
            path = _copy(b.adapters["s1"].lora_path, tmp_path / "a", rename=(".feed_forward.experts", ".mlp.experts"))
            match = r"'model\.layers\.1\.mlp\.experts(\.base_layer)?' is not a decoder layer's feed_forward\.experts"
        manager = _manager(b.folder)
    elif case == "fit neither":  # (Mixtral's s2, layer 0's gate_up pair alone, read at r=4: it holds 8 rows an expert)
        b = built["mixtral"]
        path = _copy(b.adapters["s2"].lora_path, tmp_path / "a", config={"r": 4})
        match = (r"tensor 'base_model\.model\.model\.layers\.0\.mlp\.experts\.lora_A\.weight' \(32, 64\) and "
                 r"'.*lora_B\.weight' \(96, 32\) fit neither experts\.gate_up_proj \(A \[16, 64\], B \[96, 16\]\) nor "
                 r"experts\.down_proj \(A \[16, 48\], B \[64, 16\]\) of decoder layer 0 \(4 experts\)")
        manager = _manager(b.folder)
    else:  # (Qwen3-MoE's s2: peft's gate_up_proj at rank 8 by rank_pattern, down_proj at 4)
        b = built["qwen3_moe"]
        path = b.adapters["s2"].lora_path
        match = r"rank_pattern rank 8 exceeds max_lora_rank=4 \(module 'model\.layers\.[02]\.mlp\.experts"
        manager = _manager(b.folder, max_lora_rank=4)
    with pytest.raises(LoRAAdapterError, match=match):
        manager.add_adapter(LoRARequest("x", 1, path))
    assert manager.list_adapters() == []


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_engine_matches_cpu(built, family):
    """The stacked adapters on CUDA (CUDA graphs, the Triton path of lora/moe.py) against the CPU engine: each
    request's greedy tokens equal, logprobs within 2e-3."""
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
