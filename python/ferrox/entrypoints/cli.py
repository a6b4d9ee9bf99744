"""The `ferrox` console script.

    ferrox serve [MODEL] [--port 8000] [--api-key KEY] [--max-model-len N] ...

Engine flags are generated from `ferrox.config.EngineConfig`'s dataclass fields (the same
arguments as `LLM(...)`): `--` + the field name with dashes, the type from the annotation,
bools as `--x/--no-x`, help text, choices and the documented default from the field's
metadata; so a field added to EngineConfig is a flag here with no second edit. Server flags
(host, port, api key, body limit, log level) are not engine config and stay written out here.
"""

from __future__ import annotations

import argparse
import dataclasses
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


# ---- engine flags, generated from EngineConfig ------------------------------------------------------
def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _value_type(annotation: Any) -> type:
    """`int | None` -> int, `bool` -> bool; a field type the CLI cannot parse is a TypeError."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"EngineConfig field type {annotation!r} has no CLI mapping")
        annotation = args[0]
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
        value_type = _value_type(hints[field.name])
        if meta.get("positional"):
            parser.add_argument(field.name, nargs="?", type=value_type, default=field.default, help=help_text)
            continue
        flags = [flag_name(field.name), *meta.get("aliases", ())]
        if value_type is bool:
            action = group.add_argument(*flags, dest=field.name, action=argparse.BooleanOptionalAction,
                                        default=field.default, help=help_text)
            action.help = help_text  # some Pythons' BooleanOptionalAction append their own default
        else:
            group.add_argument(*flags, dest=field.name, type=parse_size if meta.get("size") else value_type,
                               choices=meta.get("choices"), default=field.default, help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**{name: getattr(args, name) for name in EngineConfig.field_names()})


# ---- parser ---------------------------------------------------------------------------------------
def _add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI- and Anthropic-compatible HTTP API",
        description="Serve MODEL (a Hugging Face folder or a .gguf file; default: the embedded "
        "SmolLM2-135M-Instruct) with the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), "
        "the Anthropic Messages API (/v1/messages), /tokenize, /detokenize, /health, /version and "
        "Prometheus /metrics.",
        formatter_class=_HelpFormatter,
    )
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: pick a free one)")
    server.add_argument("--api-key", default=os.environ.get("FERROX_API_KEY"),
                        help="require this key (Authorization: Bearer KEY or x-api-key) on API routes; "
                        "/health, /metrics and /version stay open (default: $FERROX_API_KEY)")
    server.add_argument("--max-request-body-bytes", type=parse_size, default=32 << 20,
                        help="larger request bodies get HTTP 413 (accepts units: 1MiB)")
    server.add_argument("--disable-uvicorn-access-log", "--disable-access-log", action="store_true",
                        help="no access log line per HTTP request (vLLM's flag name; ferrox serves with aiohttp)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="logging verbosity")
    add_engine_args(p, p.add_argument_group("engine (the same arguments as LLM(...))"))
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferrox",
        description="ferrox: an LLM inference and serving engine (continuous batching over a paged KV cache, "
        "Rust core). Run `ferrox serve --help` for the server's flags.",
    )
    parser.add_argument("--version", action="version", version=f"ferrox {ferrox.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(sub)
    return parser


def serve(args: argparse.Namespace) -> int:
    from ferrox.engine.async_llm import AsyncLLM
    from ferrox.entrypoints.openai.server import run_server_blocking

    try:
        config = engine_config_from_args(args)
        engine = AsyncLLM(config=config, log_level=args.log_level.upper())
    except Exception as exc:  # a bad flag, model path or a failed engine start: say why, exit non-zero
        print(f"ferrox serve: error: {exc}", file=sys.stderr, flush=True)
        return 1

    def on_ready(url: str) -> None:
        logger.info(
            "ready: model %s (%s) on %s, max_model_len %d, KV cache capacity %d tokens, engine core pid %s; "
            "serving on %s",
            engine.model_name, config.model or "embedded default", engine.device, engine.max_model_len,
            engine.kv_capacity_tokens, engine.client.pid, url,
        )

    try:
        code = run_server_blocking(
            engine, host=args.host, port=args.port, served_model_name=args.served_model_name,
            api_key=args.api_key, max_request_body_bytes=args.max_request_body_bytes, on_ready=on_ready,
            access_log=not args.disable_uvicorn_access_log,
        )
    except OSError as exc:  # e.g. the port is taken
        print(f"ferrox serve: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        engine.shutdown()
    return code


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        sys.exit(2)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    sys.exit(serve(args))


if __name__ == "__main__":
    main()
