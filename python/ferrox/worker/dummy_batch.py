"""Dummy steps for memory profiling, kernel warm-up and CUDA-graph capture.

Every step the model runs outside serving is scheduled by a throwaway core `Scheduler` over the
fewest KV blocks that hold it (checked against the cache it will run on), so its arrays (slot
mapping, block table, query_start_loc, seq_lens, logits indices...) come from the same Rust code
as a real step's, and become attention metadata through the same `step_inputs.attention_metadata`.
Nothing here assembles metadata by hand.

    step = prefill_step(num_tokens=8192, num_seqs=256, block_size=16)
    scratch = allocate_kv_caches(spec, step.num_blocks, 16, dtype, device)
    t = upload_step(step.so, Uploader(device))
    hidden = model.forward(t.input_ids, t.positions, scratch, t.meta)

The throwaway scheduler has no tokenizer (requests are added with detokenize=False), prefix
caching off, and max_num_batched_tokens / max_num_seqs set so that the wanted step is scheduled
in one piece; each builder checks the step it got and raises RuntimeError if the core scheduled
something else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ferrox import _core
from ferrox.attention.metadata import AttentionMetadata
from ferrox.worker.step_inputs import Uploader, attention_metadata


@dataclass(frozen=True, slots=True)
class DummyStep:
    """A scheduled dummy step.

    so: the `ferrox._core.SchedulerOutput`, exactly as the core produced it.
    num_blocks: blocks (null block 0 included) of the scheduler that produced it, the smallest
        cache that holds the step: every slot and block id of the step lies below it. The size of
        a scratch cache for the step; any larger cache holds it too.
    prompt_so: decode_step only: the step that prefilled the decode requests' prompts (run it
        first to fill their context with real K/V; capture and warm-up do not need to).
    """

    so: Any
    num_blocks: int
    prompt_so: Any = None

    @property
    def block_ids(self) -> npt.NDArray[np.int64]:
        """The KV blocks the step's requests hold (sorted, null block excluded)."""
        table = np.asarray(self.so.block_table, dtype=np.int64)
        ids = np.unique(table)
        return ids[ids != 0]


@dataclass(slots=True)
class StepTensors:
    """What a forward pass needs from a scheduled step, on the model's device."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_reqs]: the rows of the forward's output to compute logits for


def upload_step(so: Any, upload: Uploader) -> StepTensors:
    """Move a scheduled step's arrays to the device, the way the model runner does for real steps."""
    return StepTensors(
        input_ids=upload("input_ids", so.input_ids),
        positions=upload("positions", so.positions),
        meta=attention_metadata(so, upload),
        logits_indices=upload("logits_indices", so.logits_indices),
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prefill_lengths(num_tokens: int, num_seqs: int) -> list[int]:
    """Prompt lengths of the dummy prefill: num_seqs (at most num_tokens) near-equal prompts
    totalling num_tokens, the remainder on the last one."""
    if num_tokens < 1 or num_seqs < 1:
        raise ValueError(f"a dummy prefill needs num_tokens >= 1 and num_seqs >= 1, got {num_tokens}, {num_seqs}")
    num_seqs = min(num_seqs, num_tokens)
    per_seq = num_tokens // num_seqs
    lens = [per_seq] * num_seqs
    lens[-1] += num_tokens - per_seq * num_seqs
    return lens


def _min_blocks(kv_lens: Sequence[int], block_size: int) -> int:
    """Blocks (null block included) a scheduler needs to hold requests of these KV lengths at once.
    Beyond the blocks themselves, the core accepts a prompt only when the whole cache holds more
    tokens than it (room for one output token), hence the second term."""
    held = sum(_cdiv(n, block_size) for n in kv_lens)
    return max(held, _cdiv(max(kv_lens) + 1, block_size)) + 1


def min_prefill_blocks(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """The smallest KV cache (blocks, null block included) `prefill_step` can use."""
    return _min_blocks(prefill_lengths(num_tokens, num_seqs), block_size)


def _context_lens(batch: int, context_len: int | Sequence[int]) -> list[int]:
    if batch < 1:
        raise ValueError(f"a dummy decode step needs batch >= 1, got {batch}")
    lens = [int(context_len)] * batch if isinstance(context_len, int) else [int(n) for n in context_len]
    if len(lens) != batch:
        raise ValueError(f"context_len has {len(lens)} entries for a batch of {batch}")
    if min(lens) < 2:
        raise ValueError(f"a dummy decode step needs context_len >= 2 (a prompt token and the new one), got {lens}")
    return lens


def min_decode_blocks(batch: int, context_len: int | Sequence[int], block_size: int) -> int:
    """The smallest KV cache (blocks, null block included) `decode_step` can use."""
    return _min_blocks(_context_lens(batch, context_len), block_size)


def _scheduler(num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
               max_num_batched_tokens: int) -> Any:
    return _core.Scheduler(
        num_blocks=num_blocks, max_model_len=max_model_len, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
    )


def _add(sched: Any, prompt_lens: Sequence[int], token_id: int, max_tokens: int) -> None:
    for i, n in enumerate(prompt_lens):
        sched.add_request(f"dummy-{i}", np.full(n, token_id, dtype=np.int64), max_tokens=max_tokens,
                          ignore_eos=True, detokenize=False)


def _check_blocks(num_blocks: int | None, needed: int, what: str) -> int:
    """The throwaway scheduler always gets the fewest blocks that hold the step (one over a real
    cache's million blocks would take ~0.1 s to build); its blocks then lie in
    any cache at least that large, which `num_blocks` (the cache the step will run on) must be."""
    if num_blocks is not None and num_blocks < needed:
        raise ValueError(f"num_blocks: a dummy {what} needs a KV cache of at least {needed} blocks, got {num_blocks}")
    return needed


def prefill_step(num_tokens: int, num_seqs: int, block_size: int, *, num_blocks: int | None = None,
                 token_id: int = 0) -> DummyStep:
    """One step that prefills min(num_seqs, num_tokens) fresh prompts totalling num_tokens tokens
    (`prefill_lengths`), all token `token_id`, from position 0.

    num_blocks: the block count (null block included) of the KV cache the step will run on, if
    any: checked to hold the step (ValueError otherwise). The step itself always uses the first
    `min_prefill_blocks` blocks (`DummyStep.num_blocks`)."""
    lens = prefill_lengths(num_tokens, num_seqs)
    needed = _check_blocks(num_blocks, _min_blocks(lens, block_size), "prefill")
    sched = _scheduler(needed, block_size, max_model_len=max(lens) + 1, max_num_seqs=len(lens),
                       max_num_batched_tokens=num_tokens)
    _add(sched, lens, token_id, max_tokens=1)
    so = sched.schedule()
    got = np.asarray(so.num_scheduled_tokens).tolist()
    if got != lens or list(so.num_computed_tokens) != [0] * len(lens):
        raise RuntimeError(f"the dummy prefill of prompts {lens} was scheduled as {got} tokens per request")
    return DummyStep(so, needed)


def decode_step(batch: int, context_len: int | Sequence[int], block_size: int, *, num_blocks: int | None = None,
                token_id: int = 0) -> DummyStep:
    """A decode-only step of `batch` requests: each computes one new token (query_len 1) and
    attends over context_len KV positions (its seq_len, the new token included; an int for every
    request, or one per request). The requests' prompts (context_len - 1 tokens of `token_id`) are
    scheduled first (`prompt_so`) and fed a sampled `token_id` through update_from_output; unless
    the caller runs `prompt_so` first, their KV slots hold whatever the cache holds.

    num_blocks: the block count (null block included) of the KV cache the step will run on, if
    any: checked to hold the step (ValueError otherwise). The step itself always uses the first
    `min_decode_blocks` blocks (`DummyStep.num_blocks`)."""
    lens = _context_lens(batch, context_len)
    needed = _check_blocks(num_blocks, _min_blocks(lens, block_size), "decode step")
    prompts = [n - 1 for n in lens]
    sched = _scheduler(needed, block_size, max_model_len=max(lens) + 1, max_num_seqs=batch,
                       max_num_batched_tokens=max(sum(prompts), batch))
    _add(sched, prompts, token_id, max_tokens=2)  # 2: the first sampled token does not finish it
    prefill = sched.schedule()
    if np.asarray(prefill.num_scheduled_tokens).tolist() != prompts:
        raise RuntimeError(f"the prompts {prompts} of a dummy decode step were not prefilled in one step")
    sched.update_from_output(np.full(prefill.num_reqs, token_id, dtype=np.int64))
    so = sched.schedule()
    if (so.num_reqs != batch or np.asarray(so.num_scheduled_tokens).tolist() != [1] * batch
            or np.asarray(so.seq_lens).tolist() != lens):
        raise RuntimeError(f"a dummy decode step of {batch} requests at context {lens} was scheduled as "
                           f"{so.num_reqs} requests with seq_lens {np.asarray(so.seq_lens).tolist()}")
    return DummyStep(so, needed, prefill)
