"""The `ferrox` console script.

    ferrox serve [MODEL] [--port 8000] [--api-key KEY] [--max-model-len N] ...

Engine flags map one-to-one onto `ferrox.config.EngineConfig` fields (the same arguments as
`LLM(...)`); server flags (host, port, api key, body limit, log level) stay here.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence

import ferrox

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


def _add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI- and Anthropic-compatible HTTP API",
        description="Serve MODEL (a Hugging Face folder or a .gguf file; default: the embedded "
        "SmolLM2-135M-Instruct) with the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), "
        "the Anthropic Messages API (/v1/messages), /tokenize, /detokenize, /health, /version and "
        "Prometheus /metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None,
                   help="model folder or .gguf file; omitted: the embedded SmolLM2-135M-Instruct")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: pick a free one)")
    server.add_argument("--served-model-name", default=None,
                        help="model id clients use and /v1/models reports (default: the model's name)")
    server.add_argument("--api-key", default=os.environ.get("FERROX_API_KEY"),
                        help="require this key (Authorization: Bearer KEY or x-api-key) on API routes; "
                        "default: $FERROX_API_KEY; /health, /metrics and /version stay open")
    server.add_argument("--max-request-body-bytes", type=parse_size, default=32 << 20,
                        help="larger request bodies get HTTP 413 (accepts units: 1MiB)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="logging verbosity")

    engine = p.add_argument_group("engine")
    engine.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's own)")
    engine.add_argument("--dtype", default="auto",
                        help="weights/activations dtype: auto, float32, float16, bfloat16")
    engine.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                        help="weight format; 'dummy' = random weights of the real architecture")
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    engine.add_argument("--seed", type=int, default=0, help="engine seed (dummy weights, unseeded sampling)")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="context length (prompt + output) per request; default: the model's, "
                        "at most 8192 on CPU")
    engine.add_argument("--max-num-seqs", type=int, default=None,
                        help="most requests in the running batch (default 256 on GPU, 64 on CPU)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one engine step (default 8192 on GPU, 2048 on CPU)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory for weights, activations and KV cache")
    engine.add_argument("--kv-cache-memory", type=parse_size, default=None,
                        help="KV cache size (e.g. 512MiB); on CPU default 2GiB capped by free memory")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    engine.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="disable automatic prefix caching")
    engine.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                        default=True, help="enable automatic prefix caching (default)")
    engine.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    engine.add_argument("--scheduling-policy", dest="policy", default="fcfs", choices=["fcfs", "priority"],
                        help="order of waiting requests: arrival, or the request's priority field")
    engine.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs a request may ask for")
    engine.add_argument("--num-threads", type=int, default=None,
                        help="CPU threads for the model (torch intra-op); default: all cores torch sees")
    engine.add_argument("--chat-template", default=None,
                        help="chat template (jinja text or a file path) overriding the model's")
    return p


ENGINE_FLAGS = ("model", "tokenizer", "dtype", "load_format", "device", "seed", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_memory", "block_size",
                "enable_prefix_caching", "enforce_eager", "policy", "max_logprobs", "chat_template",
                "served_model_name", "num_threads")


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
    from ferrox.config import EngineConfig
    from ferrox.engine.async_llm import AsyncLLM
    from ferrox.entrypoints.openai.server import run_server_blocking

    try:
        config = EngineConfig.from_kwargs(**{name: getattr(args, name) for name in ENGINE_FLAGS})
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
