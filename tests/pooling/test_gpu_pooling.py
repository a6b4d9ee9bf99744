"""Pooling models on CUDA: a tiny BERT and a tiny Llama embedder (its Triton attention backend running
without a KV cache) against transformers on the same GPU in float32, and bfloat16 close to it. GPU only."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM

from tests.helpers import tiny_models
from tests.pooling.conftest import cosine, make_tiny_encoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TEXTS = ["the quick brown fox jumps over the lazy dog", "paris", "a man is eating food and hello world"]
PROMPTS = [list(range(3, 90)), [5, 9, 11], list(range(100, 140))]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("bert"), pooling="mean", normalize=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bert_on_cuda_matches_transformers(bert_folder, dtype):
    transformers = pytest.importorskip("transformers")
    llm = LLM(bert_folder, device="cuda", dtype=dtype)
    outs = llm.embed(TEXTS, use_tqdm=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(bert_folder)
    model = transformers.AutoModel.from_pretrained(bert_folder, dtype=torch.float32).to("cuda").eval()
    ref = _reference(tokenizer, model, TEXTS)
    for out, expected in zip(outs, ref, strict=True):
        if dtype == "float32":
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-4, rtol=1e-3)
        else:
            assert cosine(out.outputs.embedding, expected) >= 0.99


def test_score_on_cuda_is_the_cosine_of_transformers_embeddings(bert_folder):
    """LLM.score on the GPU (1:N and N:N) against the cosine similarity of transformers' embeddings."""
    transformers = pytest.importorskip("transformers")
    llm = LLM(bert_folder, device="cuda", dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(bert_folder)
    model = transformers.AutoModel.from_pretrained(bert_folder, dtype=torch.float32).to("cuda").eval()
    ref = _reference(tokenizer, model, TEXTS)
    one_to_many = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS, use_tqdm=False)]
    pairwise = [o.outputs.score for o in llm.score(TEXTS, TEXTS[::-1], use_tqdm=False)]
    want_1n = [float(ref[0] @ ref[j]) for j in range(len(TEXTS))]
    want_nn = [float(ref[i] @ ref[len(TEXTS) - 1 - i]) for i in range(len(TEXTS))]
    assert one_to_many == pytest.approx(want_1n, abs=1e-4)
    assert pairwise == pytest.approx(want_nn, abs=1e-4)


def _reference(tokenizer, model, texts):
    """Mean pooling + normalisation (sentence-transformers' computation) on the GPU, in float32."""
    batch = tokenizer(texts, padding=True, return_tensors="pt").to("cuda")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).cpu()


def test_llama_embedder_on_cuda_without_a_kv_cache(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tiny_models.make_tiny_llama(tmp_path / "llama", hidden_size=128, num_heads=4, num_kv_heads=2)
    llm = LLM(folder, runner="pooling", device="cuda", dtype="float32")
    assert llm.engine.runner.kv_caches[0].numel() == 0
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    for ids, out in zip(PROMPTS, outs, strict=True):
        with torch.inference_mode():
            last = ref(torch.tensor([ids], device="cuda"), output_hidden_states=True).hidden_states[-1][0, -1]
        expected = torch.nn.functional.normalize(last, dim=-1).cpu()
        torch.testing.assert_close(torch.from_numpy(out.outputs.data), expected, atol=1e-4, rtol=1e-3)



def _cuda_kernels(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key.lower() for e in prof.key_averages()]


def test_bert_attention_builds_no_cudnn_plan_per_batch_shape(bert_folder):
    """Every embedding batch is a new (batch, padded length): on Hopper torch picks cuDNN for masked
    attention and builds a plan per shape (~40 ms a first call, measured on an H200). The encoder
    keeps to the memory-efficient kernel, so batches of new shapes launch no cuDNN kernel."""
    q = torch.randn(2, 4, 24, 32, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(24, device="cuda") < torch.tensor([[24], [7]], device="cuda"))[:, None, None, :]
    plain = _cuda_kernels(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    if not any("cudnn" in k for k in plain):
        pytest.skip(f"torch does not pick cuDNN for masked attention on this GPU: {plain}")
    llm = LLM(bert_folder, device="cuda", dtype="bfloat16")
    llm.embed(["warm up"], use_tqdm=False)
    batches = [TEXTS[:1], TEXTS, [t * 3 for t in TEXTS[1:]]]
    kernels = _cuda_kernels(lambda: [llm.embed(texts, use_tqdm=False) for texts in batches])
    assert kernels, "the profiler saw no CUDA kernel"
    assert not [k for k in kernels if "cudnn" in k], kernels


def test_reranker_from_lm_head_rows_on_cuda(tmp_path):
    """The original Qwen3-Reranker's conversion (pooling/seq_cls_conversion.py) on the CUDA engine: the
    score logit(true) - logit(false) of transformers' causal LM on the same GPU, and its sigmoid."""
    transformers = pytest.importorskip("transformers")
    tok = tiny_models.build_tokenizer()
    tokens = [tok.id_to_token(150), tok.id_to_token(151)]
    ids = [tok.token_to_id(t) for t in tokens]
    folder = tiny_models.make_tiny_qwen3(tmp_path / "qwen3", tie_word_embeddings=False, seed=4)
    llm = LLM(folder, device="cuda", dtype="float32", hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens,
        "is_original_qwen3_reranker": True})
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for ids_, out in zip(PROMPTS, outs, strict=True):
        with torch.inference_mode():
            logits = ref(torch.tensor([ids_], device="cuda")).logits[0, -1].float().cpu()
        expected = torch.sigmoid(logits[ids[1]] - logits[ids[0]])
        assert abs(out.outputs.probs[0] - float(expected)) < 2e-3, (out.outputs.probs, float(expected))
