"""DeepSeek-V2 / V3 (models/deepseek_v2.py, models/mla_attention.py) against transformers on tiny random
checkpoints (tests/helpers/tiny_deepseek.py), float32 greedy: V2-Lite's shape (q_proj, greedy routing),
V2 (q LoRA, group-limited routing, DeepSeek's YaRN with mscale_all_dim), V3 (sigmoid routing with the
correction bias, renormalised and scaled weights, interleaved rotary) and V3 with rope_interleave false
and YaRN. The test driver checks prefill logits and tokens, chunked prefill and batching; the real engine
(Rust scheduler, paged latent cache) checks chunked prefill and prefix-cache hits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer
from ferrox.loader.weights import iter_safetensors
from ferrox.model_spec import ModelLoadError, UnsupportedModelError
from ferrox.models.deepseek_v2 import DeepseekMoe, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.helpers.tiny_deepseek import YARN, make_tiny_deepseek
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_greedy_and_logits_match,
    cut_at_eos,
    hf_greedy,
    hf_last_logits,
)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
]

BUILDERS = {
    "v2_lite": lambda d: make_tiny_deepseek(d, version=2, q_lora_rank=None, topk_method="greedy", seed=3),
    "v2": lambda d: make_tiny_deepseek(d, version=2, topk_method="group_limited_greedy", n_group=3, topk_group=2,
                                       routed_scaling_factor=2.0, rope_scaling=YARN, seed=4),
    "v3": lambda d: make_tiny_deepseek(d, version=3, n_group=2, topk_group=1, routed_scaling_factor=2.5, seed=5),
    "v3_neox_yarn": lambda d: make_tiny_deepseek(d, version=3, rope_interleave=False, seed=6,
                                                 rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model), built once for the module."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("tiny_deepseek"), BUILDERS)


def _prompts(folder) -> list[list[int]]:
    tok = load_tokenizer(resolve_model(folder))
    return [tok.encode(t) for t in TEXTS] + [list(range(3, 70))]  # 67 tokens: several KV blocks


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    folder, model, ref = tiny[name]
    eos = load_tokenizer(resolve_model(folder)).eos_token_ids
    assert_greedy_and_logits_match(model, ref, _prompts(folder), eos, label=name)


@pytest.mark.parametrize("name", ["v2_lite", "v3"])
def test_chunked_prefill_and_batching_do_not_change_tokens(tiny, name):
    folder, model, _ = tiny[name]
    assert_chunking_and_batching_keep_tokens(model, _prompts(folder), alone=slice(1, 2))


def test_layers_and_cache_follow_the_config(tiny):
    folder, v3, _ = tiny["v3"]
    spec = load_model_spec(resolve_model(folder))
    assert (spec.num_kv_heads, spec.head_dim) == (1, 32 + 16)  # one latent row a token: [c_kv | k_pe]
    # ... in one plane (the value is the latent): half the bytes of a K and a V plane.
    from ferrox.attention.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block

    assert spec.kv_planes == 1 and allocate_kv_caches(spec, 3, 8, torch.float32, "cpu")[0].shape == (1, 3, 8, 1, 48)
    assert kv_cache_bytes_per_block(spec, 8, torch.float32) == 8 * 48 * 4 * spec.num_layers
    sparse = [isinstance(layer.mlp, DeepseekMoe) for layer in v3.model.layers]
    assert sparse == [False, True, True]  # first_k_dense_replace 1
    moe = v3.model.layers[1].mlp.moe
    assert (moe.scoring_func, moe.correction_bias, moe.num_expert_group, moe.topk_group, moe.renormalize) == (
        "sigmoid", True, 2, 1, True)
    assert v3.mla.interleaved and not tiny["v3_neox_yarn"][1].mla.interleaved
    attn = v3.model.layers[0].self_attn
    assert attn.w_uk is not None and tuple(attn.w_uk.shape) == (4, 16, 32)  # [H, nope, rank]
    assert attn.w_uv is not None and tuple(attn.w_uv.shape) == (4, 32, 24)  # [H, rank, v]
    assert attn.kv_b_proj.weight.numel() == 0  # absorbed, then freed
    lite = tiny["v2_lite"][1]
    assert lite.model.layers[0].self_attn.q_proj is not None and lite.model.layers[1].mlp.moe.num_expert_group == 1


def test_mtp_layers_are_skipped_and_missing_tensors_are_errors(tiny):
    folder = tiny["v3"][0]
    model = _build(folder)  # (a fresh one: loading absorbed and freed the shared model's kv_b_proj)
    tensors = dict(iter_safetensors(folder))
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128),  # V3's multi-token prediction layer
           "model.layers.3.self_attn.kv_b_proj.weight": tensors["model.layers.0.self_attn.kv_b_proj.weight"]}
    gone = "model.layers.2.mlp.gate.e_score_correction_bias"
    with pytest.raises(ModelLoadError, match="missing 1 tensor.*e_score_correction_bias"):
        model.load_weights((k, v) for k, v in {**tensors, **mtp}.items() if k != gone)
    with pytest.raises(ModelLoadError, match="does not use.*model.layers.1.mlp.gate.bogus"):
        model.load_weights({**tensors, "model.layers.1.mlp.gate.bogus": torch.zeros(1)}.items())
    model.load_weights({**tensors, **mtp}.items())
    with pytest.raises(ModelLoadError, match=r"does not use.*model\.layers\.3\."):  # V2 declares no MTP layer
        _build(tiny["v2"][0]).load_weights({**dict(iter_safetensors(tiny["v2"][0])), **mtp}.items())


def _build(folder, **changes):
    """The model class of a tiny folder's config.json with fields changed (built, not loaded)."""
    spec = load_model_spec(resolve_model(folder))
    spec = spec_from_hf_config({**spec.hf_config, **changes}, "config.json")
    cls = DeepseekV2ForCausalLM if spec.architecture == "DeepseekV2ForCausalLM" else DeepseekV3ForCausalLM
    return cls(dataclasses.replace(spec), torch.float32, "cpu")


@pytest.mark.parametrize("name,changes,error", [
    ("v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ("v2", {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
    ("v2", {"rope_interleave": False}, "rope_interleave"),
    ("v3", {"topk_method": "greedy"}, "topk_method 'greedy'"),
    ("v3", {"num_key_value_heads": 2}, "num_key_value_heads 2"),
    ("v3", {"ep_size": 8}, "ep_size"),
    ("v3", {"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_config_fields_are_refused_by_name(tiny, name, changes, error):
    with pytest.raises(UnsupportedModelError, match=error):
        _build(tiny[name][0], **changes)


def test_moe_layer_freq_places_the_sparse_layers(tiny):
    model = _build(tiny["v3"][0], num_hidden_layers=5, moe_layer_freq=2)
    assert [isinstance(layer.mlp, DeepseekMoe) for layer in model.model.layers] == [False, False, True, False, True]


def test_engine_chunked_prefill_and_prefix_cache_match_transformers(tiny):
    """The real engine with a 16-token budget (every prompt prefilled in chunks) and 8-token blocks;
    the same prompts again hit the prefix cache and give the same tokens."""
    from ferrox import LLM, SamplingParams

    folder, _, ref = tiny["v3"]
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              max_model_len=256, block_size=8)
    try:
        prompts = _prompts(folder)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out, hit in zip(prompts, first, again, strict=True):
            with torch.inference_mode():
                want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, top_p=None,
                                    top_k=None, temperature=None)[0, len(prompt):].tolist()
            assert list(out.outputs[0].token_ids) == want
            assert list(hit.outputs[0].token_ids) == want
        assert again[-1].num_cached_tokens >= 64  # the 67-token prompt's full blocks
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def block_fp8(tiny, tmp_path_factory):
    """(folder, reference): the tiny V3 in DeepSeek-V3's published layout -- every projection (attention,
    dense and shared MLPs, experts) E4M3 with a scale per 32 x 32 block -- and transformers with those
    weights dequantized and each projection's input rounded through E4M3 per token and group
    (tests/helpers/fp8_moe_checkpoints.py), except kv_b_proj, which ferrox dequantizes and absorbs (its
    latent input is never quantized)."""
    from safetensors.torch import load_file

    from tests.helpers.fp8_block_checkpoints import dequantize_blocks, quantize_blocks
    from tests.helpers.fp8_moe_checkpoints import fp8_config, reference_model
    from tests.helpers.quant_checkpoints import write_checkpoint

    float_folder = tiny["v3"][0]
    tensors = {}
    for name, w in load_file(f"{float_folder}/model.safetensors").items():
        if name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            module = name.rsplit(".", 1)[0]
            tensors[name], tensors[f"{module}.weight_scale_inv"] = quantize_blocks(w, FP8_BLOCK)
        else:
            tensors[name] = w
    folder = write_checkpoint(float_folder, tmp_path_factory.mktemp("fp8"), fp8_config("block", FP8_BLOCK), tensors)
    reference = reference_model(float_folder, {k: v for k, v in tensors.items() if "kv_b_proj" not in k}, FP8_BLOCK,
                                "weight_scale_inv")
    for i, layer in enumerate(reference.model.layers):
        kv_b = f"model.layers.{i}.self_attn.kv_b_proj"
        layer.self_attn.kv_b_proj.weight.data = dequantize_blocks(tensors[f"{kv_b}.weight"],
                                                                  tensors[f"{kv_b}.weight_scale_inv"], FP8_BLOCK)
    return folder, reference


FP8_BLOCK = (32, 32)


def _follows_the_fp8_reference(folder, reference, device: str) -> None:
    from tests.helpers.quant_checkpoints import load_checkpoint

    model = load_checkpoint(folder, device=device)
    attn = model.model.layers[1].self_attn
    assert attn.q_b_proj.quant is not None and attn.o_proj.quant is not None
    assert model.model.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    # W_UK: each head's first qk_nope_head_dim rows of the dequantized kv_b_proj (16 of its 16 + 24).
    w = reference.model.layers[1].self_attn.kv_b_proj.weight
    torch.testing.assert_close(attn.w_uk.cpu(), w.view(4, 40, 32)[:, :16])
    prompts = _prompts(folder)[1:]  # (the reference's experts run a token at a time: keep it short)
    ours, logits = run_greedy(model, prompts, 6, return_prefill_logits=True)
    eos = load_tokenizer(resolve_model(folder)).eos_token_ids
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(logits[i].cpu(), hf_last_logits(reference, ids), atol=1e-3, rtol=1e-3)
        assert cut_at_eos(ours[i], eos) == hf_greedy(reference, ids, 6), i


def test_block_fp8_checkpoint_matches_the_fake_quantized_reference(block_fp8):
    _follows_the_fp8_reference(*block_fp8, "cpu")


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_cuda_engine_matches_cpu_engine(tiny, name):
    """On CUDA: the Triton MLA kernels over the latent cache (kernels/mla_attention.py) with the decode and
    piecewise CUDA graphs, the Triton norms, rotary (in place on q_pe / k_pe views) and fused MoE kernels
    (grouped_topk's ids); float32 tokens equal the CPU engine's (torch backend), batched and alone; bfloat16
    close. A 200-token prompt too."""
    from tests.models.conftest import assert_cuda_engine_matches_cpu

    prompts = [*_prompts(tiny[name][0]), [(13 * i + 4) % 300 + 3 for i in range(200)]]
    # V3 in bf16: its sigmoid router with a random correction bias flips near-tied experts (the 200-token prompt's
    # second token parted from the CPU's top 10 on an H100, the same with the torch and the Triton attention), so
    # only its first token's logprob is compared in bf16; V2 and every float32 token are compared in full.
    assert_cuda_engine_matches_cpu(tiny[name][0], prompts, max_tokens=12, max_model_len=256,
                                   bf16_tokens=name != "v3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_block_fp8_follows_the_reference(block_fp8):
    """The FP8 block GEMM, one-token products and FP8 expert kernels, kv_b_proj dequantized on the GPU, with
    the GPU FP8 tests' rule (tests/helpers/quant_checkpoints.py assert_follows_reference: the GPU's float32
    differs from the CPU's by ~1e-6, enough to move a quantized input code, so logits are not compared to
    1e-3 as on the CPU; its first run found them within ~0.1)."""
    from tests.helpers.quant_checkpoints import assert_follows_reference, engine_greedy, make_llm

    folder, reference = block_fp8
    prompts = _prompts(folder)[1:]
    for prompt, (tokens, logprobs) in zip(prompts, engine_greedy(make_llm(folder, device="cuda", dtype="float32"),
                                                                 prompts, 6), strict=True):
        assert_follows_reference(reference, prompt, tokens, logprobs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_with_the_mla_kernels(tiny):
    """The Triton MLA backend keeps both kinds of CUDA graphs (decode, piecewise prefill); with them on and
    with enforce_eager the float32 greedy tokens are transformers' (chunked prefill over cached context:
    16-token budget)."""
    from ferrox import LLM, SamplingParams
    from ferrox.models.mla_attention import MlaTritonBackend

    folder, _, ref = tiny["v2_lite"]
    prompts = _prompts(folder)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [hf_greedy(ref, p, 8) for p in prompts]
    eos = load_tokenizer(resolve_model(folder)).eos_token_ids
    for eager in (False, True):
        llm = LLM(model=folder, device="cuda", dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=16,
                  max_num_seqs=4, max_model_len=256, block_size=16, enforce_eager=eager)
        try:
            assert isinstance(llm.engine.runner.forward.model.backend, MlaTritonBackend)
            if not eager:
                assert llm.engine.runner.graph_runner is not None, "CUDA graphs were not captured"
                assert llm.engine.runner.forward.piece_runner is not None, "piecewise graphs were not captured"
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert [cut_at_eos(list(o.outputs[0].token_ids), eos) for o in outs] == want, eager
        finally:
            llm.engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_long_prefill_expanded_follows_the_absorbed_kernels(tmp_path, monkeypatch):
    """A tiny V2-Lite with DeepSeek's real head dims (nope 128, rope 64, v 128; latent 64) on CUDA in bf16: a
    1,500-token prompt in 600-token chunks, eager, so its first two chunks take the expanded FlashAttention-3
    path (kernels/mla_prefill.py; counted, with their cached contexts) and the 300-token last one stays
    absorbed; the first token's distribution agrees with the same engine with the path off."""
    from ferrox import LLM, SamplingParams
    from ferrox.kernels import mla_prefill

    if not mla_prefill.expanded_supported(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 192, 128):
        pytest.skip("the expanded MLA prefill needs an sm90 GPU and the fa3-fwd wheel")
    folder = make_tiny_deepseek(tmp_path / "v2", version=2, q_lora_rank=None, topk_method="greedy", seed=8,
                                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=64)
    contexts: list[int] = []
    real = mla_prefill.mla_prefill_request
    monkeypatch.setattr(mla_prefill, "mla_prefill_request", lambda *a: (contexts.append(a[5]), real(*a))[1])
    prompt = [(7 * i + 3) % 200 + 3 for i in range(1500)]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)

    def first_logprobs():
        llm = LLM(model=folder, device="cuda", dtype="bfloat16", kv_cache_memory=256 << 20, max_model_len=2048,
                  max_num_batched_tokens=600, enforce_eager=True)
        contexts.clear()  # (the warm-up's long steps take the path too)
        try:
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
            return {t: lp.logprob for t, lp in out.logprobs[0].items()}
        finally:
            llm.engine.shutdown()

    expanded = first_logprobs()
    assert sorted(set(contexts)) == [0, 600], contexts  # every layer, the first two chunks
    monkeypatch.setenv("FERROX_FA3_PREFILL", "0")
    absorbed = first_logprobs()
    assert contexts == []
    best = max(absorbed, key=absorbed.__getitem__)
    assert best in expanded and abs(expanded[best] - absorbed[best]) < 0.1, (expanded, absorbed)
