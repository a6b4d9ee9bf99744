"""LoRA on the routed and shared experts of MoE models (lora/moe.py, lora/moe_targets.py): tiny random Qwen3-MoE,
Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V3, Hunyuan (A13B's layout), ERNIE 4.5 MoE, OLMoE, MiniMax-M2 and the hybrid
Qwens' (Qwen3-Next, Qwen3.5-MoE) checkpoints (transformers) with PEFT-format adapters written here, one module per expert projection as vLLM reads them
(`mlp.experts.{e}.gate_proj / up_proj / down_proj`, Mixtral's and MiniMax-M2's `block_sparse_moe.experts.{e}.w1 / w3 /
w2`), and the shared expert's projections (`mlp.shared_expert.*`, `mlp.shared_experts.*`, Hunyuan's
`mlp.shared_mlp.*`) as a dense MLP's.

Reference: transformers with each adapter merged into the weights by hand (W + scaling * B A: tests/lora/adapters.py
merged_by_hand). peft is installed, but it cannot load per-expert modules on transformers 5's fused experts (it
adapts them through `target_parameters`, another format, which ferrox reads too: tests/lora/test_lora_moe_stacked.py
and tests/lora/test_lora_moe_params.py).

- The real engine (Rust scheduler, chunked prefill under a 16-token budget, 3 adapters over 2 slots so they swap)
  serving base-model requests, two adapters with expert modules (one on every expert, the shared expert and two
  attention projections, one of rank 4 with a rank_pattern on half the experts) and one without expert modules, in
  one batch: each request's greedy tokens and their logprobs equal transformers' with its adapter merged. GLM-4.5's
  and MiniMax-M2's adapters' q rows follow their partial-rotary row order, ERNIE's its interleaved rotary's
  (lora_rewrite); DeepSeek's attention modules are its latent attention's (q_a_proj, q_b_proj, kv_a_proj_with_mqa,
  o_proj); the hybrid Qwens' are their linear attention's (Qwen3-Next's fused in_proj_qkvz / in_proj_ba cut by its
  lora_rewrite), beside the routed experts and the shared expert.
- Errors name the module: a rank above max_lora_rank, an expert index out of range, A without B, a wrong shape, a
  dense layer's experts, a family whose experts or shared experts take no adapters (the multimodal Qwen3.5-MoE: vLLM
  reads its expert adapters stacked), the shared expert's shared_expert_gate (Qwen2-MoE, Qwen3-Next), DeepSeek's
  absorbed kv_b_proj.
- Tensor and expert parallelism (2 gloo ranks, slow): each rank packs its share, the same tokens (Qwen2-MoE's,
  Hunyuan's and Qwen3.5-MoE's shared expert: its down_proj delta joins that rank's partial sum).
- On a GPU: the CUDA engine (CUDA graphs, the Triton path) against the CPU engine, tokens and logprobs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.lora.adapter import LoRAAdapterError
from ferrox.lora.manager import LoRAManager, slot_bytes
from ferrox.lora.request import LoRARequest

from tests.helpers import tiny_models
from tests.helpers.tiny_deepseek import make_tiny_deepseek
from tests.helpers.tiny_ernie4_5 import make_tiny_ernie4_5_moe
from tests.helpers.tiny_glm import make_tiny_glm4_moe
from tests.helpers.tiny_hunyuan import make_tiny_hunyuan_moe
from tests.helpers.tiny_models import EOS_TOKEN_ID, load_float32
from tests.helpers.tiny_olmo_smollm3 import make_tiny_olmoe
from tests.helpers.tiny_qwen3_5 import (
    make_tiny_qwen3_5_moe,
    make_tiny_qwen3_5_moe_multimodal,
    make_tiny_qwen3_next,
)
from tests.lora.adapters import load_hf_model, merged_by_hand, write_adapter
from tests.models.conftest import cut_at_eos, hf_greedy
from tests.models.test_minimax_m2 import make_tiny_minimax_m2

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[(7 * i) % 300 + 3 for i in range(30)], [1, 77, 78, 5], [5, 9, 11, 40, 41]]
MAX_TOKENS = 6
NAMES = ["e1", "base", "e2", "d", "e1", "e2", "base", "d"]
COMMON = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
              max_num_batched_tokens=16, kv_cache_memory=8 << 20)


@dataclass(frozen=True)
class Family:
    build: Callable[..., str]
    sparse_layers: tuple[int, ...]
    num_experts: int
    block: str  # the MoE block's module name
    projections: tuple[str, str, str]  # gate, up, down
    inter: int  # one expert's intermediate size
    hidden: int
    shared: str | None = None  # the shared expert's module (under the block), None: none
    e1_attention: tuple[str, ...] = ("q_proj", "v_proj")  # e1's attention modules (layer 0)
    d_attention: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # d's (layers 0 and 1)
    mixer: str = "self_attn"  # the token mixer of layers 0 and 1 (the hybrids': their linear attention)


_QWEN = ("gate_proj", "up_proj", "down_proj")
_HYBRID = dict(shared="shared_expert", mixer="linear_attn")
_LATENT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
FAMILIES = {
    "qwen3_moe": Family(lambda d: tiny_models.make_tiny_qwen3_moe(d, seed=21), (0, 2), 8, "mlp", _QWEN, 32, 64),
    # (a shared expert with its sigmoid gate beside the routed ones, top-k weights not renormalised)
    "qwen2_moe": Family(lambda d: tiny_models.make_tiny_qwen2_moe(d, seed=23), (0, 1), 6, "mlp", _QWEN, 32, 64,
                        shared="shared_expert"),
    "mixtral": Family(lambda d: tiny_models.make_tiny_mixtral(d, seed=22), (0, 1), 4, "block_sparse_moe",
                      ("w1", "w3", "w2"), 48, 64),
    # (grouped sigmoid routing, 2 shared experts' MLP, the first layer dense, partial-rotary q/k rows reordered)
    "glm4_moe": Family(lambda d: make_tiny_glm4_moe(d, num_layers=2, seed=6), (1,), 8, "mlp", _QWEN, 32, 64,
                       shared="shared_experts"),
    # (V3: sigmoid routing with the correction bias, latent attention, 2 shared experts, the first layer dense)
    "deepseek_v3": Family(lambda d: make_tiny_deepseek(d, num_layers=2, seed=24), (1,), 6, "mlp", _QWEN, 32, 64,
                          shared="shared_experts", e1_attention=("q_a_proj", "kv_a_proj_with_mqa"),
                          d_attention=_LATENT),
    # (q/k normed per head after rotary, NTK-alpha, every layer routed beside the shared MLP `mlp.shared_mlp`)
    "hunyuan_moe": Family(lambda d: make_tiny_hunyuan_moe(d, seed=25), (0, 1), 8, "mlp", _QWEN, 32, 64,
                          shared="shared_mlp"),
    # (interleaved rotary q/k rows reordered, biased routing, the first layer dense, one shared expert)
    "ernie4_5_moe": Family(lambda d: make_tiny_ernie4_5_moe(d, num_layers=2, seed=26), (1,), 8, "mlp", _QWEN, 32, 64,
                           shared="shared_experts"),
    # (full-width q/k norms, softmax top-k not renormalised, no shared expert)
    "olmoe": Family(lambda d: make_tiny_olmoe(d, seed=27), (0, 1), 8, "mlp", _QWEN, 32, 64),
    # (Mixtral's checkpoint names, biased sigmoid routing, partial rotary q/k rows reordered, an MTP layer skipped)
    "minimax_m2": Family(lambda d: make_tiny_minimax_m2(d, seed=28), (0, 1, 2), 8, "block_sparse_moe",
                         ("w1", "w3", "w2"), 32, 64),
    # The hybrid Qwens: three Gated DeltaNet layers then a full attention, every layer routed beside a shared
    # expert under its sigmoid gate (Qwen3.5-MoE's top-k renormalised; Qwen3-Next's fused in_proj_qkvz / in_proj_ba
    # cut at load, its router as norm_topk_prob says).
    "qwen3_5_moe": Family(lambda d: make_tiny_qwen3_5_moe(d, seed=29), (0, 1, 2, 3), 8, "mlp", _QWEN, 32, 64,
                          e1_attention=("in_proj_qkv", "out_proj"),
                          d_attention=("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"), **_HYBRID),
    "qwen3_next": Family(lambda d: make_tiny_qwen3_next(d, seed=30), (0, 1, 2, 3), 8, "mlp", _QWEN, 32, 64,
                         e1_attention=("in_proj_qkvz", "out_proj"), d_attention=("in_proj_qkvz", "in_proj_ba", "out_proj"),
                         **_HYBRID),
}


def _expert_modules(family: str, experts: list[int] | None = None) -> dict[str, tuple[int, int]]:
    f = FAMILIES[family]
    gate, up, down = f.projections
    out = {}
    for i in f.sparse_layers:
        for e in range(f.num_experts) if experts is None else experts:
            prefix = f"model.layers.{i}.{f.block}.experts.{e}"
            out.update({f"{prefix}.{gate}": (f.inter, f.hidden), f"{prefix}.{up}": (f.inter, f.hidden),
                        f"{prefix}.{down}": (f.hidden, f.inter)})
    return out


def _shared_modules(family: str, base) -> dict[str, tuple[int, int]]:
    f = FAMILIES[family]
    if f.shared is None:
        return {}
    names = [f"model.layers.{i}.{f.block}.{f.shared}.{p}" for i in f.sparse_layers for p in _QWEN]
    return {n: tuple(base.get_submodule(n).weight.shape) for n in names}


def _attention(base, layers: range, projs: tuple[str, ...], mixer: str) -> dict[str, tuple[int, int]]:
    names = [f"model.layers.{i}.{mixer}.{p}" for i in layers for p in projs]
    return {n: tuple(base.get_submodule(n).weight.shape) for n in names}


def _adapters(family: str, base, root) -> dict[str, LoRARequest]:
    """e1: every expert of every sparse layer, the shared expert and two of layer 0's attention projections (r 8);
    e2: the even experts, r 4, one module at rank 2 (rank_pattern); d: the attention only, no expert modules."""
    f = FAMILIES[family]
    e1 = {**_expert_modules(family), **_shared_modules(family, base), **_attention(base, range(1), f.e1_attention, f.mixer)}
    e2 = _expert_modules(family, list(range(0, f.num_experts, 2)))
    low = next(n for n in e2 if n.endswith((".up_proj", ".w3")))
    d = _attention(base, range(2), f.d_attention, f.mixer)
    folders = {"e1": write_adapter(root / "e1", e1, r=8, lora_alpha=16, seed=1, std=0.1),
               "e2": write_adapter(root / "e2", e2, r=4, lora_alpha=8, seed=2, std=0.15, ranks={low: 2}),
               "d": write_adapter(root / "d", d, r=4, lora_alpha=8, seed=3, std=0.1)}
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(folders.items())}


@torch.inference_mode()
def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


class _Built(dict):
    """family -> (folder, {adapter name: LoRARequest}, {"base" / adapter name: [(tokens, logprobs) per prompt]}), each
    family built (checkpoint, adapters, transformers' references) the first time a test asks for it."""

    def __init__(self, tmp_path_factory) -> None:
        super().__init__()
        self._tmp = tmp_path_factory

    def __missing__(self, family: str):
        root = self._tmp.mktemp(f"lora_{family}")
        folder = FAMILIES[family].build(root / "base")
        base = load_hf_model(folder)
        adapters = _adapters(family, base, root)
        refs = {}
        for name, model in {"base": base, **{n: merged_by_hand(base, r.lora_path) for n, r in adapters.items()}}.items():
            tokens = [cut_at_eos(hf_greedy(model, p, MAX_TOKENS), [EOS_TOKEN_ID]) for p in PROMPTS]
            refs[name] = [(t, _hf_logprobs(model, p, t)) for p, t in zip(PROMPTS, tokens, strict=True)]
        self[family] = (folder, adapters, refs)
        return self[family]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _Built(tmp_path_factory)


def _generate(llm: LLM, adapters: dict[str, LoRARequest], names: list[str]) -> list[tuple[list[int], list[float]]]:
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(names))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0), use_tqdm=False,
                        lora_request=[adapters.get(n) for n in names])
    got = []
    for o in outs:
        tokens = cut_at_eos(list(o.outputs[0].token_ids), [EOS_TOKEN_ID])
        got.append((tokens, [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)]))
    return got


def _assert_match(got, refs, names: list[str], atol: float = 1e-3) -> None:
    for i, (name, (tokens, logprobs)) in enumerate(zip(names, got, strict=True)):
        want_tokens, want_logprobs = refs[name][i % len(PROMPTS)]
        assert tokens == want_tokens, (i, name)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < atol, (i, name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_mixed_batch_matches_merged_weights(moe, family):
    folder, adapters, refs = moe[family]
    for name in ("e1", "e2", "d"):
        assert [t for t, _ in refs[name]] != [t for t, _ in refs["base"]], name  # (each adapter changes answers)
    llm = LLM(folder, **COMMON)
    try:
        _assert_match(_generate(llm, adapters, NAMES), refs, NAMES)
    finally:
        llm.engine.shutdown()


def _manager(folder) -> LoRAManager:
    return LoRAManager(load_float32(folder), max_loras=1, max_lora_rank=8, max_cpu_loras=None, device="cpu",
                       dtype=torch.float32, max_num_tokens=8)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "hunyuan_moe", "qwen3_next"])
def test_slot_bytes_counts_every_buffer_the_manager_allocates(moe, family):
    """The GPU budget leaves the adapter slots' bytes before the KV cache takes the rest (lora.manager.slot_bytes):
    the count equals the stacks a manager then allocates, the experts', shared experts' and latent attention's
    included."""
    model = load_float32(moe[family][0])
    want = slot_bytes(model, max_loras=2, max_rank=4, dtype=torch.float32)
    manager = LoRAManager(model, max_loras=2, max_lora_rank=4, max_cpu_loras=None, device="cpu", dtype=torch.float32,
                          max_num_tokens=8)
    stacks = ("a_stack", "b_stack", "w13_a", "w13_b", "w2_a", "w2_b")
    got = sum(buf.numel() * buf.element_size() for module in model.modules() for name, buf in
              module.named_buffers(recurse=False) if name in stacks)
    assert manager.experts.layers and want == got
    if FAMILIES[family].shared is not None:
        assert f"model.layers.1.mlp.{FAMILIES[family].shared}.down_proj" in manager._targets


@pytest.mark.parametrize("case", ["rank", "expert", "half", "shape", "dense layer", "projection"])
def test_expert_adapter_errors_name_the_module(moe, tmp_path, case):
    folder = moe["qwen3_moe"][0]
    module = "model.layers.0.mlp.experts.3.down_proj"
    modules, kw, match = {module: (64, 32)}, {}, None
    if case == "rank":
        kw, match = dict(r=16), f"r=16 exceeds max_lora_rank=8 (module '{module}')"
    elif case == "expert":
        module = "model.layers.2.mlp.experts.8.gate_proj"
        modules, match = {module: (32, 64)}, f"adapts '{module}': expert 8 is out of range (the layer has 8 experts)"
    elif case == "shape":
        modules, match = {module: (64, 16)}, r"experts.3.down_proj.lora_A.weight' shape \(4, 16\), model expects " \
                                             r"\(4, 32\) \(expert 3's down projection\)"
    elif case == "dense layer":  # (mlp_only_layers: layer 1 has a dense MLP)
        module = "model.layers.1.mlp.experts.0.up_proj"
        modules, match = {module: (32, 64)}, f"adapts '{module}': decoder layer 1 has no routed experts"
    elif case == "projection":
        module = "model.layers.0.mlp.experts.0.gate_up_proj"
        modules, match = {module: (64, 64)}, "'gate_up_proj' is not an expert projection"
    path = write_adapter(tmp_path / "a", modules, **kw)
    if case == "half":  # lora_A alone
        from safetensors.torch import load_file, save_file

        file = path + "/adapter_model.safetensors"
        save_file({k: v for k, v in load_file(file).items() if "lora_A" in k}, file)
        match = f"module '{module}' has no lora_B.weight tensor"
    manager = _manager(folder)
    with pytest.raises(LoRAAdapterError, match=re.escape(match) if case != "shape" else match):
        manager.add_adapter(LoRARequest("x", 1, path))
    assert manager.list_adapters() == []


def test_experts_of_other_families_are_refused_by_name(tmp_path):
    """A FusedMoE family outside the supported ones (here the multimodal Qwen3.5-MoE, whose expert adapters vLLM reads
    stacked): its expert and shared-expert modules are refused, naming the tensor and the reason; its attention still
    takes adapters (the checkpoint's `model.language_model.` names)."""
    folder = make_tiny_qwen3_5_moe_multimodal(tmp_path / "mm", seed=6)
    manager = _manager(folder)
    layer = 3  # (the full-attention layer; every layer routes)
    shape = tuple(manager.model.get_submodule(f"model.layers.{layer}.self_attn.o_proj").weight.shape)
    name = "Qwen3_5MoeForConditionalGeneration"
    why = {"experts.0.gate_proj": ("routed experts", f"not on {name}: vLLM reads its expert adapters in the stacked "
                                                     "format only"),
           "shared_expert.up_proj": ("shared experts", f"not on {name}")}
    for leaf, (kind, reason) in why.items():
        module = f"model.layers.{layer}.mlp.{leaf}"
        adapter = write_adapter(tmp_path / leaf, {f"model.language_model.layers.{layer}.mlp.{leaf}": (32, 64)})
        with pytest.raises(LoRAAdapterError, match=rf"tensor 'base_model\.model\.model\.language_model\.layers\.{layer}"
                                                   rf"\.mlp\.{re.escape(leaf)}\.lora_A\.weight' adapts "
                                                   rf"'{re.escape(module)}', not a projection of this model .*LoRA on "
                                                   rf"the {kind} runs on Qwen2-MoE, .*Qwen3.5-MoE \(float experts\).*: "
                                                   rf"{re.escape(reason)}"):
            manager.add_adapter(LoRARequest("x", 1, adapter))
    attention = write_adapter(tmp_path / "attn", {f"model.language_model.layers.{layer}.self_attn.o_proj": shape})
    manager.add_adapter(LoRARequest("a", 2, attention))


@pytest.mark.parametrize("family, module, why", [
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate", "shared_expert_gate takes no adapters"),
    ("qwen3_next", "model.layers.2.mlp.shared_expert_gate", "shared_expert_gate takes no adapters"),
    ("deepseek_v3", "model.layers.1.self_attn.kv_b_proj", "kv_b_proj takes no adapters: it is absorbed"),
])
def test_modules_vllm_leaves_alone_are_refused_by_name(moe, tmp_path, family, module, why):
    """The shared expert's shared_expert_gate (Qwen2-MoE, Qwen3-Next: a plain linear layer in vLLM, never adapted) and
    DeepSeek's kv_b_proj (absorbed into the latent attention at load) are refused, naming the tensor."""
    folder = moe[family][0]
    manager = _manager(folder)
    shape = tuple(manager.model.get_submodule(module).weight.shape) if "gate" in module else (160, 32)
    adapter = write_adapter(tmp_path / "a", {module: shape})
    with pytest.raises(LoRAAdapterError, match=rf"adapts '{re.escape(module)}', not a projection .*{why}"):
        manager.add_adapter(LoRARequest("x", 1, adapter))


@pytest.mark.slow
@pytest.mark.parametrize("family, expert_parallel", [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", False),
                                                     ("deepseek_v3", False), ("hunyuan_moe", False),
                                                     ("ernie4_5_moe", True), ("qwen3_5_moe", False)])
def test_sharded_expert_adapters_match_merged_weights(moe, family, expert_parallel):
    """Two gloo ranks: each expert's intermediate rows sharded (gate / up B rows and down A columns cut), or the
    experts split between the ranks (each packs its own experts' pairs); Qwen2-MoE's and Qwen3.5-MoE's shared expert
    cut as a dense MLP (its down_proj's delta joins the rank's partial sum before that projection's all-reduce), the
    latter's linear attention by key-head groups."""
    folder, adapters, refs = moe[family]
    llm = LLM(folder, tensor_parallel_size=2, device="cpu", enable_expert_parallel=expert_parallel, **COMMON)
    try:
        _assert_match(_generate(llm, adapters, NAMES), refs, NAMES)
    finally:
        llm.engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_engine_matches_cpu(moe, family):
    """The expert adapters on CUDA (default settings: CUDA graphs, the Triton path of lora/moe.py) against the CPU
    engine: each request's greedy tokens and logprobs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    folder, adapters, _ = moe[family]
    got = {}
    for device in ("cpu", "cuda"):
        settings = {k: v for k, v in COMMON.items() if k != "max_num_batched_tokens"}
        llm = LLM(folder, device=device, **dict(settings, kv_cache_memory=32 << 20))
        try:
            got[device] = _generate(llm, adapters, NAMES)
        finally:
            llm.engine.shutdown()
    for (cpu_tokens, cpu_lp), (cuda_tokens, cuda_lp) in zip(got["cpu"], got["cuda"], strict=True):
        assert cuda_tokens == cpu_tokens
        assert max(abs(a - b) for a, b in zip(cpu_lp, cuda_lp, strict=True)) < 2e-3
