"""gpt-oss (models/gpt_oss.py) against transformers on a tiny random checkpoint (tests/helpers/tiny_gpt_oss.py):
attention sinks, the 8-token sliding window on alternate layers, YaRN, the biased router, the experts'
biases and clamped SwiGLU, from transformers' fused layout and from the same weights in MXFP4 blocks;
through the test driver (chunked prefill, batching) and the real engine. Also the MXFP4 dequantizer
against transformers' and the config fields refused by name."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch
from ferrox.layers.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import ModelLoadError, UnsupportedModelError, spec_for_context

from tests.helpers import tiny_gpt_oss
from tests.helpers.driver import run_greedy
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_greedy_and_logits_match,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [5, 9, 100, 7, 300, 22, 11],
    list(range(3, 70)),  # 67 tokens: several KV blocks, far past the window
    [(13 * i + 4) % 380 + 3 for i in range(30)],
    [42, 17],
]
CONTEXT = 256


def _load(folder: str):
    source = resolve_model(folder)
    spec = spec_for_context(load_model_spec(source), CONTEXT)
    return load_model(source, spec, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(bf16-layout folder, MXFP4 folder, ferrox model of the first, transformers model)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    folder = tiny_gpt_oss.make_tiny_gpt_oss(root / "fused", seed=5)
    mxfp4 = tiny_gpt_oss.write_mxfp4_copy(folder, str(root / "mxfp4"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, mxfp4, _load(folder), ref


def test_greedy_and_logits_match_transformers(tiny):
    _, _, model, ref = tiny
    assert [layer.self_attn.window for layer in model.model.layers] == [tiny_gpt_oss.WINDOW, 0, tiny_gpt_oss.WINDOW]
    assert_greedy_and_logits_match(model, ref, PROMPTS, [2])


def test_chunked_prefill_and_batching_do_not_change_tokens(tiny):
    _, _, model, _ = tiny
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, alone=slice(1, 2), prefill_chunk=5)


def test_mxfp4_checkpoint_loads_the_same_model(tiny):
    folder, mxfp4, model, _ = tiny
    assert "gate_up_proj_blocks" in " ".join(_tensor_names(mxfp4))
    quantized = _load(mxfp4)
    for (name, a), (_, b) in zip(model.state_dict().items(), quantized.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert run_greedy(quantized, PROMPTS[:2], 6) == run_greedy(model, PROMPTS[:2], 6)


def test_sinks_clamp_and_window_are_in_play(tiny):
    """Each feature changes the output on these weights, so the parity above covers it."""
    _, _, model, _ = tiny
    _, base = run_greedy(model, PROMPTS[1:2], 1, return_prefill_logits=True)
    attn = model.model.layers[1].self_attn
    experts = model.model.layers[0].mlp.experts
    saved = (attn.sinks.data.clone(), experts.activation, attn.window)
    try:
        attn.sinks.data.fill_(-1e4)  # no sink mass
        _, no_sinks = run_greedy(model, PROMPTS[1:2], 1, return_prefill_logits=True)
        attn.sinks.data.copy_(saved[0])
        experts.activation = dataclasses.replace(saved[1], limit=100.0)
        _, no_clamp = run_greedy(model, PROMPTS[1:2], 1, return_prefill_logits=True)
    finally:
        attn.sinks.data.copy_(saved[0])
        experts.activation = saved[1]
    full = _load_full_attention(tiny[0])
    _, unwindowed = run_greedy(full, PROMPTS[1:2], 1, return_prefill_logits=True)
    for other in (no_sinks, no_clamp, unwindowed):
        assert (other - base).abs().max() > 1e-3


def _load_full_attention(folder: str):
    source = resolve_model(folder)
    return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")  # no context: no windows


def test_engine_chunked_prefill_matches_transformers(tiny):
    """The real engine (Rust scheduler, paged KV, sampler) with a 16-token budget: prompts prefilled in chunks
    from the MXFP4 checkpoint; greedy tokens and their logprobs against transformers."""
    from ferrox import LLM, SamplingParams

    _, mxfp4, _, ref = tiny
    llm = LLM(model=mxfp4, dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              max_model_len=CONTEXT)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        with torch.inference_mode():
            hf = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, top_p=None,
                              top_k=None, temperature=None)[0, len(prompt):].tolist()
            ref_lp = torch.log_softmax(ref(torch.tensor([prompt + ids])).logits[0].double(), dim=-1)
        assert ids == hf
        for i, (tok, lps) in enumerate(zip(ids, sample.logprobs, strict=True)):
            assert math.isclose(lps[tok].logprob, ref_lp[len(prompt) - 1 + i, tok].item(), abs_tol=1e-3)


def test_mxfp4_dequantizer_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8, generator=gen)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, rows, cols]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), theirs.transpose(1, 2).bfloat16())
    again = dequantize_mxfp4(*quantize_mxfp4(ours), torch.float32)
    assert torch.equal(again, ours)  # values on the grid round-trip


def _tensor_names(folder: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _edited_copy(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    edit(config)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return str(dst)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(experts_per_token=2), "experts_per_token"),
    (lambda c: c.update(mlp_only_layers=[1]), "mlp_only_layers"),
    (lambda c: c.update(quantization_config={"quant_method": "awq"}), "awq"),
])
def test_unsupported_config_fields_are_refused_by_name(tiny, tmp_path, edit, match):
    folder = _edited_copy(tiny[0], tmp_path / "edited", edit)
    source = resolve_model(folder)
    with pytest.raises(UnsupportedModelError, match=match):
        from ferrox.layers.quant.config import resolve_quant_config

        spec = load_model_spec(source)
        quant = resolve_quant_config(None, spec)
        load_model(source, spec, dtype=torch.float32, device="cpu", quant_config=quant)


def test_mxfp4_checkpoint_refuses_another_quantization(tiny):
    from ferrox.layers.quant.config import resolve_quant_config

    spec = load_model_spec(resolve_model(tiny[1]))
    assert resolve_quant_config(None, spec) is None  # read by gpt_oss.py (kept MXFP4 on Triton, else dequantized)
    with pytest.raises(UnsupportedModelError, match="nothing else applies"):
        resolve_quant_config("fp8", spec)


def test_mxfp4_experts_are_dequantized_on_the_torch_kernels(tiny):
    """On CPU (the torch loop) the experts load dequantized into float parameters, no packed tensors."""
    experts = tiny[2].model.layers[0].mlp.experts
    quantized = _load(tiny[1]).model.layers[0].mlp.experts
    assert quantized.weight_method is None and quantized.w13.dtype == torch.float32
    assert torch.equal(quantized.w13, experts.w13) and torch.equal(quantized.w2, experts.w2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_mxfp4_experts_stay_packed_and_match_dequantized_ones(tiny):
    """On CUDA (the Triton kernels) the MXFP4 checkpoint's experts stay packed (4.25 bits a weight:
    w13 / w2 uint8 codes and E8M0 scales) and the engine matches the same weights loaded dequantized
    (the bf16-layout folder: the same values): float32 greedy tokens equal, bfloat16 first-token
    logprob close."""
    from ferrox import LLM, SamplingParams
    from ferrox.layers.quant.mxfp4_moe import Mxfp4MoeMethod

    folder, mxfp4, _, _ = tiny
    source = resolve_model(mxfp4)
    spec = spec_for_context(load_model_spec(source), CONTEXT)
    packed = load_model(source, spec, dtype=torch.bfloat16, device="cuda").model.layers[0].mlp.experts
    dense_source = resolve_model(folder)  # (its own spec: no quantization_config)
    dense = load_model(dense_source, spec_for_context(load_model_spec(dense_source), CONTEXT), dtype=torch.bfloat16,
                       device="cuda").model.layers[0].mlp.experts
    assert isinstance(packed.weight_method, Mxfp4MoeMethod) and packed.w13.dtype == torch.uint8
    e, hidden, inter = packed.num_experts, packed.hidden_size, packed.intermediate_size
    weights = 3 * e * hidden * inter  # gate, up and down
    packed_bytes = sum(t.nbytes for t in (packed.w13, packed.w2, packed.w13_scale, packed.w2_scale))
    assert packed_bytes == weights // 2 + weights // 32  # 4.25 bits a weight
    assert dense.w13.nbytes + dense.w2.nbytes == 2 * weights
    w13, w2 = packed.weight_method.dequantized(packed, torch.bfloat16)
    assert torch.equal(w13, dense.w13) and torch.equal(w2, dense.w2)

    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True)
    prompts = [*PROMPTS, [(13 * i + 4) % 300 + 3 for i in range(200)]]
    for dtype in ("float32", "bfloat16"):
        runs = []
        for model in (mxfp4, folder):
            llm = LLM(model=model, device="cuda", dtype=dtype, kv_cache_memory=256 << 20, max_model_len=CONTEXT)
            try:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                one = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)  # one-token decode
            finally:
                llm.engine.shutdown()
            runs.append([(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in (*outs, *one)])
        for i, ((tokens, lps), (want, want_lps)) in enumerate(zip(*runs, strict=True)):
            if dtype == "float32":
                assert tokens == want, (i, tokens, want)
            assert abs(lps[0][want[0]].logprob - want_lps[0][want[0]].logprob) < (1e-3 if dtype == "float32" else 0.1)


def test_mxfp4_pair_missing_its_scales_is_a_load_error(tiny):
    _, mxfp4, _, _ = tiny
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(mxfp4, "model.safetensors"))
    model = _load(mxfp4)
    dropped = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.experts.down_proj_scales"}
    with pytest.raises(ModelLoadError, match="down_proj_scales"):
        model.load_weights(dropped.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu_engine(tiny):
    """On CUDA (CUDA graphs, the Triton kernels' sinks and window, the fused MoE kernels' biases and clamped
    SwiGLU; the CUDA decode kernel and cuDNN step aside), from the MXFP4 checkpoint: float32 tokens equal the
    CPU engine's, batched and alone; bfloat16 close. A 200-token prompt takes the Triton prefill kernel."""
    from tests.models.conftest import assert_cuda_engine_matches_cpu

    prompts = [*PROMPTS, [(13 * i + 4) % 300 + 3 for i in range(200)]]
    assert_cuda_engine_matches_cpu(tiny[1], prompts, max_tokens=12, max_model_len=CONTEXT)


# openai/gpt-oss-20b's config.json as published (its keys and values), with the sizes cut down.
PUBLISHED = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 32, "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 4, "num_experts_per_tok": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "num_local_experts": 8, "output_router_logits": False,
    "pad_token_id": 199999, "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 300,
}


def test_published_config_is_read():
    from ferrox.layers.quant.config import resolve_quant_config
    from ferrox.loader.model_config import spec_from_hf_config
    from ferrox.models.gpt_oss import GptOssForCausalLM

    spec = spec_from_hf_config(PUBLISHED, "config.json")
    assert spec.max_position_embeddings == 131072 and spec.sliding_window == 128
    assert spec.moe is not None and (spec.moe.num_experts, spec.moe.num_experts_per_tok) == (8, 4)
    assert resolve_quant_config(None, spec) is None
    spec = spec_for_context(spec, 4096)
    model = GptOssForCausalLM(spec, torch.float32, "cpu")
    assert [layer.self_attn.window for layer in model.model.layers] == [128, 0, 128, 0]
    experts = model.model.layers[0].mlp.experts
    assert experts.activation is not None and (experts.activation.alpha, experts.activation.limit) == (1.702, 7.0)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_matches_one_rank(tiny, expert_parallel):
    """Two CPU ranks (gloo) from the MXFP4 checkpoint: attention and sinks by heads, experts by intermediate
    rows (the down bias on rank 0) or split 4 + 4; greedy tokens equal one rank's, logprobs to rounding."""
    from ferrox import LLM, SamplingParams

    def generate(tp: int):
        llm = LLM(model=tiny[1], dtype="float32", tensor_parallel_size=tp, kv_cache_memory=4 << 20,
                  max_num_batched_tokens=16, max_model_len=CONTEXT, enable_expert_parallel=expert_parallel)
        try:
            params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                               o.outputs[0].token_ids, strict=True)])
                for o in outs]

    for (tokens, lps), (want_tokens, want_lps) in zip(generate(2), generate(1), strict=True):
        assert tokens == want_tokens
        assert torch.allclose(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4)
