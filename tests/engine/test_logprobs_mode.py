"""vLLM's --logprobs-mode on the embedded model against transformers: raw_logits reports the model's
logits as they are; processed_logprobs the log-softmax of what the draw saw (here: a repetition
penalty over the prompt and the output so far, vLLM's rule)."""

from __future__ import annotations

import math

import pytest
import torch
from ferrox import LLM, SamplingParams

from tests.engine.conftest import TEST_KV_CACHE_MEMORY

PROMPT = "The capital of France is"
PENALTY = 1.5


def _penalized(row: torch.Tensor, seen: set[int]) -> torch.Tensor:
    row = row.clone()
    idx = torch.tensor(sorted(seen))
    vals = row[idx]
    row[idx] = torch.where(vals > 0, vals / PENALTY, vals * PENALTY)
    return row


# (raw_logits and processed_logits on crafted logits: tests/engine/test_sampler.py)
@pytest.mark.parametrize("mode", ["processed_logprobs"])
def test_logprobs_mode_matches_transformers(hf_model, mode):
    llm = LLM(dtype="float32", kv_cache_memory=TEST_KV_CACHE_MEMORY, max_model_len=1024, logprobs_mode=mode)
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True, repetition_penalty=PENALTY)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    sample = out.outputs[0]
    ids = out.prompt_token_ids + sample.token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    n = len(out.prompt_token_ids)
    for i, (tok, lps) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        row = logits[n - 1 + i]
        if mode == "processed_logprobs":
            row = torch.log_softmax(_penalized(row, set(ids[:n + i])), dim=-1)
        assert math.isclose(lps[tok].logprob, row[tok].item(), abs_tol=2e-3), (i, mode)
        assert lps[tok].rank == int((row > row[tok]).sum()) + 1  # processed: 1, the top of what greedy saw
        assert set(torch.topk(row, 2).indices.tolist()) <= set(lps)
