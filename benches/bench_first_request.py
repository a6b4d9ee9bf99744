"""Time to first token of the first request of each shape class after the engine is ready, against
the same kind of request run a second time (issue 17: within 1.5x), on dummy Llama-3.1-8B weights.

    python benches/bench_first_request.py                  # the engine as it starts (warm-up on)
    python benches/bench_first_request.py --no-warmup      # FERROX_WARMUP=0: what a first request paid before
    TRITON_CACHE_DIR=$(mktemp -d) python benches/bench_first_request.py   # a machine with a cold Triton cache

Each class runs twice with fresh random tokens (so the second run is the same shape, not a prefix-cache
hit on the first): TTFT is the wall time from adding the request to the engine step that reports its
first token (the engine core driven directly, as the server's core loop does; async scheduling reports
a token one step after it is sampled, in both runs alike). Prefix-hit classes first run an untimed
donor request that leaves the context in the prefix cache; the mixed class starts 8 decoding requests
first. Kernel compilations are counted with the JIT hooks (worker/warmup.py CompileWatch) for each
first run. Start-up (process age when the engine is ready) and the warm-up's own time are printed
above the table; the ratio is the last column.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402

TARGET_RATIO = 1.5


Ids = Callable[[int], list[int]]  # n -> n fresh random token ids
Go = Callable[[], list[str]]  # adds the timed requests, returns their ids


@dataclass
class ShapeClass:
    name: str
    # (driver, ids) -> go: the untimed set-up runs in `prepare`, the timed requests are added by `go`
    prepare: Callable[[Driver, Ids], Go]


class Driver:
    """Adds requests to an EngineCore and steps it, as the server's core loop does."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._ids = itertools.count()
        self.background: list[str] = []  # requests kept decoding beside the timed one

    def add(self, prompt: list[int], **params: Any) -> str:
        from ferrox import SamplingParams
        from ferrox.engine.protocol import EngineCoreRequest

        rid = f"bench-{next(self._ids)}"
        sp = SamplingParams(ignore_eos=True, detokenize=False, **{"max_tokens": 1, "temperature": 0.0, **params})
        self.engine.add_request(EngineCoreRequest(rid, prompt, sp, arrival_time=time.time()))
        return rid

    def until_first_tokens(self, rids: list[str]) -> None:
        waiting = set(rids)
        while waiting:
            result = self.engine.step()
            offsets = result.token_offsets
            for i, rid in enumerate(result.req_ids):
                if offsets[i + 1] > offsets[i] or result.finish_reasons[i]:
                    waiting.discard(rid)

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def abort_all(self, rids: list[str]) -> None:
        self.engine.abort_requests(rids)
        self.drain()


def shape_classes(budget: int, max_model_len: int) -> list[ShapeClass]:
    def single(n: int, count: int = 1, **params: Any) -> Callable[[Driver, Ids], Go]:
        def prepare(d: Driver, ids: Ids) -> Go:
            prompts = [ids(n) for _ in range(count)]
            return lambda: [d.add(p, **params) for p in prompts]

        return prepare

    def prefix_hit(context: int, query: int, count: int = 1) -> Callable[[Driver, Ids], Go]:
        def prepare(d: Driver, ids: Ids) -> Go:
            shared = ids(context)
            d.add(shared)
            d.drain()  # the donor: its blocks stay in the prefix cache
            prompts = [shared + ids(query) for _ in range(count)]
            return lambda: [d.add(p) for p in prompts]

        return prepare

    def mixed(d: Driver, ids: Ids) -> Go:
        d.background = [d.add(ids(200), max_tokens=10_000) for _ in range(8)]
        d.until_first_tokens(d.background)
        prompt = ids(2000)
        return lambda: [d.add(prompt)]

    # Whole chunks after the first attend their contexts through cuDNN's exact-shape plans on Hopper.
    whole = [ShapeClass(f"prompt {3 * budget} (three whole chunks)", single(3 * budget))] \
        if 3 * budget < max_model_len else []
    return [
        ShapeClass("prompt 32", single(32)),
        ShapeClass("prompt 1000", single(1000)),
        ShapeClass(f"prompt {budget + budget // 2} (two chunks)", single(budget + budget // 2)),
        *whole,
        ShapeClass("prefix hit: 8k context, 8 new tokens", prefix_hit(8192, 8)),
        ShapeClass("prefix hit: 8k context, 200 new tokens", prefix_hit(8192, 200)),
        ShapeClass("16 prefix hits at once: 4k context, 4 new tokens", prefix_hit(4096, 4, 16)),
        ShapeClass("16 prompts of 100", single(100, 16)),
        ShapeClass("prompt 2000 beside 8 decodes", mixed),
        ShapeClass("top-k/top-p + logprobs + penalties", single(64, temperature=0.8, top_k=40, top_p=0.9, logprobs=5,
                                                                repetition_penalty=1.1, presence_penalty=0.2)),
        ShapeClass("min-p, seeded", single(64, temperature=1.0, min_p=0.05, seed=7)),
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="first-request TTFT per shape class after ready vs a second run")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-warmup", action="store_true", help="FERROX_WARMUP=0 (the start-up before issue 17)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.no_warmup:
        os.environ["FERROX_WARMUP"] = "0"

    from ferrox import LLM
    from ferrox.worker.warmup import CompileWatch, describe_compiles

    config = json.loads(Path(args.config).read_text())
    model_dir = bench_setup.make_model_dir(args.config)
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager)
    ready_s = bench_setup.process_age_seconds()
    engine = llm.engine
    warmup = engine.warmup
    budget = engine.config.resolved_max_num_batched_tokens(engine.device.type)
    rng = random.Random(0)
    max_id = bench_setup.first_special_id(config)

    def ids(n: int) -> list[int]:
        return [rng.randrange(max_id) for _ in range(n)]

    driver = Driver(engine)
    rows = []
    total = CompileWatch()
    with total:
        for shape in shape_classes(budget, args.max_model_len):
            times, compiled = [], []
            for _ in range(2):
                go = shape.prepare(driver, ids)
                with CompileWatch() as watch:
                    t0 = time.perf_counter()
                    driver.until_first_tokens(go())
                    times.append(time.perf_counter() - t0)
                compiled.append(len(watch.events))
                if driver.background:
                    driver.abort_all(driver.background)
                    driver.background = []
                driver.drain()
            rows.append({"class": shape.name, "first_ms": round(times[0] * 1e3, 1),
                         "second_ms": round(times[1] * 1e3, 1), "compiles_first": compiled[0],
                         "compiles_second": compiled[1], "ratio": round(times[0] / times[1], 2)})
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "benchmark": "first_request",
        **bench_setup.environment(),
        "warmup": not args.no_warmup,
        "enforce_eager": args.enforce_eager,
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache"),
        "startup_ready_s": round(ready_s, 2),
        "warmup_s": round(warmup.seconds, 2) if warmup is not None else None,
        "warmup_steps": len(warmup.steps) if warmup is not None else 0,
        "warmup_compiles": describe_compiles(warmup.compiled) if warmup is not None else None,
        "compiles_after_ready": describe_compiles(total.events),
        "classes": rows,
        "max_ratio": max(r["ratio"] for r in rows),
    }
    print(f"\nstart-up {ready_s:.1f} s to ready (warm-up {result['warmup_s']} s, {result['warmup_steps']} steps, "
          f"{result['warmup_compiles']}); after ready: {result['compiles_after_ready']}")
    print("\n| shape class (first request after ready) | first TTFT ms | second TTFT ms | kernels compiled "
          "(first run) | first / second |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        flag = "" if r["ratio"] <= TARGET_RATIO else " (over 1.5x)"
        print(f"| {r['class']} | {r['first_ms']} | {r['second_ms']} | {r['compiles_first']} "
              f"| **{r['ratio']}x**{flag} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
