"""The persistent input batch: per-request sampling state kept across steps, indexed by the Rust
core's request slot.

Each live request owns one row (its slot) of a few device tensors (temperature, top-k, top-p,
min-p, greedy) and of host flag arrays. Rows are written once when a request joins and left
alone until it leaves; a step gathers its rows with one `index_select` per parameter in use,
so a batch whose composition changes every step (continuous batching) costs the same as a
steady one, and the all-greedy batch costs nothing.

Rows that need per-request work (penalties, min_tokens, seeded generators, logit_bias,
allowed_token_ids) are flagged; only those are visited in Python each step.

Async scheduling: when step N+1 samples before step N's tokens reach the host, a row's last
token is still on the device. `InFlight` names those tokens, and penalty counts and min_tokens
counts add them on the device / by count, so such rows overlap like any other.

No host<->device copy here may block: while step N+1's forward pass is queued, a blocking copy
(`torch.tensor(..., device="cuda")`, a pageable `.to("cuda")`) would wait for it to finish and
serialize the host with the GPU. Per-step arrays go through `upload` (the runner's pinned,
non-blocking Uploader); per-request masks are built on the host and copied from pinned memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ferrox.layers.sampler import PenaltyInputs, SamplingMetadata, SeededDraws, seed_bits
from ferrox.sampling_params import SamplingParams
from ferrox.worker.penalty_rows import PenaltyRows, flat_indices
from ferrox.worker.request_state import PromptLogprobsAccumulator, RequestState

# (name, host array) -> the array on the device, without blocking (worker/step_inputs.Uploader).
Upload = Callable[[str, np.ndarray], torch.Tensor]


@dataclass(slots=True)
class InFlight:
    """The sampled tokens of a step not yet delivered to the host: row i of that step (slot
    `slots[i]`, sampled when `sample_mask[i]`) has its token at `token_ids[i]` on the device."""

    slots: npt.NDArray[np.int32]
    generations: npt.NDArray[np.int64]  # InputBatch.generation of each row's slot at launch
    sample_mask: npt.NDArray[np.bool_]
    token_ids: torch.Tensor

    def row_of_slot(self, generation: npt.NDArray[np.int64]) -> dict[int, int]:
        """slot -> row, for rows that sampled and whose slot still holds the same request (a slot
        freed by an abort may have been taken by a new request since)."""
        same = self.sample_mask & (generation[self.slots] == self.generations)
        return {int(self.slots[i]): int(i) for i in np.flatnonzero(same)}


class InputBatch:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device, capacity: int = 64,
                 upload: Upload | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        # Without an uploader (tests): plain copies, as the row-by-row error path uses too.
        self.upload: Upload = upload or self.plain_upload
        self.states: list[RequestState | None] = []
        self.penalties = PenaltyRows(vocab_size, device)
        self._cap = 0
        self._grow(capacity)

    def plain_upload(self, _name: str, array: np.ndarray) -> torch.Tensor:
        """A plain (possibly blocking) copy to the device, for paths that upload one name several
        times in a step (the pinned Uploader holds one array per name per step)."""
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    # ---- rows ------------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        old = self._cap
        dev = self.device

        def dev_col(prev: torch.Tensor | None, dtype: torch.dtype, fill: float) -> torch.Tensor:
            t = torch.full((capacity,), fill, dtype=dtype, device=dev)
            if prev is not None:
                t[:old] = prev
            return t

        def host_col(prev: np.ndarray | None, dtype: type, fill: int) -> np.ndarray:
            a: np.ndarray = np.full(capacity, fill, dtype=dtype)
            if prev is not None:
                a[:old] = prev
            return a

        g = getattr
        self.temperature = dev_col(g(self, "temperature", None), torch.float32, 1.0)
        self.top_k = dev_col(g(self, "top_k", None), torch.int64, self.vocab_size)
        self.top_p = dev_col(g(self, "top_p", None), torch.float32, 1.0)
        self.min_p = dev_col(g(self, "min_p", None), torch.float32, 0.0)
        self.greedy_dev = dev_col(g(self, "greedy_dev", None), torch.bool, True)
        self.greedy = host_col(g(self, "greedy", None), np.bool_, 1)
        self.uses_top_k = host_col(g(self, "uses_top_k", None), np.bool_, 0)
        self.top_k_host = host_col(g(self, "top_k_host", None), np.int64, 0)  # top_k's bound, known without a sync
        self.uses_top_p = host_col(g(self, "uses_top_p", None), np.bool_, 0)
        self.uses_min_p = host_col(g(self, "uses_min_p", None), np.bool_, 0)
        self.num_logprobs = host_col(g(self, "num_logprobs", None), np.int32, -1)
        # Rows whose alternatives are the request's logprob_token_ids rather than the top-N.
        self.names_logprob_ids = host_col(g(self, "names_logprob_ids", None), np.bool_, 0)
        self.wants_prompt_logprobs = host_col(g(self, "wants_prompt_logprobs", None), np.bool_, 0)
        # Rows that need a Python visit per step (see module docs).
        self.per_row_work = host_col(g(self, "per_row_work", None), np.bool_, 0)
        # Rows whose accepted-token count matters (penalties, min_tokens).
        self.counts_outputs = host_col(g(self, "counts_outputs", None), np.bool_, 0)
        # Bumped each time a slot is given to a request, so stale references to a slot are seen.
        self.generation = host_col(g(self, "generation", None), np.int64, 0)
        self.states.extend([None] * (capacity - old))
        self._cap = capacity

    def add(self, slot: int, req_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestState:
        if slot >= self._cap:
            self._grow(max(slot + 1, 2 * self._cap))
        if self.states[slot] is not None:
            raise RuntimeError(f"slot {slot} is still held by request {self.states[slot].req_id!r}")  # type: ignore[union-attr]
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids = self.eos_token_ids + [t for t in stop_ids if t not in self.eos_token_ids]
        state = RequestState(req_id, slot, prompt_token_ids, params, stop_ids)
        greedy = params.is_greedy
        if params.seed is not None and not greedy:
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed(params.seed)
        if state.has_penalties:
            state.penalty_row = self.penalties.acquire(prompt_token_ids)
        if params.allowed_token_ids:
            state.init_allowed_mask(self.vocab_size, self.device)
        state.init_bad_words()
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = PromptLogprobsAccumulator(num_top=params.prompt_logprobs)
        self.states[slot] = state
        self.generation[slot] += 1
        self.greedy[slot] = greedy
        # The device columns are written through one-element slices: `t[slot] = value` on a CUDA
        # tensor copies a host scalar and waits for the stream (the step in flight), a slice fills.
        row = slice(slot, slot + 1)
        self.greedy_dev[row] = greedy
        self.temperature[row] = 1.0 if greedy else params.temperature
        self.uses_top_k[slot] = params.top_k > 0
        top_k = min(params.top_k, self.vocab_size) if params.top_k > 0 else self.vocab_size
        self.top_k[row] = top_k
        self.top_k_host[slot] = top_k
        self.uses_top_p[slot] = params.top_p < 1.0
        self.top_p[row] = params.top_p
        self.uses_min_p[slot] = params.min_p > 0.0
        self.min_p[row] = params.min_p
        num_logprobs = params.num_logprobs
        self.num_logprobs[slot] = -1 if num_logprobs is None else num_logprobs
        self.names_logprob_ids[slot] = bool(params.logprob_token_ids)
        self.wants_prompt_logprobs[slot] = params.prompt_logprobs is not None
        min_tokens = params.min_tokens > 0 and bool(stop_ids)
        self.counts_outputs[slot] = state.has_penalties or min_tokens or bool(state.bad_sequences)
        self.per_row_work[slot] = (state.generator is not None or state.has_penalties or min_tokens
                                   or bool(params.logit_bias) or bool(params.allowed_token_ids)
                                   or bool(params.bad_words_token_ids))
        return state

    def remove(self, slots: list[int] | npt.NDArray[np.int32]) -> None:
        for slot in slots:
            s = int(slot)
            if s < self._cap:
                state = self.states[s]
                if state is not None and state.penalty_row is not None:
                    self.penalties.release(state.penalty_row)
                self.states[s] = None
                self.per_row_work[s] = False
                self.counts_outputs[s] = False
                self.num_logprobs[s] = -1
                self.names_logprob_ids[s] = False
                self.wants_prompt_logprobs[s] = False

    def append_accepted(self, slots: npt.NDArray[np.int32], token_ids: npt.NDArray[np.int32],
                        token_offsets: npt.NDArray[np.int32]) -> None:
        """Count the tokens the core accepted this step, for the rows that count them."""
        rows = np.flatnonzero(self.counts_outputs[slots])
        pen_rows: list[int] = []  # per accepted token of a penalty request: its PenaltyRows row
        pen_tokens: list[npt.NDArray[np.int32]] = []
        for i in rows.tolist():
            state = self.states[int(slots[i])]
            if state is None:
                continue
            toks = token_ids[token_offsets[i] : token_offsets[i + 1]]
            state.num_output_tokens += len(toks)
            if state.bad_sequences and len(toks):
                state.note_output(toks.tolist())
            if state.penalty_row is not None and len(toks):
                pen_rows.extend([state.penalty_row] * len(toks))
                pen_tokens.append(toks)
        if pen_rows:
            # One upload and one device-side add for every penalty request's tokens.
            where = flat_indices(np.array(pen_rows, dtype=np.int64), np.concatenate(pen_tokens), self.vocab_size)
            self.penalties.count(self.upload("accepted_tokens", where))

    # ---- one step --------------------------------------------------------------------------------
    def sampling_metadata(
        self,
        slots: npt.NDArray[np.int32],
        slots_dev: torch.Tensor,
        sample_mask: npt.NDArray[np.bool_],
        in_flight: InFlight | None,
        upload: Upload | None = None,
    ) -> SamplingMetadata:
        """The sampler's per-row inputs for a step whose rows are `slots` (batch order). upload:
        how per-step arrays reach the device (default: the batch's own)."""
        greedy = self.greedy[slots]
        md = SamplingMetadata(all_greedy=bool(greedy.all()))
        lp = self.num_logprobs[slots]
        if lp.size and lp.max() >= 0:
            named = self.names_logprob_ids[slots]
            top = lp[~named]
            md.max_num_logprobs = max(int(top.max()), 0) if top.size else 0
            if named.any():
                md.logprob_token_ids = (upload or self.upload)("logprob_token_ids", self._named_ids(slots, named))
        if not md.all_greedy:
            if greedy.any():
                md.greedy_rows = self.greedy_dev.index_select(0, slots_dev)
            md.temperature = self.temperature.index_select(0, slots_dev)
            uses_top_k = self.uses_top_k[slots]
            if uses_top_k.any():
                md.top_k = self.top_k.index_select(0, slots_dev)
                md.top_k_max = int(self.top_k_host[slots][uses_top_k].max())
            if self.uses_top_p[slots].any():
                md.top_p = self.top_p.index_select(0, slots_dev)
            if self.uses_min_p[slots].any():
                md.min_p = self.min_p.index_select(0, slots_dev)
        rows = np.flatnonzero(self.per_row_work[slots])
        if rows.size:
            self._per_row(md, rows.tolist(), slots, sample_mask, in_flight, upload or self.upload)
        return md

    @staticmethod
    def _bad_word_ban(state: RequestState, seq: list[int], row: int, in_flight_row: int | None,
                      ban_rows: list[int], ban_cols: list[int], maybe_bans: list[tuple[int, int, int, int]]) -> None:
        """Ban a bad word's last token on `row` when the output so far ends with its other tokens (vLLM:
        the output only, so not before it holds that many). The token sampled last may still be on the
        device (in_flight_row): then the host matches the rest and the device compares that one."""
        prefix, out = seq[:-1], state.recent_output
        if in_flight_row is None:
            if state.num_output_tokens >= len(prefix) and out[len(out) - len(prefix):] == prefix:
                ban_rows.append(row)
                ban_cols.append(seq[-1])
            return
        head = prefix[:-1]
        if state.num_output_tokens + 1 >= len(prefix) and out[len(out) - len(head):] == head:
            maybe_bans.append((row, seq[-1], prefix[-1], in_flight_row))

    def _named_ids(self, slots: npt.NDArray[np.int32], named: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
        """SamplingMetadata.logprob_token_ids for these rows: each naming row's ids, padded by repeating
        its first (a valid column the host drops); -1 across the others."""
        rows = np.flatnonzero(named).tolist()
        lists = [self.states[int(slots[i])].params.logprob_token_ids or [0] for i in rows]  # type: ignore[union-attr]
        out = np.full((len(slots), max(len(ids) for ids in lists)), -1, dtype=np.int64)
        for i, ids in zip(rows, lists, strict=True):
            out[i] = ids[0]
            out[i, : len(ids)] = ids
        return out

    def _per_row(self, md: SamplingMetadata, rows: list[int], slots: npt.NDArray[np.int32],
                 sample_mask: npt.NDArray[np.bool_], in_flight: InFlight | None, upload: Upload) -> None:
        states = [self.states[int(slots[i])] for i in rows]
        pending = in_flight.row_of_slot(self.generation) if in_flight is not None else {}
        pen_rows: list[int] = []
        pen_states: list[RequestState] = []
        pen_pending: list[tuple[int, int]] = []  # (index among penalty rows, row in the in-flight step)
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        # Bans that hang on the in-flight token (a bad word whose next-to-last token is it): (row, token
        # banned, the in-flight token that bans it, its row in the in-flight step).
        maybe_bans: list[tuple[int, int, int, int]] = []
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        allowed_rows: list[int] = []
        allowed_masks: list[torch.Tensor] = []
        seeded: list[tuple[int, int, int]] = []  # (row, seed bits, steps sampled before)
        for i, state in zip(rows, states, strict=True):
            if state is None:
                continue
            params = state.params
            if state.generator is not None and sample_mask[i]:
                md.generators[i] = state.generator
                seeded.append((i, seed_bits(params.seed or 0), state.draws))
                state.draws += 1
            in_flight_row = pending.get(state.slot)
            if state.has_penalties:
                if in_flight_row is not None:
                    pen_pending.append((len(pen_rows), in_flight_row))
                pen_rows.append(i)
                pen_states.append(state)
            if params.min_tokens > 0 and state.stop_ids_for_min_tokens:
                produced = state.num_output_tokens + (in_flight_row is not None)
                if produced < params.min_tokens:
                    ban_rows.extend([i] * len(state.stop_ids_for_min_tokens))
                    ban_cols.extend(state.stop_ids_for_min_tokens)
            if state.bad_tokens:
                ban_rows.extend([i] * len(state.bad_tokens))
                ban_cols.extend(state.bad_tokens)
            for seq in state.bad_sequences:
                self._bad_word_ban(state, seq, i, in_flight_row, ban_rows, ban_cols, maybe_bans)
            for tok, bias in (params.logit_bias or {}).items():
                bias_rows.append(i)
                bias_cols.append(tok)
                bias_vals.append(bias)
            if state.allowed_mask is not None:
                allowed_rows.append(i)
                allowed_masks.append(state.allowed_mask)
        if seeded and self.device.type == "cuda":
            # Three uploads, not one [3, S] array: each column then starts 16-byte aligned whatever
            # S is, so the kernel compiles one variant, in the warm-up.
            cols = np.array(seeded, dtype=np.int64).T
            md.seeded = SeededDraws(*(upload(f"seeded_{name}", np.ascontiguousarray(col))
                                      for name, col in zip(("rows", "seeds", "counters"), cols, strict=True)))
        if pen_rows:
            pool_rows = upload("pen_pool_rows", np.array([s.penalty_row for s in pen_states], dtype=np.int64))
            counts = self.penalties.counts.index_select(0, pool_rows)
            if pen_pending and in_flight is not None:
                # The in-flight tokens of these rows count too (module docstring), on the gathered copy.
                pairs = upload("pen_pending", np.array(pen_pending, dtype=np.int64))
                toks = in_flight.token_ids.index_select(0, pairs[:, 1])
                counts.view(-1).index_add_(0, pairs[:, 0] * self.vocab_size + toks, self.penalties.ones(len(pen_pending)))
            values = upload("pen_values", np.array(
                [[s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty]
                 for s in pen_states], dtype=np.float32))
            md.penalties = PenaltyInputs(
                rows=upload("pen_rows", np.array(pen_rows, dtype=np.int64)),
                prompt_mask=self.penalties.prompt_mask.index_select(0, pool_rows),
                output_counts=counts,
                repetition=values[:, 0],
                frequency=values[:, 1],
                presence=values[:, 2],
            )
        if ban_rows:
            ban = upload("ban", np.array([ban_rows, ban_cols], dtype=np.int64))
            md.banned = (ban[0], ban[1])
        if maybe_bans and in_flight is not None:
            rows_cols_prev_flight = upload("maybe_bans", np.array(maybe_bans, dtype=np.int64).T.copy())
            r, c, prev, flight = rows_cols_prev_flight
            md.banned_if = (r, c, in_flight.token_ids.index_select(0, flight).to(torch.int64) == prev)
        if bias_rows:
            where = upload("bias_idx", np.array([bias_rows, bias_cols], dtype=np.int64))
            md.logit_bias = (where[0], where[1], upload("bias_vals", np.array(bias_vals, dtype=np.float32)))
        if allowed_rows:
            md.allowed = (upload("allowed_rows", np.array(allowed_rows, dtype=np.int64)), torch.stack(allowed_masks))
