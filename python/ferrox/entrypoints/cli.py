"""The `ferrox` console script.

    ferrox serve [MODEL] [--port 8000] [--api-key KEY] [--max-model-len N] ...

Engine flags are generated from `ferrox.config.EngineConfig`'s dataclass fields (the same
arguments as `LLM(...)`): `--` + the field name with dashes, the type from the annotation,
bools as `--x/--no-x` or `--enable-x/--disable-x` (SwitchAction: vLLM's partner spellings, for the
written-out server switches too), help text, choices and the documented default from the field's
metadata; so a field added to EngineConfig is a flag here with no second edit. Server flags
(host, port, api key, body limit, log level) are not engine config and stay written out here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

import ferrox
from ferrox.config import EngineConfig  # imports no torch: the API server process stays torch-free
from ferrox.engine.defaults import resolve_generation_defaults
from ferrox.entrypoints.openai.tool_parsers.plugin import load_tool_parser_plugin, plugin_path
from ferrox.logging_config import CONFIG_PATH_ENV, configure_logging
from ferrox.plugin_files import flag_value
from ferrox.reasoning.plugin import FLAG as REASONING_FLAG
from ferrox.reasoning.plugin import load_reasoning_parser_plugin
from ferrox.speculative_config import SPEC_SHORTHANDS

logger = logging.getLogger("ferrox.serve")

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_size(text: str) -> int:
    """'536870912', '512MiB', '2GiB', '1.5GB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or a unit: 512MiB, 2GiB, 1GB)")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to a flag's help unless the help already states its default (the
    generated engine flags always do), so no default is printed twice."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, SwitchAction):  # the flag and its partner; the hidden --no-enable-x kind left out
            return ", ".join(action.shown_option_strings)
        return super()._format_action_invocation(action)


class SwitchAction(argparse.Action):
    """Every boolean flag of `ferrox serve`, with vLLM's partner spellings (its EnableDisableAction):
    `--x` also takes `--no-x`; `--enable-x` takes `--disable-x` and `--no-enable-x`; `--disable-x` takes
    `--enable-x` and `--no-disable-x`. A partner sets the opposite value; the last spelling given wins.
    --help shows each flag with its partner, and leaves out the `--no-enable-x` / `--no-disable-x` ones
    (vLLM hides them too). The serve parser registers this class for `action="store_true"`, so a switch
    written out by hand gets its partners as the engine's generated ones do.

    `refuse_inverse`: why ferrox cannot do what the opposite value asks (cascade attention, say); a
    partner spelling then stops the parse naming itself, rather than being accepted and ignored."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = False, required: bool = False,
                 help: str | None = None, refuse_inverse: str | None = None, deprecated: bool = False) -> None:
        shown_inverses: list[str] = []
        hidden: list[str] = []
        for flag in option_strings:
            if not flag.startswith("--"):  # a short form (-ep) has no partner, as in vLLM
                continue
            for prefix, other in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
                if flag.startswith(prefix):
                    shown_inverses.append(other + flag.removeprefix(prefix))
                    hidden.append("--no-" + flag[2:])
                    break
            else:
                shown_inverses.append("--no-" + flag[2:])
        super().__init__([*option_strings, *shown_inverses, *hidden], dest, nargs=0, default=default,
                         required=required, help=help)
        # (a refused partner stays out of --help: it is there only to be refused by name)
        self.shown_option_strings = list(option_strings) if refuse_inverse else [*option_strings, *shown_inverses]
        self.inverse_option_strings = frozenset(shown_inverses + hidden)
        self.refuse_inverse = refuse_inverse

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        inverse = option_string in self.inverse_option_strings
        if inverse and self.refuse_inverse:
            parser.error(f"{option_string}: {self.refuse_inverse}")
        setattr(namespace, self.dest, not inverse)

    def format_usage(self) -> str:
        return " | ".join(self.shown_option_strings)

    def spelling(self, value: bool) -> str:
        """A spelling that sets `value` (--config FILE.yaml's `flag: false`)."""
        return self.option_strings[0] if value else min(self.inverse_option_strings)


# ---- engine flags, generated from EngineConfig ------------------------------------------------------
def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def parse_json_object(text: str) -> dict[str, Any]:
    """A dict-valued engine flag (--speculative-config) takes a JSON object, as vLLM's does."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def _value_type(annotation: Any) -> Any:
    """`int | None` -> int, `bool` -> bool, `dict[...] | None` -> a JSON-object parser; a field type the
    CLI cannot parse is a TypeError."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"EngineConfig field type {annotation!r} has no CLI mapping")
        annotation = args[0]
    if typing.get_origin(annotation) is dict:
        return parse_json_object
    if annotation not in (bool, int, float, str):
        raise TypeError(f"EngineConfig field type {annotation!r} has no CLI mapping")
    return typing.cast(type, annotation)


def engine_help(field: dataclasses.Field[Any]) -> str:
    """The field's help text with its default stated once: the documented default where the
    value alone does not say it (None = auto, device-dependent), else the value itself."""
    # tests/test_config_cli.py requires "help" on every field and "default_help" where the default
    # is None; the fallbacks only keep `ferrox serve` usable if a new field lacks them.
    meta = field.metadata
    default = meta.get("default_help")
    if default is None:
        default = "auto" if field.default is None else field.default
    return f"{meta.get('help', field.name.replace('_', ' '))} (default: {default})".replace("%", "%%")


def add_engine_args(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> None:
    """One argument per EngineConfig field (the positional MODEL goes on `parser` itself)."""
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        meta = field.metadata
        help_text = engine_help(field)
        if meta.get("nargs"):  # a name or several (--served-model-name a b)
            group.add_argument(flag_name(field.name), *meta.get("aliases", ()), dest=field.name, nargs=meta["nargs"],
                               type=meta.get("item_type", str), default=field.default, help=help_text)
            continue
        value_type = _value_type(hints[field.name])
        if meta.get("positional"):
            parser.add_argument(field.name, nargs="?", type=value_type, default=field.default, help=help_text)
            continue
        flags = [flag_name(field.name), *meta.get("aliases", ())]
        if value_type is bool:  # --x / --no-x, --enable-x / --disable-x (SwitchAction)
            group.add_argument(*flags, dest=field.name, action=SwitchAction, default=field.default, help=help_text,
                               refuse_inverse=meta.get("refuse_inverse"))
        else:
            group.add_argument(*flags, dest=field.name, type=parse_size if meta.get("size") else value_type,
                               choices=meta.get("choices"), default=field.default, help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    _check_names_are_not_the_model(args)
    shorthands = {name: getattr(args, name, None) for name in SPEC_SHORTHANDS}  # --spec-method ...
    return EngineConfig.from_kwargs(**{name: getattr(args, name) for name in EngineConfig.field_names()},
                                    **{name: value for name, value in shorthands.items() if value is not None})


def _check_names_are_not_the_model(args: argparse.Namespace) -> None:
    """`--served-model-name NAME MODEL` reads MODEL as a second name (the flag takes several, as vLLM's),
    and ferrox, whose MODEL is optional, would then serve its embedded model under both: refuse that."""
    names = args.served_model_name
    if args.model is None and isinstance(names, list):
        for name in names[1:]:
            if os.path.exists(name) or name.endswith(".gguf"):
                raise ValueError(f"--served-model-name: {name!r} looks like the model path, which the flag took as "
                                 f"a second name; put MODEL before --served-model-name, or write "
                                 f"--served-model-name={names[0]}")


# ---- parser ---------------------------------------------------------------------------------------
def parse_json_list(text: str) -> list[str]:
    """--allowed-origins '["https://a.example"]' (vLLM's JSON lists); a bare word is a list of one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = [text]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer: {text!r}")
    return value


def _token_count(text: str) -> int:
    """A count of tokens >= 0 as vLLM's human-readable integers: 2048, 25.6k / 1m (x 1000s), 1K / 2M (x 1024s)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)([kmgtKMGT]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (an integer, or 1k = 1000, 1K = 1024)")
    number, unit = match.groups()
    if unit.isupper() and "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: {unit} multiplies by a power of 1024, which takes whole "
                                         f"numbers (write {number}{unit.lower()} for a power of 1000)")
    if not unit:
        if "." in number:
            raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
        return int(number)
    power = "kmgt".index(unit.lower()) + 1
    return int(number) * 1024 ** power if unit.isupper() else int(float(number) * 1000 ** power)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


# vLLM's --uvicorn-log-level choices -> logging levels.
_LOG_LEVELS = {"critical": "CRITICAL", "error": "ERROR", "warning": "WARNING", "info": "INFO", "debug": "DEBUG",
               "trace": "DEBUG"}


def _add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ferrox.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from ferrox.loader.chat_template import CONTENT_FORMATS

    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI- and Anthropic-compatible HTTP API",
        description="Serve MODEL (a Hugging Face folder, a .gguf file, or a model id such as org/name in the local "
        "Hugging Face cache; default: the embedded SmolLM2-135M-Instruct) with the OpenAI API (/v1/chat/completions, "
        "/v1/completions, /v1/responses, /v1/models; /v1/embeddings, /pooling, /score, /rerank and /classify for a "
        "pooling model, see --runner), the Anthropic Messages API (/v1/messages), /tokenize, "
        "/detokenize, /health, /version and Prometheus /metrics. vLLM's flags are accepted with vLLM's meaning; "
        "a flag ferrox lacks is refused by name.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # an unknown vLLM flag must not pass as the prefix of a ferrox one
    )
    p.register("action", "store_true", SwitchAction)  # every switch gets vLLM's partner spellings
    server = p.add_argument_group("server")
    server.add_argument("--model", dest="model_flag", metavar="MODEL",
                        help="the model, as vLLM's --model (the positional MODEL wins when both are given) (default: MODEL)")
    server.add_argument("--config", metavar="FILE.yaml",
                        help="read flags from a YAML file of `flag: value` lines (vLLM's --config); flags on the "
                        "command line win (default: none)")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: pick a free one)")
    server.add_argument("--uds", help="listen on this Unix domain socket path instead of --host/--port "
                        "(default: TCP)")
    server.add_argument("--api-server-count", "-asc", type=_one_api_server, default=1, metavar="1",
                        help="API server processes: one (ferrox's front-end is one aiohttp process beside the "
                        "engine cores; more are refused)")
    server.add_argument("--api-key", default=os.environ.get("FERROX_API_KEY"),
                        help="require this key (Authorization: Bearer KEY or x-api-key) on API routes; "
                        "/health, /metrics and /version stay open (default: $FERROX_API_KEY)")
    server.add_argument("--h11-max-incomplete-event-size", type=parse_size, default=4 << 20, metavar="BYTES",
                        help="longest request head line (request line or header) the server reads, vLLM's h11 limit "
                        "(aiohttp applies it to each line rather than their sum); longer gets HTTP 400")
    server.add_argument("--h11-max-header-count", type=int, default=256,
                        help="most headers a request may carry (vLLM's h11 limit); more gets HTTP 400")
    server.add_argument("--max-request-body-bytes", type=parse_size, default=32 << 20,
                        help="larger request bodies get HTTP 413 (accepts units: 1MiB)")
    server.add_argument("--root-path", default="",
                        help="serve every route also under this path prefix (behind a proxy that keeps it) (default: none)")
    server.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM) (default: plain HTTP)")
    server.add_argument("--ssl-keyfile", help="the certificate's private key (PEM) (default: in --ssl-certfile)")
    server.add_argument("--ssl-ca-certs", help="CA certificates to verify client certificates with (default: none)")
    server.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                        help="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)")
    server.add_argument("--ssl-ciphers", metavar="CIPHERS",
                        help="the cipher suites HTTPS offers for TLS 1.2 and below, an OpenSSL cipher list (e.g. "
                        "'ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305'); TLS 1.3's are not chosen this "
                        "way (default: Python's)")
    server.add_argument("--allowed-origins", type=parse_json_list, default=["*"],
                        help="CORS: origins allowed, a JSON list")
    server.add_argument("--allowed-methods", type=parse_json_list, default=["*"],
                        help="CORS: methods allowed, a JSON list")
    server.add_argument("--allowed-headers", type=parse_json_list, default=["*"],
                        help="CORS: request headers allowed, a JSON list")
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    load = p.add_argument_group("load and shutdown")
    load.add_argument("--max-num-queued-reqs", type=_positive_int,
                      help="most requests in flight (waiting + running; n > 1 counts n, as vLLM counts them): "
                      "past it a new request gets HTTP 503 with Retry-After at once (default: no limit)")
    load.add_argument("--max-num-queued-tokens", type=_token_count, metavar="TOKENS",
                      help="a time-to-first-token bound (vLLM's): while the prompts admitted and still without a "
                      "first output hold this many tokens or more (each whole, cached or partly computed ones "
                      "included; n > 1 counts each sample's), a new request gets HTTP 503 with Retry-After at once; "
                      "takes 1k = 1000, 1K = 1024 (default: no limit)")
    load.add_argument("--sse-keep-alive-interval", type=_non_negative_int, default=0, metavar="SECONDS",
                      help="send an SSE comment line (': keep-alive') on a /v1/chat/completions or /v1/completions "
                      "stream idle this long -- waiting in the queue, in prefill or between tokens -- so that a "
                      "proxy with a read timeout keeps the connection (vLLM's); 0: never")
    load.add_argument("--stream-interval", type=_positive_int, default=1, metavar="TOKENS",
                      help="tokens a streamed chunk gathers before it is sent (the first and the last chunk go at "
                      "once): larger values send fewer, larger chunks, for many concurrent streams; a request's "
                      "stream_interval wins (default: 1, every token)")
    load.add_argument("--request-timeout", type=_positive_float, metavar="SECONDS",
                      help="abort a request still running this long after it arrived, freeing its KV cache; "
                      "its client gets an error saying so (default: none)")
    load.add_argument("--metrics-prefix", choices=("ferrox", "vllm"), default="ferrox",
                      help="the namespace of /metrics' names: ferrox:num_requests_running..., or vllm: so that "
                      "Prometheus queries and Grafana dashboards written for vLLM read this server unchanged")
    load.add_argument("--stream-stall-timeout", type=_positive_float, metavar="SECONDS", default=60.0,
                      help="drop a stream whose client has read nothing for this long (its writes blocked) "
                      "and abort its request")
    load.add_argument("--enable-server-load-tracking", action="store_true",
                      help="count the requests in the model routes (chat, completions, Responses, Messages, "
                      "embeddings, pooling, score, rerank, classify) for GET /load's server_load (vLLM's; "
                      "without it /load says 0)")
    load.add_argument("--shutdown-timeout", type=_non_negative_float, metavar="SECONDS", default=0.0,
                      help="on SIGTERM, refuse new requests (503) and let running ones finish for up to this "
                      "long before aborting them; 0 aborts them at once (vLLM's default). A second signal "
                      "stops waiting")
    logs = p.add_argument_group("logging")
    logs.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                      choices=list(_LOG_LEVELS), help="logging verbosity (trace = debug)")
    logs.add_argument("--disable-uvicorn-access-log", "--disable-access-log", action="store_true",
                      help="no access log line per HTTP request (vLLM's flag name; ferrox serves with aiohttp)")
    logs.add_argument("--disable-access-log-for-endpoints", metavar="PATHS",
                      help="comma-separated request paths that leave no access log line, e.g. '/health,/metrics' "
                      "(matched exactly, without the query string; vLLM's) (default: none)")
    logs.add_argument("--enable-log-requests", action="store_true",
                      help="log each API request at info: its id, route and parameters")
    logs.add_argument("--enable-log-outputs", action="store_true",
                      help="with --enable-log-requests, also log each finished choice's text, token ids and finish "
                      "reason (a stream's whole answer, once)")
    logs.add_argument("--enable-log-deltas", action="store_true", default=True,
                      help="with --enable-log-outputs, also log each delta of a streamed answer as it is sent "
                      "(vLLM's)")
    logs.add_argument("--log-config-file", metavar="FILE.json",
                      help="a JSON object for logging.config.dictConfig (vLLM's flag; also $VLLM_LOGGING_CONFIG_PATH), "
                      "applied in the API server and every engine core; then --log-level does not apply "
                      "(default: ferrox's line format at --log-level)")
    logs.add_argument("--log-error-stack", action="store_true",
                      help="log every error response with the stack trace that raised it (4xx at info; 5xx are "
                      "always logged with theirs)")
    logs.add_argument("--max-log-len", type=int, help="longest prompt string or id list a request log line shows "
                      "in full (default: no limit)")
    api = p.add_argument_group("API defaults")
    api.add_argument("--response-role", default="assistant",
                     help="role of the generated chat message when the request's add_generation_prompt is true")
    api.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help="logprobs name tokens as 'token_id:N' unless a request says otherwise")
    api.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="usage.prompt_tokens_details (cached_tokens: prompt tokens found in the prefix cache) in "
                     "every response's usage")
    api.add_argument("--enable-force-include-usage", action="store_true",
                     help="streamed chat and completions end with a usage chunk even when the request's "
                     "stream_options does not ask for one (vLLM's)")
    api.add_argument("--enable-request-id-headers", action="store_true",
                     help="vLLM's switch for an X-Request-Id header on responses; ferrox always sends one (the "
                     "client's own X-Request-Id, else the request's id), so it is on with or without this",
                     refuse_inverse="ferrox always sends X-Request-Id (the client's own, else the request's id; its "
                     "logs and errors name requests by it) and has no switch to leave it out")
    api.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                     help="a request's tools stay out of the prompt when its tool_choice is \"none\" (default: "
                     "they are rendered, only never called, as vLLM's)")
    api.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                     help="serve GET /tokenizer_info: the tokenizer's configuration and the chat template "
                     "(vLLM's; off by default since it exposes them)")
    api.add_argument("--disable-fastapi-docs", action="store_true",
                     help="do not serve /openapi.json (vLLM's flag, which also drops its Swagger UI and ReDoc "
                     "pages; ferrox has none)")
    api.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="tool_choice 'auto' (parse tool calls out of the model's text; ferrox always does, "
                     "so this vLLM flag is accepted and changes nothing)",
                     refuse_inverse="ferrox always parses tool calls for tool_choice 'auto'; it has no switch to "
                     "refuse such requests, as vLLM does without --enable-auto-tool-choice")
    api.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                     help="how tool calls are read from the model's text (default: from the chat template: "
                     "mistral for templates writing [TOOL_CALLS], qwen3_coder for <function=...><parameter=...>, "
                     "llama3_json for Llama 3 templates, else hermes)")
    api.add_argument("--tool-parser-plugin", metavar="FILE.py",
                     help="a Python file run at start-up that registers tool parsers (ferrox's ToolParser with "
                     "register_tool_parser(NAME)), which --tool-call-parser NAME then takes (default: none)")
    api.add_argument("--generation-config", default="auto",
                     help="sampling defaults: 'auto' (the model's generation_config.json), 'vllm' (none: "
                     "temperature 1.0...), or a folder holding a generation_config.json")
    api.add_argument("--override-generation-config", type=parse_json_object,
                     help="a JSON object of sampling defaults laid over --generation-config's (default: none)")
    api.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                     help="LoRA adapters to serve (needs --enable-lora): name=path, or a JSON object "
                     "{\"name\": ..., \"path\": ...}; a request picks one by naming it in `model` (default: none)")
    api.add_argument("--lora-allowed-dirs", nargs="+", default=[], metavar="DIR",
                     help="folders /v1/load_lora_adapter may load adapters from (with VLLM_ALLOW_RUNTIME_LORA_UPDATING; "
                     "default: none, so run-time loading is refused)")
    api.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept a request's own chat_template (rendered in a jinja2 sandbox; default: refused, as vLLM)")
    api.add_argument("--trust-request-mm-kwargs", action="store_true",
                     help="accept a request's own mm_processor_kwargs and media_io_kwargs (chat completions, "
                     "/tokenize: its image processor and video loader settings over the server's; default: a "
                     "non-empty one is refused with a 400, as vLLM)")
    api.add_argument("--chat-template-content-format", choices=list(CONTENT_FORMATS), default="auto",
                     help="message contents as the chat template gets them: 'string' (text parts joined by "
                     "newlines), 'openai' (a list of {\"type\": \"text\", \"text\": ...} parts) or 'auto' (openai "
                     "for templates that loop over a message's content, else string; default)")
    api.add_argument("--default-chat-template-kwargs", type=parse_json_object, default=None,
                     help="chat template variables for every request, as a JSON object (e.g. '{\"enable_thinking\": "
                     "false}' for Qwen3); a request's chat_template_kwargs / reasoning_effort win (default: none)")
    api.add_argument("--download-dir", help="the Hugging Face cache to find model ids in (default: $HF_HUB_CACHE, "
                     "else $HF_HOME/hub); nothing is downloaded")
    api.add_argument("--hf-token", nargs="?", const=True, metavar="TOKEN",
                     help="vLLM's Hugging Face token for hub downloads (bare: the stored login's). ferrox downloads "
                     "nothing (a model id is read from the local cache), so no request carries it; accepted so "
                     "vLLM command lines run unchanged, and not exported to HF_TOKEN, which nothing here reads "
                     "(default: none)")
    engine = p.add_argument_group("engine (the same arguments as LLM(...))")
    add_engine_args(p, engine)
    # vLLM's shorthands for --speculative-config keys (EngineConfig.from_kwargs folds them in; also LLM(...)).
    engine.add_argument("--spec-method", metavar="METHOD",
                        help="--speculative-config's method ('ngram' or 'draft_model'); a key the JSON also sets is "
                        "refused, as vLLM's (default: none)")
    engine.add_argument("--spec-model", metavar="PATH",
                        help="--speculative-config's model: the draft model (default: none)")
    engine.add_argument("--spec-tokens", type=int, metavar="K",
                        help="--speculative-config's num_speculative_tokens (default: none)")
    return p


def _one_api_server(text: str) -> int:
    count = int(text)
    if count != 1:
        raise argparse.ArgumentTypeError(f"{count}: ferrox serves with one API server process (vLLM's several "
                                         "front-end processes are not supported)")
    return count


def build_parser() -> argparse.ArgumentParser:
    return build_parsers()[0]


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(the `ferrox` parser, its `serve` subparser)."""
    parser = argparse.ArgumentParser(
        prog="ferrox",
        description="ferrox: an LLM inference and serving engine (continuous batching over a paged KV cache, "
        "Rust core). Run `ferrox serve --help` for the server's flags.",
    )
    parser.add_argument("--version", action="version", version=f"ferrox {ferrox.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser, _add_serve_parser(sub)


# ---- --config FILE.yaml -----------------------------------------------------------------------------
def expand_config_file(argv: list[str]) -> list[str]:
    """vLLM's `--config FILE.yaml`: the file's `flag: value` pairs become flags placed before the
    command line's own, so that the command line wins. A key ferrox lacks is then refused by name
    like any unknown flag."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
        elif arg.startswith("--config="):
            path, rest = arg.partition("=")[2], argv[:i] + argv[i + 1:]
        else:
            continue
        at = rest.index("serve") + 1 if "serve" in rest else 0
        return rest[:at] + config_file_args(path) + rest[at:]
    return argv


def config_file_args(path: str) -> list[str]:
    try:
        import yaml  # type: ignore[import-untyped]  # PyYAML ships no stubs (types-PyYAML)
    except ImportError:
        raise ValueError("--config: reading a YAML file needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag: value")
    switches = {spelling: action for action in build_parsers()[1]._actions if isinstance(action, SwitchAction)
                for spelling in action.option_strings}
    several = {flag_name(f.name) for f in dataclasses.fields(EngineConfig) if f.metadata.get("nargs")}
    args: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None:
            continue
        if value is True:
            args.append(flag)
        elif value is False:
            action = switches.get(flag)
            if action is not None and flag in action.inverse_option_strings:  # `disable-prefix-caching: false`
                args.append(action.spelling(True))
            elif action is not None and action.default is not False:  # (False, the default, needs no spelling)
                args.append(action.spelling(False))
        elif isinstance(value, list) and flag in several:
            args += [flag, *map(str, value)]
        elif isinstance(value, (list, dict)):
            args += [flag, json.dumps(value)]
        else:
            # One token (`--flag=value`): a value never reads as a flag, and a flag that takes several
            # values (--served-model-name) does not swallow the command line's MODEL after it.
            args.append(f"{flag}={value}")
    return args


# ---- serve ------------------------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> int:
    from ferrox.engine.async_llm import AsyncLLM
    from ferrox.entrypoints.openai.server import (
        ServerOptions,
        bind_socket,
        bind_unix_socket,
        run_server_blocking,
        ssl_context,
    )
    from ferrox.entrypoints.openai.serving_lora import parse_lora_module

    if args.model is None and args.model_flag is not None:
        args.model = args.model_flag
    if args.download_dir:
        os.environ["HF_HUB_CACHE"] = args.download_dir  # the engine-core process inherits it
    options = ServerOptions(
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
        root_path=args.root_path.rstrip("/"), enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len, response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details, tool_call_parser=args.tool_call_parser,
        stream_stall_timeout=args.stream_stall_timeout, metrics_prefix=args.metrics_prefix,
        access_log_excluded_paths=frozenset(
            path.strip() for path in (args.disable_access_log_for_endpoints or "").split(",") if path.strip()),
        sse_keep_alive_interval=float(args.sse_keep_alive_interval),
    )
    try:
        lora_modules = tuple(parse_lora_module(m) for m in args.lora_modules)
        if lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if args.enable_log_outputs and not args.enable_log_requests:
            raise ValueError("--enable-log-outputs needs --enable-log-requests (outputs are logged beside the "
                             "request lines, as vLLM's request logger does)")
        options = dataclasses.replace(
            options, lora_modules=lora_modules, trust_request_chat_template=args.trust_request_chat_template,
            trust_request_mm_kwargs=args.trust_request_mm_kwargs,
            default_chat_template_kwargs=types.MappingProxyType(dict(args.default_chat_template_kwargs or {})),
            chat_template_content_format=args.chat_template_content_format,
            enable_force_include_usage=args.enable_force_include_usage,
            enable_server_load_tracking=args.enable_server_load_tracking,
            disable_fastapi_docs=args.disable_fastapi_docs,
            enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            log_error_stack=args.log_error_stack,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count,
            lora_allowed_dirs=tuple(os.path.realpath(d) for d in args.lora_allowed_dirs))
        # What can fail without the model fails before it loads: the port (taken?), the TLS files,
        # the generation config folder.
        tls = None
        if args.ssl_certfile:
            tls = ssl_context(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs,
                              args.ssl_ciphers)
        elif args.ssl_keyfile or args.ssl_ciphers:
            raise ValueError(f"{'--ssl-keyfile' if args.ssl_keyfile else '--ssl-ciphers'} needs --ssl-certfile")
        resolve_generation_defaults(args.generation_config, {}, args.override_generation_config)
        sock = bind_unix_socket(args.uds) if args.uds else bind_socket(args.host, args.port)
    except (OSError, ValueError) as exc:
        print(f"ferrox serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        config = engine_config_from_args(args)
        engine = AsyncLLM(config=config, log_level=_LOG_LEVELS[args.log_level])
    except Exception as exc:  # a bad flag, model path or a failed engine start: say why, exit non-zero
        sock.close()
        if args.uds:
            os.unlink(args.uds)
        print(f"ferrox serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    if args.enable_log_outputs:
        from ferrox.engine.output_log import OutputLog

        engine.output_log = OutputLog(args.max_log_len, log_deltas=args.enable_log_deltas)
    engine.max_num_queued_reqs = args.max_num_queued_reqs
    engine.max_num_queued_tokens = args.max_num_queued_tokens
    engine.stream_interval = args.stream_interval
    engine.request_timeout = args.request_timeout
    engine.generation_defaults = resolve_generation_defaults(args.generation_config, engine.generation_defaults,
                                                             args.override_generation_config)

    def on_ready(url: str) -> None:
        memory = (f"KV cache capacity {engine.kv_capacity_tokens} tokens" if engine.runner == "generate"
                  else "runner pooling (embeddings; no KV cache)")
        logger.info(
            "ready: model %s (%s) on %s, max_model_len %d, %s, engine core pid %s; serving on %s",
            engine.model_name, config.model or "embedded default", engine.device, engine.max_model_len, memory,
            engine.client.pid, url,
        )

    try:
        code = run_server_blocking(
            engine, host=args.host, port=args.port, served_model_name=args.served_model_name,
            api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes, on_ready=on_ready,
            access_log=not args.disable_uvicorn_access_log, options=options, sock=sock, ssl_context=tls,
            shutdown_timeout=args.shutdown_timeout,
        )
    except OSError as exc:
        print(f"ferrox serve: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        engine.shutdown()
        if args.uds and os.path.exists(args.uds):
            os.unlink(args.uds)  # the socket file would outlive the server
    return code


def _refuse_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """argparse's "unrecognized arguments", saying which are flags ferrox does not support."""
    flags = [a.partition("=")[0] for a in unknown if a.startswith("-")]
    others = [a for a in unknown if not a.startswith("-")]
    if flags:
        parser.error(f"{', '.join(flags)}: ferrox does not support {'these flags' if len(flags) > 1 else 'this flag'} "
                     "(README.md, \"vLLM flags\", lists vLLM's serve flags and ferrox's status; "
                     "`ferrox serve --help` lists ferrox's)")
    parser.error(f"unrecognized arguments: {' '.join(others)}")


# ---- --json-flag.key value ---------------------------------------------------------------------------
_SERVER_JSON_FLAGS = ("--override-generation-config", "--default-chat-template-kwargs")


def json_flags() -> dict[str, str]:
    """Every spelling of a flag that takes a JSON object (aliases included) -> its long name."""
    hints = typing.get_type_hints(EngineConfig)
    names: dict[str, str] = {flag: flag for flag in _SERVER_JSON_FLAGS}
    for field in dataclasses.fields(EngineConfig):
        if not field.metadata.get("nargs") and _value_type(hints[field.name]) is parse_json_object:
            long = flag_name(field.name)
            for spelling in (long, *field.metadata.get("aliases", ())):
                names[spelling] = long
    return names


def expand_dotted_json_args(argv: list[str]) -> list[str]:
    """vLLM's dotted spelling of a JSON-object flag: `--compilation-config.cudagraph_mode FULL_DECODE_ONLY`,
    `-cc.mode=0`, `--speculative-config.num_speculative_tokens 3` set one key (a dot per level of nesting;
    the value read as JSON where it parses, else as text). A flag's keys gather, over its JSON object if the
    command line gives one too, into one `--flag JSON` argument where the flag first appears."""
    spellings = json_flags()

    def split(arg: str) -> tuple[str | None, str, str | None]:  # (long flag, dotted path, "=" value)
        name, eq, text = arg.partition("=")
        head, _, path = name.partition(".")
        return spellings.get(head), path, text if eq else None

    dotted = {long for long, path, _ in map(split, argv) if long and path}
    if not dotted:
        return argv
    out: list[str] = []
    objects: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        long, path, text = split(argv[i])
        if long not in dotted:
            out.append(argv[i])
            i += 1
            continue
        if text is None:
            if i + 1 == len(argv):
                raise ValueError(f"{argv[i]}: needs a value")
            text, i = argv[i + 1], i + 1
        i += 1
        if long not in objects:
            objects[long] = {}
            out += [long, long]  # the second is the JSON's place, filled in below
        if not path:  # the whole object: the dotted keys go over it
            objects[long] = _deep_merge(parse_json_object(text), objects[long])
            continue
        try:
            value: Any = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = objects[long]
        *parents, last = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"{long}.{path}: {key} already has a value that is not an object")
        node[last] = value
    for long, obj in objects.items():
        out[out.index(long) + 1] = json.dumps(obj)
    return out


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def dashed_flag_names(argv: list[str]) -> list[str]:
    """`--tokenizer_mode mistral` as `--tokenizer-mode mistral`: vLLM's parser takes either spelling of a flag's
    name (Mistral's model cards and vLLM's recipes write `--tokenizer_mode`, `--config_format`, `--load_format`).
    Only the name is rewritten: not a value (`--x=a_b`), nor a dotted JSON key (`--hf-overrides.rope_scaling`)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            head, dot, keys = name.partition(".")
            arg = head.replace("_", "-") + dot + keys + eq + value
        out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    argv = dashed_flag_names(list(sys.argv[1:] if argv is None else argv))
    try:
        argv = expand_dotted_json_args(expand_config_file(argv))
        # A --tool-parser-plugin registers its parsers before the parser lists --tool-call-parser's choices.
        plugin = plugin_path(argv)
        if plugin is not None:
            load_tool_parser_plugin(plugin)
        # ... and a --reasoning-parser-plugin its parsers before --reasoning-parser's choices are checked.
        load_reasoning_parser_plugin(flag_value(argv, REASONING_FLAG))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        build_parsers()[0].error(str(exc))
    parser, serve_parser = build_parsers()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(serve_parser if args.command == "serve" else parser, unknown)
    if args.command is None:
        parser.print_help()
        sys.exit(2)
    if args.log_config_file:  # (the engine cores inherit the variable: ferrox/logging_config.py)
        os.environ[CONFIG_PATH_ENV] = args.log_config_file
    try:
        configure_logging(_LOG_LEVELS[args.log_level], "%(asctime)s %(levelname)s %(name)s: %(message)s")
    except ValueError as exc:
        source = "--log-config-file" if args.log_config_file else CONFIG_PATH_ENV
        print(f"ferrox serve: error: {source}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(serve(args))


if __name__ == "__main__":
    main()
