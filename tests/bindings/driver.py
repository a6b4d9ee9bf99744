"""A minimal engine loop over the Rust scheduler for the binding tests: the model is replaced by
a deterministic function of (request, position), so any lost or duplicated token shows up."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ferrox._core import FINISH_REASONS, Scheduler, SchedulerOutput, StepOutputs

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
    assert out.req_slots.dtype == np.int32 and out.req_slots.shape == (n,)
    assert len(out.req_ids) == n
    assert int(qsl[-1]) == out.num_tokens
    drafts, lsl = out.num_draft_tokens, out.logits_start_loc
    assert drafts.dtype == np.int32 and drafts.shape == (n,) and lsl.dtype == np.int32 and lsl.shape == (n + 1,)
    assert out.logits_indices.shape == (int(lsl[-1]),) and out.draft_token_ids.shape == (int(drafts.sum()),)
    draft_starts = np.concatenate([[0], np.cumsum(drafts)])
    for r in range(n):
        lo, hi = int(qsl[r]), int(qsl[r + 1])
        assert hi - lo == out.num_scheduled_tokens[r]
        assert out.seq_lens[r] == out.num_computed_tokens[r] + out.num_scheduled_tokens[r]
        pos = out.positions[lo:hi]
        assert list(pos) == list(range(int(out.num_computed_tokens[r]), int(out.seq_lens[r])))
        blocks = out.block_table[r]
        assert list(out.slot_mapping[lo:hi]) == [int(blocks[p // block_size]) * block_size + p % block_size for p in pos]
        # Logits at the last 1 + d positions (the verify positions); the drafts end the request's inputs.
        d = int(drafts[r])
        assert list(out.logits_indices[lsl[r] : lsl[r + 1]]) == list(range(hi - 1 - d, hi))
        assert list(out.input_ids[hi - d : hi]) == list(out.draft_token_ids[draft_starts[r] : draft_starts[r + 1]])
        used = -(-int(out.seq_lens[r]) // block_size)
        assert (blocks[:used] != 0).all() and (blocks[used:] == 0).all()


@dataclass
class Row:
    """One row of a StepOutputs, as the tests read it."""

    request_id: str
    slot: int
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None
    stop_reason: int | str | None
    num_output_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def rows(outs: StepOutputs) -> list[Row]:
    """The columns as one Row per request, after checking their shapes and dtypes agree."""
    n = len(outs)
    cols = dict(
        slots=(np.int32, (n,)),
        token_offsets=(np.int32, (n + 1,)),
        text_offsets=(np.int32, (n + 1,)),
        finish_reasons=(np.uint8, (n,)),
        num_output_tokens=(np.int32, (n,)),
        num_prompt_tokens=(np.int32, (n,)),
        num_cached_tokens=(np.int32, (n,)),
    )
    for name, (dtype, shape) in cols.items():
        arr = getattr(outs, name)
        assert arr.dtype == dtype and arr.shape == shape, (name, arr.dtype, arr.shape)
        assert getattr(outs, name) is arr  # made once, on first access
    toff, txt = outs.token_offsets, outs.text_offsets
    assert outs.token_ids.dtype == np.int32 and outs.token_ids.shape == (int(toff[-1]),)
    assert toff[0] == 0 and txt[0] == 0 and (np.diff(toff) >= 0).all() and (np.diff(txt) >= 0).all()
    assert int(txt[-1]) == len(outs.text)
    assert len(outs.req_ids) == n and outs.req_ids is outs.req_ids
    assert all(0 <= int(i) < n for i in outs.stop_reasons)
    return [
        Row(
            request_id=outs.req_ids[i],
            slot=int(outs.slots[i]),
            new_token_ids=outs.token_ids[toff[i] : toff[i + 1]].tolist(),
            text_delta=outs.text[txt[i] : txt[i + 1]],
            finish_reason=FINISH_REASONS[int(outs.finish_reasons[i])],
            stop_reason=outs.stop_reasons.get(i),
            num_output_tokens=int(outs.num_output_tokens[i]),
            num_prompt_tokens=int(outs.num_prompt_tokens[i]),
            num_cached_tokens=int(outs.num_cached_tokens[i]),
        )
        for i in range(n)
    ]


def run_step(
    sched: Scheduler, token_fn: TokenFn = default_token, block_size: int = 16
) -> tuple[SchedulerOutput, list[Row]]:
    out = sched.schedule()
    check_arrays(out, block_size)
    sampled = np.array(
        [token_fn(rid, int(out.seq_lens[i])) for i, rid in enumerate(out.req_ids)], dtype=np.int64
    )
    return out, rows(sched.update_from_output(sampled))


def run_to_completion(
    sched: Scheduler, token_fn: TokenFn = default_token, block_size: int = 16, max_steps: int = 10_000
) -> tuple[dict[str, list[int]], dict[str, str], dict[str, Row], list[SchedulerOutput]]:
    """Steps until idle; returns tokens and text per request, the final outputs, every step."""
    tokens: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    final: dict[str, Row] = {}
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
