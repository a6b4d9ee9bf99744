"""An agent's conversation on /v1/messages, turn by turn: what the prefix cache saves when the prompt's
start stays the same, measured against a prompt whose first line changes every turn.

Claude Code starts each request's system prompt with a billing line whose hash (cch) changes every
request. ferrox leaves that line out of the prompt (entrypoints/anthropic/protocol.py), so turn k reads
turn k-1's blocks from the prefix cache and computes only what is new. The other arm sends the same
line with one letter changed, which ferrox keeps: the prompt then differs from the first tokens on and
every turn computes its whole context again (what every turn cost before). Both arms run in one
server, interleaved turn by turn, each with its own conversation: a long system prompt (an agent's
instructions and tool descriptions, ~--system-tokens tokens), then --turns user turns, each adding
a tool result of ~--turn-tokens tokens and the model's short reply (max_tokens 8, greedy).

    python benches/bench_agent_turns.py [--turns 6] [--system-tokens 1500] [--turn-tokens 150]

Time to first token is the time to `message_start` of a streamed request (ferrox sends it with the
first output, after the prefill). The last line is `agent_turn_ttft_ratio: <uncached / cached>`, over
turns 2.. (turn 1 computes everything in both arms).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("file", "read", "write", "search", "tool", "path", "line", "edit", "test", "run", "agent", "output",
         "result", "error", "shell", "command", "diff", "patch", "code", "repository", "branch", "commit")


def text_of(tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(int(tokens * 0.9)))


def serve(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "ferrox", "serve", "--port", str(port), "--max-model-len", "8192",
                             "--disable-log-stats", "--disable-uvicorn-access-log"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}") from None
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server not ready in 300 s")


def ttft(port: int, body: dict) -> tuple[float, dict]:
    """Seconds to message_start and its usage."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/messages", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        first, usage = None, {}
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and first is None:
                event = json.loads(line[6:])
                if event.get("type") == "message_start":
                    first, usage = time.perf_counter() - start, event["message"]["usage"]
        assert first is not None, "no message_start"
    return first, usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--turn-tokens", type=int, default=150)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()

    system = text_of(args.system_tokens, 1)
    proc = serve(args.port)
    try:
        arms = {"cached": "x-anthropic-billing-header", "uncached": "x-anthropic-billing-headr"}
        conversations: dict[str, list[dict]] = {arm: [] for arm in arms}
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        print(f"{'turn':>4}  {'arm':>9}  {'prompt':>6}  {'from cache':>10}  {'TTFT s':>7}")
        for turn in range(args.turns):
            for arm, marker in arms.items():
                messages = conversations[arm]
                # Each arm has its own conversation (its own tool results), so neither reads the other's blocks.
                messages.append({"role": "user", "content": f"[{arm}] tool result {turn}: "
                                 + text_of(args.turn_tokens, 1000 * turn + len(arm))})
                header = f"{marker}: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={random.getrandbits(20):05x};"
                body = {"max_tokens": 8, "temperature": 0, "messages": messages,
                        "system": [{"type": "text", "text": header}, {"type": "text", "text": system}]}
                seconds, usage = ttft(args.port, body)
                times[arm].append(seconds)
                prompt = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
                print(f"{turn + 1:>4}  {arm:>9}  {prompt:>6}  {usage.get('cache_read_input_tokens', 0):>10}  "
                      f"{seconds:>7.3f}", flush=True)
                messages.append({"role": "assistant", "content": "ok"})
    finally:
        proc.terminate()
        proc.wait(60)
    later = {arm: statistics.mean(t[1:]) for arm, t in times.items()}
    print(f"machine: {platform.node()} ({platform.processor() or platform.machine()}); "
          f"turns 2-{args.turns} mean TTFT: cached {later['cached']:.3f} s, uncached {later['uncached']:.3f} s")
    print(f"agent_turn_ttft_ratio: {later['uncached'] / later['cached']:.2f}")


if __name__ == "__main__":
    main()
