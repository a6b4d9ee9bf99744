"""PEFT LoRA adapters for tests, written by the real `peft` package on tiny transformers models, and
the references ferrox is compared with (the adapter merged into the base weights by peft)."""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import torch

from tests.helpers import tiny_glm, tiny_granitemoehybrid, tiny_llama4, tiny_qwen3_5

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Qwen3.5's projections, both token mixers' and the dense MLP's (PEFT names).
QWEN3_5_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
               "out_proj", "gate_proj", "up_proj", "down_proj")
# The attention (and, in a regex, dense MLPs), not the experts or shared experts (peft cannot write per-expert
# modules on transformers 5: tests/lora/test_lora_moe.py adapts them with adapters written by hand).
ATTENTION = r".*\.self_attn\.(q|k|v|o)_proj"
# name -> (build the checkpoint, a1's target_modules (r 8), a2's (r 4, rsLoRA))
FAMILIES: dict[str, tuple[Any, Any, Any]] = {
    "qwen3_5": (lambda d: tiny_qwen3_5.make_tiny_qwen3_5(d, seed=3), QWEN3_5_ALL,
                ("q_proj", "k_proj", "in_proj_qkv", "in_proj_b", "down_proj")),
    "qwen3_next": (lambda d: tiny_qwen3_5.make_tiny_qwen3_next(d, seed=4),
                   ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"),
                   ("k_proj", "in_proj_qkvz", "in_proj_ba")),
    "glm4": (lambda d: tiny_glm.make_tiny_glm4(d, seed=5),
             ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"), ("q_proj", "k_proj", "gate_up_proj")),
    # (An MLP target on a transformers-5 MoE model makes peft adapt the fused experts' parameters too, in the
    # target_parameters format: tested apart in tests/lora/test_lora_moe_stacked.py. Llama 4's dense layers take
    # the MLP targets here.)
    "glm4_moe": (lambda d: tiny_glm.make_tiny_glm4_moe(d, num_layers=2, seed=6), ATTENTION, ("q_proj", "k_proj")),
    "llama4": (lambda d: tiny_llama4.make_tiny_llama4(d, num_layers=2, interleave_moe_layer_step=2, seed=7),
               ATTENTION + r"|.*\.layers\.\d+\.feed_forward\.(gate|up|down)_proj", ("q_proj", "k_proj")),
    # The Mamba2 hybrids: the attention, the Mamba2 in_proj (five row segments) / out_proj and the MLPs; Granite's
    # multipliers (residual 0.5...) on the layers feeding the residual.
    "granitemoehybrid": (lambda d: tiny_granitemoehybrid.make_tiny_granitemoehybrid(d, seed=8),
                         ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear",
                          "output_linear"), ("v_proj", "in_proj", "output_linear")),
    # (peft refuses out_proj on Nemotron-H's Mamba2 mixers, whose fused CUDA scan bypasses the module: Granite's
    # adapters take it, on the same mixer)
    "nemotron_h": (lambda d: tiny_granitemoehybrid.make_tiny_nemotron_h(d, seed=9),
                   ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"),
                   ("k_proj", "in_proj", "down_proj")),
}


def load_hf_model(folder: str | os.PathLike[str]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.fspath(folder), dtype=torch.float32).eval()


def make_peft_adapter(base: Any, folder: str | os.PathLike[str], *, r: int = 8, lora_alpha: float = 16,
                      target_modules: tuple[str, ...] | list[str] | str = PROJECTIONS, seed: int = 0,
                      **config: Any) -> str:
    """Save a LoRA adapter of `base` (a transformers model, left untouched) in `folder`.
    init_lora_weights=False makes B random (PEFT's default zero B would be a no-op adapter)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets,
                                                           init_lora_weights=False, **config))
    model.save_pretrained(os.fspath(folder))
    return os.fspath(folder)


def merged_reference(base: Any, adapter_folder: str | os.PathLike[str]) -> Any:
    """`base` with the adapter loaded by peft and merged into its weights (merge_and_unload)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), os.fspath(adapter_folder)).merge_and_unload().eval()


def peft_modules(base: Any, adapter_folder: str | os.PathLike[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor,
                                                                                          float]]:
    """module path -> (A, B, scaling) as peft loaded them (the reference for read_peft_adapter)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), os.fspath(adapter_folder))
    out = {}
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            out[name] = (module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach(),
                         float(module.scaling["default"]))
    return out


def two_adapters(tmp_path_factory: Any, *, hidden_size: int = 64, alphas: tuple[float, float] = (16, 8),
                 rslora: bool = True) -> tuple[str, Any, dict[str, Any]]:
    """(a tiny Llama folder, its transformers model, {"a1", "a2": LoRARequest}) for the engine tests: a1 (r 8)
    adapts every projection, a2 (r 4) q/v/down only, with rsLoRA when `rslora`."""
    from ferrox.lora.request import LoRARequest

    from tests.helpers.tiny_models import make_tiny_llama

    base_dir = make_tiny_llama(tmp_path_factory.mktemp("base"), hidden_size=hidden_size, num_layers=2)
    base = load_hf_model(base_dir)
    a1 = make_peft_adapter(base, tmp_path_factory.mktemp("a1"), r=8, lora_alpha=alphas[0], seed=1)
    a2 = make_peft_adapter(base, tmp_path_factory.mktemp("a2"), r=4, lora_alpha=alphas[1], seed=2, use_rslora=rslora,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    return base_dir, base, {"a1": LoRARequest("a1", 1, a1), "a2": LoRARequest("a2", 2, a2)}


def merged_greedy(base: Any, adapters: dict[str, Any], prompts: list[list[int]], max_tokens: int,
                  eos_token_id: int) -> dict[str, list[list[int]]]:
    """Each prompt's greedy tokens (cut at EOS) from transformers with each adapter merged, and the base's."""
    from tests.models.conftest import cut_at_eos, hf_greedy

    models = {"base": base, **{name: merged_reference(base, r.lora_path) for name, r in adapters.items()}}
    return {name: [cut_at_eos(hf_greedy(model, p, max_tokens), [eos_token_id]) for p in prompts]
            for name, model in models.items()}


def assert_lora_rows_follow_the_loader(folder: str | os.PathLike[str], model: Any = None) -> None:
    """The family's lora_rewrite (lora/rewrite.py) puts rows where its loader puts them: every projection weight
    of the checkpoint, fed through it as if it were a lora_B (a B has its weight's output rows), lands under the
    name and in the rows of the wrapped layer slice the loader filled with it, and every wrapped projection of the
    model is reached. Cheap (no forward), so each family's test file checks it on its tiny checkpoints. model: a
    ferrox model of `folder` that may be wrapped (default: loaded here in float32)."""
    import glob

    from ferrox.lora.manager import LoRAManager
    from safetensors.torch import load_file

    from tests.helpers.tiny_models import load_float32

    model = load_float32(folder) if model is None else model
    manager = LoRAManager(model, max_loras=1, max_lora_rank=8, max_cpu_loras=None, device="cpu",
                          dtype=torch.float32, max_num_tokens=8)
    reached = set()
    for file in sorted(glob.glob(os.path.join(os.fspath(folder), "*.safetensors"))):
        for name, weight in load_file(file).items():
            if weight.dim() != 2 or not name.endswith(".weight"):
                continue
            for new_name, rows in model.lora_rewrite([(name, weight)]):
                module = new_name.removesuffix(".weight")
                target = manager._targets.get(module)
                if target is None:  # (norms, embeddings, experts: no LoRA there)
                    continue
                layer = manager.layers[target.layer]
                # (slice None: the module is the whole layer, its slices in checkpoint order: Mamba2's in_proj; a
                # constant the loader folded into the weight is the layer's output_scale, which B takes at packing)
                lo, hi = ((0, layer.out_features) if target.slice is None
                          else (layer.slice_bounds[target.slice], layer.slice_bounds[target.slice + 1]))
                want = (rows * layer.output_scale).to(layer.base_layer.weight.dtype)
                assert torch.equal(layer.base_layer.weight[lo:hi], want), new_name
                reached.add(module)
    assert reached == set(manager._targets)


def write_adapter(folder: str | os.PathLike[str], modules: dict[str, tuple[int, int]], *, r: int = 4,
                  lora_alpha: float | None = None, seed: int = 0, std: float = 1.0,
                  ranks: dict[str, int] | None = None) -> str:
    """A PEFT-format adapter folder written by hand, random A and B (N(0, std^2); lora_alpha 2r by default), for
    modules PEFT would not adapt on a tiny transformers model (experts, routers, a conv): module path -> (out, in)
    of its weight. ranks: module path -> its rank, written as PEFT's rank_pattern (default: r)."""
    import json

    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    tensors = {}
    for module, (out, inp) in modules.items():
        rank = (ranks or {}).get(module, r)
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, inp) * std
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, rank) * std
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r if lora_alpha is None else lora_alpha,
              "target_modules": ".*", "bias": "none"}
    if ranks:
        config["rank_pattern"] = {re.escape(m): k for m, k in ranks.items()}
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return os.fspath(folder)


# An expert module of a PEFT adapter (vLLM's names: one module per expert projection) -> transformers 5's fused
# expert parameters (experts.gate_up_proj [E, 2I, H]: gate rows, then up; experts.down_proj [E, H, I]), the hybrid
# Qwens' too (Qwen3NextExperts, Qwen3_5MoeExperts; a tiny model's gate_up_proj may be square, [E, 64, 64], so the
# layout is checked against config.json's hidden size rather than left to a shape mismatch).
_EXPERT = re.compile(r"^(?P<layer>model\.layers\.\d+)\.(mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                     r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
_EXPERT_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def merged_by_hand(base: Any, adapter_folder: str | os.PathLike[str]) -> Any:
    """A copy of `base` (a transformers model) with the adapter merged into its weights, W + scaling * B A, read
    from the adapter's files here (the reference for adapters peft cannot load on transformers 5's fused experts:
    per-expert modules). Linear modules by path; expert modules into the fused expert parameters. Honours lora_alpha,
    use_rslora and rank_pattern / alpha_pattern of exact module paths (what write_adapter writes)."""
    import json
    import math

    from safetensors.torch import load_file

    folder = os.fspath(adapter_folder)
    with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    model = copy.deepcopy(base)
    prefix = "base_model.model."
    names = {k[len(prefix):].rsplit(".lora_", 1)[0] for k in tensors}
    with torch.no_grad():
        for name in sorted(names):
            a = tensors[f"{prefix}{name}.lora_A.weight"].double()
            b = tensors[f"{prefix}{name}.lora_B.weight"].double()
            rank = a.shape[0]
            alpha = config.get("lora_alpha", 8)
            for key, value in (config.get("alpha_pattern") or {}).items():
                if re.fullmatch(rf"(.*\.)?({key})", name):
                    alpha = value
            scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
            delta = scaling * (b @ a)
            expert = _EXPERT.match(name)
            if expert is None:
                weight = model.get_submodule(name).weight
                weight.copy_((weight.double() + delta).to(weight.dtype))
                continue
            experts = model.get_submodule(expert["layer"] + ".mlp.experts")
            e, proj = int(expert["expert"]), _EXPERT_PROJ[expert["proj"]]
            inter = experts.down_proj.shape[2]
            hidden = model.config.get_text_config().hidden_size
            assert experts.down_proj.shape[1] == hidden and tuple(experts.gate_up_proj.shape[1:]) == (2 * inter,
                                                                                                   hidden), name
            target = (experts.down_proj[e] if proj == "down" else
                      experts.gate_up_proj[e, :inter] if proj == "gate" else experts.gate_up_proj[e, inter:])
            target.copy_((target.double() + delta).to(target.dtype))
    return model.eval()
