"""Prompts given as input embeddings (vLLM's prompt_embeds, enable_prompt_embeds=True) on the real engine:
greedy tokens equal transformers' generate(inputs_embeds=...) and ferrox's own for the same token ids, in a
batch mixed with token prompts, through chunked prefill (a step budget smaller than the prompts); the same
embeddings reuse their cached prefix blocks and different ones of the same length do not; penalties count
generated tokens only (as transformers does without input_ids); the text families with their own embedding
scales (Granite, Gemma) match transformers' inputs_embeds too; bad tensors are refused naming prompt_embeds and leave the engine clean."""

from __future__ import annotations

import asyncio

import pytest
import torch
from ferrox import LLM, AsyncLLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.helpers import tiny_models
from tests.helpers.tiny_deepseek import make_tiny_deepseek
from tests.helpers.tiny_glm import make_tiny_glm4
from tests.helpers.tiny_gpt_oss import make_tiny_gpt_oss
from tests.helpers.tiny_models import make_tiny_llama

transformers = pytest.importorskip("transformers")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    # A step budget of 16 tokens: the 23- and 40-row prompts are cut across steps.
    llm = LLM(model=folder, dtype="float32", device="cpu", enable_prompt_embeds=True, max_model_len=256,
              max_num_batched_tokens=16, max_num_seqs=8, kv_cache_memory=16 << 20)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = ["The quick brown fox", "Paris is the capital of France. Berlin is the",
             "def add(a, b):\n    return a + b\nNumbers: 0 1 2 3 4 5 6 7 8 9 10 42 123 2024 3.14159 café"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return llm, hf, ids


def _embeds(hf, ids):
    with torch.no_grad():
        return hf.get_input_embeddings()(torch.tensor(ids))


def _hf_greedy(hf, embeds, **kwargs):
    with torch.no_grad():
        out = hf.generate(inputs_embeds=embeds.unsqueeze(0), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=0, **kwargs)
    return out[0, -MAX_TOKENS:].tolist()


def _greedy(**kwargs):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def test_embeddings_generate_what_transformers_and_token_ids_do(setup):
    llm, hf, ids = setup
    assert max(len(i) for i in ids) > 16  # chunked prefill cuts at least one prompt
    prompts = [{"prompt_embeds": _embeds(hf, i)} for i in ids] + [{"prompt_token_ids": i} for i in ids]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    by_embeds, by_ids = outs[:len(ids)], outs[len(ids):]
    for i, e, t in zip(ids, by_embeds, by_ids, strict=True):
        assert e.outputs[0].token_ids == t.outputs[0].token_ids
        assert e.outputs[0].token_ids == _hf_greedy(hf, _embeds(hf, i))
        assert e.prompt is None and len(e.prompt_token_ids) == len(i)
        assert e.outputs[0].text == t.outputs[0].text


def test_batched_3d_and_half_precision_tensors_are_taken(setup):
    llm, hf, ids = setup
    e = _embeds(hf, ids[0])
    flat, batched = llm.generate([{"prompt_embeds": e}, {"prompt_embeds": e.unsqueeze(0)}], _greedy(), use_tqdm=False)
    assert flat.outputs[0].token_ids == batched.outputs[0].token_ids
    (half,) = llm.generate([{"prompt_embeds": e.to(torch.bfloat16)}], _greedy(), use_tqdm=False)
    assert len(half.outputs[0].token_ids) == MAX_TOKENS


def test_n_samples_of_one_embeddings_prompt(setup):
    llm, hf, ids = setup
    e = _embeds(hf, ids[2])
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_embeds": e}], params, use_tqdm=False)
    (same,) = llm.generate([{"prompt_token_ids": ids[2]}], params, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in same.outputs]


def test_penalties_count_generated_tokens_only(setup):
    llm, hf, ids = setup
    e = _embeds(hf, ids[1])
    (out,) = llm.generate([{"prompt_embeds": e}], _greedy(repetition_penalty=1.8), use_tqdm=False)
    assert out.outputs[0].token_ids == _hf_greedy(hf, e, repetition_penalty=1.8)


def test_prefix_cache_is_shared_by_the_same_embeddings_only(setup):
    llm, hf, ids = setup
    e = _embeds(hf, ids[2])  # 40 rows: two full 16-token blocks
    stats = llm.engine.stats
    (first,) = llm.generate([{"prompt_embeds": e}], _greedy(), use_tqdm=False)
    before = stats()["prefix_cache_hits"]
    (again,) = llm.generate([{"prompt_embeds": e.clone()}], _greedy(), use_tqdm=False)
    assert stats()["prefix_cache_hits"] > before and again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    before = stats()["prefix_cache_hits"]
    other = e + 0.01 * torch.randn(e.shape, generator=torch.Generator().manual_seed(0))
    (different,) = llm.generate([{"prompt_embeds": other}], _greedy(), use_tqdm=False)
    # (its placeholder ids equal the first's: only the embeddings' hash keeps the blocks apart)
    assert stats()["prefix_cache_hits"] == before and different.num_cached_tokens == 0


@pytest.mark.parametrize(("tensor", "message"), [
    (torch.zeros(4, 32), "hidden size 32"),
    (torch.zeros(64), "2-D tensor"),
    (torch.zeros(0, 64), "empty"),
    (torch.ones(3, 64, dtype=torch.int64), "dtype must be"),
    (torch.full((3, 64), float("nan")), "NaN"),
    ([[0.0] * 64], "torch.Tensor"),
])
def test_bad_tensors_are_refused_naming_prompt_embeds(setup, tensor, message):
    llm, hf, ids = setup
    total = llm.engine.stats()["num_free_blocks"]
    with pytest.raises(InvalidArgumentError, match=message) as info:
        llm.generate([{"prompt_token_ids": ids[0]}, {"prompt_embeds": tensor}], _greedy(), use_tqdm=False)
    assert info.value.param == "prompt_embeds"
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats()["num_free_blocks"] == total
    (ok,) = llm.generate([{"prompt_embeds": _embeds(hf, ids[0])}], _greedy(), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == MAX_TOKENS


def test_prompt_embeds_beside_tokens_or_prompt_logprobs_are_refused(setup):
    llm, hf, ids = setup
    e = _embeds(hf, ids[0])
    with pytest.raises(InvalidArgumentError) as info:
        llm.generate([{"prompt_embeds": e, "prompt_token_ids": ids[0]}], _greedy(), use_tqdm=False)
    assert info.value.param == "prompt_embeds"
    with pytest.raises(InvalidArgumentError) as info:
        llm.generate([{"prompt_embeds": e}], _greedy(prompt_logprobs=1), use_tqdm=False)
    assert info.value.param == "prompt_logprobs"
    with pytest.raises(InvalidArgumentError, match="has 1000 tokens") as info:  # > max_model_len
        llm.generate([{"prompt_embeds": _embeds(hf, ids[0] * 100)}], _greedy(), use_tqdm=False)
    assert info.value.param == "prompt_embeds"


# Families whose embedding differs from a plain lookup: Granite multiplies inputs_embeds by embedding_multiplier
# after the lookup (ferrox folds it into its rows, so the rows sent get it); Gemma's get_input_embeddings()
# already scales by sqrt(hidden_size) (the rows are used as sent); the others as Llama. And the stacks of their
# own: the MoE stack (Qwen3-MoE), DeepSeek's latent attention, gpt-oss, GLM-4's sandwich norms.
FAMILIES = {
    "granite": tiny_models.make_tiny_granite, "gemma2": tiny_models.make_tiny_gemma2,
    "gemma3": tiny_models.make_tiny_gemma3, "qwen3": tiny_models.make_tiny_qwen3, "phi3": tiny_models.make_tiny_phi3,
    "qwen3_moe": tiny_models.make_tiny_qwen3_moe, "deepseek_v3": make_tiny_deepseek, "gpt_oss": make_tiny_gpt_oss,
    "glm4": make_tiny_glm4,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_families_match_transformers(tmp_path, family):
    folder = FAMILIES[family](tmp_path / family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", enable_prompt_embeds=True, max_model_len=128,
              kv_cache_memory=8 << 20, max_num_batched_tokens=8)
    ids = [5, 17, 33, 60, 7, 99, 120, 44, 3, 12, 250, 31]
    e = _embeds(hf, ids)
    by_embeds, by_ids = llm.generate([{"prompt_embeds": e}, {"prompt_token_ids": ids}], _greedy(), use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids == _hf_greedy(hf, e)


def test_async_engine_takes_tensors_and_refuses_bad_ones(setup, tmp_path):
    llm, hf, ids = setup
    e = _embeds(hf, ids[1])
    (want,) = llm.generate([{"prompt_embeds": e}], _greedy(), use_tqdm=False)
    folder = make_tiny_llama(tmp_path / "llama")
    engine = AsyncLLM(model=folder, dtype="float32", device="cpu", enable_prompt_embeds=True, max_model_len=256,
                      kv_cache_memory=16 << 20)

    async def run():
        good = [o async for o in engine.generate({"prompt_embeds": e}, _greedy(), "good")]
        with pytest.raises(ValueError, match="prompt_embeds: hidden size 8"):
            async for _ in engine.generate({"prompt_embeds": torch.zeros(2, 8)}, _greedy(), "bad"):
                pass
        return good[-1]

    try:
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_without_the_flag_embeddings_are_refused(setup, tmp_path):
    llm, hf, ids = setup
    plain = LLM(model=make_tiny_llama(tmp_path / "llama"), dtype="float32", device="cpu", max_model_len=128,
                kv_cache_memory=8 << 20)
    with pytest.raises(InvalidArgumentError, match="enable_prompt_embeds") as info:
        plain.generate([{"prompt_embeds": _embeds(hf, ids[0])}], _greedy(), use_tqdm=False)
    assert info.value.param == "prompt_embeds" and not plain.engine.has_unfinished_requests()


def test_start_up_refuses_what_cannot_take_embeddings(setup, tmp_path):
    folder = make_tiny_llama(tmp_path / "llama")
    with pytest.raises(ValueError, match="enable_prompt_embeds: not supported with speculative_config"):
        LLM(model=folder, dtype="float32", device="cpu", enable_prompt_embeds=True, max_model_len=128,
            kv_cache_memory=8 << 20, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                           "prompt_lookup_max": 2})
    vision = tiny_models.make_tiny_llava(tmp_path / "llava")
    with pytest.raises(ValueError, match="enable_prompt_embeds: not supported for LlavaForConditionalGeneration"):
        LLM(model=vision, dtype="float32", device="cpu", enable_prompt_embeds=True, max_model_len=128,
            kv_cache_memory=8 << 20)
