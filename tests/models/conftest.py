"""Shared fixtures for model tests: the embedded SmolLM2 (ferrox and transformers, loaded once per
session), the tiny float Llama the quantized-checkpoint tests quantize (fp8, int8, block fp8; read
only), and a small transformers-reference greedy helper."""

from __future__ import annotations

import os

import pytest
import torch
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import ModelSource, resolve_model
from ferrox.loader.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def float_folder(tmp_path_factory) -> str:
    """A tiny float Llama folder (tiny_models.make_tiny_llama's defaults), built once per session;
    test modules that need another shape define their own."""
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("quant") / "float")


@pytest.fixture(scope="session")
def float_weights(float_folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(float_folder, "model.safetensors"))


@pytest.fixture(scope="session")
def smollm_source() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_source):
    return load_tokenizer(smollm_source)


@pytest.fixture(scope="session")
def smollm_model(smollm_source):
    spec = load_model_spec(smollm_source)
    return load_model(smollm_source, spec, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def hf_smollm(smollm_source):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(smollm_source.path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_source):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(smollm_source.path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate for one prompt (no padding, so no mask effects). Stops at
    EOS like transformers does; compare with `cut_at_eos` of ferrox's tokens."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0, top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt_ids):].tolist()


def cut_at_eos(tokens: list[int], eos_ids: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def hf_last_logits(model, prompt_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt_ids], device=model.device)).logits[0, -1].float()


def assert_greedy_and_logits_match(model, ref, prompts: list[list[int]], eos_ids: list[int], *, max_tokens: int = 10,
                                   tol: float = 1e-4, label: object = None) -> None:
    """The model's own forward over a paged cache (tests/helpers/driver.run_greedy) against transformers' `ref`:
    each prompt's last-position logits within tol, and its greedy tokens (to EOS) equal to transformers'."""
    from tests.helpers.driver import run_greedy

    ours, logits = run_greedy(model, prompts, max_tokens, block_size=16, return_prefill_logits=True)
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(logits[i], hf_last_logits(ref, ids), atol=tol, rtol=tol)
        assert cut_at_eos(ours[i], eos_ids) == hf_greedy(ref, ids, max_tokens), (label, i)


def assert_chunking_and_batching_keep_tokens(model, prompts: list[list[int]], alone: slice,
                                             prefill_chunk: int = 7) -> None:
    """Prefill chunks of prefill_chunk tokens over 8-token blocks, and prompts[alone] run without the others
    in 32-token blocks: the same greedy tokens as the whole batch in one-chunk prefills."""
    from tests.helpers.driver import run_greedy

    base = run_greedy(model, prompts, 6)
    assert run_greedy(model, prompts, 6, block_size=8, prefill_chunk=prefill_chunk) == base
    assert run_greedy(model, prompts[alone], 6, block_size=32) == base[alone]


def chunked_engine_outputs(folder: str, prompts: list[list[int]], *, max_tokens: int = 8, **llm_kwargs):
    """The real engine (Rust scheduler, paged KV, sampler) with a 16-token budget, so long prompts prefill in
    chunks: greedy outputs with logprobs=1 for assert_outputs_match_transformers."""
    from ferrox import LLM, SamplingParams

    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              **llm_kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def assert_outputs_match_transformers(ref, prompts: list[list[int]], outs, *, abs_tol: float = 1e-4) -> None:
    """Each engine output (greedy, logprobs=1) against transformers' model `ref` run over prompt + the output:
    every token its argmax, every sampled token's logprob within abs_tol."""
    import math

    for prompt, out in zip(prompts, outs, strict=True):
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        with torch.inference_mode():
            ref_lp = torch.log_softmax(ref(torch.tensor([prompt + ids])).logits[0].double(), dim=-1)
        assert ids == ref_lp[len(prompt) - 1:-1].argmax(-1).tolist()
        for i, (tok, lps) in enumerate(zip(ids, sample.logprobs, strict=True)):
            assert math.isclose(lps[tok].logprob, ref_lp[len(prompt) - 1 + i, tok].item(), abs_tol=abs_tol)


def assert_triton_kernel_set_matches(folder: str, ref, prompt: list[int], *, max_model_len: int = 256) -> None:
    """The GPU's op set (kernels="triton") on the CPU -- under TRITON_INTERPRET=1 -- with the windows served for
    max_model_len: the prompt's last logits and 3 greedy tokens against transformers."""
    from ferrox.loader.weights import iter_safetensors
    from ferrox.model_spec import spec_for_context
    from ferrox.models.registry import get_model_class

    from tests.helpers.driver import run_greedy
    from tests.helpers.tiny_models import EOS_TOKEN_ID

    spec = spec_for_context(load_model_spec(resolve_model(folder)), max_model_len)
    model = get_model_class([spec.architecture])(spec, torch.float32, "cpu", kernels="triton")
    model.load_weights(iter_safetensors(folder))
    model.finalize_weights()
    ours, logits = run_greedy(model, [prompt], 3, block_size=16, return_prefill_logits=True)
    torch.testing.assert_close(logits[0], hf_last_logits(ref, prompt), atol=1e-4, rtol=1e-4)
    assert cut_at_eos(ours[0], [EOS_TOKEN_ID]) == hf_greedy(ref, prompt, 3)


def assert_tensor_parallel_matches_one_rank(folder: str, prompts: list[list[int]], **llm_kwargs) -> None:
    """Two gloo rank processes generate what one rank does (greedy tokens, their logprobs within 1e-4), the long
    prompts prefilled in 16-token chunks; llm_kwargs go to the two-rank engine (enable_expert_parallel...)."""
    from ferrox import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(model=folder, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=8 << 20,
                  max_num_batched_tokens=16, max_model_len=256, **(llm_kwargs if tp > 1 else {}))
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        results.append([(list(o.outputs[0].token_ids),
                         [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)])
                        for o in outs])
    for (tokens, lps), (tp_tokens, tp_lps) in zip(*results, strict=True):
        assert tp_tokens == tokens
        assert torch.allclose(torch.tensor(tp_lps), torch.tensor(lps), atol=1e-4)


def assert_cuda_engine_matches_cpu(folder: str, prompts: list[list[int]], *, max_tokens: int,
                                   max_model_len: int, bf16_tokens: bool = True) -> None:
    """The engine on CUDA (CUDA graphs on) against the CPU float32 engine on the same folder, batched and one
    prompt at a time. float32: every greedy token equal, the first token's logprob within 1e-3. bfloat16: the
    tokens agree until a near-tie (vLLM's check_logprobs_close): where they first part, each side's token is
    among the other's top 5, so a rounding that flips two close logits passes and a wrong kernel does not;
    the first token's logprob within 0.1. GPU tests of model families call it. bf16_tokens False keeps only the
    first token's logprob check in bfloat16, for a family whose bf16 routing flips near-tied experts (a discrete
    change that no top-k bound follows); float32 still checks every token."""
    from ferrox import LLM, SamplingParams

    top = 5
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=top, ignore_eos=True)

    def generate(llm, batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]

    def close(got, want, what):
        (tokens, lps), (want_tokens, want_lps) = got, want
        for pos, (a, b) in enumerate(zip(tokens, want_tokens, strict=True) if bf16_tokens else ()):
            if a != b:
                assert a in want_lps[pos] and b in lps[pos], (what, pos, tokens, want_tokens)
                return
        token = want_tokens[0]
        assert abs(lps[0][token].logprob - want_lps[0][token].logprob) < 0.1, what

    cpu = LLM(model=folder, device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=max_model_len)
    try:
        want = generate(cpu, prompts)
    finally:
        cpu.engine.shutdown()
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=folder, device="cuda", dtype=dtype, kv_cache_memory=256 << 20, max_model_len=max_model_len)
        try:
            batched = generate(llm, prompts)
            alone = [generate(llm, [p])[0] for p in prompts]
        finally:
            llm.engine.shutdown()
        for i in range(len(prompts)):
            if dtype == "float32":
                assert batched[i][0] == want[i][0] and alone[i][0] == want[i][0], (dtype, i, batched[i][0], want[i][0])
                token = want[i][0][0]
                assert abs(batched[i][1][0][token].logprob - want[i][1][0][token].logprob) < 1e-3
            else:
                close(batched[i], want[i], (dtype, "batched", i))
                close(alone[i], want[i], (dtype, "alone", i))
