"""A minimal engine loop over the Rust scheduler for the binding tests: the model is replaced by
a deterministic function of (request, position), so any lost or duplicated token shows up."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ferrox._core import RequestOutput, Scheduler, SchedulerOutput

TokenFn = Callable[[str, int], int]


def default_token(req_id: str, pos: int) -> int:
    return 10 + (sum(map(ord, req_id)) * 31 + pos * 7) % 500


def check_arrays(out: SchedulerOutput, block_size: int) -> None:
    """The flat arrays agree with each other (what the attention backend relies on)."""
    n = out.num_reqs
    qsl = out.query_start_loc
    assert qsl.dtype == np.int32 and out.seq_lens.dtype == np.int32 and out.input_ids.dtype == np.int64
    assert qsl.shape == (n + 1,) and out.input_ids.shape == (out.num_tokens,)
    assert out.block_table.shape[0] == n
    assert int(qsl[-1]) == out.num_tokens
    for r in range(n):
        lo, hi = int(qsl[r]), int(qsl[r + 1])
        assert hi - lo == out.num_scheduled_tokens[r]
        assert out.seq_lens[r] == out.num_computed_tokens[r] + out.num_scheduled_tokens[r]
        pos = out.positions[lo:hi]
        assert list(pos) == list(range(int(out.num_computed_tokens[r]), int(out.seq_lens[r])))
        blocks = out.block_table[r]
        assert list(out.slot_mapping[lo:hi]) == [int(blocks[p // block_size]) * block_size + p % block_size for p in pos]
        assert out.logits_indices[r] == hi - 1
        used = -(-int(out.seq_lens[r]) // block_size)
        assert (blocks[:used] != 0).all() and (blocks[used:] == 0).all()


def run_step(
    sched: Scheduler, token_fn: TokenFn = default_token, block_size: int = 16
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    out = sched.schedule()
    check_arrays(out, block_size)
    sampled = np.array(
        [token_fn(rid, int(out.seq_lens[i])) for i, rid in enumerate(out.req_ids)], dtype=np.int64
    )
    return out, sched.update_from_output(sampled)


def run_to_completion(
    sched: Scheduler, token_fn: TokenFn = default_token, block_size: int = 16, max_steps: int = 10_000
) -> tuple[dict[str, list[int]], dict[str, str], dict[str, RequestOutput], list[SchedulerOutput]]:
    """Steps until idle; returns tokens and text per request, the final outputs, every step."""
    tokens: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    final: dict[str, RequestOutput] = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out, res = run_step(sched, token_fn, block_size)
        steps.append(out)
        for o in res:
            assert o.request_id not in final, "output after finish"
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            text[o.request_id] = text.get(o.request_id, "") + o.text_delta
            if o.finished:
                final[o.request_id] = o
    else:
        raise AssertionError("scheduler did not drain")
    return tokens, text, final, steps
