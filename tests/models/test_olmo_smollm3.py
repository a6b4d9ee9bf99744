"""SmolLM3 (NoPE layers), OLMo 2 (post-norms, full-width q/k norms), OLMo 3 (OLMo 2 with sliding-window layers
rotating without the full layers' YaRN) and OLMoE (MoE with full-width q/k norms, clip_qkv) against transformers on tiny random checkpoints: greedy tokens and last-prompt logits through the
test driver, chunked prefill and batching, the real engine with a 16-token budget (long prompts prefilled in
chunks), SmolLM3's sliding window on its NoPE layers, the one-token decode paths (under TRITON_INTERPRET=1:
the Triton kernel set, SmolLM3's fused one-token kernels with the NoPE layer's identity rotation), the layers
each config builds, and the refusals by name."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.errors import UnsupportedModelError
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.weights import iter_safetensors
from ferrox.model_spec import spec_for_context
from ferrox.models.registry import get_model_class

from tests.helpers import tiny_models, tiny_olmo_smollm3
from tests.helpers.config_edit import copy_with_config as _copy_with_config
from tests.helpers.driver import run_greedy
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_cuda_engine_matches_cpu,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    assert_tensor_parallel_matches_one_rank,
    chunked_engine_outputs,
    cut_at_eos,
    hf_greedy,
    hf_last_logits,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], [4, 4, 4, 4, 8], list(range(3, 70))]  # 67: 5 blocks
BUILDERS = {
    # SmolLM3-3B's layout: no_rope_layers left to transformers' default (layer 3 of 4 NoPE), tied embeddings.
    "smollm3": lambda d: tiny_olmo_smollm3.make_tiny_smollm3(d, seed=31),
    "olmo2": lambda d: tiny_olmo_smollm3.make_tiny_olmo2(d, attention_bias=True, seed=32),
    # (an 8-token window on layers 0-2, YaRN x4 on layer 3: the 67-token prompt crosses both)
    "olmo3": lambda d: tiny_olmo_smollm3.make_tiny_olmo3(d, seed=36),
    "olmoe": lambda d: tiny_olmo_smollm3.make_tiny_olmoe(d, seed=33),
    # OLMoE with renormalised top-k and q/k/v clamped (clip_qkv of OLMo-1-style configs).
    "olmoe_clip": lambda d: tiny_olmo_smollm3.make_tiny_olmoe(d, norm_topk_prob=True, clip_qkv=0.5, top_k=3,
                                                              seed=34),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model); built once for the module."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("olmo_smollm3"), BUILDERS)


def _load(folder: str, max_model_len: int = 256):
    source = resolve_model(folder)
    return load_model(source, spec_for_context(load_model_spec(source), max_model_len), dtype=torch.float32,
                      device="cpu")


def _check_parity(model, ref, name: str) -> None:
    assert_greedy_and_logits_match(model, ref, PROMPTS, [tiny_models.EOS_TOKEN_ID], label=name)


# ---- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in BUILDERS if n != "olmo3"])  # (OLMo 3: with its windows, below)
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    _check_parity(model, ref, name)


@pytest.mark.parametrize("name", ["smollm3", "olmo2", "olmoe"])
def test_chunked_prefill_and_batching_do_not_change_tokens(tiny, name):
    _, model, _ = tiny[name]
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))


@pytest.mark.parametrize("name", ["smollm3", "olmo2", "olmo3", "olmoe_clip"])
def test_engine_chunked_prefill_matches_transformers(tiny, name):
    """The real engine (Rust scheduler, paged KV, sampler) with a 16-token budget: the long prompt is
    prefilled in chunks; greedy tokens and their logprobs against transformers."""
    folder, _, ref = tiny[name]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS, max_model_len=256))


# ---- SmolLM3's NoPE layers and window -----------------------------------------------------------------
def test_smollm3_nope_layers_follow_the_config(tiny, tmp_path):
    folder, model, ref = tiny["smollm3"]
    assert model.model.rotary_layers == (True, True, True, False)  # transformers' default interval 4
    # The fused one-token path's view of each layer: the NoPE one takes the identity rotation.
    assert [view.rotary for view in model.model.one_token_layers] == [True, True, True, False]
    # Every layer rotated (the list in config.json flipped): the outputs change, so the NoPE layer counts.
    rotating = _load(_copy_with_config(folder, tmp_path / "all_rope", no_rope_layers=[1, 1, 1, 1]))
    assert rotating.model.rotary_layers == (True,) * 4
    ours, logits = run_greedy(rotating, PROMPTS[3:], 1, return_prefill_logits=True)
    assert not torch.allclose(logits[0], hf_last_logits(ref, PROMPTS[3]), atol=1e-3)
    # Without the list, no_rope_layer_interval decides (every 2nd layer NoPE).
    derived = _load(_copy_with_config(folder, tmp_path / "interval", no_rope_layers=None, no_rope_layer_interval=2))
    assert derived.model.rotary_layers == (True, False, True, False)


def test_smollm3_sliding_window_on_its_nope_layers(tmp_path):
    """use_sliding_window: an 8-token window on the NoPE layers (layers 1 and 3), with config.json's
    layer_types as transformers writes them and without (derived from no_rope_layers, as transformers does)."""
    folder = tiny_olmo_smollm3.make_tiny_smollm3(tmp_path / "window", no_rope_layers=[1, 0, 1, 0],
                                                 use_sliding_window=True, sliding_window=8, seed=35)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["layer_types"] == ["full_attention", "sliding_attention"] * 2
    written = _load(folder)
    derived = _load(_copy_with_config(folder, tmp_path / "derived", layer_types=None))
    for model in (written, derived):
        assert [layer.self_attn.window for layer in model.model.layers] == [0, 8, 0, 8]
        _check_parity(model, ref, "smollm3_window")
    # use_sliding_window false: no window, whatever sliding_window says (transformers' SmolLM3).
    off = _load(_copy_with_config(folder, tmp_path / "off", use_sliding_window=False, layer_types=None))
    assert [layer.self_attn.window for layer in off.model.layers] == [0] * 4
    # Sliding layer_types with use_sliding_window false: transformers' layers and masks disagree; refused.
    with pytest.raises(UnsupportedModelError, match="config.json: layer_types.*use_sliding_window"):
        _load(_copy_with_config(folder, tmp_path / "mixed", use_sliding_window=False))


# ---- OLMo 3's windows and two rotaries -------------------------------------------------------------------
def test_olmo3_windows_and_rotaries_follow_the_config(tiny, tmp_path):
    """Layers 0-2 windowed and rotating without the YaRN of layer 3; config.json as transformers 4.5x writes it
    (rope_theta and rope_scaling at the top, no layer_types: every fourth layer full) loads the same model.
    Mutations that must show: YaRN on every layer, or no window."""
    folder, _, ref = tiny["olmo3"]
    model = _load(folder)  # (served: the windows as spec_for_context sets them)
    assert [layer.self_attn.window for layer in model.model.layers] == [8, 8, 8, 0]
    _check_parity(model, ref, "olmo3")
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(3, None))
    assert model.model.sliding == (True, True, True, False)
    flat = _load(_copy_with_config(folder, tmp_path / "flat", rope_parameters=None, layer_types=None,
                                   rope_theta=50_000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                      "original_max_position_embeddings": 512}))
    assert [layer.self_attn.window for layer in flat.model.layers] == [8, 8, 8, 0]
    _check_parity(flat, ref, "olmo3_flat")
    _, expected = run_greedy(model, PROMPTS[3:], 1, return_prefill_logits=True)
    yarn = {"rope_type": "yarn", "rope_theta": 50_000.0, "factor": 4.0, "original_max_position_embeddings": 512}
    yarn_everywhere = _load(_copy_with_config(folder, tmp_path / "yarn_all",
                                              rope_parameters={"sliding_attention": yarn, "full_attention": yarn}))
    unwindowed = _load(_copy_with_config(folder, tmp_path / "no_window", sliding_window=None))
    for changed in (yarn_everywhere, unwindowed):
        _, logits = run_greedy(changed, PROMPTS[3:], 1, return_prefill_logits=True)
        assert not torch.allclose(logits[0], expected[0], atol=1e-3)
    # A window no shorter than the context: full attention everywhere, the sliding layers' rotary kept.
    wide = _load(_copy_with_config(folder, tmp_path / "wide", sliding_window=4096))
    assert [layer.self_attn.window for layer in wide.model.layers] == [0] * 4
    assert wide.model.sliding == (True, True, True, False)


# ---- the Triton kernel set (the GPU's): decode paths, and the layers under the interpreter ----------------
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_model(name: str, tiny, **replace):
    folder, model, _ = tiny[name]
    spec = dataclasses.replace(model.spec, **replace)
    built = get_model_class([spec.architecture])(spec, torch.float32, "cpu", kernels="triton")
    built.load_weights(iter_safetensors(folder))
    built.finalize_weights()
    return built


def test_one_token_decode_paths(tiny):
    """The fused one-token kernels norm q/k per head and run pre-norm layers: both OLMo families step aside
    (the path may still fuse the lm_head). SmolLM3 keeps them, its NoPE layer marked unrotated."""
    for name in ("olmo2", "olmoe"):
        assert _triton_model(name, tiny).model.decode_path.layers is None, name
    layers = _triton_model("smollm3", tiny).model.decode_path.layers
    assert [layer.rotary for layer in layers] == [True, True, True, False]


@pytest.mark.skipif(not INTERPRETED, reason="the Triton kernel set on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["smollm3", "olmo2", "olmoe_clip"])
def test_triton_kernel_set_matches_transformers(tiny, name, monkeypatch):
    """Prefill through the Triton layers, decode through the fused one-token kernels where the model takes
    them (SmolLM3: counted, so the NoPE layer's identity rotation is what is compared)."""
    _, _, ref = tiny[name]
    model = _triton_model(name, tiny)
    path = model.model.decode_path
    fused_steps = []
    if path.layers is not None:
        forward = path.forward
        monkeypatch.setattr(path, "forward", lambda *a, **k: fused_steps.append(1) or forward(*a, **k))
    # One prompt at a time (the fused path takes 1-token steps); with the fused path a second one prefilled a
    # token a step, so its prompt logits come through the fused kernels at every position.
    cases = [(PROMPTS[0], None)] + ([(PROMPTS[1], 1)] if path.layers is not None else [])
    for i, (ids, chunk) in enumerate(cases):
        ours, logits = run_greedy(model, [ids], 3, block_size=16, prefill_chunk=chunk, return_prefill_logits=True)
        torch.testing.assert_close(logits[0], hf_last_logits(ref, ids), atol=1e-4, rtol=1e-4)
        assert cut_at_eos(ours[0], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 3), (name, i)
    assert bool(fused_steps) == (name == "smollm3")


@pytest.mark.skipif(not INTERPRETED, reason="the Triton kernel set on CPU needs TRITON_INTERPRET=1")
def test_olmo3_triton_kernel_set_matches_transformers(tiny):
    """OLMo 3 on the GPU's op set under the interpreter, its windows served (the 8-token prompt fills one)."""
    _, _, ref = tiny["olmo3"]
    model = _triton_model("olmo3", tiny, attention_windows=(8, 8, 8, 0))
    assert [layer.self_attn.window for layer in model.model.layers] == [8, 8, 8, 0]
    ours, logits = run_greedy(model, [PROMPTS[1]], 3, block_size=16, return_prefill_logits=True)
    torch.testing.assert_close(logits[0], hf_last_logits(ref, PROMPTS[1]), atol=1e-4, rtol=1e-4)
    assert cut_at_eos(ours[0], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, PROMPTS[1], 3)


# ---- what the OLMo configs build ------------------------------------------------------------------------
def test_olmo_qk_norms_span_all_heads(tiny):
    for name, q_width in (("olmo2", 64), ("olmoe", 64)):
        attn = tiny[name][1].model.layers[0].self_attn
        assert attn.q_norm.weight.shape == (q_width,) and attn.k_norm.weight.shape == (2 * 16,)
    assert tiny["olmoe_clip"][1].model.layers[0].self_attn.clip_qkv == 0.5
    assert tiny["olmoe"][1].model.layers[0].self_attn.clip_qkv is None


# ---- refusals by name -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "fields", "words"), [
    ("olmo2", {"sliding_window": 16}, "sliding_window"),
    ("olmo2", {"clip_qkv": 8.0}, "clip_qkv"),
    ("olmo2", {"mlp_bias": True}, "mlp_bias"),
    ("olmo3", {"clip_qkv": 8.0}, "clip_qkv"),
    ("olmo3", {"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]},
     "layer_types"),
    ("olmoe", {"sliding_window": 16}, "sliding_window"),
    ("olmoe", {"clip_qkv": -1.0}, "clip_qkv"),
    ("olmoe", {"shared_expert_intermediate_size": 32}, "shared_expert_intermediate_size"),
    ("olmoe", {"head_dim": 8}, "head_dim"),
])
def test_unsupported_fields_are_refused_by_name(tiny, tmp_path, name, fields, words):
    folder = _copy_with_config(tiny[name][0], tmp_path / name, **fields)
    with pytest.raises(UnsupportedModelError, match=f"config.json.*{words}"):
        _load(folder)


@pytest.mark.parametrize("name", ["olmo3", "olmo2-one-kv-head"])
def test_tensor_parallel_engine_matches_one_rank(tiny, tmp_path, name):
    """Two gloo ranks, each with its heads' rows of the full-width q/k norms and their variance all-reduced: OLMo 3
    (windows, 2 KV heads: one a rank), and an OLMo 2 with one KV head (replicated on both ranks, counted once)."""
    if name == "olmo3":
        folder = tiny["olmo3"][0]
    else:
        folder = tiny_olmo_smollm3.make_tiny_olmo2(tmp_path / "kv1", num_kv_heads=1, seed=37)
    assert_tensor_parallel_matches_one_rank(folder, PROMPTS)


def test_a_rank_holds_its_heads_of_the_norms(tiny):
    """Under tensor parallelism (rank 1 of 2) each norm holds its heads' weights, and the model's own norms are
    NormShards (so the variance is summed over the ranks)."""
    from ferrox.models.olmo2 import NormShard

    folder = tiny["olmoe"][0]
    whole = _load(folder)
    source = resolve_model(folder)
    with use_tp_group(TPGroup(rank=1, size=2)):
        shard = load_model(source, spec_for_context(load_model_spec(source), 256), dtype=torch.float32, device="cpu")
    for full, part in zip(whole.model.layers, shard.model.layers, strict=True):
        q, k = part.self_attn.q_norm, part.self_attn.k_norm
        assert isinstance(q, NormShard) and isinstance(k, NormShard)
        assert torch.equal(q.weight, full.self_attn.q_norm.weight.view(2, -1)[1])
        assert torch.equal(k.weight, full.self_attn.k_norm.weight.view(2, -1)[1])


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["smollm3", "olmo2", "olmoe_clip"])
def test_cuda_engine_matches_cpu_engine(tiny, name):
    """On CUDA with CUDA graphs: SmolLM3's fused one-token decode with the identity rotation on its NoPE
    layers, OLMo's whole-projection q/k norms on the Triton RMSNorm, OLMoE's fused expert kernels; float32
    tokens equal the CPU engine's, bfloat16 close (tests/models/conftest.py). A 200-token prompt too."""
    from tests.models.conftest import assert_cuda_engine_matches_cpu

    prompts = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], [(13 * i + 4) % 300 + 3 for i in range(200)]]
    assert_cuda_engine_matches_cpu(tiny[name][0], prompts, max_tokens=12, max_model_len=256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_olmo3_cuda_engine_matches_cpu(tiny):
    """OLMo 3's windowed layers and two rotaries on the CUDA engine (CUDA graphs) against the CPU engine."""
    assert_cuda_engine_matches_cpu(tiny["olmo3"][0], PROMPTS, max_tokens=8, max_model_len=256)
