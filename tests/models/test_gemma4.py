"""Gemma 4 text against transformers on tiny random checkpoints (float32, CPU): sliding layers and wider full
layers with fewer KV heads and no v_proj (attention_k_eq_v), value norms, unscaled scores, proportional RoPE
on the full layers, layer scalars, final logit soft-capping; prompts past the window through chunked prefill
over paged blocks. Also the MoE block (26B-A4B's shape: its experts a FusedMoE, the torch loop on CPU),
per-layer embeddings and KV-sharing layers (E2B/E4B's), the multimodal checkpoint served as text, and the
engine end to end; on a GPU the CUDA engine against the CPU one, the MoE checkpoint's decode steps replayed as
CUDA graphs over the fused MoE kernels."""

from __future__ import annotations

import json
import os

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import UnsupportedModelError, spec_for_context

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_gemma4 import WINDOW, make_tiny_gemma4
from tests.models.conftest import assert_cuda_engine_matches_cpu, cut_at_eos, hf_greedy, hf_last_logits

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], list(range(3, 43)), [7, 100, 45] * 13]
KINDS = {"dense": {}, "moe": {"moe": True}, "per_layer_kv_shared": {"per_layer": True, "kv_shared": 2},
         "conditional": {"conditional": True}}


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """name -> (folder, ferrox model built for 256 tokens, transformers model)."""
    root = tmp_path_factory.mktemp("gemma4")
    out = {}
    for seed, (name, kind) in enumerate(KINDS.items()):
        folder = make_tiny_gemma4(root / name, seed=40 + seed, **kind)
        source = resolve_model(folder)
        model = load_model(source, spec_for_context(load_model_spec(source), 256), dtype=torch.float32, device="cpu")
        cls = transformers.Gemma4ForConditionalGeneration if name == "conditional" else transformers.Gemma4ForCausalLM
        ref = cls.from_pretrained(folder, dtype=torch.float32).eval()
        out[name] = (folder, model, ref)
    return out


@pytest.mark.parametrize("name", list(KINDS))
@torch.inference_mode()
def test_greedy_and_logits_match_transformers(gemma4, name):
    _, model, ref = gemma4[name]
    assert model.spec.attention_windows == (WINDOW, WINDOW, 0) * 2
    ours, logits = run_greedy(model, PROMPTS, 10, block_size=8, prefill_chunk=7, return_prefill_logits=True)
    for i, ids in enumerate(PROMPTS):
        torch.testing.assert_close(logits[i], hf_last_logits(ref, ids), atol=1e-4, rtol=1e-4)
        assert cut_at_eos(ours[i], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 10), (name, i)


def test_per_layer_kv_shapes(gemma4):
    """Full layers: head_dim 32 with one KV head; sliding: 16 with two; KV-sharing layers write no cache."""
    assert gemma4["dense"][1].spec.layer_kv_shapes == ((2, 16), (2, 16), (1, 32)) * 2
    assert gemma4["per_layer_kv_shared"][1].spec.layer_kv_shapes == ((2, 16), (2, 16), (1, 32), (2, 16), (1, 1), (1, 1))
    assert gemma4["conditional"][1].takes_images  # (its images: tests/models/test_gemma4_vision.py)
    # Prompt embeddings: refused at start-up where per-layer embeddings need the prompt's token ids.
    from ferrox.multimodal.prompt_embeds import startup_problem

    def problem(name: str) -> str | None:
        return startup_problem(gemma4[name][1], tensor_parallel_size=1, speculative=False, pooling=False)

    assert problem("dense") is None and "per-layer embeddings" in (problem("per_layer_kv_shared") or "")


def test_hub_config_layout_reads_the_same(gemma4):
    """The published configs write global_head_dim / num_global_key_value_heads (transformers now writes
    per_layer_config); and the multimodal layout nests the text under text_config."""
    folder = gemma4["dense"][0]
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    hub = {k: v for k, v in config.items() if k != "per_layer_config"}
    hub.update(global_head_dim=32, num_global_key_value_heads=1)
    assert spec_from_hf_config(hub, "config.json").layer_kv_shapes == ((2, 16), (2, 16), (1, 32)) * 2
    nested = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
              "text_config": {**hub, "architectures": None}, "vision_config": {"hidden_size": 32}}
    spec = spec_from_hf_config(nested, "config.json")
    assert spec.layer_kv_shapes == ((2, 16), (2, 16), (1, 32)) * 2 and spec.architecture == "Gemma4ForConditionalGeneration"


@pytest.mark.parametrize("name", ["dense", "conditional"])
def test_engine_matches_transformers(gemma4, name):
    """The engine (scheduler, paged cache of per-layer shapes, chunked prefill); the multimodal checkpoint
    serves its language model (--language-model-only) and refuses a request's image."""
    folder, _, ref = gemma4[name]
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              language_model_only=name == "conditional")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        if name == "conditional":
            assert not llm.engine.runner.model.takes_images  # (the tower was neither built nor loaded)
            # (its tokenizer has no image token: served as text, the prompt rules take no images)
            with pytest.raises(InvalidArgumentError, match=r"messages\[0\]\.content\[0\]: .* takes no images"):
                llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params,
                         use_tqdm=False, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert cut_at_eos(list(out.outputs[0].token_ids), [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, prompt, 10)


def test_refusals(gemma4):
    folder = gemma4["dense"][0]
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    from ferrox.models.gemma4 import Gemma4ForCausalLM

    for change, words in (({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
                          ({"hidden_activation": "silu"}, "hidden_activation")):
        spec = spec_from_hf_config({**config, **change}, "config.json")
        with pytest.raises(UnsupportedModelError, match=words):
            Gemma4ForCausalLM(spec, torch.float32, "cpu")
    assert not Gemma4ForCausalLM.supports_quantization  # (tensor parallelism: test_gemma4_tp.py)


# ---- GPU ----------------------------------------------------------------------------------------------
# First run on a GPU (H100, 2026-12-06): float32 equals the CPU engine for all three, and dense passes in bf16; the
# MoE and per-layer models' bf16 runs part from the CPU engine by more than transformers' own bf16 does (first token
# 0.157 nats vs transformers' 0.041 for the MoE; the CPU engine's bf16: 0.009). Open: a CUDA bf16 precision gap.
_BF16_GAP = pytest.mark.xfail(reason="open: CUDA bf16 of Gemma 4's MoE / per-layer models (closing note)", strict=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["dense", pytest.param("moe", marks=_BF16_GAP),
                                  pytest.param("per_layer_kv_shared", marks=_BF16_GAP)])
def test_cuda_engine_matches_cpu(gemma4, name):
    """The CUDA engine (the Triton attention over caches of two shapes, the q/k-norm rotary kernel, the
    value norm, CUDA graphs over the general path) against the CPU float32 engine
    (conftest.assert_cuda_engine_matches_cpu); bf16 routing may flip near-tied experts, so the MoE case checks
    only bf16's first token."""
    assert_cuda_engine_matches_cpu(gemma4[name][0], PROMPTS, max_tokens=8, max_model_len=256,
                                   bf16_tokens=name != "moe")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_moe_replays_cuda_graphs(gemma4):
    """The MoE checkpoint on CUDA: its experts on the fused MoE kernels (the GELU-tanh epilogue; routed on the
    device, nothing read back on the host), so its decode steps replay CUDA graphs -- batch 1 (the matrix-vector
    path) and the padded batch of all prompts (the grouped GEMMs) --, with the CPU engine's greedy tokens and
    first-token logprobs (float32)."""
    folder = gemma4["moe"][0]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True)

    def generate(llm, batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]

    cpu = LLM(model=folder, device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=256)
    try:
        want = generate(cpu, PROMPTS)
    finally:
        cpu.engine.shutdown()
    replayed: list[int] = []  # the token count of each step run by a CUDA graph
    llm = LLM(model=folder, device="cuda", dtype="float32", kv_cache_memory=256 << 20, max_model_len=256)
    try:
        graphs = llm.engine.runner.graph_runner
        assert graphs is not None, "CUDA graphs were not captured (supports_cuda_graphs off for the MoE?)"
        run = graphs.run

        def counting(input_ids, positions, meta, run=run):
            replayed.append(int(input_ids.shape[0]))
            return run(input_ids, positions, meta)

        graphs.run = counting
        batched = generate(llm, PROMPTS)
        alone = [generate(llm, [p])[0] for p in PROMPTS]
    finally:
        llm.engine.shutdown()
    assert 1 in replayed and len(PROMPTS) in replayed, replayed
    for i, (tokens, lps) in enumerate(want):
        assert batched[i][0] == tokens and alone[i][0] == tokens, (i, batched[i][0], alone[i][0], tokens)
        for got in (batched[i], alone[i]):
            assert abs(got[1][0][tokens[0]].logprob - lps[0][tokens[0]].logprob) < 1e-3
