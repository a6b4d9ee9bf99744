"""What every route shares: body parsing, the model check, the max_tokens check, building
SamplingParams, the engine's request rules, chat-template rendering, SSE framing and logprob
formatting.

Errors name the request field at fault in OpenAI's `param`, read from the exception's `param`
(ferrox.errors), never parsed out of a message. The engine names fields as its own API spells them
("prompt", "logprobs"); each route renames the few that it receives under another name
(CHAT_FIELDS, COMPLETION_FIELDS, MESSAGES_FIELDS).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import types
import uuid
from collections.abc import AsyncGenerator, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from aiohttp import web
from pydantic import BaseModel, ValidationError

from ferrox.engine import validation
from ferrox.engine.async_llm import AsyncLLM, EngineOverloadedError, RequestTimeoutError
from ferrox.engine.defaults import GENERATION_DEFAULT_KEYS, generation_sampling_defaults
from ferrox.entrypoints.openai.errors import APIError, bad_request, from_exception, from_validation_error
from ferrox.entrypoints.openai.protocol import json_depth
from ferrox.entrypoints.openai.serving_lora import LoRAModule, LoRARegistry
from ferrox.errors import FerroxError, InvalidArgumentError
from ferrox.loader.chat_template import content_text
from ferrox.outputs import Logprob
from ferrox.reasoning import AnyReasoningParser, get_reasoning_parser
from ferrox.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from ferrox.lora.request import LoRARequest

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")

# JSON cannot carry -inf; clients get a very small finite number instead (as vLLM does).
_MIN_LOGPROB = -9999.0

# Engine field name -> the request field it comes from, per route (the rest are spelled alike).
CHAT_FIELDS = {"prompt": "messages", "logprobs": "top_logprobs"}
COMPLETION_FIELDS = {"prompt_logprobs": "logprobs"}
MESSAGES_FIELDS = {"prompt": "messages", "stop": "stop_sequences"}


logger = logging.getLogger("ferrox.server")

# Deeper JSON than any API body needs (a schema may nest MAX_SCHEMA_DEPTH levels inside one).
MAX_BODY_DEPTH = 128

# What a stream's client gets for a stall: its connection is dropped (nothing more can be sent to it).
DEFAULT_STREAM_STALL_TIMEOUT_S = 60.0


@dataclass(slots=True, frozen=True)
class ServerOptions:
    """The server-level settings of vLLM's serve flags (defaults: vLLM's)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""  # served under this prefix too (a proxy that does not strip it)
    enable_log_requests: bool = False
    max_log_len: int | None = None  # longest string a request log line shows in full
    # Defaults of the routes (vLLM's --response-role, --return-tokens-as-token-ids,
    # --enable-prompt-tokens-details, --tool-call-parser).
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    tool_call_parser: str | None = None
    # A stream whose client reads nothing for this long (its socket and aiohttp's buffer full, so a
    # write blocks) is dropped and its request aborted, freeing its KV blocks; None: wait forever.
    stream_stall_timeout: float | None = DEFAULT_STREAM_STALL_TIMEOUT_S
    # /metrics names' namespace (metrics/prometheus.py): "ferrox", or "vllm" for vLLM's dashboards.
    metrics_prefix: str = "ferrox"
    # --lora-modules: adapters loaded at start-up (entrypoints/openai/serving_lora.py).
    lora_modules: tuple[LoRAModule, ...] = ()
    # --lora-allowed-dirs: the only folders /v1/load_lora_adapter may read adapters from.
    lora_allowed_dirs: tuple[str, ...] = ()
    # vLLM's --trust-request-chat-template: without it a request's own chat_template is refused.
    trust_request_chat_template: bool = False
    # vLLM's --trust-request-mm-kwargs: without it a request's non-empty mm_processor_kwargs / media_io_kwargs
    # are refused.
    trust_request_mm_kwargs: bool = False
    # vLLM's --default-chat-template-kwargs: template variables under every request's own.
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))
    # vLLM's --chat-template-content-format: message contents as strings, OpenAI parts, or by the template.
    chat_template_content_format: str = "auto"
    # vLLM's --enable-force-include-usage: streamed chat and completions end with a usage chunk whether or not
    # the request's stream_options asked for one.
    enable_force_include_usage: bool = False
    # vLLM's --enable-server-load-tracking: GET /load counts the requests in the model routes.
    enable_server_load_tracking: bool = False
    # vLLM's --disable-fastapi-docs: no /openapi.json (ferrox serves no Swagger UI or ReDoc pages).
    disable_fastapi_docs: bool = False
    # vLLM's --enable-tokenizer-info-endpoint: GET /tokenizer_info (it shows the chat template and tokenizer config).
    enable_tokenizer_info_endpoint: bool = False
    # vLLM's --exclude-tools-when-tool-choice-none: a request's tools leave the prompt under tool_choice "none".
    exclude_tools_when_tool_choice_none: bool = False
    # vLLM's --log-error-stack: 4xx error responses are logged at info with the stack that raised them.
    log_error_stack: bool = False
    # vLLM's --h11-max-incomplete-event-size / --h11-max-header-count (its defaults): the request head's limits.
    # aiohttp bounds each line of the head (request line, every header) by the size rather than their sum.
    h11_max_incomplete_event_size: int = 4 << 20
    h11_max_header_count: int = 256
    # vLLM's --disable-access-log-for-endpoints: request paths (without the query) that leave no access-log line.
    access_log_excluded_paths: frozenset[str] = frozenset()
    # vLLM's --sse-keep-alive-interval: a chat or completions stream idle this many seconds gets an SSE comment
    # line (SSE_KEEP_ALIVE), so a proxy with a read timeout keeps the connection; 0: never.
    sse_keep_alive_interval: float = 0.0


class ServingContext:
    """The engine, the names this server answers to, its options, and its drain state."""

    def __init__(self, engine: AsyncLLM, served_model_name: str | list[str] | None = None,
                 options: ServerOptions | None = None) -> None:
        self.engine = engine
        # Every --served-model-name is answered to; responses name the first (vLLM's rule).
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        self.model_names: list[str] = names or [engine.model_name]
        self.model_name = self.model_names[0]
        self.options = options or ServerOptions()
        self.created = int(time.time())
        # Adapters, by the names clients use.
        self.loras = LoRARegistry(engine, self.model_name, allowed_dirs=self.options.lora_allowed_dirs)
        self.draining = False  # SIGTERM: new API requests get 503, running ones may finish
        # --reasoning-parser: the chat routes return a reasoning model's thinking apart from its answer.
        name = engine.config.reasoning_parser if engine is not None else None  # None: a test serving no engine
        self.reasoning: AnyReasoningParser | None = (get_reasoning_parser(name, engine.tokenizer.token_to_id)
                                                     if name else None)
        self.active_requests = 0  # API requests inside their handler (what a drain waits for)
        self.server_load = 0  # of those, the ones on LOAD_TRACKED_PATHS (GET /load, with the flag)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def limits(self) -> validation.RequestLimits:
        """What the engine can take, for the request rules (ferrox.engine.validation)."""
        return self.engine.limits

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (*self.model_names, self.engine.model_name) and \
                self.loras.get(model) is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.loras.get(model)

    def check_engine(self) -> None:
        if not self.engine.is_running:
            raise APIError(503, f"engine is not running: {self.engine.dead_reason or 'shut down'}")

    def as_token_ids(self, req: Any) -> bool:
        """return_tokens_as_token_ids: the request's, else the server's --return-tokens-as-token-ids."""
        given = getattr(req, "return_tokens_as_token_ids", None)
        return self.options.return_tokens_as_token_ids if given is None else bool(given)

    def starts_thinking(self, prompt_ids: list[int], template_kwargs: Mapping[str, Any] | None = None) -> bool:
        """Whether a reply starts inside the model's thinking (--reasoning-parser): the parser's rule for
        the request (Qwen3's enable_thinking), unless the prompt already closed the thinking -- the
        engine core's rule for where a structured output's grammar starts, so that the answer it
        constrains is the answer the routes return."""
        return self.reasoning is not None and self.reasoning.thinks(self.template_kwargs(template_kwargs)) \
            and not self.reasoning.prompt_ends_reasoning(prompt_ids)

    def keeps_special_tokens(self, tool_parser_needs: bool) -> bool:
        """Whether a reply is decoded with skip_special_tokens=False: its tool parser (tool_parser_needs) or the
        reasoning parser reads markers that are special tokens (Mistral's [TOOL_CALLS], gpt-oss's harmony), as
        vLLM's parsers ask -- unless the tokenizer keeps those markers in the text anyway (tokenizer_mode
        mistral): vLLM's parsers leave such a request alone, so <s> and </s> stay out of the reply."""
        if getattr(self.engine.tokenizer, "keeps_markers_in_text", False):
            return False
        return tool_parser_needs or self.reasoning_needs_special_tokens

    @property
    def reasoning_needs_special_tokens(self) -> bool:
        """The reasoning parser reads special tokens (gpt-oss's harmony markers): replies are decoded
        with skip_special_tokens=False, as the tool parsers that need them ask."""
        return self.reasoning is not None and self.reasoning.needs_special_tokens

    def template_kwargs(self, request_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The chat template's variables: --default-chat-template-kwargs, then the request's on top."""
        return {**self.options.default_chat_template_kwargs, **(request_kwargs or {})}

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int = 0,
              reasoning_tokens: int | None = None) -> dict[str, Any]:
        """usage, with prompt_tokens_details only under --enable-prompt-tokens-details, and
        completion_tokens_details.reasoning_tokens where the route counted them (as vLLM)."""
        usage = usage_body(prompt_tokens, completion_tokens,
                           cached if self.options.enable_prompt_tokens_details else None)
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage


class ServiceUnavailable(APIError):
    """A 503 that tells the client when to come back (Retry-After): overload or a draining server."""

    def __init__(self, message: str, *, code: str, retry_after: int = 1) -> None:
        super().__init__(503, message, code=code)
        self.retry_after = retry_after

    def response(self, anthropic: bool = False) -> web.Response:
        resp = super().response(anthropic)
        resp.headers["Retry-After"] = str(self.retry_after)
        return resp


def api_error(exc: BaseException, *, default_param: str | None = None,
              rename: Mapping[str, str] | None = None) -> APIError:
    """from_exception, plus the front-end's own limits: a full server is a 503 with Retry-After, a
    request past --request-timeout a 504 (it was aborted; nothing is wrong with its fields)."""
    if isinstance(exc, EngineOverloadedError):
        return ServiceUnavailable(str(exc), code="server_overloaded")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), code="request_timeout")
    return from_exception(exc, default_param=default_param, rename=rename)


# What a stream reports in-band once its headers are out (anything else ends the connection).
STREAM_ERRORS = (FerroxError, ValueError, EngineOverloadedError)


async def parse_body(request: web.Request, model: type[ModelT]) -> ModelT:
    """Read and validate a JSON body; 413 past client_max_size, 400 for bad JSON or fields."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # a chunked body (no Content-Length) past the limit
        # aiohttp's exception keeps neither size as an attribute: the limit is the request's.
        raise APIError(413, f"request body too large (limit {request.client_max_size} bytes)",
                       code="request_too_large") from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"invalid JSON body: {exc}", code="invalid_json") from None
    except RecursionError:  # thousands of nested brackets: json.loads gives up
        raise bad_request(f"the request body nests deeper than {MAX_BODY_DEPTH} levels", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    # The depth check (the checks below and pydantic recurse) and the surrogate check walk the whole body
    # in Python (~1 us per value: a 4k-token prompt is 4k values), so each runs only when the raw bytes
    # allow what it looks for.
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH and json_depth(body) > MAX_BODY_DEPTH:
        raise bad_request(f"the request body nests deeper than {MAX_BODY_DEPTH} levels", code="invalid_json")
    bad = _lone_surrogate_path(body) if _may_hold_surrogates(raw) else None
    if bad is not None:
        raise bad_request(f"{bad}: holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode text",
                          param=bad, code="invalid_value")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether json.loads could have produced a lone surrogate from these bytes: only a \\u escape
    in D800-DFFF does, or (json.loads decodes bytes with surrogatepass) UTF-8-encoded surrogates,
    which start with byte 0xED (as some Hangul syllables do too)."""
    return b"\\ud" in raw or b"\\uD" in raw or b"\xed" in raw


def _lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The field path ("messages.0.content", as pydantic spells it) of the first string holding a lone
    surrogate, else None. JSON may escape one (`"\\ud800"`) and json.loads accepts it, but no UTF-8
    tokenizer can encode it: refused here so every route answers 400 instead of failing later."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            found = _lone_surrogate_path(key, sub) or _lone_surrogate_path(item, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_path(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def check_max_tokens(ctx: ServingContext, num_prompt_tokens: int, requested: int | None) -> None:
    """OpenAI's rule: prompt + max_tokens must fit in the model's context (the offline engine clips
    max_tokens instead). A prompt that leaves no room at all is the request rules' to refuse
    (`validate_request`), naming the prompt; omitted max_tokens means up to the model's length."""
    room = ctx.max_model_len - num_prompt_tokens
    if requested is not None and room >= 1 and requested > room:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded",
        )


# n x max_tokens: the output one request may ask for, in multiples of the model's context. Each
# sample is already capped at max_model_len; this bounds the product (n up to 128 long samples
# would hold a server for one client), and is far above what n-best sampling needs.
MAX_OUTPUT_CONTEXTS = 64


def check_output_budget(ctx: ServingContext, samples: int, num_prompt_tokens: int, requested: int | None,
                        max_tokens_field: str) -> None:
    """n x max_tokens (omitted max_tokens: what the prompt leaves of max_model_len) within
    MAX_OUTPUT_CONTEXTS x max_model_len; a 400 naming `n` past it."""
    per_sample = requested if requested is not None else max(ctx.max_model_len - num_prompt_tokens, 1)
    limit = MAX_OUTPUT_CONTEXTS * ctx.max_model_len
    if samples * per_sample > limit:
        raise bad_request(
            f"n: {samples} samples x {per_sample} tokens ({max_tokens_field}"
            f"{'' if requested is not None else ' unset: up to max_model_len'}) = {samples * per_sample} output "
            f"tokens, more than one request may ask for ({limit} = {MAX_OUTPUT_CONTEXTS} x max_model_len); "
            f"lower n or {max_tokens_field}", param="n", code="invalid_value")


def request_ids(request: web.Request, req: Any, prefix: str) -> tuple[str, str]:
    """(the request's id, the X-Request-Id response header). As vLLM does, the id is built on the
    incoming X-Request-Id header, else the body's `request_id`, else a fresh uuid; the header echoes
    what the client sent (header first, then body) and is the id itself when it sent neither."""
    given = request.headers.get("X-Request-Id") or getattr(req, "request_id", None)
    request_id = f"{prefix}-{given or uuid.uuid4().hex}"
    return request_id, given or request_id


def check_priority(ctx: ServingContext, priority: int) -> None:
    """A priority means something only under the priority policy; under fcfs a non-zero one would be
    silently ignored, so it is refused (as vLLM does)."""
    policy = getattr(ctx.engine.config, "policy", "fcfs")
    if priority != 0 and policy != "priority":
        raise bad_request(f"priority: the server schedules with the {policy!r} policy; start it with "
                          "--policy priority to use request priorities", param="priority")


def truncate_prompt(ctx: ServingContext, ids: list[int], req: Any) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (the first k with truncation_side
    "right"); -1 means max_model_len."""
    k = getattr(req, "truncate_prompt_tokens", None)
    if k is None:
        return ids
    if k > ctx.max_model_len:
        raise bad_request(f"truncate_prompt_tokens: {k} is more than max_model_len ({ctx.max_model_len})",
                          param="truncate_prompt_tokens")
    if k == -1:
        k = ctx.max_model_len
    if len(ids) <= k:
        return ids
    return ids[:k] if req.truncation_side == "right" else ids[len(ids) - k:]


def validate_request(ctx: ServingContext, prompt_token_ids: list[int], params: SamplingParams,
                     fields: Mapping[str, str]) -> None:
    """The engine's request rules (ferrox.engine.validation) on one tokenized prompt, before anything
    is queued: a 400 naming the field, spelled for the route by `fields`."""
    try:
        if ctx.reasoning is not None and ctx.reasoning.end_token_id is None:
            _check_multi_token_reasoning_end(ctx.reasoning.name, params)
        validation.validate_request(prompt_token_ids, params, ctx.limits)
    except FerroxError as exc:
        raise from_exception(exc, rename={"extra_args": "vllm_xargs", **fields}) from None


def _check_multi_token_reasoning_end(parser: str, params: SamplingParams) -> None:
    """gpt-oss's thinking ends with several tokens (`<|channel|>final<|message|>`), where the engine's
    grammar gate and thinking budget take one: both are refused rather than applied in the wrong place."""
    if params.structured_outputs is not None:
        raise InvalidArgumentError(
            f"structured_outputs: a structured output (response_format, structured_outputs, or a tool_choice that "
            f"forces a call) is not supported with --reasoning-parser {parser}: its thinking does not end at one "
            "token, where the grammar would start", param="structured_outputs")
    if params.thinking_token_budget is not None:
        raise InvalidArgumentError(f"thinking_token_budget: not supported with --reasoning-parser {parser}: its "
                                   "thinking does not end at one token the budget could force",
                                   param="thinking_token_budget")


def build_sampling_params(
    req: Any,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    stream: bool,
    prompt_logprobs: int | None = None,
    structured: Any = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """Map an OpenAI-style request onto SamplingParams (vLLM names); a bad field is a 400 naming it."""
    if (getattr(req, "spaces_between_special_tokens", False) and not getattr(req, "skip_special_tokens", True)
            and "spaces_between_special_tokens" in getattr(req, "model_fields_set", ())):
        # The Rust detokenizer joins special tokens as the tokenizer decodes them, with no space.
        raise bad_request("spaces_between_special_tokens: only false is supported with skip_special_tokens false "
                          "(special tokens are joined without spaces)", param="spaces_between_special_tokens")
    kwargs: dict[str, Any] = dict(
        n=req.n,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=req.stop_list() or None,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        logprob_token_ids=named_logprob_ids(req, logprobs),
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=getattr(req, "bad_words", None) or None,
        structured_outputs=structured,
        thinking_token_budget=getattr(req, "thinking_token_budget", None),
        repetition_detection=getattr(req, "repetition_detection", None),
        extra_args=getattr(req, "vllm_xargs", None) or None,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )
    kwargs.update(sampling_knobs(defaults, **{name: getattr(req, name) for name in GENERATION_DEFAULT_KEYS}))
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError, msgspec.ValidationError) as exc:
        raise from_exception(exc) from None


def named_logprob_ids(req: Any, logprobs: int | None) -> list[int] | None:
    """The request's logprob_token_ids (vLLM's: these ids' logprobs replace the top alternatives at each
    generated position). As in vLLM the logprobs switch still turns the output on, so without it they
    would do nothing: refused by name rather than ignored."""
    ids = getattr(req, "logprob_token_ids", None)
    if ids and logprobs is None:
        raise bad_request("logprob_token_ids: needs logprobs (chat: \"logprobs\": true; completions: \"logprobs\": "
                          "a number) to return anything", param="logprob_token_ids")
    return ids or None


def check_request_template(ctx: ServingContext, chat_template: str | None) -> None:
    """vLLM's rule: a request's own chat template is code (even in the jinja2 sandbox); the operator
    opts in with --trust-request-chat-template."""
    if chat_template is not None and not ctx.options.trust_request_chat_template:
        raise APIError(400, "chat_template: this server does not take a request's chat template (start it with "
                       "--trust-request-chat-template to allow one)", param="chat_template")


def check_request_mm_kwargs(ctx: ServingContext, **fields: dict[str, Any] | None) -> None:
    """vLLM's rule: a request's own multimodal processor and media loader settings change how the server
    processes inputs (and what that costs it); the operator opts in with --trust-request-mm-kwargs. A field
    left out, null or {} is no request for them."""
    if ctx.options.trust_request_mm_kwargs:
        return
    for name, value in fields.items():
        if value:
            raise APIError(400, f"{name}: this server does not take a request's {name} (start it with "
                           "--trust-request-mm-kwargs to allow them)", param=name)


def render_chat(ctx: ServingContext, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """Render a conversation with the model's chat template (or the server's / request's override)."""
    if ctx.reasoning is not None:
        try:  # what the parser's model cannot take (gpt-oss: a reasoning_effort it does not know)
            ctx.reasoning.check_template_kwargs(ctx.template_kwargs(template_kwargs))
        except FerroxError as exc:
            raise from_exception(exc) from None
        # gpt-oss's template reads an earlier turn's thinking as `thinking` (harmony.py).
        messages = ctx.reasoning.template_messages(messages)
    # A tokenizer that encodes chats itself (tokenizer_mode mistral) leaves the last message open on request.
    encodes_chats = getattr(ctx.engine.tokenizer, "encodes_chats", False)
    try:
        text = ctx.engine.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template=chat_template or ctx.engine.chat_template,
            content_format=ctx.options.chat_template_content_format,
            **ctx.template_kwargs(template_kwargs),
            **({"continue_final_message": True} if encodes_chats and continue_final_message else {}),
        )
    except Exception as exc:  # jinja errors, missing template: the caller's input is at fault
        raise bad_request(f"chat template: {exc}", param="messages") from None
    if continue_final_message and messages and not encodes_chats:
        # Let the model continue the last (assistant) message: cut what the template adds after it.
        last = content_text(messages[-1].get("content"))
        cut = text.rfind(last) if last else -1
        if cut >= 0:
            text = text[: cut + len(last)]
    return text


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finite(logprob: float) -> float:
    return logprob if logprob > _MIN_LOGPROB else _MIN_LOGPROB


def top_entries(position: dict[int, Logprob], n: int, named: list[int] | None = None) -> list[tuple[int, Logprob]]:
    """The top-n alternatives at one position, by rank; or, for a request that named them
    (logprob_token_ids), those ids in the order given."""
    if named:
        return [(tid, position[tid]) for tid in dict.fromkeys(named) if tid in position]
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= n]
    ranked.sort(key=lambda item: item[1].rank or 0)
    return ranked[:n]


def chosen_entry(position: dict[int, Logprob], token_id: int) -> Logprob:
    return position.get(token_id) or next(iter(position.values()))


def token_text(token_id: int, lp: Logprob, as_token_ids: bool) -> str:
    """A token as logprobs show it: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids,
    for tokens whose text is not valid UTF-8 on its own)."""
    return f"token_id:{token_id}" if as_token_ids else (lp.decoded_token or "")


def prompt_logprobs_body(prompt_logprobs: list[dict[int, Logprob] | None] | None,
                         as_token_ids: bool = False) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` in a response: per prompt position None (the first) or
    {token id: {"logprob", "rank", "decoded_token"}}."""
    if prompt_logprobs is None:
        return None
    return [
        None if position is None else {
            str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank,
                       "decoded_token": token_text(tid, lp, as_token_ids)}
            for tid, lp in position.items()
        }
        for position in prompt_logprobs
    ]


def sampling_knobs(defaults: Mapping[str, Any] | None, **given: Any) -> dict[str, Any]:
    """temperature, top_p, top_k, min_p, repetition_penalty: each as the request gave it (None: not
    given, or a field the route's API lacks), else the model's generation_config default
    (--generation-config), else left to SamplingParams (temperature 1, no truncation). One rule
    for every route, as vLLM applies the model's defaults on each."""
    model = generation_sampling_defaults(defaults)
    out: dict[str, Any] = {}
    for name in GENERATION_DEFAULT_KEYS:
        value = given.get(name)
        if value is None:
            value = model.get(name)
        if value is not None:
            out[name] = value
    return out


def usage_body(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; prompt_tokens_details when `cached` is given (ServingContext.usage decides)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


# ---- SSE -----------------------------------------------------------------------------------------


async def first_output(outputs: AsyncGenerator[T, None], default_param: str,
                       fields: Mapping[str, str] | None = None, *, request: web.Request | None = None,
                       headers: Mapping[str, str] | None = None) -> T | None:
    """Pull a stream's first output before any header is sent, so a request the engine rejects is
    still a plain 4xx (naming the field; `default_param` when the error names none) or 503 rather
    than a broken stream; None if it ends at once.

    With --sse-keep-alive-interval and the stream's `request` (and its `headers`), a first output slower
    than the interval starts the stream meanwhile (start_sse with keep-alive comments), so a request
    that waits in the queue or through a long prefill keeps its connection through a proxy's read
    timeout, as vLLM's does; an error after that goes in-band (the error middleware writes it into
    the started stream)."""
    try:
        interval = _keep_alive_interval(request)
        if request is None or not interval:
            return await anext(outputs)
        return await _first_with_keep_alive(outputs, request, headers, interval)
    except StopAsyncIteration:
        return None
    except (FerroxError, ValueError) as exc:
        raise api_error(exc, default_param=default_param, rename=fields) from None
    except BaseException:
        await outputs.aclose()
        raise


def _keep_alive_interval(request: web.Request | None) -> float:
    ctx = request.app.get(CTX) if request is not None else None
    return ctx.options.sse_keep_alive_interval if ctx is not None else 0.0


async def _first_with_keep_alive(outputs: AsyncGenerator[T, None], request: web.Request,
                                 headers: Mapping[str, str] | None, interval: float) -> T:
    pending = asyncio.ensure_future(anext(outputs))  # (a task: waiting on it with a timeout does not cancel it)
    try:
        done, _ = await asyncio.wait({pending}, timeout=interval)
        if not done:
            stream = await start_sse(request, headers, keep_alive=True)
            await stream.write(SSE_KEEP_ALIVE)  # the headers go out with it; the stream's own timer goes on
        return await pending
    except BaseException:
        pending.cancel()  # (the handler was cancelled: the client left) the pending step ends, aborting the request
        with contextlib.suppress(BaseException):
            await pending
        raise


def stream_error_event(exc: Exception) -> bytes:
    """Headers are gone once a stream has started: a failure is reported in-band, as OpenAI does
    (503 when the engine died, 504 past the request timeout, 400 otherwise); the stream then ends
    with [DONE]."""
    return sse_event(api_error(exc).openai_body())


class SSEResponse(web.StreamResponse):
    """An event stream whose writes may block for at most `stall_timeout` seconds. aiohttp blocks a
    write while the client's socket and its own buffer are full (write back-pressure), which keeps
    memory bounded but would let a client that stops reading hold its request, and its KV blocks,
    for as long as it likes; past the limit the connection is dropped, which cancels the handler
    like any disconnect and so aborts the request in the engine. Only this stream waits meanwhile:
    the engine and other streams run on (outputs of a waiting DELTA stream are merged in AsyncLLM)."""

    def __init__(self, request: web.Request, stall_timeout: float | None, headers: Mapping[str, str]) -> None:
        super().__init__(status=200, headers=headers)
        self.request = request
        self.stall_timeout = stall_timeout
        self._last_write = time.monotonic()
        self._ended = False
        self._keep_alive_sender: asyncio.Task[None] | None = None

    def send_keep_alives(self, interval: float) -> None:
        """vLLM's --sse-keep-alive-interval: an SSE comment whenever nothing was written for `interval` s."""
        self._last_write = time.monotonic()
        self._keep_alive_sender = asyncio.get_running_loop().create_task(self._send_keep_alives(interval))

    async def _send_keep_alives(self, interval: float) -> None:
        try:
            while not self._ended:
                await asyncio.sleep(self._last_write + interval - time.monotonic())
                if not self._ended and time.monotonic() - self._last_write >= interval:
                    await self.write(SSE_KEEP_ALIVE)
        except Exception:  # noqa: BLE001 - the client went away: the handler finds out at its own next write
            return

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self._last_write = time.monotonic()
        await self._bounded(super().write(data), len(data))

    async def write_eof(self, data: bytes = b"") -> None:
        """End the stream; `data` (the last events) goes out with the terminating chunk in one write."""
        self._ended = True
        if self._keep_alive_sender is not None:
            self._keep_alive_sender.cancel()
        await self._bounded(super().write_eof(data), len(data))

    async def _bounded(self, write: Coroutine[Any, Any, None], size: int) -> None:
        transport = self.request.transport
        if (self.stall_timeout is None or transport is None
                or transport.get_write_buffer_size() + size < transport.get_write_buffer_limits()[1]):
            # Below the transport's high-water mark the protocol is not paused, so the write does
            # not wait and needs no timer: a wait_for (a task and a timer handle per event) cost
            # ~10% of the server's CPU per streamed token.
            return await write
        try:
            await asyncio.wait_for(write, self.stall_timeout)
        except TimeoutError:
            logger.warning("dropping the stream of %s %s: its client read nothing for %gs (--stream-stall-timeout)",
                           self.request.method, self.request.path, self.stall_timeout)
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            # The same path as a client that disconnected: the handler unwinds, closing its generator.
            raise asyncio.CancelledError() from None


# The request's stream once started (start_sse): started early (first_output), it is the one the route writes.
SSE_STARTED = "ferrox.sse_response"
# vLLM's SSE keep-alive: a comment line, which SSE clients skip.
SSE_KEEP_ALIVE = b": keep-alive\n\n"


async def start_sse(request: web.Request, headers: Mapping[str, str] | None = None, *,
                    keep_alive: bool = False) -> SSEResponse:
    """The request's event stream, prepared (its headers out) on the first call. keep_alive: send
    --sse-keep-alive-interval's comments while it is idle (vLLM's: chat and completions streams)."""
    started = request.get(SSE_STARTED)
    if isinstance(started, SSEResponse):
        return started
    ctx = request.app.get(CTX)
    stall = ctx.options.stream_stall_timeout if ctx is not None else DEFAULT_STREAM_STALL_TIMEOUT_S
    resp = SSEResponse(request, stall, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                        "Connection": "keep-alive", **(headers or {})})
    await resp.prepare(request)
    request[SSE_STARTED] = resp
    interval = _keep_alive_interval(request) if keep_alive else 0.0
    if interval:
        resp.send_keep_alives(interval)
    return resp


def sse_event(payload: Any, event: str | None = None) -> bytes:
    """One server-sent event: `data: <JSON>` (after `event: <name>` when named) and a blank line."""
    data = payload if isinstance(payload, bytes) else msgspec.json.encode(payload)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + data + b"\n\n"


async def send_sse(resp: web.StreamResponse, payload: Any, event: str | None = None) -> None:
    await resp.write(sse_event(payload, event))


SSE_DONE = b"data: [DONE]\n\n"


async def end_sse(resp: web.StreamResponse, tail: list[bytes]) -> None:
    """Write the stream's held-back last events (its final chunk, usage, [DONE]) with the end of the
    response: one write instead of one per event plus the terminating chunk, which adds up when a
    wave of requests finishes in the same step."""
    await resp.write_eof(b"".join(tail))


def json_response(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json",
                        headers=headers)


CTX = web.AppKey("ctx", ServingContext)
