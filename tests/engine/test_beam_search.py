"""LLM.beam_search (vLLM's algorithm over the engine's one-token steps, real Rust core and prefix cache)
against a beam search written here over transformers' full next-token distributions: the same beams
in the same order, the same cumulative logprobs; finished beams end at an EOS; limits named."""

from __future__ import annotations

import math

import pytest
import torch
from ferrox.errors import InvalidArgumentError
from ferrox.sampling_params import BeamSearchParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def reference_beam_search(hf_model, prompt_ids: list[int], width: int, max_tokens: int, eos: set[int],
                          length_penalty: float, ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """(tokens incl. the prompt, cumulative logprob) of the best `width`: every step each beam offers its
    2 * width most likely next tokens, an EOS among them finishes that candidate, the rest are ranked by
    cumulative logprob / length ** length_penalty (length with the prompt, less a final EOS)."""

    def score(tokens: list[int], cum: float) -> float:
        length = len(tokens) - (1 if tokens[-1] in eos else 0)
        return cum / length ** length_penalty

    beams: list[tuple[list[int], float]] = [(list(prompt_ids), 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            with torch.inference_mode():
                logits = hf_model(torch.tensor([tokens])).logits[0, -1].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logprobs, 2 * width)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                cand = ([*tokens, tok], cum + lp)
                (done if tok in eos and not ignore_eos else candidates).append(cand)
        beams = sorted(candidates, key=lambda c: score(*c), reverse=True)[:width]
    return sorted(done + beams, key=lambda c: score(*c), reverse=True)[:width]


@pytest.mark.parametrize(("width", "max_tokens", "length_penalty"), [(3, 6, 1.0), (2, 8, 0.5)])
def test_beams_match_a_reference_search_on_transformers(llm, hf_model, width, max_tokens, length_penalty):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt": p} for p in PROMPTS], params)
    tokenizer = llm.get_tokenizer()
    eos = set(llm.engine.eos_token_ids)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tokenizer.encode(prompt)
        want = reference_beam_search(hf_model, ids, width, max_tokens, eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want], prompt
        for seq, (_, cum) in zip(out.sequences, want, strict=True):
            assert math.isclose(seq.cum_logprob, cum, abs_tol=3e-3)
            assert seq.text == tokenizer.decode(seq.tokens)  # vLLM's offline shape: prompt and beam
            assert seq.finish_reason == ("stop" if seq.tokens[-1] in eos else "length")
            assert len(seq.logprobs) == len(seq.tokens) - len(ids)


def test_eos_finishes_a_beam(llm, hf_model):
    """A prompt whose continuation soon ends (a chat turn): finished beams carry the EOS and "stop"."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n")
    eos = set(llm.engine.eos_token_ids)
    params = BeamSearchParams(beam_width=2, max_tokens=12)
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    want = reference_beam_search(hf_model, prompt, 2, 12, eos, 1.0)
    assert [s.tokens for s in out.sequences] == [w[0] for w in want]
    finished = [s for s in out.sequences if s.finish_reason == "stop"]
    assert finished and all(s.tokens[-1] in eos and s.stop_reason == s.tokens[-1] for s in finished)
    # ignore_eos: EOS is a token like any other and every beam runs to max_tokens.
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=12,
                                                                               ignore_eos=True))
    want = reference_beam_search(hf_model, prompt, 2, 12, eos, 1.0, ignore_eos=True)
    assert [s.tokens for s in out.sequences] == [w[0] for w in want]
    assert all(len(s.tokens) == len(prompt) + 12 and s.finish_reason == "length" for s in out.sequences)


def test_limits_are_named(llm):
    with pytest.raises(InvalidArgumentError, match="beam_width: .* at most 10") as e:
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    assert e.value.param == "beam_width"
    with pytest.raises(InvalidArgumentError, match="max_tokens: prompts\\[0\\]: prompt") as e:
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=5000))
    with pytest.raises(InvalidArgumentError, match="beam_width: must be >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    with pytest.raises(InvalidArgumentError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=float("nan"))
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2)) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_beams_on_cuda_match_the_reference(tmp_path):
    """On the GPU's default configuration (async scheduling, CUDA-graph decode, the device sampler's
    logprobs) in float32: the same beams and scores as the reference search on transformers."""
    from ferrox import LLM
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_models import make_tiny_llama

    folder = make_tiny_llama(str(tmp_path / "llama"), hidden_size=128, num_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    llm = LLM(folder, device="cuda", dtype="float32", max_num_seqs=16, kv_cache_memory=64 << 20)
    assert llm.engine.async_scheduling  # the default on CUDA
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [100, 9]]
    eos = set(llm.engine.eos_token_ids)
    for width, max_tokens in ((3, 6), (4, 5)):
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs, strict=True):
            want = reference_beam_search(hf, prompt, width, max_tokens, eos, 1.0, ignore_eos=True)
            assert [s.tokens for s in out.sequences] == [w[0] for w in want], prompt
            for seq, (_, cum) in zip(out.sequences, want, strict=True):
                assert math.isclose(seq.cum_logprob, cum, abs_tol=2e-3)
