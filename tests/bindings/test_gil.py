"""The heavy core calls release the GIL while the Rust work runs, so the engine's other Python
threads (the core process's I/O, a server's event loop in the same process) keep running
through a big schedule / update / detokenization step.

How it is measured without timing: the switch interval is set far beyond the test's length,
so the interpreter never takes the GIL from the calling thread on its own. A probe thread
counts in a loop, sleeping (GIL released) between counts. While this thread runs a call that
holds the GIL, the probe cannot run a single bytecode: its count is unchanged, exactly. Only a
call that releases the GIL lets it count. A call that releases it might, in principle, return
before the OS wakes the probe, so each release check gets a few fresh attempts."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from ferrox._core import Detokenizer, Scheduler

from .conftest import make_corpus

ATTEMPTS = 5


class GilProbe:
    """A thread that counts whenever it holds the GIL."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.count += 1
            time.sleep(1e-4)  # releases the GIL, so the caller gets it back at once

    def counts_during(self, call: Callable[[], object]) -> int:
        """How many times the probe ran Python code while `call()` ran in this thread."""
        before = self.count
        call()
        return self.count - before

    def released_in_some_attempt(self, make_call: Callable[[], Callable[[], object]]) -> bool:
        """Runs fresh calls (`make_call()` sets one up, outside the measurement) until the probe
        counted during one."""
        return any(self.counts_during(make_call()) > 0 for _ in range(ATTEMPTS))


@pytest.fixture
def probe() -> Iterator[GilProbe]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    p = GilProbe()
    p._thread.start()
    while p.count == 0:  # the probe is running before any measurement
        time.sleep(1e-3)
    try:
        yield p
    finally:
        p._stop.set()
        p._thread.join()
        sys.setswitchinterval(old)


def test_the_probe_sees_a_call_that_holds_the_gil(probe):
    # sorted() of floats runs in C without releasing the GIL or running bytecode.
    data = [random.random() for _ in range(300_000)]
    for _ in range(3):
        assert probe.counts_during(lambda: sorted(data)) == 0
    # ... and a call that releases it (a blocking sleep).
    assert probe.released_in_some_attempt(lambda: lambda: time.sleep(0.01))


N_REQS = 8192
PROMPT_LEN = 32


def _loaded_scheduler(tokenizer_json: str) -> Scheduler:
    s = Scheduler(
        num_blocks=N_REQS * 8 + 1,
        max_model_len=512,
        block_size=16,
        max_num_seqs=N_REQS,
        max_num_batched_tokens=N_REQS * PROMPT_LEN,
        tokenizer_json=tokenizer_json,
        eos_token_ids=[0],
    )
    rng = np.random.default_rng(0)
    for i in range(N_REQS):
        prompt = rng.integers(10, 1500, PROMPT_LEN, dtype=np.int64)
        s.add_request(f"r{i}", prompt, max_tokens=64, stop=["answer is", "never"])
    return s


def test_scheduler_construction_parsing_a_tokenizer_releases_the_gil(probe, tokenizer_json):
    assert probe.released_in_some_attempt(
        lambda: lambda: Scheduler(num_blocks=64, max_model_len=256, tokenizer_json=tokenizer_json)
    )


def test_detokenizer_construction_releases_the_gil(probe, tokenizer_json):
    assert probe.released_in_some_attempt(lambda: lambda: Detokenizer(tokenizer_json))


def test_schedule_of_a_big_batch_releases_the_gil(probe, tokenizer_json):
    def make_call():
        s = _loaded_scheduler(tokenizer_json)
        return s.schedule

    assert probe.released_in_some_attempt(make_call)


def test_update_from_output_detokenizing_a_big_batch_releases_the_gil(probe, byte_level_tokenizer, tokenizer_json):
    # Every request is past its prefill and samples a real text token, so the measured update
    # detokenizes and stop-checks N_REQS tokens.
    text_ids = byte_level_tokenizer.encode(" ".join(make_corpus(4))).ids

    def make_call():
        s = _loaded_scheduler(tokenizer_json)
        s.update_from_output(np.full(s.schedule().num_reqs, text_ids[0], dtype=np.int64))
        out = s.schedule()
        sampled = np.array([text_ids[1 + i % (len(text_ids) - 1)] for i in range(out.num_reqs)], dtype=np.int64)
        return lambda: s.update_from_output(sampled)

    assert probe.released_in_some_attempt(make_call)


def test_add_request_with_a_long_prompt_releases_the_gil(probe, tokenizer_json):
    prompt = np.random.default_rng(1).integers(10, 1500, 500_000, dtype=np.int64)

    def make_call():
        s = Scheduler(num_blocks=40_000, max_model_len=600_000, tokenizer_json=tokenizer_json)
        return lambda: s.add_request("long", prompt, max_tokens=8, stop=["x"])

    assert probe.released_in_some_attempt(make_call)
