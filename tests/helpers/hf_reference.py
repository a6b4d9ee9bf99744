"""References for quantized-checkpoint tests: a transformers model (dequantized weights, fake-quantized
inputs: tests/helpers/int8_checkpoints.py, tests/models/test_fp8_quant.py) stepped the way the engine
steps one request, with a KV cache."""

from __future__ import annotations

import torch


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, one token per step after the prompt (a KV cache), as the
    engine steps a request that runs alone."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(new_tokens):
        lp = out.logits[0, -1].float().log_softmax(-1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


@torch.inference_mode()
def reference_forced(model, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    """The reference fed the engine's tokens: per step, its logprob of that token and its best logprob."""
    out = model(torch.tensor([prompt]), use_cache=True)
    chosen, best = [], []
    for token in tokens:
        lp = out.logits[0, -1].float().log_softmax(-1)
        chosen.append(float(lp[token]))
        best.append(float(lp.max()))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return chosen, best
