"""SamplingParams: how one request is decoded (vLLM-compatible field names and meanings).

A msgspec Struct so that it crosses the engine-core socket inside `EngineCoreRequest` as
msgpack unchanged; `__post_init__` validates on construction *and* on decode, so a bad value
is an `InvalidArgumentError` (a `ValueError`) whose `param` is the field, wherever it enters. The
rules that need the engine's limits (vocabulary, max_logprobs, max_model_len) are in
`ferrox.request_rules` / `ferrox.engine.validation`, which the engine runs before a request is queued.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

from ferrox._core import InvalidArgumentError
from ferrox.bad_words import check_bad_words
from ferrox.request_rules import check_min_tokens, check_token_ids_in_vocab
from ferrox.structured.params import StructuredOutputsParams

# Below this a temperature means greedy (argmax); dividing by it would overflow.
_GREEDY_EPS = 1e-5
# OpenAI clamps logit_bias values to this range; larger values only make overflow likely.
_MAX_ABS_LOGIT_BIAS = 100.0
# vLLM's cap on logprob_token_ids: the sampler gathers these columns for every position of the request.
MAX_LOGPROB_TOKEN_IDS = 128


class RequestOutputKind(enum.IntEnum):
    """What each streamed `RequestOutput` carries."""

    CUMULATIVE = 0  # all text/tokens so far (offline `LLM` default)
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


class RepetitionDetectionParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's `repetition_detection`: end a request whose output ends in a pattern of
    min_pattern_size..max_pattern_size tokens repeated min_count times back to back (a model stuck in a
    loop); it then finishes with finish_reason "repetition" and stop_reason "repetition_detected". Checked
    after the length limits and only once min_tokens are out (the Rust core's `RepetitionRule`).
    max_pattern_size 0 turns it off; min_pattern_size 0 means 1."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise _invalid("repetition_detection", f"{name} must be an integer, got {value!r}")
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise _invalid("repetition_detection", "max_pattern_size and min_pattern_size must be >= 0, with "
                           "min_pattern_size <= max_pattern_size (both 0 turn detection off)")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise _invalid("repetition_detection", "min_count must be >= 2 when max_pattern_size > 0 (set "
                           "max_pattern_size to 0 to turn detection off)")

    def as_rule(self) -> tuple[int, int, int]:
        """(min_pattern_size, max_pattern_size, min_count), as the Rust core's add_request takes it (the core
        reads max 0 as off and min 0 as 1)."""
        return (self.min_pattern_size, self.max_pattern_size, self.min_count)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives returned with each sampled token
    prompt_logprobs: int | None = None
    # vLLM's: at each generated position, the logprobs of exactly these token ids (beside the sampled
    # token's) in place of the top `logprobs` alternatives; turns sample logprobs on by itself. [] = unset.
    logprob_token_ids: list[int] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output must not contain (ferrox.bad_words). bad_words_token_ids: their token
    # sequences, which the engine fills in from bad_words with its tokenizer (vLLM's update_from_tokenizer).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # At most this many tokens of thinking (a reasoning model's `<think>` section), then `</think>` is
    # forced; needs a reasoning parser. -1 or None: no budget.
    thinking_token_budget: int | None = None
    # Stop a request looping on a repeated pattern (RepetitionDetectionParams; a dict of its fields is taken).
    repetition_detection: RepetitionDetectionParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._validate()
        if self.temperature < _GREEDY_EPS:
            # Greedy ignores the truncation knobs; resetting them keeps the sampler's greedy
            # fast path free of work that cannot change the argmax.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.logprob_token_ids is not None and len(self.logprob_token_ids) == 0:
            self.logprob_token_ids = None  # vLLM's: an empty list keeps the natural top-k
        if isinstance(self.repetition_detection, dict):
            unknown = set(self.repetition_detection) - {"max_pattern_size", "min_pattern_size", "min_count"}
            if unknown:
                raise _invalid("repetition_detection", f"unknown field(s) {sorted(unknown)}")
            self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise _invalid("logit_bias", f"keys must be token ids and values numbers ({e})") from None

    def _validate(self) -> None:
        _check_int("n", self.n, lo=1)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise _invalid(name, f"must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise _invalid("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not self.temperature >= 0.0:
            raise _invalid("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise _invalid("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=0, note=" (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise _invalid("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, lo=0, note=" (-1: no budget)")
        if self.max_tokens is not None:
            check_min_tokens(self.min_tokens, self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, lo=0)
        if self.stop is not None:
            for s in self.stop:
                if not isinstance(s, str) or not s:
                    raise _invalid("stop", f"every stop string must be a non-empty string, got {s!r}")
        _check_token_ids("stop_token_ids", self.stop_token_ids, allow_empty=True)
        _check_token_ids("allowed_token_ids", self.allowed_token_ids, allow_empty=False)
        _check_token_ids("logprob_token_ids", self.logprob_token_ids, allow_empty=True)
        if self.bad_words is not None:
            check_bad_words(self.bad_words)
        for seq in self.bad_words_token_ids or []:
            _check_token_ids("bad_words_token_ids", seq, allow_empty=False)
        if self.logprob_token_ids is not None and len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
            raise _invalid("logprob_token_ids", f"at most {MAX_LOGPROB_TOKEN_IDS} token ids, got "
                                                f"{len(self.logprob_token_ids)}")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if tok < 0:
                    raise _invalid("logit_bias", f"token id must be >= 0, got {tok}")
                if not -_MAX_ABS_LOGIT_BIAS <= bias <= _MAX_ABS_LOGIT_BIAS:
                    raise _invalid("logit_bias", f"value for token {tok} must be in [-100, 100], got {bias}")
        if not self.detokenize and self.stop:
            raise _invalid("stop", "stop strings need detokenize=True")

    # ---- derived views used by the engine --------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives reported with each sampled token, or None when sample logprobs are off: the named
        logprob_token_ids when given (they replace the top-N), else `logprobs`."""
        return len(self.logprob_token_ids) if self.logprob_token_ids else self.logprobs

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary; the engine calls it (through
        ferrox.engine.validation), as only it knows the vocabulary size."""
        check_token_ids_in_vocab("stop_token_ids", self.stop_token_ids or [], vocab_size)
        check_token_ids_in_vocab("allowed_token_ids", self.allowed_token_ids or [], vocab_size)
        check_token_ids_in_vocab("logit_bias", list(self.logit_bias or {}), vocab_size)
        check_token_ids_in_vocab("logprob_token_ids", self.logprob_token_ids or [], vocab_size)
        for seq in self.bad_words_token_ids or []:
            check_token_ids_in_vocab("bad_words_token_ids", seq, vocab_size)

    def clone(self, **changes: Any) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


class BeamSearchParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's beam search parameters (LLM.beam_search; `use_beam_search` on the API routes, where `n` is
    the beam width). The search itself: ferrox.beam_search."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # the end-of-sequence token's text in the beam's text

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, lo=1)
        _check_int("max_tokens", self.max_tokens, lo=1)
        if not self.temperature >= 0.0:
            raise _invalid("temperature", f"must be >= 0, got {self.temperature}")
        if not math.isfinite(self.length_penalty):
            raise _invalid("length_penalty", f"must be a finite number, got {self.length_penalty}")


def _check_int(name: str, value: Any, lo: int | None = None, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(name, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise _invalid(name, f"must be >= {lo}{note}, got {value}")


def _check_token_ids(name: str, ids: list[int] | None, *, allow_empty: bool) -> None:
    if ids is None:
        return
    if not allow_empty and not ids:
        raise _invalid(name, "must not be empty when given")
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise _invalid(name, f"token ids must be integers >= 0, got {tok!r}")


def _invalid(param: str, what: str) -> InvalidArgumentError:
    """The error for one bad field: "param: what", with `param` set."""
    return InvalidArgumentError(f"{param}: {what}", param=param)
