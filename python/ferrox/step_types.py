"""The step's data, shared by the worker, the engine core and the front-ends.

A low module (numpy + msgspec only): the worker produces `Logprobs`, the engine core turns the
Rust core's columnar `StepOutputs` into one `StepResult` per step, and the front-end
(`OutputProcessor`) reads it row by row. `StepResult` is columns, not one object per request, so
the engine-core process ships a step without building Python objects per request; msgspec
encodes its arrays as raw bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

# Finish codes in StepResult.finish_reasons; index = code (the Rust core's FINISH_REASONS).
FINISH_REASONS: tuple[str | None, ...] = (None, "stop", "length", "abort", "error", "repetition")
FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = 1, 2, 3, 4


class Logprobs(msgspec.Struct, array_like=True):
    """Per generated (or prompt) position: the chosen token's logprob and rank, plus the top-N."""

    token_ids: list[int]  # the chosen token at each position
    logprobs: list[float]  # its logprob
    ranks: list[int]  # its 1-based rank in the distribution
    top_token_ids: list[list[int]]  # [positions][N]
    top_logprobs: list[list[float]]  # [positions][N]


def _i32(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype=np.int32).tobytes()


def pooled_bytes(vector: npt.NDArray[np.float32]) -> bytes:
    """A pooling vector as it travels (StepResult.pooled): little-endian float32, whatever the host."""
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()


class StepResult(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one engine step reports: one row per request with news, as columns.

    Row i: request `req_ids[i]`; its new tokens `token_ids[token_offsets[i]:token_offsets[i+1]]`
    (several per step once speculation lands); its text delta `text[text_offsets[i]:text_offsets[i+1]]`
    (offsets in characters); `finish_reasons[i]` a code into FINISH_REASONS (0 = still running).
    The int32 / uint8 columns travel as bytes; the accessors below view them as numpy arrays.
    Sparse extras are keyed by row: stop reasons, logprobs, prompt logprobs, error messages.
    """

    req_ids: list[str] = msgspec.field(default_factory=list)
    token_ids_raw: bytes = b""
    token_offsets_raw: bytes = b"\x00\x00\x00\x00"
    text: str = ""
    text_offsets_raw: bytes = b"\x00\x00\x00\x00"
    finish_reasons_raw: bytes = b""
    num_prompt_tokens_raw: bytes = b""
    num_cached_tokens_raw: bytes = b""
    stop_reasons: dict[int, int | str] = msgspec.field(default_factory=dict)
    logprobs: dict[int, Logprobs] = msgspec.field(default_factory=dict)
    prompt_logprobs: dict[int, Logprobs] = msgspec.field(default_factory=dict)
    errors: dict[int, str] = msgspec.field(default_factory=dict)
    # Pooling requests (ferrox.pooling): row -> its vector as little-endian float32 bytes, sent once, in
    # the row that finishes the request.
    pooled: dict[int, bytes] = msgspec.field(default_factory=dict)
    # row -> of its num_cached_tokens, those loaded from the host tier (rows without any are left out: the tier
    # is rare and its loads rarer than steps).
    external_cached_tokens: dict[int, int] = msgspec.field(default_factory=dict)

    # ---- columns as numpy views -----------------------------------------------------------------
    @property
    def token_ids(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.token_ids_raw, dtype=np.int32)

    @property
    def token_offsets(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.token_offsets_raw, dtype=np.int32)

    @property
    def text_offsets(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.text_offsets_raw, dtype=np.int32)

    @property
    def finish_reasons(self) -> npt.NDArray[np.uint8]:
        return np.frombuffer(self.finish_reasons_raw, dtype=np.uint8)

    @property
    def num_prompt_tokens(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.num_prompt_tokens_raw, dtype=np.int32)

    @property
    def num_cached_tokens(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.num_cached_tokens_raw, dtype=np.int32)

    @property
    def num_external_cached_tokens(self) -> npt.NDArray[np.int32]:
        column = np.zeros(len(self.req_ids), dtype=np.int32)
        for row, n in self.external_cached_tokens.items():
            column[row] = n
        return column

    def __len__(self) -> int:
        return len(self.req_ids)

    def finished_req_ids(self) -> list[str]:
        return [self.req_ids[i] for i in np.flatnonzero(self.finish_reasons).tolist()]

    def rows(self) -> list[StepRow]:
        """Row objects (tests, debugging, slow paths); hot paths read the columns."""
        tok, toff = self.token_ids.tolist(), self.token_offsets.tolist()
        txt = self.text_offsets.tolist()
        fin, npt_, nct = self.finish_reasons.tolist(), self.num_prompt_tokens.tolist(), self.num_cached_tokens.tolist()
        return [
            StepRow(
                request_id=rid,
                new_token_ids=tok[toff[i] : toff[i + 1]],
                text_delta=self.text[txt[i] : txt[i + 1]],
                finish_reason=FINISH_REASONS[fin[i]],
                stop_reason=self.stop_reasons.get(i),
                num_prompt_tokens=npt_[i],
                num_cached_tokens=nct[i],
                num_external_cached_tokens=self.external_cached_tokens.get(i, 0),
                new_logprobs=self.logprobs.get(i),
                prompt_logprobs=self.prompt_logprobs.get(i),
                error=self.errors.get(i),
                pooled=self.pooled.get(i),
            )
            for i, rid in enumerate(self.req_ids)
        ]

    def set_pooled(self, vectors: dict[str, npt.NDArray[np.float32]]) -> None:
        """Attach pooling vectors (request id -> float32 vector) to their rows."""
        for i, rid in enumerate(self.req_ids):
            vector = vectors.get(rid)
            if vector is not None:
                self.pooled[i] = pooled_bytes(vector)

    def pooled_vector(self, row: int) -> npt.NDArray[np.float32] | None:
        """Row's pooling vector, a writable native float32 copy (users hand it to torch.from_numpy)."""
        raw = self.pooled.get(row)
        return None if raw is None else np.frombuffer(raw, dtype="<f4").astype(np.float32)

    # ---- building -------------------------------------------------------------------------------
    @staticmethod
    def from_core(outputs: Any, req_ids: Sequence[str]) -> StepResult:
        """From the Rust core's `StepOutputs` (columns), with the request ids of its rows."""
        external = np.asarray(outputs.num_external_cached_tokens)
        return StepResult(
            external_cached_tokens={row: int(external[row]) for row in np.flatnonzero(external).tolist()},
            req_ids=list(req_ids),
            token_ids_raw=_i32(outputs.token_ids),
            token_offsets_raw=_i32(outputs.token_offsets),
            text=outputs.text,
            text_offsets_raw=_i32(outputs.text_offsets),
            finish_reasons_raw=np.ascontiguousarray(outputs.finish_reasons, dtype=np.uint8).tobytes(),
            num_prompt_tokens_raw=_i32(outputs.num_prompt_tokens),
            num_cached_tokens_raw=_i32(outputs.num_cached_tokens),
            stop_reasons=dict(outputs.stop_reasons),
        )

    @staticmethod
    def from_rows(rows: Sequence[StepRow]) -> StepResult:
        """From row objects (errors, aborts, tests)."""
        tokens: list[int] = []
        token_offsets = [0]
        texts: list[str] = []
        text_offsets = [0]
        result = StepResult(req_ids=[r.request_id for r in rows])
        for i, r in enumerate(rows):
            tokens.extend(r.new_token_ids)
            token_offsets.append(len(tokens))
            texts.append(r.text_delta)
            text_offsets.append(text_offsets[-1] + len(r.text_delta))
            if r.stop_reason is not None:
                result.stop_reasons[i] = r.stop_reason
            if r.new_logprobs is not None:
                result.logprobs[i] = r.new_logprobs
            if r.prompt_logprobs is not None:
                result.prompt_logprobs[i] = r.prompt_logprobs
            if r.error is not None:
                result.errors[i] = r.error
            if r.pooled is not None:
                result.pooled[i] = r.pooled
            if r.num_external_cached_tokens:
                result.external_cached_tokens[i] = r.num_external_cached_tokens
        result.token_ids_raw = _i32(tokens)
        result.token_offsets_raw = _i32(token_offsets)
        result.text = "".join(texts)
        result.text_offsets_raw = _i32(text_offsets)
        result.finish_reasons_raw = bytes(FINISH_REASONS.index(r.finish_reason) for r in rows)
        result.num_prompt_tokens_raw = _i32([r.num_prompt_tokens for r in rows])
        result.num_cached_tokens_raw = _i32([r.num_cached_tokens for r in rows])
        return result

    @staticmethod
    def concat(parts: Sequence[StepResult]) -> StepResult:
        """One result from several (a step's update, its failures and aborts)."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return StepResult()
        if len(parts) == 1:
            return parts[0]
        out = StepResult()
        tok_off: list[npt.NDArray[np.int32]] = [np.zeros(1, dtype=np.int32)]
        txt_off: list[npt.NDArray[np.int32]] = [np.zeros(1, dtype=np.int32)]
        base_row = base_tok = base_txt = 0
        for p in parts:
            out.req_ids.extend(p.req_ids)
            tok_off.append(p.token_offsets[1:] + base_tok)
            txt_off.append(p.text_offsets[1:] + base_txt)
            out.stop_reasons.update({row + base_row: v for row, v in p.stop_reasons.items()})
            out.logprobs.update({row + base_row: v for row, v in p.logprobs.items()})
            out.prompt_logprobs.update({row + base_row: v for row, v in p.prompt_logprobs.items()})
            out.errors.update({row + base_row: v for row, v in p.errors.items()})
            out.pooled.update({row + base_row: v for row, v in p.pooled.items()})
            out.external_cached_tokens.update({row + base_row: v for row, v in p.external_cached_tokens.items()})
            base_row += len(p)
            base_tok += int(p.token_offsets[-1])
            base_txt += int(p.text_offsets[-1])
        out.token_ids_raw = b"".join(p.token_ids_raw for p in parts)
        out.token_offsets_raw = np.concatenate(tok_off).astype(np.int32).tobytes()
        out.text = "".join(p.text for p in parts)
        out.text_offsets_raw = np.concatenate(txt_off).astype(np.int32).tobytes()
        out.finish_reasons_raw = b"".join(p.finish_reasons_raw for p in parts)
        out.num_prompt_tokens_raw = b"".join(p.num_prompt_tokens_raw for p in parts)
        out.num_cached_tokens_raw = b"".join(p.num_cached_tokens_raw for p in parts)
        return out


class StepRow(msgspec.Struct):
    """One row of a StepResult as an object (tests, error paths; hot paths read the columns)."""

    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    text_delta: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_external_cached_tokens: int = 0  # of num_cached_tokens, from the host tier
    new_logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    error: str | None = None
    pooled: bytes | None = None  # a pooling request's vector (little-endian float32)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
