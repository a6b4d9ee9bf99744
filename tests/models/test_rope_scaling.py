"""Long-context RoPE against transformers: YaRN (Qwen2.5 / Qwen3 past 32k, DeepSeek's mscale),
LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) and partial rotary (Phi-4-mini), each as
frequencies and attention factors, then as whole models (logits and greedy tokens through chunked
prefill), then through the engine, where the served max_model_len picks LongRoPE's factors and
YaRN / linear scaling set the context length as vLLM derives it. The base models are built once;
each variant is a copy with config.json edited (rope does not change the weights)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.layers.rotary import RotaryEmbedding, partial_rotary_order, rope_angles
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import ModelLoadError

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.models.conftest import assert_cuda_engine_matches_cpu, cut_at_eos, hf_greedy, hf_last_logits

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

ORIGINAL = 64  # the tiny models' pretraining context for every scaled rope below
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# 8 rotary pairs (head_dim 16); the long factors bigger, as in real LongRoPE configs.
SHORT, LONG = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5], [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}
SHORT_PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], list(range(3, 43))]  # + 10 tokens <= ORIGINAL
LONG_PROMPTS = [list(range(3, 83)), [7] * 5 + list(range(200, 290))]  # past ORIGINAL from the prompt on


# ---- frequencies and attention factors ------------------------------------------------------------
def _hf_rope(config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    kind = config.rope_parameters["rope_type"]
    return rope_utils.ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("rope, fields", [
    ({**YARN, "rope_theta": 1e6}, {}),
    ({**YARN, "rope_theta": 1e4, "beta_fast": 16, "beta_slow": 2, "truncate": False}, {}),
    ({**YARN, "rope_theta": 1e4, "mscale": 0.707, "mscale_all_dim": 0.707}, {}),  # DeepSeek's: ratio 1
    ({**YARN, "rope_theta": 1e4, "mscale": 1.0, "mscale_all_dim": 0.5}, {}),
    ({**YARN, "rope_theta": 1e4, "attention_factor": 1.25}, {}),
    ({**YARN, "rope_theta": 1e4, "partial_rotary_factor": 0.5}, {}),
])
def test_yarn_frequencies_match_transformers(rope, fields):
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=256,
                                      rope_parameters=dict(rope), **fields)
    inv_freq, factor = _hf_rope(config)
    rotary_dim = inv_freq.numel() * 2
    angles = rope_angles(64, rope["rope_theta"], rope, rotary_dim=rotary_dim, max_position_embeddings=256)
    torch.testing.assert_close(angles.inv_freq[: rotary_dim // 2], inv_freq, rtol=1e-6, atol=0)
    assert torch.all(angles.inv_freq[rotary_dim // 2:] == 0)  # partial rotary: the rest do not turn
    amplitude = angles.amplitude if angles.amplitude is not None else torch.ones(32)  # None: 1 (mscale ratio 1)
    torch.testing.assert_close(amplitude[: rotary_dim // 2], torch.full((rotary_dim // 2,), factor))
    assert torch.all(amplitude[rotary_dim // 2:] == 1)


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("long_context", [False, True])
def test_longrope_frequencies_match_transformers(partial, long_context):
    pairs = int(64 * partial) // 2
    rope = {**LONGROPE, "short_factor": (SHORT * 4)[:pairs], "long_factor": (LONG * 4)[:pairs], "rope_theta": 1e4}
    config = transformers.Phi3Config(hidden_size=128, num_attention_heads=2, max_position_embeddings=1024,
                                     original_max_position_embeddings=ORIGINAL, rope_parameters=dict(rope),
                                     partial_rotary_factor=partial)
    inv_freq, factor = _hf_rope(config, seq_len=ORIGINAL + 1 if long_context else ORIGINAL)
    scaling = {**rope, "original_max_position_embeddings": ORIGINAL}
    angles = rope_angles(64, 1e4, scaling, rotary_dim=2 * pairs, max_position_embeddings=1024,
                         long_context=long_context)
    torch.testing.assert_close(angles.inv_freq[:pairs], inv_freq, rtol=1e-6, atol=0)
    assert angles.amplitude is not None and factor > 1  # sqrt(1 + ln 16 / ln 64)
    torch.testing.assert_close(angles.amplitude[:pairs], torch.full((pairs,), factor))


def test_partial_rotary_order_pairs_rows_as_whole_head_rotary_expects():
    """HF rotates dims [0, r) pairing i with i + r/2; after the reorder ferrox pairs j with j + d/2."""
    order = partial_rotary_order(16, 8)
    assert order.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    x = torch.randn(3, 1, 16)
    positions = torch.tensor([0, 5, 77])
    hf = RotaryEmbedding(8, 1e4, None)  # HF's formula on the rotated part, the rest passed through
    cos, sin = hf.cos_sin(positions, torch.float32)
    expected = torch.cat([x[..., :8] * cos + torch.cat([-x[..., 4:8], x[..., :4]], -1) * sin, x[..., 8:]], -1)
    ours = RotaryEmbedding(16, 1e4, None, rotary_dim=8)
    cos, sin = ours.cos_sin(positions, torch.float32)
    y = x[..., order]
    got = y * cos + torch.cat([-y[..., 8:], y[..., :8]], -1) * sin
    torch.testing.assert_close(got, expected[..., order])


def test_rope_scaling_fields_are_checked_by_name():
    with pytest.raises(ModelLoadError, match=r"rope_scaling\.short_factor has 3 entries, the model's rotary dims "
                                             r"need 32"):
        rope_angles(64, 1e4, {**LONGROPE, "short_factor": [1.0] * 3, "original_max_position_embeddings": 64})
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor.* must be in \(0, 1\]"):
        from ferrox.loader.model_config import spec_from_hf_config
        spec_from_hf_config({"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                             "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 16,
                             "partial_rotary_factor": 1.5}, "config.json")


# ---- whole models ---------------------------------------------------------------------------------
def _edited(base: str, dest, **fields) -> str:
    """A copy of a model folder with config.json fields set (the weights do not depend on rope)."""
    shutil.copytree(base, dest)
    path = os.path.join(dest, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(fields)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return str(dest)


VARIANTS = {  # name -> (base family, config.json fields, LongRoPE long factors)
    "qwen2_yarn": ("qwen2", {"rope_parameters": {**YARN, "rope_theta": 1e6}}, False),
    "qwen3_yarn": ("qwen3", {"rope_parameters": {**YARN, "factor": 8.0, "rope_theta": 1e6}}, False),
    "phi3_longrope_short": ("phi3", {"rope_parameters": {**LONGROPE, "rope_theta": 1e4}, "max_position_embeddings": 256,
                                     "original_max_position_embeddings": ORIGINAL}, False),
    "phi3_longrope_long": ("phi3", {"rope_parameters": {**LONGROPE, "rope_theta": 1e4}, "max_position_embeddings": 256,
                                    "original_max_position_embeddings": ORIGINAL}, True),
    # transformers >= 5 writes the factor under rope_parameters (and it wins over a top-level one).
    "phi3_partial": ("phi3", {"partial_rotary_factor": 1.0, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, False),
    # Phi-4-mini's shape: LongRoPE over the rotated three quarters... here a half of a 16-dim head.
    "phi3_partial_longrope": ("phi3", {"partial_rotary_factor": 0.5, "max_position_embeddings": 256,
                                       "original_max_position_embeddings": ORIGINAL,
                                       "rope_parameters": {**LONGROPE, "short_factor": SHORT[:4],
                                                           "long_factor": LONG[:4], "rope_theta": 1e4}}, True),
}
BASES = {
    "qwen2": lambda d: tiny_models.make_tiny_qwen2(d, seed=21),
    "qwen3": lambda d: tiny_models.make_tiny_qwen3(d, seed=22),
    "phi3": lambda d: tiny_models.make_tiny_phi3(d, seed=23),
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model), all float32 on the CPU."""
    root = tmp_path_factory.mktemp("rope_scaling")
    bases = {name: build(root / name) for name, build in BASES.items()}
    out = {}
    for name, (base, fields, long_context) in VARIANTS.items():
        folder = _edited(bases[base], root / name, **fields)
        source = resolve_model(folder)
        spec = dataclasses.replace(load_model_spec(source), rope_long_context=long_context)
        model = load_model(source, spec, dtype=torch.float32, device="cpu")
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[name] = (folder, model, ref)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
@torch.inference_mode()
def test_models_match_transformers(variants, name):
    """Prefill in chunks of 7 over 8-token blocks, then batched decode: logits and greedy tokens.
    LongRoPE's short factors are compared on requests that stay within the original context and its
    long ones on prompts already past it (where transformers picks each set for every forward)."""
    _, model, ref = variants[name]
    prompts = LONG_PROMPTS if VARIANTS[name][2] else SHORT_PROMPTS
    if name.endswith("yarn") or name == "phi3_partial":
        prompts = SHORT_PROMPTS + LONG_PROMPTS  # no switch: any length
    ours, logits = run_greedy(model, prompts, 10, block_size=8, prefill_chunk=7, return_prefill_logits=True)
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_last_logits(ref, ids), atol=1e-4, rtol=1e-4)
        assert cut_at_eos(ours[i], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 10), (name, i)


def test_the_scaled_rope_changes_the_output(variants):
    """The variants differ from their plain-rope bases (a test of the comparisons above)."""
    _, yarn, _ = variants["qwen2_yarn"]
    _, short, _ = variants["phi3_longrope_short"]
    _, long, _ = variants["phi3_longrope_long"]
    prompt = [LONG_PROMPTS[0]]
    _, a = run_greedy(short, prompt, 1, return_prefill_logits=True)
    _, b = run_greedy(long, prompt, 1, return_prefill_logits=True)
    assert (a[0] - b[0]).abs().max() > 1e-2
    assert yarn.model.rotary.amplitude is not None and float(yarn.model.rotary.amplitude[0]) > 1.1


# ---- the engine: context length and LongRoPE's choice ------------------------------------------------
def test_engine_picks_longrope_factors_by_max_model_len(variants):
    """Above the original context (the default here: max_position_embeddings 256) the long factors,
    as vLLM; at most the original context, the short ones. Both against transformers' greedy."""
    folder, _, ref = variants["phi3_longrope_long"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for max_model_len, prompt in ((None, LONG_PROMPTS[0]), (ORIGINAL, SHORT_PROMPTS[1])):
        llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=32,
                  max_model_len=max_model_len)
        try:
            assert llm.engine.max_model_len == (256 if max_model_len is None else ORIGINAL)
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        finally:
            llm.engine.shutdown()
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, 6)[:6]


def test_yarn_sets_the_context_as_vllm(variants, tmp_path):
    """YaRN: original_max_position_embeddings x factor (here 64 x 4, below the config's 2048: vLLM's
    rule either way); linear: max_position_embeddings x factor. A longer max_model_len names it."""
    folder = variants["qwen2_yarn"][0]
    assert load_model_spec(resolve_model(folder)).max_position_embeddings == ORIGINAL * 4
    with pytest.raises(ValueError, match=r"max_model_len: 257 exceeds the model's context \(256 tokens, as its "
                                         r"rope_scaling \(yarn, factor 4\.0\) extends it\)"):
        LLM(model=folder, max_model_len=257, kv_cache_memory=8 << 20)
    linear = _edited(folder, tmp_path / "linear", max_position_embeddings=100,
                     rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    assert load_model_spec(resolve_model(linear)).max_position_embeddings == 200


def test_hf_overrides_turn_yarn_on_as_config_json_would(variants, tmp_path):
    """vLLM's --hf-overrides (LLM(hf_overrides=...)): Qwen's recipe for 4x its context without editing
    config.json; the same tokens as transformers on the edited config. Errors name the overrides."""
    folder, _, ref = variants["qwen2_yarn"]
    plain = _edited(folder, tmp_path / "plain", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    prompt = LONG_PROMPTS[1]
    llm = LLM(model=plain, dtype="float32", kv_cache_memory=8 << 20, hf_overrides={"rope_scaling": YARN})
    try:
        assert llm.engine.max_model_len == ORIGINAL * 4
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, 6)[:6]
    with pytest.raises(ModelLoadError, match=r"config\.json with hf_overrides: num_attention_heads 3 is not a "
                                             r"multiple of num_key_value_heads 2"):
        LLM(model=plain, kv_cache_memory=8 << 20, hf_overrides={"num_attention_heads": 3, "head_dim": 16})
    with pytest.raises(ValueError, match=r"hf_overrides: must be a JSON object"):
        LLM(model=plain, hf_overrides=["rope_scaling"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qwen2_yarn", "qwen3_yarn", "phi3_partial_longrope"])
def test_cuda_engine_matches_cpu_engine(variants, name):
    """On CUDA (CUDA graphs, the rope rows with YaRN's / LongRoPE's amplitude and unturned pairs in the
    Triton rotary kernels, Qwen3's q/k-norm + rope kernel, the fused one-token qkv kernel): float32 greedy
    tokens equal the CPU float32 engine's, bfloat16's first tokens and first logprob close."""
    folder = variants[name][0]
    assert_cuda_engine_matches_cpu(folder, SHORT_PROMPTS + LONG_PROMPTS, max_tokens=8, max_model_len=256)
