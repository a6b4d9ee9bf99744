"""Tiny random Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints written by transformers: ferrox's loader
(per-expert tensors stacked per layer) and MoE models against transformers on the same weights,
through the test driver and once through the whole engine with chunked prefill; on a GPU, one
prompt at a time, so decode steps take the fused one-token path (attention/fused_decode.py)."""

from __future__ import annotations

import math

import pytest
import torch
from ferrox.layers.fused_moe import FusedMoE
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer
from ferrox.loader.weights import iter_safetensors
from ferrox.model_spec import ModelLoadError
from ferrox.models.moe import MoeBlock

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_greedy_and_logits_match,
    cut_at_eos,
    hf_greedy,
)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 123 and 3.14159, unicode café 東京 🙂",
]

BUILDERS = {
    "qwen3_moe": lambda d: tiny_models.make_tiny_qwen3_moe(d, seed=11),
    "qwen2_moe": lambda d: tiny_models.make_tiny_qwen2_moe(d, seed=12),
    "mixtral": lambda d: tiny_models.make_tiny_mixtral(d, max_shard_size="100KB", seed=13),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model); built once for the module."""
    return tiny_models.models_with_references(tmp_path_factory.mktemp("tiny_moe"), BUILDERS)


def _prompts(folder) -> list[list[int]]:
    tok = load_tokenizer(resolve_model(folder))
    return [tok.encode(t) for t in TEXTS] + [list(range(3, 70))]  # 67 tokens: several KV blocks


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_and_logits_match_transformers(tiny, name):
    folder, model, ref = tiny[name]
    eos = load_tokenizer(resolve_model(folder)).eos_token_ids
    assert_greedy_and_logits_match(model, ref, _prompts(folder), eos, label=name)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_chunked_prefill_and_batching_do_not_change_tokens(tiny, name):
    folder, model, _ = tiny[name]
    assert_chunking_and_batching_keep_tokens(model, _prompts(folder), alone=slice(1, 2))


def test_layers_follow_the_config(tiny):
    qwen3 = tiny["qwen3_moe"][1]
    assert qwen3.spec.moe is not None and qwen3.spec.moe.mlp_only_layers == (1,)
    sparse = [isinstance(layer.mlp, MoeBlock) for layer in qwen3.model.layers]
    assert sparse == [True, False, True]  # mlp_only_layers=[1]
    assert qwen3.model.layers[0].mlp.renormalize and qwen3.model.layers[0].mlp.shared_expert is None
    qwen2 = tiny["qwen2_moe"][1]
    block = qwen2.model.layers[0].mlp
    assert not block.renormalize and block.shared_expert is not None  # norm_topk_prob false, shared expert
    assert qwen2.model.layers[0].self_attn.qkv_proj.bias is not None
    mixtral = tiny["mixtral"][1]
    assert mixtral.spec.moe is not None and mixtral.spec.moe.num_experts == 4  # from num_local_experts
    assert mixtral.model.layers[0].mlp.renormalize  # Mixtral always renormalises
    experts = mixtral.model.layers[1].mlp.experts
    assert isinstance(experts, FusedMoE) and tuple(experts.w13.shape) == (4, 2 * 48, 64)
    assert experts.w13.dtype == torch.float32 and mixtral.model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_stacked_experts_equal_the_checkpoint_tensors(tiny):
    folder, model, _ = tiny["mixtral"]
    tensors = dict(iter_safetensors(folder))
    experts = model.model.layers[1].mlp.experts
    prefix = "model.layers.1.block_sparse_moe.experts.2"
    assert torch.equal(experts.w13[2, :48], tensors[f"{prefix}.w1.weight"])  # gate rows first
    assert torch.equal(experts.w13[2, 48:], tensors[f"{prefix}.w3.weight"])  # then up
    assert torch.equal(experts.w2[2], tensors[f"{prefix}.w2.weight"])


def test_missing_or_misshapen_expert_is_a_load_error(tiny):
    folder, model, _ = tiny["qwen2_moe"]
    tensors = dict(iter_safetensors(folder))
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*experts shard 5\.up"):
        model.load_weights((k, v) for k, v in tensors.items() if k != gone)
    bad = dict(tensors)
    bad["model.layers.0.mlp.experts.1.down_proj.weight"] = bad["model.layers.0.mlp.experts.1.gate_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"experts\.1\.down_proj.*expert 1 down"):
        model.load_weights(bad.items())
    extra = dict(tensors, **{"model.layers.0.mlp.experts.6.up_proj.weight": tensors[gone]})
    with pytest.raises(ModelLoadError, match="out of range"):
        model.load_weights(extra.items())
    model.load_weights(tensors.items())  # leave the shared model as it was


def test_engine_chunked_prefill_matches_transformers(tiny):
    """The real engine (Rust scheduler, paged KV, sampler) with a 16-token budget: every prompt is
    prefilled in chunks; greedy tokens and their logprobs against transformers."""
    from ferrox import LLM, SamplingParams

    folder, _, ref = tiny["qwen2_moe"]
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              max_model_len=256)
    prompts = _prompts(folder)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        with torch.inference_mode():
            hf = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, top_p=None,
                              top_k=None, temperature=None)[0, len(prompt):].tolist()
            full = torch.tensor([prompt + ids])
            ref_lp = torch.log_softmax(ref(full).logits[0].double(), dim=-1)
        assert ids == hf
        for i, (tok, lps) in enumerate(zip(ids, sample.logprobs, strict=True)):
            assert math.isclose(lps[tok].logprob, ref_lp[len(prompt) - 1 + i, tok].item(), abs_tol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(BUILDERS))
def test_cuda_one_token_path_matches_transformers(tiny, name):
    from ferrox.attention.fused_decode import FusedOneTokenDecode

    folder, _, ref = tiny[name]
    source = resolve_model(folder)
    model = load_model(source, load_model_spec(source), dtype=torch.float32, device="cuda")
    path = model.model.decode_path
    assert isinstance(path, FusedOneTokenDecode) and path.layers is not None
    assert any(layer.moe is not None for layer in path.layers)
    eos = load_tokenizer(source).eos_token_ids
    for ids in _prompts(folder):
        ours = run_greedy(model, [ids], 10, block_size=16)[0]  # alone: every decode step has one token
        assert cut_at_eos(ours, eos) == hf_greedy(ref, ids, 10), (name, ids[:5])
