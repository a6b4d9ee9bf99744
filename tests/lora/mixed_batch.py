"""The MoE LoRA tests' mixed batch (base requests beside adapters' requests, greedy) and its reference: each
prompt's greedy tokens (cut at EOS) and their logprobs from the engine, and a transformers model's logprobs of the
same tokens (tests/lora/test_lora_moe_stacked.py, test_lora_moe_params.py, test_lora_moe_activations.py)."""

from __future__ import annotations

import torch
from ferrox import LLM, SamplingParams
from ferrox.lora.request import LoRARequest

from tests.helpers.tiny_models import EOS_TOKEN_ID
from tests.models.conftest import cut_at_eos


@torch.inference_mode()
def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """The model's logprob of each of `tokens` after `prompt` (float64 softmax)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def generate_mixed(llm: LLM, adapters: dict[str, LoRARequest], names: list[str], prompts: list[list[int]],
                   max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Request i: prompts[i % len(prompts)] under adapter names[i] (a name with no adapter: the base model), one
    batch; each one's greedy tokens cut at EOS and their logprobs."""
    batch = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(len(names))]
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0), use_tqdm=False,
                        lora_request=[adapters.get(n) for n in names])
    got = []
    for o in outs:
        tokens = cut_at_eos(list(o.outputs[0].token_ids), [EOS_TOKEN_ID])
        got.append((tokens, [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)]))
    return got
