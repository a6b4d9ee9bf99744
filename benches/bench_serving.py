"""Serving benchmark in the style of vLLM's: random prompts, Poisson arrivals, streamed completions.

    # against a running server
    python benches/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 16
    # no --base-url: start `ferrox serve` here, benchmark it, stop it, then run the same workload
    # through the offline LLM.generate in-process and print `server_over_offline: <ratio>` last
    python benches/bench_serving.py --num-prompts 64 --input-len 128 --output-len 64 --result-json out.json

Prompts are random words cut to exactly --input-len tokens (through the server's /tokenize) and
sent as token ids, so every request has the requested length; every request asks for exactly
--output-len tokens (ignore_eos). Metrics: request throughput, output tokens/s, TTFT (time to the
first token), TPOT (time per output token after the first), ITL (gap between streamed chunks)
and E2E latency, each as mean / p50 / p90 / p99 / max.

--long-prompt-chars C (with --long-prompt-interval S) measures how the server copes with huge
prompts arriving during the run: every S seconds a C-character prompt goes to /tokenize or (as a
chat message, rejected as too long after tokenizing) to /v1/chat/completions, while /health is
probed every 20 ms. Tokenizing off the event loop keeps the short requests' TTFT and the /health
latency flat; the report adds HEALTH (ms) and the number of long prompts sent.

CPU: the share of one core that this client and (when this script started the server) each
process of the server's tree spent during the timed run, from /proc: a process near 1.0 is a
single-threaded bottleneck of the measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain light house music garden story table window "
    "paper water city green quiet bright happy small large early young open simple ancient careful"
).split()


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    sent_at: float = 0.0  # perf_counter() when the request was sent


# ---- workload ---------------------------------------------------------------------------------------


async def make_prompts(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str], n: int,
                       input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(input_len * 2))
        async with session.post(base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                                headers=headers) as resp:
            resp.raise_for_status()
            tokens = (await resp.json())["tokens"]
        if len(tokens) < input_len:
            raise RuntimeError("random prompt too short; raise the word count")
        prompts.append(tokens[:input_len])
    return prompts


class _Choice(msgspec.Struct):
    text: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Error(msgspec.Struct):
    message: str = ""


class _Chunk(msgspec.Struct):
    """The fields of a streamed completion chunk that the metrics read (the rest is skipped)."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _Error | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def one_request(session: aiohttp.ClientSession, url: str, headers: dict[str, str], model: str,
                      prompt: list[int], output_len: int) -> RequestResult:
    """One streamed completion. The client is one Python process reading every stream, so it reads
    whole socket reads at a time and decodes only the fields it needs (~3x less CPU per chunk than
    line iteration + json.loads): at 512 streams and ~25k chunks/s a slower client falls behind the
    server and delays the next requests itself. Chunks that arrive in one read share its time."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_len=len(prompt))
    start = last = result.sent_at = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {await resp.text()}"
                return result
            pending = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                lines = (pending + data).split(b"\n")
                pending = lines.pop()  # an event cut by the read: completed by the next one
                for line in lines:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = _decode_chunk(line[6:])
                    if chunk.error is not None:
                        result.error = chunk.error.message
                        return result
                    if chunk.choices and chunk.choices[0].text:
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
                    if chunk.usage is not None:
                        result.output_tokens = chunk.usage.completion_tokens
        result.e2e = time.perf_counter() - start
        result.ok = True
    except aiohttp.ClientError as exc:
        result.error = repr(exc)
    return result


def _process_tree(root: int) -> list[int]:
    """root and its descendants (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree if Path(f"/proc/{root}").exists() else []


def _cpu_seconds(pids: list[int]) -> dict[str, float]:
    """User + system CPU seconds so far of each process, keyed "pid name"."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            raw = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            name = " ".join(a.decode(errors="replace") for a in argv[1:4])[:48]
            fields = raw.rsplit(")", 1)[1].split()
            out[f"{pid} {name}"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


SERVER_PIDS: list[int] = []  # the server's process tree, when this script started it


async def run_load(base_url: str, model: str | None, api_key: str | None, args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if model is None:
            async with session.get(base_url + "/v1/models", headers=headers) as resp:
                model = (await resp.json())["data"][0]["id"]
        prompts = await make_prompts(session, base_url, headers, args.num_prompts, args.input_len, args.seed)
        url = base_url + "/v1/completions"
        # Warm-up: one request so first-call costs are not in the measurement.
        await one_request(session, url, headers, model, prompts[0], 4)
        # The client's own full collections (its prompts, the session) would pause every stream it
        # reads and show up as the server's latency: keep them out of the measurement.
        gc.collect()
        gc.freeze()
        limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = random.Random(args.seed + 1)

        async def limited(prompt: list[int]) -> RequestResult:
            async with limit:
                return await one_request(session, url, headers, model, prompt, args.output_len)

        tasks = []
        done = asyncio.Event()
        health_ms: list[float] = []
        long_sent: list[int] = []
        background = []
        if args.long_prompt_chars:
            background = [asyncio.create_task(probe_health(session, base_url, done, health_ms)),
                          asyncio.create_task(send_long_prompts(session, base_url, headers, model, args, done,
                                                                long_sent))]
        server_pids = [p for root in SERVER_PIDS for p in _process_tree(root)]
        server_cpu0, client_cpu0 = _cpu_seconds(server_pids), time.process_time()
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu = {"client": (time.process_time() - client_cpu0) / duration}
        for key, secs in _cpu_seconds(server_pids).items():
            if key in server_cpu0:
                cpu[f"server {key}"] = (secs - server_cpu0[key]) / duration
        done.set()
        await asyncio.gather(*background)
    summary = summarize(results, duration, model, args)
    summary["cpu_share"] = cpu
    if args.long_prompt_chars:
        summary["health_ms"] = _pcts(health_ms, scale=1.0)
        summary["long_prompts_sent"] = len(long_sent)
    return summary


async def probe_health(session: aiohttp.ClientSession, base_url: str, done: asyncio.Event,
                       latencies_ms: list[float]) -> None:
    """GET /health every 20 ms until `done`: how long the event loop takes to answer."""
    while not done.is_set():
        start = time.perf_counter()
        async with session.get(base_url + "/health") as resp:
            await resp.read()
        latencies_ms.append((time.perf_counter() - start) * 1000)
        await asyncio.sleep(0.02)


async def send_long_prompts(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str], model: str,
                            args: argparse.Namespace, done: asyncio.Event, sent: list[int]) -> None:
    """A --long-prompt-chars prompt every --long-prompt-interval s, alternately to /tokenize and (too
    long for the model: a 400 after tokenizing) to /v1/chat/completions; each runs unawaited."""
    rng = random.Random(args.seed + 2)
    pending = []

    async def post(path: str, body: dict[str, Any]) -> None:
        async with session.post(base_url + path, json=body, headers=headers) as resp:
            await resp.read()
        sent.append(resp.status)

    while not done.is_set():
        words: list[str] = []
        size = 0
        while size < args.long_prompt_chars:
            words.append(rng.choice(WORDS))
            size += len(words[-1]) + 1
        text = " ".join(words)[: args.long_prompt_chars]
        if len(pending) % 2 == 0:
            pending.append(asyncio.create_task(post("/tokenize", {"prompt": text})))
        else:
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
            pending.append(asyncio.create_task(post("/v1/chat/completions", body)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), args.long_prompt_interval)
    await asyncio.gather(*pending)


def _pcts(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] * scale

    return {"mean": statistics.fmean(values) * scale, "p50": pct(50), "p90": pct(90), "p99": pct(99),
            "max": ordered[-1] * scale}


def summarize(results: list[RequestResult], duration: float, model: str, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": model,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_output_tokens": out_tokens,
        "ttft_ms": _pcts([r.ttft for r in ok]),
        "tpot_ms": _pcts(tpots),
        "itl_ms": _pcts([x for r in ok for x in r.itls]),
        "e2e_ms": _pcts([r.e2e for r in ok]),
        # Per request, time.perf_counter() (CLOCK_MONOTONIC, comparable with other processes' traces)
        # when it was sent, its first token and its last token arrived (--result-json).
        "requests": [(r.sent_at, r.sent_at + r.ttft, r.sent_at + r.e2e) for r in ok],
    }


def print_report(res: dict[str, Any]) -> None:
    print(f"{'model':<28}{res['model']}")
    print(f"{'completed / failed':<28}{res['completed']} / {res['failed']}")
    print(f"{'duration (s)':<28}{res['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<28}{res['request_throughput']:.3f}")
    print(f"{'output throughput (tok/s)':<28}{res['output_throughput']:.1f}")
    print(f"{'total throughput (tok/s)':<28}{res['total_token_throughput']:.1f}")
    if "long_prompts_sent" in res:
        print(f"{'long prompts sent':<28}{res['long_prompts_sent']}")
    print(f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "health_ms"):
        if key not in res:
            continue
        v = res[key]
        print(f"{key[:-3].upper():<12}{v['mean']:>10.1f}{v['p50']:>10.1f}{v['p90']:>10.1f}{v['p99']:>10.1f}"
              f"{v['max']:>10.1f}")
    for who, share in res.get("cpu_share", {}).items():
        if share >= 0.01:
            per_token = share * res["duration_s"] / max(res["total_output_tokens"], 1) * 1e6
            print(f"{'CPU ' + who:<58}{share:.2f} of a core, {per_token:.1f} us per output token")
    if res["errors"]:
        print("errors:", *res["errors"], sep="\n  ")


# ---- own server + offline comparison ------------------------------------------------------------------


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # `python -m` rather than the console script: a --target install (the GPU machine) has none.
    cmd = [sys.executable, "-m", "ferrox.entrypoints.cli", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--log-level", "warning", *engine_flags(args), *shlex.split(args.server_args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    import urllib.request

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ferrox serve exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("server did not start") from None
            time.sleep(0.5)


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_concurrency or 256)]
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", args.kv_cache_memory]
    if args.load_format != "auto":
        flags += ["--load-format", args.load_format]
    if args.num_threads is not None:
        flags += ["--num-threads", str(args.num_threads)]
    return flags


def run_offline(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """The same prompts and budget through the in-process LLM, with the same concurrency cap."""
    from ferrox import LLM, SamplingParams
    from ferrox.entrypoints.cli import parse_size

    kwargs: dict[str, Any] = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_concurrency or 256,
                              "load_format": args.load_format, "num_threads": args.num_threads}
    if args.kv_cache_memory:
        kwargs["kv_cache_memory"] = parse_size(args.kv_cache_memory)
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    duration = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"duration_s": duration, "total_output_tokens": tokens, "output_throughput": tokens / duration}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server; omitted: start `ferrox serve` here")
    p.add_argument("--model", default=None,
                   help="model path for the own server and the offline run (default: the embedded model); "
                   "the model id sent is the one /v1/models reports")
    p.add_argument("--api-key", default=os.environ.get("FERROX_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    p.add_argument("--compare-offline", action="store_true",
                   help="also run the workload through offline LLM.generate (default when no --base-url)")
    p.add_argument("--long-prompt-chars", type=int, default=0,
                   help="also send prompts of this many characters during the run (0: none); adds HEALTH")
    p.add_argument("--long-prompt-interval", type=float, default=0.25, help="seconds between long prompts")
    p.add_argument("--max-model-len", type=int, default=1024, help="(own server / offline run)")
    p.add_argument("--kv-cache-memory", default="512MiB",
                   help="(own server / offline run; '' = sized from GPU memory)")
    p.add_argument("--load-format", default="auto", help="(own server / offline run) e.g. dummy")
    p.add_argument("--server-args", default="", help="(own server) more `ferrox serve` flags, e.g. "
                   "\"--stream-interval 8\"")
    p.add_argument("--num-threads", type=int, default=None,
                   help="(own server / offline run) CPU threads of the model; 1 leaves the other core of a "
                   "2-core box to the API server and this client")
    args = p.parse_args()

    proc = None
    base_url = args.base_url
    if base_url is None:
        proc, base_url = start_server(args)
        SERVER_PIDS.append(proc.pid)
        args.compare_offline = True
    try:
        result = asyncio.run(run_load(base_url.rstrip("/"), None, args.api_key, args))
        prompts = asyncio.run(_prompts_again(base_url, args)) if args.compare_offline else []
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print_report(result)
    if args.compare_offline:
        # The server is stopped first: on a small CPU box both would fight for the same cores.
        offline = run_offline(args, prompts)
        result["offline"] = offline
        result["server_over_offline"] = result["output_throughput"] / offline["output_throughput"]
        print(f"{'offline output (tok/s)':<28}{offline['output_throughput']:.1f}")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))
    if args.compare_offline:
        print(f"server_over_offline: {result['server_over_offline']:.3f}")


async def _prompts_again(base_url: str, args: argparse.Namespace) -> list[list[int]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession() as session:
        return await make_prompts(session, base_url.rstrip("/"), headers, args.num_prompts, args.input_len, args.seed)


if __name__ == "__main__":
    main()
