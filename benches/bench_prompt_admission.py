"""How fast a busy API server admits a burst of short prompts: encoded inline on the event loop
(what AsyncLLM.prompt_work does for prompts up to INLINE_PROMPT_SIZE) vs a hop to the two prompt
threads (what every prompt took before).

The event loop is kept busy as a streaming server's is (Python work in 0.5 ms slices, the loop
idle ~30% of the time); a burst of requests arrives, each one parse-like Python work (0.3 ms),
the prompt's encoding (the embedded model's tokenizer, ~250 characters) and queue-like work (0.2 ms).
Printed per mode and repetition: the time to queue the whole burst and each request's latency
(p50 / max). A pool thread needs the GIL to start and the loop to hand back its result, which
waits behind the loop's other work; inline encoding takes a fraction of a millisecond.

    python benches/bench_prompt_admission.py --requests 488 --reps 3

The last line is `inline_over_pool_p50_latency: <ratio>` (lower is better).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from ferrox.engine.input_processor import INLINE_PROMPT_SIZE, prompt_size
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer

TEXT = "time person year way day thing man world life hand " * 5


def spin(ms: float) -> None:
    """Hold the GIL for `ms` milliseconds, as pure-Python work does."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


async def streaming(stop: asyncio.Event) -> None:
    while not stop.is_set():
        spin(0.5)
        await asyncio.sleep(0.0002)


async def burst(tokenizer: object, pool: ThreadPoolExecutor, inline: bool, n: int) -> tuple[float, list[float]]:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []

    async def handler() -> None:
        start = time.perf_counter()
        spin(0.3)
        if inline:
            tokenizer.encode(TEXT)  # type: ignore[attr-defined]
        else:
            await loop.run_in_executor(pool, tokenizer.encode, TEXT)  # type: ignore[attr-defined]
        spin(0.2)
        latencies.append(time.perf_counter() - start)

    stop = asyncio.Event()
    background = asyncio.create_task(streaming(stop))
    start = time.perf_counter()
    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(handler()))
        await asyncio.sleep(0)  # arrivals interleave with the loop's other work
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    stop.set()
    await background
    return elapsed, latencies


async def run(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(resolve_model(None))
    assert prompt_size(TEXT) <= INLINE_PROMPT_SIZE  # the server would encode it inline
    pool = ThreadPoolExecutor(2, thread_name_prefix="ferrox-prompt")  # AsyncLLM's prompt threads
    p50: dict[bool, list[float]] = {True: [], False: []}
    print(f"{'mode':<8}{'burst ms':>10}{'p50 ms':>10}{'max ms':>10}")
    for _ in range(args.reps):
        for inline in (False, True):
            elapsed, lat = await burst(tokenizer, pool, inline, args.requests)
            p50[inline].append(statistics.median(lat))
            print(f"{'inline' if inline else 'pool':<8}{elapsed * 1e3:>10.1f}{statistics.median(lat) * 1e3:>10.2f}"
                  f"{max(lat) * 1e3:>10.2f}")
    pool.shutdown()
    print(f"inline_over_pool_p50_latency: {statistics.median(p50[True]) / statistics.median(p50[False]):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=488)
    p.add_argument("--reps", type=int, default=3)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
