"""transformers (float32) as the reference for ferrox's FP8 KV cache.

- `prompt_logprobs_with_fp8_kv`: each layer's K (after rotary) and V rounded through FP8 E4M3 at that
  layer's scales before attention -- what an FP8 cache stores and reads back -- teacher-forced over a
  prompt's own tokens. A scale is a number, or a float32 [num_kv_heads] tensor (one per KV head: under
  tensor parallelism each rank has its own).
- `engine_prompt_logprobs`: the same teacher-forced log-probabilities from a ferrox engine (prompt_logprobs).
- `kv_head_maxima`: each layer's largest |k| and |v| per KV head over a prompt, as calculate_kv_scales'
  measuring pass meets them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Scale = float | torch.Tensor


def fake_fp8(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    """x [batch, heads, tokens, dim] as an FP8 cache at `scale` holds it, read back."""
    s = scale.to(x.dtype).view(1, -1, 1, 1) if isinstance(scale, torch.Tensor) else scale
    return (x / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * s


def engine_prompt_logprobs(llm: Any, prompts: Sequence[str]) -> list[torch.Tensor]:
    """Per prompt: a ferrox engine's log-probabilities of its tokens 1.. (prompt_logprobs, one step)."""
    from ferrox import SamplingParams

    out = []
    for o in llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False):
        ids = o.prompt_token_ids
        out.append(torch.tensor([o.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]))
    return out


def _model(folder: str, name: str, attention: Callable[..., Any]) -> Any:
    """The folder's transformers model with `attention` in place of sdpa (registered under `name`)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(name, attention)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=name)


def prompt_logprobs_with_fp8_kv(folder: str, prompts: Sequence[str], tokenizer: Any, k_scales: Sequence[Scale],
                                v_scales: Sequence[Scale]) -> list[torch.Tensor]:
    """Per prompt: the log-probabilities of its tokens 1.. with layer i's K / V at k_scales[i] / v_scales[i]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        i = module.layer_idx
        return sdpa_attention_forward(module, query, fake_fp8(key, k_scales[i]), fake_fp8(value, v_scales[i]),
                                      attention_mask, **kwargs)

    model = _model(folder, "ferrox_test_fp8_kv", attention)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            logprobs = model(ids).logits[0].float().log_softmax(-1)
            out.append(logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


def kv_head_maxima(folder: str, token_ids: Sequence[int], ranks: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (max |k|, max |v|) over the prompt's tokens, each float32 [num_kv_heads], as an engine's
    calculate_kv_scales pass meets them: each layer's K/V are then rounded through FP8 at the scales its
    maxima give (max / 200, max / 100 over each of `ranks` equal groups of KV heads: a tensor-parallel
    rank's), so a later layer sees the earlier layers' rounding, as in the engine's measuring step."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def per_rank(maxima: torch.Tensor, divisor: float) -> torch.Tensor:
        return maxima.view(ranks, -1).amax(dim=1).repeat_interleave(maxima.numel() // ranks) / divisor

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_max, v_max = key.abs().amax(dim=(0, 2, 3)), value.abs().amax(dim=(0, 2, 3))
        seen[module.layer_idx] = (k_max, v_max)
        key, value = fake_fp8(key, per_rank(k_max, 200.0)), fake_fp8(value, per_rank(v_max, 100.0))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    model = _model(folder, "ferrox_test_kv_maxima", attention)
    with torch.no_grad():
        model(torch.tensor([list(token_ids)]))
    return [seen[i] for i in range(len(seen))]
