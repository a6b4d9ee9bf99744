"""Pooling settings: PoolingParams (one request's, vLLM's names) and PoolerConfig (the model's), and
the rules a pooling request must satisfy before it is queued.

A base-layer module (msgspec and the error tree only): PoolingParams crosses the engine-core socket
inside EngineCoreRequest, and PoolerConfig inside the core's handshake, so the API server checks a
request against the model without importing torch.

How a vector is made (worker/pooling_runner.py, pooling/pooler.py): the model's hidden states of the
whole prompt are pooled by the model's `pooling_type` (MEAN over the tokens, CLS: the first token,
LAST: the last token); a request's `dimensions` keeps the first d values (Matryoshka models only);
`normalize` (the request's, else the model's) divides by the L2 norm.

A sequence-classification model (a cross-encoder, PoolerConfig.task "classify") gives each request its
class scores instead: the head's logits through an activation (pooling/classify.py), for task "classify"
a text's class probabilities, for task "score" one score of a pair read as one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ferrox._core import InvalidArgumentError, PromptTooLongError
from ferrox.request_rules import check_token_ids_in_vocab
from ferrox.sampling_params import RequestOutputKind, SamplingParams

POOLING_TYPES = ("MEAN", "CLS", "LAST")
# "encode" is vLLM's name of a model's pooled output, whatever its kind: an embedding model's vector, a
# classifier's class scores. "classify" and "score" are a classifier's; "embed" an embedding model's.
TASKS = ("embed", "encode", "classify", "score")
MODEL_TASKS = ("embed", "classify")  # PoolerConfig.task: what the model's pooled output is
# --pooler-config keys that are honoured (vLLM's names); any other key is refused by name.
POOLER_CONFIG_KEYS = ("pooling_type", "normalize")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One pooling request's settings (vLLM's PoolingParams, the fields ferrox honours).

    dimensions: keep the first d values of the vector (Matryoshka models only; others refuse it).
    normalize: L2-normalise the vector; None takes the model's choice (its folder's Normalize module,
    else True for an embedding model, as vLLM does).
    task: "embed", "classify", "score" (a classifier's pair score) or "encode" (the model's own output);
    None: the model's (PoolerConfig.task).
    use_activation: a classifier's scores through its activation (sigmoid, softmax...: pooling/classify.py);
    False gives the raw logits; None: True (vLLM's).
    second_text_start: a cross-encoder pair's (score() and the score routes set it): where the second text
    starts in the prompt, from which on BERT's token type is 1 (the tokenizer's pair encoding, compressed to
    one index as vLLM compresses it: the types are a run of 0s then a run of 1s)."""

    dimensions: int | None = None
    normalize: bool | None = None
    task: str | None = None
    use_activation: bool | None = None
    second_text_start: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidArgumentError(f"dimensions: must be a positive integer, got {self.dimensions!r}",
                                       param="dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidArgumentError(f"normalize: must be true, false or null, got {self.normalize!r}",
                                       param="normalize")
        if self.task is not None and self.task not in TASKS:
            raise InvalidArgumentError(f"task: {self.task!r} is not supported (pooling tasks: {', '.join(TASKS)})",
                                       param="task")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise InvalidArgumentError(f"use_activation: must be true, false or null, got {self.use_activation!r}",
                                       param="use_activation")
        s = self.second_text_start
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise InvalidArgumentError(f"second_text_start: must be a positive integer, got {s!r}",
                                       param="second_text_start")

    def clone(self, **changes: Any) -> PoolingParams:
        return msgspec.structs.replace(self, **changes)


class PoolerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a pooling model makes its vectors (pooling/config.py reads it from the model folder)."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # the default when a request leaves `normalize` unset
    hidden_size: int  # the width of a vector before `dimensions`
    # Matryoshka models (config.json "matryoshka_dimensions" or "is_matryoshka", as vLLM reads them) may be
    # truncated; with a list, only to its sizes.
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    declared_by: str = ""  # where the pooling came from (a file, or "the default for X"), for the start-up log
    task: str = "embed"  # one of MODEL_TASKS
    # A classifier's (task "classify"): its class names in logit order (config.json id2label) and the
    # activation of each task (pooling/classify.py).
    labels: list[str] | None = None
    classify_activation: str = ""
    score_activation: str = ""
    # A classifier's pair prompt (score, /score, /rerank): the tokenizer's pair encoding, or, with config.json
    # use_pad_token false (vLLM's "LLM as reranker" models), the two texts joined into one string.
    join_pair_texts: bool = False

    def task_of(self, params: PoolingParams) -> str:
        """What a request computes: "embed", "classify" or "score" (None and "encode": the model's own)."""
        return self.task if params.task in (None, "encode") else params.task

    def activation_of(self, params: PoolingParams) -> str | None:
        """The activation a classifier applies to a request's logits; None for an embedding model."""
        if self.task != "classify":
            return None
        if params.use_activation is False:
            return "identity"
        return self.score_activation if self.task_of(params) == "score" else self.classify_activation

    def check(self, params: PoolingParams, model_name: str = "the model") -> None:
        """A request's settings against the model: InvalidArgumentError naming the field."""
        if self.task == "classify":
            self._check_classify(params, model_name)
            return
        if params.task in ("classify", "score"):
            raise InvalidArgumentError(f"task: {model_name} is an embedding model: it does not support "
                                       f"{params.task!r} (it embeds; a sequence-classification model classifies)",
                                       param="task")
        for name in ("use_activation", "second_text_start"):
            if getattr(params, name) is not None:
                raise InvalidArgumentError(f"{name}: applies to a sequence-classification model; {model_name} is "
                                           "an embedding model", param=name)
        d = params.dimensions
        if d is None:
            return
        if not self.is_matryoshka:
            raise InvalidArgumentError(
                f"dimensions: {model_name} does not support Matryoshka representations (its config.json declares "
                "no matryoshka_dimensions), so its vectors cannot be shortened; leave dimensions unset",
                param="dimensions")
        if self.matryoshka_dimensions and d not in self.matryoshka_dimensions:
            raise InvalidArgumentError(
                f"dimensions: {model_name} supports the Matryoshka sizes {self.matryoshka_dimensions}, got {d}",
                param="dimensions")
        if d > self.hidden_size:
            raise InvalidArgumentError(f"dimensions: {d} is more than the model's {self.hidden_size}",
                                       param="dimensions")

    def _check_classify(self, params: PoolingParams, model_name: str) -> None:
        task = self.task_of(params)
        if task == "embed":
            raise InvalidArgumentError(f"task: {model_name} is a sequence-classification model (a cross-encoder): "
                                       "it does not embed; classify texts or score pairs with it", param="task")
        n = len(self.labels or ())
        if task == "score" and n != 1:
            raise InvalidArgumentError(f"task: scoring needs one score per pair, and {model_name} has {n} labels; "
                                       "classify with it instead", param="task")
        for name in ("dimensions", "normalize"):
            if getattr(params, name) is not None:
                raise InvalidArgumentError(f"{name}: applies to embedding vectors; {model_name} is a "
                                           "sequence-classification model (use_activation chooses its scores or "
                                           "raw logits)", param=name)

    def resolve_normalize(self, params: PoolingParams) -> bool:
        return self.normalize if params.normalize is None else params.normalize


def pooling_sampling_params() -> SamplingParams:
    """The sampling side of a pooling request: it runs through the same scheduler as generation, as a
    request that computes its prompt and ends with one placeholder token (never detokenized, never
    shown), so the scheduler finishes it ("length") in the step that pooled it."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def validate_pooling_request(
    prompt_token_ids: Sequence[int],
    params: PoolingParams,
    config: PoolerConfig,
    *,
    max_model_len: int,
    vocab_size: int,
    what: str | None = None,
    prompt_param: str = "prompt",
    model_name: str = "the model",
) -> None:
    """A pooling request's rules: a non-empty prompt of at most max_model_len tokens (no room for output
    is needed: nothing is generated; the prompt is never truncated silently), ids in the vocabulary, and
    `dimensions` the model allows. `prompt_param` names the field the prompt came in (the embeddings API
    calls it "input")."""
    of = f" ({what})" if what else ""
    if len(prompt_token_ids) == 0:
        raise InvalidArgumentError(f"{prompt_param}: must not be empty{of}", param=prompt_param)
    if len(prompt_token_ids) > max_model_len:
        raise PromptTooLongError(
            f"{prompt_param}: {what or 'the input'} has {len(prompt_token_ids)} tokens, more than the model's "
            f"maximum context length of {max_model_len} tokens; shorten it", param=prompt_param)
    check_token_ids_in_vocab(prompt_param, prompt_token_ids, vocab_size, what=what)
    config.check(params, model_name)
    if params.second_text_start is not None and params.second_text_start >= len(prompt_token_ids):
        raise InvalidArgumentError(f"second_text_start: {params.second_text_start} is past the end of the "
                                   f"{len(prompt_token_ids)}-token prompt{of}", param="second_text_start")


def parse_pooler_overrides(value: Any) -> dict[str, Any]:
    """--pooler-config / LLM(pooler_config=...) as vLLM spells it, the keys ferrox honours: pooling_type
    ("MEAN" | "CLS" | "LAST", any case) and normalize (bool). ValueError naming the key otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"pooler_config: must be a dict (JSON object), got {type(value).__name__}")
    unknown = sorted(set(value) - set(POOLER_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"pooler_config: {', '.join(unknown)} not supported (ferrox honours "
                         f"{', '.join(POOLER_CONFIG_KEYS)})")
    out: dict[str, Any] = {}
    if value.get("pooling_type") is not None:
        kind = value["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type: {kind!r} is not one of {', '.join(POOLING_TYPES)}")
        out["pooling_type"] = kind.upper()
    if value.get("normalize") is not None:
        if not isinstance(value["normalize"], bool):
            raise ValueError(f"pooler_config.normalize: must be true or false, got {value['normalize']!r}")
        out["normalize"] = value["normalize"]
    return out
