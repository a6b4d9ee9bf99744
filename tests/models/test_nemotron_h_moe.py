"""Nemotron 3's mixture-of-experts ("E") layers in NemotronHForCausalLM (models/nemotron_h_moe.py) against
transformers' NemotronHMoE, on tiny random checkpoints (tests/helpers/tiny_nemotron_h_moe.py: layers M E * E - M,
8 experts in 4 groups of which a token keeps 2, top 3, a random e_score_correction_bias, a shared expert; once
plain with norm_topk_prob, once behind a latent projection with biases, without it).

The real engine (Rust scheduler, chunked prefill under a 16-token budget, four prompts batched) against
transformers' greedy tokens and logprobs; the releases' per-expert tensor names and transformers' stacked ones
loading alike (and the MTP layers skipped); config fields out of range refused naming them; on a GPU, the CUDA
engine (the fused non-gated expert kernels, decode steps in CUDA graphs) against the CPU one."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.loader.model_config import load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import ModelLoadError, UnsupportedModelError
from ferrox.models.nemotron_h import NemotronHForCausalLM

from tests.helpers.tiny_models import load_float32
from tests.helpers.tiny_nemotron_h_moe import EXPERTS, NEMOTRON_MOE_PATTERN, make_tiny_nemotron_h_moe
from tests.models.conftest import assert_outputs_match_transformers, chunked_engine_outputs

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], list(range(3, 43)), [(7 * i) % 300 + 3 for i in range(30)],
           [(11 * i) % 200 + 7 for i in range(9)]]
MOE_LAYERS = [i for i, c in enumerate(NEMOTRON_MOE_PATTERN) if c == "E"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, transformers model), float32 on the CPU: "plain" and "latent" (moe_latent_size)."""
    root = tmp_path_factory.mktemp("nemotron_h_moe")
    out = {}
    for name in ("plain", "latent"):
        folder = make_tiny_nemotron_h_moe(root / name, latent=name == "latent", seed=3)
        out[name] = folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return out


@pytest.mark.parametrize("name", ["plain", "latent"])
def test_engine_matches_transformers(tiny, name):
    """Greedy tokens equal to transformers' and their logprobs within 1e-4, the prompts prefilled in chunks and
    batched."""
    folder, ref = tiny[name]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS))


def test_stacked_expert_tensors_load_as_per_expert_ones(tiny, tmp_path):
    """save_pretrained writes the releases' names (`backbone.layers.N.mixer.experts.{e}.up_proj.weight`); the same
    experts stacked as transformers holds them (`model.layers.N.mixer.experts.up_proj` [E, I, H], `down_proj`
    [E, H, I]) load into the same weights, and an MTP layer's tensors are skipped."""
    from safetensors.torch import load_file, save_file

    folder, _ = tiny["latent"]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    layer = MOE_LAYERS[0]
    for leaf in ("experts.0.up_proj.weight", f"experts.{EXPERTS - 1}.down_proj.weight", "gate.weight",
                 "gate.e_score_correction_bias", "shared_experts.up_proj.weight", "fc1_latent_proj.weight",
                 "fc2_latent_proj.bias"):
        assert f"backbone.layers.{layer}.mixer.{leaf}" in tensors
    stacked = {k: v for k, v in tensors.items() if ".mixer.experts." not in k}
    for i in MOE_LAYERS:
        for proj in ("up_proj", "down_proj"):
            stacked[f"model.layers.{i}.mixer.experts.{proj}"] = torch.stack(
                [tensors[f"backbone.layers.{i}.mixer.experts.{e}.{proj}.weight"] for e in range(EXPERTS)])
    stacked["mtp.layers.0.mixer.gate.weight"] = torch.zeros(EXPERTS, 64)
    other = tmp_path / "stacked"
    shutil.copytree(folder, other)
    os.remove(other / "model.safetensors")
    save_file(stacked, str(other / "model.safetensors"))
    per_expert, from_stacked = load_float32(folder).state_dict(), load_float32(str(other)).state_dict()
    assert per_expert.keys() == from_stacked.keys()
    for key, value in per_expert.items():
        assert torch.equal(value, from_stacked[key]), key
    w13 = per_expert[f"model.layers.{layer}.mixer.experts.w13"]
    assert w13.shape == (EXPERTS, 32, 32)  # (the up rows alone: non-gated experts behind the 32-wide latent)
    assert torch.equal(w13[EXPERTS - 1], tensors[f"backbone.layers.{layer}.mixer.experts.{EXPERTS - 1}.up_proj.weight"])


def test_a_missing_expert_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = tiny["plain"]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    del tensors[f"backbone.layers.{MOE_LAYERS[1]}.mixer.experts.5.up_proj.weight"]
    other = tmp_path / "missing"
    shutil.copytree(folder, other)
    save_file(tensors, str(other / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"model\.layers\.{MOE_LAYERS[1]}\.mixer\.experts shard 5\.up\.weight"):
        load_float32(str(other))


@pytest.mark.parametrize("override, error, match", [
    ({"n_group": 3}, ModelLoadError, "config.json: n_group 3 does not divide n_routed_experts 8"),
    ({"topk_group": 5}, ModelLoadError, "config.json: topk_group 5 is more than n_group 4"),
    ({"num_experts_per_tok": 5}, ModelLoadError, "num_experts_per_tok 5 is more than the 4 experts"),
    ({"moe_latent_size": 0}, ModelLoadError, "field 'moe_latent_size' must be an integer >= 1"),
    ({"moe_intermediate_size": None}, ModelLoadError, "need field 'moe_intermediate_size'"),
    ({"norm_topk_prob": "yes"}, ModelLoadError, "norm_topk_prob must be true or false"),
    ({"routed_scaling_factor": "2.5"}, ModelLoadError, "routed_scaling_factor must be a number"),
    ({"n_shared_experts": 2}, UnsupportedModelError, "n_shared_experts 2 is not supported"),
])
def test_config_fields_out_of_range_are_refused_by_name(tiny, override, error, match):
    folder, _ = tiny["plain"]
    spec = load_model_spec(resolve_model(folder), hf_overrides=override)
    with pytest.raises(error, match=match):
        NemotronHForCausalLM(spec, torch.float32, "cpu")


# (FP8 checkpoints load, and other quantizations are refused by name: tests/models/test_nemotron_h_fp8.py)
# (LoRA on the attention, Mamba2 and ReLU^2 MLP layers runs: tests/lora/test_lora_mamba2.py; on the E layers' experts,
# shared expert and latent projections: tests/lora/test_lora_moe_activations.py)
def test_lora_on_the_moe_layers_router_is_refused_by_name(tiny, tmp_path):
    """The E layers' router takes no adapter; their experts and shared expert do, as the M layer before them."""
    from ferrox.lora.adapter import LoRAAdapterError
    from ferrox.lora.manager import LoRAManager
    from ferrox.lora.request import LoRARequest

    from tests.lora.adapters import write_adapter

    manager = LoRAManager(load_float32(tiny["plain"][0]), max_loras=1, max_lora_rank=8, max_cpu_loras=None,
                          device="cpu", dtype=torch.float32, max_num_tokens=8)
    taken = {"backbone.layers.0.mixer.in_proj": (2 * 64 + 2 * 2 * 16 + 4, 64),
             "backbone.layers.1.mixer.experts.0.up_proj": (32, 64),
             "backbone.layers.1.mixer.shared_experts.up_proj": (48, 64)}
    manager.add_adapter(LoRARequest("moe", 1, write_adapter(tmp_path / "m", taken)))
    with pytest.raises(LoRAAdapterError, match=r"adapts 'model\.layers\.1\.mixer\.gate', not a projection of this "
                                               r"model"):
        manager.add_adapter(LoRARequest("router", 2, write_adapter(tmp_path / "e", {"backbone.layers.1.mixer.gate":
                                                                                    (EXPERTS, 64)})))


def test_the_releases_config_fields_are_read(tiny, tmp_path):
    """Nemotron 3 Nano's config.json as published spells the experts' fields as the tiny one does (n_routed_experts,
    moe_shared_expert_intermediate_size, n_group / topk_group, routed_scaling_factor, n_shared_experts 1) and
    names no layers_block_type: the pattern alone builds the E layers."""
    folder, _ = tiny["plain"]
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["n_shared_experts"] == 1 and config["hybrid_override_pattern"] == NEMOTRON_MOE_PATTERN
    spec = load_model_spec(resolve_model(folder), hf_overrides={"layers_block_type": None})
    model = NemotronHForCausalLM(spec, torch.float32, "cpu")
    moe = model.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == (EXPERTS, 3, 4, 2)
    assert moe.routed_scaling_factor == 2.5 and moe.renormalize and moe.latent_size is None
    assert [layer.kind for layer in model.model.layers] == ["mamba", "moe", "full_attention", "moe", "mlp", "mamba"]


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["plain", "latent"])
def test_cuda_engine_matches_cpu(tiny, name):
    """float32 on CUDA (the fused non-gated expert kernels: grouped GEMMs for the prompts, matrix-vector products
    per pair for the decode steps, which replay CUDA graphs) against the CPU engine: each of 10 concurrent prompts'
    greedy tokens and logprobs."""
    folder, _ = tiny[name]
    batch = [[(7 * i + j * 13) % 300 + 3 for j in range(5 + 9 * (i % 7))] for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = {}
    replays: list[int] = []
    for device in ("cpu", "cuda"):
        llm = LLM(model=folder, dtype="float32", device=device, kv_cache_memory=32 << 20, max_num_batched_tokens=64)
        try:
            if device == "cuda":
                experts = llm.engine.runner.model.model.layers[MOE_LAYERS[0]].mixer.experts
                assert experts.triton and not experts.gated
                graphs = llm.engine.runner.graph_runner
                run = graphs.run

                def counting(input_ids, positions, meta, run=run):
                    replays.append(meta.num_reqs)
                    return run(input_ids, positions, meta)

                graphs.run = counting
            outs[device] = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
    assert replays, "no decode step replayed a CUDA graph"
    for a, b in zip(outs["cpu"], outs["cuda"], strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert list(a.token_ids) == list(b.token_ids)
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert abs(la[t].logprob - lb[t].logprob) < 2e-3
