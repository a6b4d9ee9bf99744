"""StructuredOutputManager: the engine's one object for constrained decoding.

Life of a constrained request, as the engine core drives it:
  submit(id, params)      compile in a thread pool (LRU cache by constraint text); the scheduler
                          holds the request back (add_request(..., wait_for_grammar=True)).
                          gate_token (a reasoning model's `</think>`): the grammar applies only
                          after the request samples that token; until then its rows are unmasked
  poll_ready()            once per step: ids whose matcher is ready -> scheduler.grammar_ready();
  take_failures()         ids whose constraint did not compile -> finish that request with an error
  fill_bitmask(ids, m)    before sampling: int32 allow-bits per batch row, or None (no constrained
                          row this step, so free batches pay nothing); with speculative drafts,
                          one row per verified position (the grammar walks each request's drafts)
  constrained_rows(ids, m), fill_rows(matchers, out)
                          the same for just the constrained rows, into a caller's buffer (the
                          pinned mask the device waits for: worker/mask_gate.py)
  in_background(fill)     run a fill on the manager's mask thread (llguidance releases the GIL), so
                          the engine's host work for the previous step overlaps it; until the
                          future is waited, only that thread touches the matchers
  apply_bitmask(l, b)     -inf on the disallowed logits, on the logits' device
  accept_tokens(ids, t)   after sampling: advance matchers by each request's kept token(s); True where
                          the grammar is complete, which the engine passes to
                          update_from_output(force_stop=...)
  free(ids)               on finish / abort

A request's thinking_token_budget (structured/thinking_budget.py) rides on the same machinery:
add_budget(id, budget) counts its kept tokens in accept_tokens, and once its thinking has used the
budget its next mask row allows `</think>` alone. Such a request counts as constrained only when a
forced row may be due, so budgeted requests cost the step nothing until then.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

import llguidance
import numpy as np
import numpy.typing as npt
import torch

from ferrox.structured.backend import GrammarText, compile_matcher, get_tokenizer, grammar_text
from ferrox.structured.bitmask import apply_token_bitmask, bitmask_words
from ferrox.structured.params import StructuredOutputsParams
from ferrox.structured.thinking_budget import ThinkingBudget, force_row

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        max_compile_workers: int = 2,
        cache_size: int = 256,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.tokenizer = get_tokenizer(tokenizer_json, vocab_size, eos_token_ids)
        self._compile_pool = cf.ThreadPoolExecutor(max_compile_workers, thread_name_prefix="ferrox-grammar")
        # Constraint key -> future of a matcher in its start state (the compiled grammar). Failed
        # compiles stay cached too: the same bad schema fails again without recompiling.
        self._compiled: OrderedDict[str, cf.Future[llguidance.LLMatcher]] = OrderedDict()
        self._cache_size = cache_size
        self._pending: dict[str, cf.Future[llguidance.LLMatcher]] = {}
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # Compiled, waiting for their gate token (a reasoning model still thinking): request id ->
        # (matcher, token). They count as constrained (is_constrained), so that a step whose mask
        # is filled after the previous step's tokens are accepted (async scheduling) sees a gate that
        # just opened; their rows stay all ones until it does.
        self._gated: dict[str, tuple[llguidance.LLMatcher, int]] = {}
        self._gates: dict[str, int] = {}  # request id -> gate token, until its grammar is compiled
        self._budgets: dict[str, ThinkingBudget] = {}  # request id -> its thinking_token_budget
        self._failures: list[tuple[str, str]] = []
        self._errors: dict[str, str] = {}  # request id -> matcher error seen in accept_tokens
        self._mask_executor = llguidance.LLExecutor()
        self._mask_thread = cf.ThreadPoolExecutor(1, thread_name_prefix="ferrox-mask")
        self._bitmask = self._allocate(16)
        self.cache_hits = 0
        self.cache_misses = 0

    # ---- compile -------------------------------------------------------------------------
    def submit(self, request_id: str, params: StructuredOutputsParams, gate_token: int | None = None) -> None:
        """Start compiling a request's constraint. Never raises for a bad constraint: the
        failure comes back from take_failures(), so the engine fails that request alone.
        gate_token: the constraint applies from the token after the request's first gate_token."""
        if request_id in self._pending or request_id in self._matchers or request_id in self._gated:
            raise ValueError(f"request_id: {request_id!r} already has a structured output constraint")
        try:
            text = grammar_text(params)
        except ValueError as e:
            self._failures.append((request_id, str(e)))
            return
        self._pending[request_id] = self._compiled_future(text)
        if gate_token is not None:
            self._gates[request_id] = int(gate_token)

    def add_budget(self, request_id: str, budget: ThinkingBudget) -> None:
        """Count a request's thinking against its thinking_token_budget (and force `</think>` when
        spent), beside or without a grammar."""
        if request_id in self._budgets:
            raise ValueError(f"request_id: {request_id!r} already has a thinking budget")
        self._budgets[request_id] = budget

    def _compiled_future(self, text: GrammarText) -> cf.Future[llguidance.LLMatcher]:
        future = self._compiled.get(text.key)
        if future is not None:
            self._compiled.move_to_end(text.key)
            self.cache_hits += 1
            return future
        self.cache_misses += 1
        future = self._compile_pool.submit(compile_matcher, self.tokenizer, text)
        self._compiled[text.key] = future
        while len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return future

    def poll_ready(self) -> list[str]:
        """Ids whose grammar became ready since the last call (give them to grammar_ready).
        Compile failures found on the way are queued for take_failures()."""
        ready: list[str] = []
        for request_id, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            error = future.exception()
            if error is not None:
                self._failures.append((request_id, str(error)))
                continue
            # The cached matcher is a start state shared by all requests with this constraint.
            matcher = future.result().deep_copy()
            gate = self._gates.pop(request_id, None)
            if gate is None:
                self._matchers[request_id] = matcher
            else:
                self._gated[request_id] = (matcher, gate)
            ready.append(request_id)
        return ready

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, message) of constraints that failed to compile; each reported once."""
        failures, self._failures = self._failures, []
        return failures

    def num_pending(self) -> int:
        return len(self._pending)

    def wait_for_pending(self, timeout: float) -> None:
        """Block until some pending compile finishes (for an engine with nothing else to run)."""
        if self._pending:
            cf.wait(list(self._pending.values()), timeout=timeout, return_when=cf.FIRST_COMPLETED)

    # ---- per step --------------------------------------------------------------------------
    def is_constrained(self, request_id: str) -> bool:
        """Whether the request's next row may need a mask. Asked before the step in flight's tokens
        are accepted, so a budget counts as due one token early."""
        if request_id in self._matchers or request_id in self._gated:
            return True
        budget = self._budgets.get(request_id)
        return budget is not None and budget.may_force_within(1)

    def has_active(self) -> bool:
        """Whether any request needs its kept tokens (accept_tokens)."""
        return bool(self._matchers) or bool(self._gated) or bool(self._budgets)

    def _forced(self, request_id: str) -> int | None:
        """The token a budget forces on the request's next row (a grammar, once it runs, rules instead)."""
        budget = self._budgets.get(request_id)
        if budget is None or request_id in self._matchers:
            return None
        return budget.forced_token()

    def is_gated(self, request_id: str) -> bool:
        """Compiled, but its grammar waits for the gate token (no mask on its rows yet)."""
        return request_id in self._gated

    def _allocate(self, rows: int) -> torch.Tensor:
        # Pinned when a GPU exists, so the copy to the logits' device can overlap.
        return torch.full(
            (rows, bitmask_words(self.vocab_size)),
            -1,
            dtype=torch.int32,
            pin_memory=torch.cuda.is_available(),
        )

    def fill_bitmask(
        self, req_ids: Sequence[str], sample_mask: npt.NDArray[np.bool_] | Sequence[bool] | None = None
    ) -> torch.Tensor | None:
        """int32 [num_reqs, ceil(vocab/32)] allow-bits in batch order, rows of unconstrained
        requests (and of partial prefill chunks, whose sample is dropped) all ones. None when no
        row is constrained. The tensor is a view of a reused buffer, valid until the next call."""
        rows = self.constrained_rows(req_ids, sample_mask)
        if not rows:
            return None
        if self._bitmask.shape[0] < len(req_ids):
            self._bitmask = self._allocate(max(len(req_ids), 2 * self._bitmask.shape[0]))
        bitmask = self._bitmask[: len(req_ids)]
        bitmask.fill_(-1)
        self._fill(rows, bitmask)
        return bitmask

    def _fill(self, rows: Sequence[tuple[llguidance.LLMatcher | int, int]], out: torch.Tensor) -> None:
        """Write each (matcher or forced token, row) entry's allow-bits into that row of `out`."""
        matchers = [(m, i) for m, i in rows if not isinstance(m, int)]
        if matchers:
            # The executor writes row i at data_ptr + i * row_bytes, in parallel over matchers.
            self._mask_executor.unsafe_compute_mask_ptr(matchers, out.data_ptr(), out.shape[1] * 4, out.shape[0])
        for token, i in rows:
            if isinstance(token, int):
                force_row(out[i], token)

    @property
    def mask_words(self) -> int:
        """int32 words per row of allow-bits."""
        return bitmask_words(self.vocab_size)

    def constrained_rows(
        self, req_ids: Sequence[str], sample_mask: npt.NDArray[np.bool_] | Sequence[bool] | None = None
    ) -> list[tuple[llguidance.LLMatcher | int, int]]:
        """(matcher, batch row) of each constrained row that samples this step, or (token, batch row)
        where a thinking budget forces that token. Taken on the engine's thread, so that a request
        freed while a fill runs does not change what the fill reads."""
        rows: list[tuple[llguidance.LLMatcher | int, int]] = []
        for i, request_id in enumerate(req_ids):
            if sample_mask is not None and not sample_mask[i]:
                continue
            matcher = self._matchers.get(request_id)
            if matcher is not None:
                rows.append((matcher, i))
            elif self._budgets and (forced := self._forced(request_id)) is not None:
                rows.append((forced, i))
        return rows

    def fill_rows(self, entries: Sequence[llguidance.LLMatcher | int], out: torch.Tensor) -> None:
        """Write entries[i]'s allow-bits (a matcher's mask, or a forced token alone) into row i of `out`
        (int32 [len(entries), words], e.g. pinned memory that the device reads next), in parallel
        over the matchers."""
        if out.dim() != 2 or out.shape[0] != len(entries) or out.shape[1] != self.mask_words \
                or out.dtype != torch.int32 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous int32 [{len(entries)}, {self.mask_words}], "
                             f"got {out.dtype} {tuple(out.shape)}")
        self._fill([(m, i) for i, m in enumerate(entries)], out)

    def in_background(self, fill: Callable[[], _T]) -> cf.Future[_T]:
        """Run `fill` (a fill_bitmask call) on the mask thread. The caller must wait for the future
        before the next accept_tokens or fill: the matchers are not locked."""
        return self._mask_thread.submit(fill)

    def fill_bitmask_with_drafts(self, req_ids: Sequence[str], sample_mask: npt.NDArray[np.bool_],
                                 num_drafts: npt.NDArray[np.int32],
                                 draft_token_ids: npt.NDArray[np.int64]) -> torch.Tensor | None:
        """Allow-bits for a step that verifies drafts: one row per verified position (request r has
        1 + num_drafts[r] rows, in batch order), or None when no row is constrained. A constrained
        request's row j is its grammar's mask after its first j drafts: the verifier then rejects a
        draft the grammar forbids (its probability is 0) and never keeps a token past it. The
        matcher walks the drafts the grammar accepts and is rolled back to where it was."""
        forced = {rid: token for rid in req_ids if self._budgets and (token := self._forced(rid)) is not None}
        if not forced and not any(rid in self._matchers for rid in req_ids):
            return None
        num_rows = int(len(req_ids) + num_drafts.sum())
        words = bitmask_words(self.vocab_size)
        bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
        row, first_draft = 0, 0
        for i, request_id in enumerate(req_ids):
            d = int(num_drafts[i])
            matcher = self._matchers.get(request_id)
            if request_id in forced and sample_mask[i]:
                # Budgeted requests take no drafts (d == 0): their one row allows the forced token.
                force_row(bitmask[row], forced[request_id])
            elif matcher is not None and sample_mask[i]:
                drafts = [int(t) for t in draft_token_ids[first_draft:first_draft + d]]
                valid = matcher.validate_tokens(drafts) if drafts else 0
                for j in range(valid + 1):
                    # Rows past the first forbidden draft keep all ones: the verifier never reaches them.
                    matcher.unsafe_compute_mask_ptr(bitmask[row + j].data_ptr(), words * 4)
                    if j < valid:
                        matcher.consume_token(drafts[j])
                if valid:
                    matcher.rollback(valid)
            row += 1 + d
            first_draft += d
        return bitmask

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place on logits [num_reqs, vocab] (any device); only constrained rows are touched."""
        apply_token_bitmask(logits, bitmask)

    def accept_tokens(
        self,
        req_ids: Sequence[str],
        sampled: npt.NDArray[np.int64] | Sequence[int],
        sample_mask: npt.NDArray[np.bool_] | Sequence[bool] | None = None,
        num_sampled: npt.NDArray[np.int32] | None = None,
    ) -> npt.NDArray[np.bool_]:
        """Advance each constrained request's matcher by its sampled token (or, with num_sampled from a
        step that verified drafts, by its num_sampled[i] tokens, flat in batch order). Returns force_stop
        [num_reqs]: True where the grammar is complete (nothing but EOS may follow) so the
        request ends with 'stop', or where the matcher broke (see error_for). Where the grammar
        completes before a request's last kept token, num_sampled[i] is lowered in place to the
        tokens up to that point (one-step decoding would have stopped there)."""
        force_stop = np.zeros(len(req_ids), dtype=np.bool_)
        counts = np.ones(len(req_ids), dtype=np.int64) if num_sampled is None else num_sampled.astype(np.int64)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        for i, request_id in enumerate(req_ids):
            if sample_mask is not None and not sample_mask[i]:
                continue
            budget = self._budgets.get(request_id)
            if budget is not None:
                for token in sampled[int(starts[i]):int(starts[i] + counts[i])]:
                    budget.accept(int(token))
            if request_id in self._gated:
                self._open_gate(i, request_id, sampled[int(starts[i]):int(starts[i] + counts[i])], num_sampled)
                continue
            matcher = self._matchers.get(request_id)
            if matcher is None:
                continue
            tokens = [int(t) for t in sampled[int(starts[i]):int(starts[i] + counts[i])]]
            for k, token in enumerate(tokens):
                if not matcher.consume_token(token):
                    # Only reachable when the mask was not applied (a bug) or a limit was hit; stop
                    # this request rather than let it produce output that breaks its constraint.
                    self._errors[request_id] = matcher.get_error() or "token rejected by the grammar"
                    logger.warning("structured output for %s stopped: %s", request_id, self._errors[request_id])
                    force_stop[i] = True
                    break
                if matcher.is_stopped():
                    force_stop[i] = True
                    if num_sampled is not None:
                        num_sampled[i] = k + 1
                    break
        return force_stop

    def _open_gate(self, row: int, request_id: str, tokens: Sequence[int] | npt.NDArray[np.int64],
                   num_sampled: npt.NDArray[np.int32] | None) -> None:
        """A gated request's kept tokens: at its gate token the grammar starts (the gate token itself is
        not the grammar's). Tokens kept after it in the same step (verified drafts) were sampled
        without the mask, so they are dropped; the next step samples under the grammar."""
        matcher, gate = self._gated[request_id]
        for k, token in enumerate(tokens):
            if int(token) == gate:
                del self._gated[request_id]
                self._matchers[request_id] = matcher
                if num_sampled is not None and k + 1 < int(num_sampled[row]):
                    num_sampled[row] = k + 1
                return

    def error_for(self, request_id: str) -> str | None:
        """The matcher error that force-stopped a request, if any."""
        return self._errors.get(request_id)

    def free(self, req_ids: Sequence[str]) -> None:
        for request_id in req_ids:
            self._matchers.pop(request_id, None)
            self._gated.pop(request_id, None)
            self._gates.pop(request_id, None)
            self._budgets.pop(request_id, None)
            self._pending.pop(request_id, None)
            self._errors.pop(request_id, None)

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_thread.shutdown(wait=True)
