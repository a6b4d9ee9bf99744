"""Gemma 3 text against transformers on tiny random checkpoints: q/k norms, local and global RoPE apart
(with the global one scaled), five sliding-window layers per global one, windows much shorter than the
prompts -- logits and greedy tokens through chunked prefill over paged blocks, then the engine -- and the
older config layout (rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import UnsupportedModelError, spec_for_context
from ferrox.models.gemma3 import rope_settings

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.models.conftest import cut_at_eos, hf_greedy, hf_last_logits

transformers = pytest.importorskip("transformers")

WINDOW = 16
PROMPTS = [[5, 9, 11], list(range(3, 43)), [7, 100, 45] * 19]
LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """name -> (folder, ferrox model built for 256 tokens, transformers model)."""
    root = tmp_path_factory.mktemp("gemma3")
    out = {}
    for name, scaling in (("plain", None), ("scaled", LINEAR)):
        folder = tiny_models.make_tiny_gemma3(root / name, sliding_window=WINDOW, global_scaling=scaling, seed=51)
        source = resolve_model(folder)
        model = load_model(source, spec_for_context(load_model_spec(source), 256), dtype=torch.float32, device="cpu")
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[name] = (folder, model, ref)
    return out


@pytest.mark.parametrize("name", ["plain", "scaled"])
@torch.inference_mode()
def test_greedy_and_logits_match_transformers(gemma3, name):
    _, model, ref = gemma3[name]
    assert model.spec.attention_windows == (WINDOW,) * 5 + (0,)
    ours, logits = run_greedy(model, PROMPTS, 12, block_size=8, prefill_chunk=7, return_prefill_logits=True)
    for i, ids in enumerate(PROMPTS):
        torch.testing.assert_close(logits[i], hf_last_logits(ref, ids), atol=1e-4, rtol=1e-4)
        assert cut_at_eos(ours[i], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 12), (name, i)


def test_engine_matches_transformers(gemma3):
    folder, _, ref = gemma3["plain"]
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        assert llm.engine.max_model_len == 512
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert cut_at_eos(list(out.outputs[0].token_ids), [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, prompt, 12)


def test_older_config_layout_reads_the_same(gemma3, tmp_path):
    """Checkpoints on the hub predate rope_parameters: rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern say the same things."""
    folder = gemma3["scaled"][0]
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling=LINEAR, sliding_window_pattern=6)
    assert rope_settings(old) == rope_settings(config) == ((10_000.0, None), (1_000_000.0, LINEAR))
    from ferrox.loader.model_config import spec_from_hf_config
    assert spec_from_hf_config(old, "config.json").sliding_layers == (True,) * 5 + (False,)


def test_bidirectional_attention_is_refused_by_name(gemma3, tmp_path):
    import shutil
    folder = str(tmp_path / "bidi")
    shutil.copytree(gemma3["plain"][0], folder)
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["use_bidirectional_attention"] = True
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedModelError, match=r"use_bidirectional_attention"):
        LLM(model=folder, kv_cache_memory=8 << 20)


@torch.inference_mode()
def test_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration (gemma-3-4b/12b/27b-it) text-only: its language model's tensors
    (the vision tower and projector left unread) give transformers' text-only logits and greedy tokens."""
    folder = tiny_models.make_tiny_gemma3_multimodal(tmp_path / "mm", sliding_window=WINDOW, seed=53)
    source = resolve_model(folder)
    spec = load_model_spec(source)
    assert spec.architecture == "Gemma3ForConditionalGeneration" and spec.num_layers == 6
    model = load_model(source, spec_for_context(spec, 256), dtype=torch.float32, device="cpu")
    ref = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    ours, logits = run_greedy(model, PROMPTS, 8, block_size=8, prefill_chunk=7, return_prefill_logits=True)
    for i, ids in enumerate(PROMPTS):
        torch.testing.assert_close(logits[i], hf_last_logits(ref, ids), atol=1e-4, rtol=1e-4)
        assert cut_at_eos(ours[i], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 8), i


def test_hub_style_text_config_takes_gemma3_defaults():
    """The hub's gemma-3-4b-it config.json writes only the text fields that differ from transformers'
    defaults; the rest are Gemma3TextConfig's."""
    from ferrox.loader.model_config import spec_from_hf_config

    config = {"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024}}
    spec = spec_from_hf_config(config, "config.json")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (8, 4, 256, 262_208)
    assert spec.sliding_window == 1024 and spec.sliding_layers == ((True,) * 5 + (False,)) * 5 + (True,) * 4
    assert spec.tie_word_embeddings and spec.dtype == torch.bfloat16
    assert rope_settings(spec.hf_config) == ((10_000.0, None), (1_000_000.0, {"factor": 8.0, "rope_type": "linear"}))
