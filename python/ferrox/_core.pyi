"""Typed stubs of ferrox's native core (rust/py/*.rs). Checked in CI with mypy.stubtest.

The step contract: per engine step Python makes exactly one `Scheduler.schedule()` call and
one `Scheduler.update_from_output()` call. Bulk per-step data crosses as numpy arrays that
`torch.from_numpy` wraps without a copy; a step's results come back as one `StepOutputs` of
columns (no Python object per request). Requests are named by their slot (`add_request`'s
return value), a small integer the engine can index its own per-request state with. One optional
call more, with vLLM's --kv-events-config only: `take_kv_events()`, once a step.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__version__: str

# ---- exception tree (rust/error.rs) -------------------------------------------------------
class FerroxError(Exception):
    """Root of every error ferrox raises on purpose."""

    param: str | None
    """The request or configuration field at fault ("max_tokens", "stop" for "stop[2]",
    "prompt_token_ids", "request_id"), None when the error is about no one field."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None: ...

class InvalidArgumentError(FerroxError, ValueError):
    """A bad configuration value or request field (negative size, bad policy name, ...)."""

class DuplicateRequestError(InvalidArgumentError):
    """`add_request` with an id that is already live."""

class UnknownRequestError(FerroxError, KeyError):
    """An operation named a request id the scheduler does not hold."""

class PromptTooLongError(InvalidArgumentError):
    """A prompt (plus nothing else) that cannot fit in `max_model_len` or the whole KV cache."""

class TokenizerError(FerroxError):
    """tokenizer.json could not be parsed / a token id is outside the vocabulary."""

# ---- per-step data ------------------------------------------------------------------------
class SchedulerOutput:
    """Everything the model runner needs for one step. Requests appear in batch order."""

    @property
    def num_reqs(self) -> int: ...
    @property
    def num_tokens(self) -> int:
        """Total tokens scheduled this step (<= max_num_batched_tokens)."""
    @property
    def req_ids(self) -> list[str]:
        """Batch order: running requests first (in their running order), then newly scheduled ones.
        Built on first access; the same list after that (do not modify it)."""
    @property
    def req_slots(self) -> npt.NDArray[np.int32]:
        """[num_reqs] each request's slot (see Scheduler.add_request), batch order."""
    @property
    def new_req_ids(self) -> list[str]:
        """Requests scheduled for the first time (their KV starts at num_computed_tokens, which may be
        > 0 after a prefix-cache hit)."""
    @property
    def resumed_req_ids(self) -> list[str]:
        """Requests resumed after preemption (their KV is recomputed from num_computed_tokens)."""
    @property
    def finished_req_ids(self) -> list[str]:
        """Requests that finished or were aborted since the previous schedule(); the runner drops them
        before adding new_req_ids (a finished request's id may be reused by a new request)."""
    @property
    def preempted_req_ids(self) -> list[str]:
        """Requests preempted during this schedule() (back to waiting, blocks freed)."""
    @property
    def input_ids(self) -> npt.NDArray[np.int64]:
        """[num_tokens] token ids, request after request."""
    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """[num_tokens] absolute position of each token in its sequence."""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """[num_tokens] KV slot = block_id * block_size + offset where each token's K/V is written."""
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]:
        """[num_reqs + 1] prefix sum of num_scheduled_tokens."""
    @property
    def num_scheduled_tokens(self) -> npt.NDArray[np.int32]:
        """[num_reqs] tokens computed for each request this step."""
    @property
    def num_computed_tokens(self) -> npt.NDArray[np.int32]:
        """[num_reqs] tokens whose KV was already in the cache before this step."""
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]:
        """[num_reqs] num_computed_tokens + num_scheduled_tokens: KV length attention reads."""
    @property
    def block_table(self) -> npt.NDArray[np.int32]:
        """[num_reqs, max_blocks] block ids per request; padded with the null block (id 0)."""
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]:
        """[num_reqs + sum(num_draft_tokens)] flat indices (into input_ids) of the tokens whose logits
        the runner computes: each request's last scheduled token, or, for a request with d drafts, its
        last 1 + d tokens (the verify positions, in order). Without drafts: [num_reqs], one per request."""
    @property
    def logits_start_loc(self) -> npt.NDArray[np.int32]:
        """[num_reqs + 1] request i's rows of logits_indices are logits_start_loc[i]:logits_start_loc[i + 1]
        (1 + num_draft_tokens[i] rows; the last one is its bonus position). Without drafts: 0..num_reqs."""
    @property
    def sample_mask(self) -> npt.NDArray[np.bool_]:
        """[num_reqs] True where this step reaches the end of the request's known tokens (drafts
        included), so the sampled token(s) are kept; False for a partial prefill chunk (its sample is
        ignored)."""
    @property
    def num_draft_tokens(self) -> npt.NDArray[np.int32]:
        """[num_reqs] speculative drafts scheduled after each request's last sampled token (0 without
        speculation). A request with d > 0 drafts is a decode of 1 + d tokens: input_ids holds its last
        sampled token then the d drafts, each with its position and KV slot."""
    @property
    def draft_token_ids(self) -> npt.NDArray[np.int64]:
        """[sum(num_draft_tokens)] every request's drafts, batch order (the same ids as in input_ids)."""
    # The host tier's copies this step (host_cache_blocks > 0), issued before the forward: every offload
    # (device block -> host slot), then every load (host slot -> device block).
    @property
    def num_kv_transfers(self) -> int: ...
    @property
    def kv_offload_blocks(self) -> npt.NDArray[np.int64]: ...
    @property
    def kv_offload_slots(self) -> npt.NDArray[np.int64]: ...
    @property
    def kv_load_slots(self) -> npt.NDArray[np.int64]: ...
    @property
    def kv_load_blocks(self) -> npt.NDArray[np.int64]: ...
    # A hybrid model's state snapshots this step (rust/state_snapshots.rs): each restore copies snapshot slot
    # state_restore_slots[k] into the state row of batch entry state_restore_index[k] before the forward; each
    # save copies batch entry state_save_index[k]'s row into slot state_save_slots[k] after it.
    @property
    def num_state_copies(self) -> int: ...
    @property
    def state_restore_index(self) -> npt.NDArray[np.int32]: ...
    @property
    def state_restore_slots(self) -> npt.NDArray[np.int32]: ...
    @property
    def state_save_index(self) -> npt.NDArray[np.int32]: ...
    @property
    def state_save_slots(self) -> npt.NDArray[np.int32]: ...

FINISH_REASONS: tuple[None, str, str, str, str, str]
"""(None, "stop", "length", "abort", "error", "repetition"): the meaning of StepOutputs.finish_reasons codes. The
core never produces 4, "error": it is the Python engine's, for requests it fails itself."""

class StepOutputs:
    """What one update_from_output() (or abort_requests()) produced: one row per request with news
    (a new token, text, or a finish), as columns. Each column is made on first access and the same
    object is returned after that (do not modify it)."""

    def __len__(self) -> int:
        """Number of rows (n)."""
    @property
    def slots(self) -> npt.NDArray[np.int32]:
        """[n] the slot of each row's request (as returned by add_request). A finished row's slot is
        free again: a later add_request may reuse it."""
    @property
    def req_ids(self) -> list[str]:
        """[n] the request id of each row (built on first access)."""
    @property
    def token_ids(self) -> npt.NDArray[np.int32]:
        """[total] every row's new tokens, row after row (one per row today, none for an abort;
        speculative decoding will append several)."""
    @property
    def token_offsets(self) -> npt.NDArray[np.int32]:
        """[n + 1] row i's tokens are token_ids[token_offsets[i]:token_offsets[i + 1]]."""
    @property
    def text(self) -> str:
        """Every row's text delta, concatenated. A delta never splits a UTF-8 character and never
        contains a partial stop string (held back until it is known not to be one); empty when
        detokenize is off or the scheduler has no tokenizer. Only generated text: the prompt is never
        included. A token that stops the request by id (EOS, stop_token_ids) adds no text unless
        include_stop_str_in_output."""
    @property
    def text_offsets(self) -> npt.NDArray[np.int32]:
        """[n + 1] in characters (code points, as Python indexes a str): row i's delta is
        text[text_offsets[i]:text_offsets[i + 1]]."""
    @property
    def finish_reasons(self) -> npt.NDArray[np.uint8]:
        """[n] 0 while running, else the index of the reason in FINISH_REASONS (1 stop, 2 length,
        3 abort, 5 repetition)."""
    @property
    def stop_reasons(self) -> dict[int, int | str]:
        """{row: the stop_token_id or stop string that fired, "repetition_detected" for a repetition
        finish}, only for rows that stopped on one (EOS, length, abort and a forced stop have none)."""
    @property
    def num_output_tokens(self) -> npt.NDArray[np.int32]:
        """[n] output tokens of each row's request so far."""
    @property
    def num_prompt_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_cached_tokens(self) -> npt.NDArray[np.int32]:
        """[n] prompt tokens served from the prefix cache when the request was first scheduled."""
    @property
    def num_external_cached_tokens(self) -> npt.NDArray[np.int32]:
        """[n] of num_cached_tokens, those loaded from the prefix cache's host tier (vLLM's external KV)."""

class SchedulerStats:
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # fraction of usable blocks held by live requests, 0.0..1.0
    prefix_cache_queries: int  # tokens looked up (cumulative)
    prefix_cache_hits: int  # tokens found (cumulative)
    host_cache_hits: int  # tokens the host tier served, loaded instead of computed (cumulative)
    host_cache_blocks: int  # blocks the host tier holds now
    num_preemptions: int  # cumulative
    num_scheduled_tokens: int  # last step
    num_prompt_tokens: int  # cumulative tokens of prompt scheduled (prefill work)
    num_generation_tokens: int  # cumulative tokens appended by update_from_output
    # Speculative decoding (cumulative, vLLM's spec_decode names). num_drafts: verified steps of a
    # request with drafts; mean acceptance length = 1 + num_accepted_tokens / num_drafts.
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int  # drafts accepted by the verifier (before any stop cut the run)
    num_accepted_tokens_per_pos: list[int]  # [num_speculative_tokens] acceptances of the draft at each position
    # The LoRA adapters (nonzero lora_id, each once, in queue order) of the running / waiting requests now.
    running_lora_ids: list[int]
    waiting_lora_ids: list[int]

class Scheduler:
    """Not for concurrent use: one engine thread drives it (construction, schedule, update and a
    long prompt's add_request release the GIL, so a second thread calling in meanwhile gets a
    RuntimeError rather than a data race)."""

    def __init__(
        self,
        *,
        num_blocks: int,
        max_model_len: int,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        tokenizer_json: str | None = None,
        eos_token_ids: Sequence[int] = (),
        num_speculative_tokens: int = 0,
        speculative_method: str = "ngram",
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 5,
        max_loras: int = 0,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 1,
        max_long_partial_prefills: int = 1,
        prefix_caching_hash_algo: str = "sha256",
        prefix_hash_seed: str | bytes | None = None,
        host_cache_blocks: int = 0,
        recurrent_states: bool = False,
        mamba_block_size: int = 0,
        state_snapshot_slots: int = 0,
    ) -> None:
        """num_blocks includes the null block (id 0), which is never handed out.
        policy: 'fcfs' or 'priority' (lower priority value first, then arrival order).
        tokenizer_json: the text of a tokenizer.json; without it text_delta is always empty and a
        request with stop strings is rejected (InvalidArgumentError).
        The longest prompt + output any request may reach is min(max_model_len, the whole KV
        cache: (num_blocks - 1) * block_size); max_tokens is clipped to it.
        Prefix caching may share a block that another request computes in the same step: the
        runner must write the K/V of every scheduled token of a layer before that layer's attention.
        Speculative decoding (off with num_speculative_tokens=0): each running request in the decode
        state gets up to num_speculative_tokens drafts per step. speculative_method 'ngram': proposed in
        the core by prompt lookup (vLLM's semantics: the longest suffix of prompt + output, between
        prompt_lookup_min and prompt_lookup_max tokens, that occurred earlier, its earliest occurrence;
        the tokens after it); 'draft_model': only drafts passed to schedule().
        max_loras: the most distinct LoRA adapters (lora_id != 0) among running requests (0: no
        cap); a waiting request whose adapter would exceed it waits while later ones may go ahead.
        enable_chunked_prefill=False: every prompt runs whole in one step (encoder models); a
        prompt longer than max_num_batched_tokens is rejected by add_request.
        long_prefill_token_threshold > 0: a prefill chunk takes at most that many of a request's tokens
        per step (vLLM's; an image computed whole is not cut by it).
        max_num_partial_prefills > 1 (needs the threshold): vLLM's concurrent partial prefills
        (rust/partial_prefills.rs): the prompts that can prefill together share the step's budget, at
        most max_long_partial_prefills of them longer than the threshold (later ones may pass those).
        prefix_caching_hash_algo: the block hash, 'sha256' (truncated to 128 bits; crafted prompts cannot
        collide) or 'xxhash' (xxh3-128, cheaper, not collision-resistant); 'sha256_cbor' / 'xxhash_cbor':
        vLLM's own block hashes, bit for bit (rust/cbor_block_hash.rs), whose root comes from
        prefix_hash_seed (required with them only): a str (PYTHONHASHSEED's value: hashed, as vLLM) or
        bytes (the root itself: vLLM's random bytes when PYTHONHASHSEED is unset).
        host_cache_blocks > 0: a second tier of the prefix cache in host memory (rust/host_tier.rs; needs
        prefix caching): cached blocks evicted from the device are offloaded to it, and prefixes it holds
        are loaded back; each SchedulerOutput lists the step's copies (kv_offload_* then kv_load_*).
        recurrent_states: a hybrid model's per-request recurrent states (a rolled-back step preempts its
        requests). With prefix caching they need mamba_block_size (a multiple of block_size) and
        state_snapshot_slots > 0: prompts' chunks are cut to end on that grid, the state where a step ends on
        it is saved, and a prefix-cache hit ends where a saved state is (rust/state_snapshots.rs)."""
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_speculative_tokens(self) -> int: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.int64] | npt.NDArray[np.int32],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        repetition_detection: tuple[int, int, int] | None = None,
        skip_special_tokens: bool = True,
        detokenize: bool = True,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: int = 0,
        lora_name: str | None = None,
        mm_items: Sequence[tuple[str, int, int]] = (),
        wait_for_grammar: bool = False,
        allow_drafts: bool = True,
        atomic_spans: Sequence[tuple[int, int]] = (),
    ) -> int:
        """Queue a request; returns its slot: a small integer naming it in SchedulerOutput.req_slots
        and StepOutputs.slots. A request keeps its slot while it lives (waiting, running,
        preempted); once it has finished or been aborted, a later request may get the same slot.
        Token ids must be in 0..2^31. max_tokens is clipped so prompt + output <= max_model_len.
        min_tokens: EOS, stop_token_ids and stop strings fire only on a token that brings the output
        to at least min_tokens tokens; a stop string may begin in earlier output (it is held back,
        not streamed) and is trimmed as usual, but one completed before that never fires.
        Releases the GIL for long prompts (>= 16384 tokens) while their blocks are hashed.
        wait_for_grammar: keep it waiting (other requests run) until grammar_ready() names it.
        allow_drafts: False keeps speculative decoding off for this request (e.g. while a grammar
        constrains it and drafts are not checked against the grammar).
        atomic_spans: prompt ranges [start, end) each computed within one step (a chunk never ends
        inside one; each must fit max_num_batched_tokens): Gemma 3's images, whose tokens attend to
        each other both ways.
        cache_salt, lora_id: blocks of requests with another salt or adapter are never shared.
        lora_name: the adapter's name (with a lora_id only; required then under the CBOR hashes, which
        hash it as vLLM does). mm_items: (identifier, offset, length) of each multimodal item's
        placeholder run, in prompt order: the blocks holding an item and those after it depend on its
        identifier (blocks before the first item are shared with the same text without items)."""
    def grammar_ready(self, request_ids: Sequence[str]) -> None: ...
    def abort_requests(self, request_ids: Sequence[str]) -> StepOutputs:
        """Abort live requests (unknown ids are ignored); frees their blocks at once and returns a
        row (finish_reason 3 'abort', no tokens, no text) for each one that was live."""
    def schedule(
        self,
        *,
        keep_in_flight: bool = False,
        draft_slots: npt.NDArray[np.int32] | npt.NDArray[np.int64] | Sequence[int] | None = None,
        draft_token_ids: npt.NDArray[np.int32] | npt.NDArray[np.int64] | Sequence[int] | None = None,
        draft_offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64] | Sequence[int] | None = None,
    ) -> SchedulerOutput:
        """Decide one step. Normally each schedule() with num_reqs > 0 is followed by one
        update_from_output(). If it is not (the model step failed), the next schedule() counts that
        step's tokens as not computed and schedules them again.
        keep_in_flight (async scheduling): the previous step is still computing and its
        update_from_output() will come after this call; its sampled tokens are placeholders, given as
        input id -1 (the runner fills them from the previous step's sampled tokens on the device).
        Updates then come in schedule order. At most one step stays in flight (with two undelivered,
        both are rolled back).
        draft_slots / draft_token_ids / draft_offsets (all or none; speculation on): drafts made outside
        the core (a draft model) for this step: slot draft_slots[i] proposes
        draft_token_ids[draft_offsets[i]:draft_offsets[i + 1]]. They replace the n-gram proposal for
        those requests, are cut to num_speculative_tokens and the limits, and are dropped for a request
        that is not in the decode state this step (prefilling, a step of it in flight, drafts not
        allowed) or not live.
        Drafts never push a request past max_tokens or the length limit (all accepted plus one more
        token fit), count against max_num_batched_tokens, and never cause a preemption (without room
        for them the request runs without). With keep_in_flight (n-gram drafts), the step in flight
        counts as if every one of its drafts will be accepted: a request with a step in flight is
        scheduled at the position that gives, its first input is the placeholder for that step's last
        token, and its drafts are proposed from its tokens plus the drafts in flight (the proposal's
        first token guesses the placeholder and is dropped). The runner shifts such a row back on the
        device by the drafts its request rejected (positions, slots, sequence length); the update then
        takes them out of the count. Handed-in drafts go only to requests with nothing in flight."""
    def update_from_output(
        self,
        sampled_token_ids: npt.NDArray[np.int64] | npt.NDArray[np.int32],
        force_stop: npt.NDArray[np.bool_] | None = None,
        *,
        num_sampled_tokens: npt.NDArray[np.int32] | npt.NDArray[np.int64] | None = None,
    ) -> StepOutputs:
        """sampled_token_ids: [num_reqs] (int64 or int32) of the oldest step not yet updated, in its
        batch order; entries where sample_mask is False are ignored. force_stop: [num_reqs], True
        finishes the request with 'stop' after appending its token (a completed grammar).
        Returns one row per request with news; requests aborted or preempted since that step was
        scheduled have none.
        num_sampled_tokens (speculative decoding): [num_reqs] tokens each request produced, and
        sampled_token_ids is then flat, request after request: its accepted drafts (which must equal its
        drafts) then the correction or bonus token, so 1..=1 + num_draft_tokens[i] tokens (0 or 1,
        ignored, where sample_mask is False). Without it, one token per request (none of any drafts
        accepted). Every token is appended, detokenized and stop-checked in order; a stop inside the
        run ends the request there (the row carries the tokens up to it). The K/V of rejected drafts
        is un-counted: their slots are overwritten by the next step; blocks only they needed are freed.
        force_stop[i] applies after request i's last token."""
    def has_unfinished_requests(self) -> bool: ...
    def num_unfinished_requests(self) -> int: ...
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash (and state snapshot); False (nothing done) while any block is in use."""
    @property
    def state_snapshot_counts(self) -> tuple[int, int, int] | None:
        """A hybrid model's state snapshots: (restored, saved, held now); None without them."""
    def preempt_all(self) -> int:
        """Preempt every running request by recompute (sleep mode's "keep"); how many. Raises
        ValueError while a step is in flight."""
    def stats(self) -> SchedulerStats: ...
    def record_kv_events(self) -> None:
        """Records the prefix cache's events from now on (vLLM's --kv-events-config)."""
    def take_kv_events(self) -> list[tuple[Any, ...]]:
        """The prefix cache's events since the last call, oldest first: ("stored", block_hashes,
        parent_block_hash | None, token_ids, lora_id, extra_keys), ("removed", block_hashes), ("cleared",).
        extra_keys: under the CBOR hashes, one entry per block (None, or the tuple vLLM hashes: the
        adapter's name, (identifier, offset from the block's start) per item, the salt on block 0);
        otherwise None."""
    def request_block_ids(self, request_id: str) -> list[int]:
        """Blocks held by a live request (for tests and debugging)."""

class Detokenizer:
    """Standalone incremental detokenizer (the one the scheduler uses), for tests and tools."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None: ...
    def step(self, token_id: int) -> tuple[str, str | None]:
        """Feed one token; returns (text_delta, stop string that fired or None).
        Raises TokenizerError for an id outside the vocabulary (the scheduler instead decodes such
        ids, e.g. from a model's padded vocabulary, to no text)."""
    def flush(self) -> str:
        """End of stream: release text held back for a possible stop string."""
    @property
    def output_text(self) -> str: ...

# ---- CPU kernels (rust/cpu/): quantized matmul and the decode-step decoder ------------------------

class CpuQuantMatrix:
    """A weight [rows, cols] in groups of 32 columns, w = scale * q + offset, q of 4 or 8 bits."""

    def __init__(
        self,
        q: npt.NDArray[np.uint8],
        scale: npt.NDArray[np.float32],
        offset: npt.NDArray[np.float32],
        bits: int,
    ) -> None:
        """q: one unsigned value a byte, [rows, cols]; scale, offset: [rows, cols / 32]."""
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def bits(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def matmul(
        self,
        x: npt.NDArray[np.float32],
        out: npt.NDArray[np.float32],
        bias: npt.NDArray[np.float32] | None = None,
        accumulate: bool = False,
    ) -> None:
        """out (=, or += with accumulate) x @ w.T (+ bias) with int8 activations; x [m, cols], out [m, rows]."""
    def dequantize(self) -> npt.NDArray[np.float32]:
        """float32 [rows, cols]: the weights the product multiplies by."""

class CpuDecoderLayer:
    """One pre-norm decoder layer's weights for CpuDecoder (shapes checked here)."""

    def __init__(
        self,
        *,
        input_norm: npt.NDArray[np.float32],
        post_norm: npt.NDArray[np.float32],
        eps: float,
        qkv: CpuQuantMatrix,
        o: CpuQuantMatrix,
        gate_up: CpuQuantMatrix,
        down: CpuQuantMatrix,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        qkv_bias: npt.NDArray[np.float32] | None = None,
        o_bias: npt.NDArray[np.float32] | None = None,
        gate_up_bias: npt.NDArray[np.float32] | None = None,
        down_bias: npt.NDArray[np.float32] | None = None,
        window: int = 0,
    ) -> None: ...

class CpuDecoder:
    """A model's decoder layers, run for a whole step (prefill chunks and decodes) in one call."""

    def __init__(self, layers: Sequence[CpuDecoderLayer]) -> None: ...
    def forward(
        self,
        h: npt.NDArray[np.float32],
        kv_caches: Sequence[npt.NDArray[np.float32]],
        rope: npt.NDArray[np.float32],
        slots: npt.NDArray[np.int64],
        query_start_loc: npt.NDArray[np.int32],
        block_table: npt.NDArray[np.int32],
        seq_lens: npt.NDArray[np.int32],
    ) -> None:
        """h [T, hidden] updated in place; kv_caches [2, blocks, block_size, kv_heads, head_dim] per
        layer; rope [T, head_dim] ([cos | sin]); slots [T]; query_start_loc [R + 1]; block_table
        [R, max_blocks]; seq_lens [R] (this step's tokens included)."""

def cpu_set_num_threads(threads: int) -> None:
    """The CPU kernels' thread count (the engine keeps it equal to torch's)."""

def cpu_num_threads() -> int: ...
