"""Which engine core a new request goes to, when several serve one API (data parallelism).

Load first: the core with the least work gets the request. A core's load is the number of requests
the front-end has in flight on it (exact and current: counted on send, released when the core
reports the request finished or the front-end aborts it), plus an extra weight for the requests
its last stats snapshot reports as waiting: a waiting queue means the core is out of batch slots
or KV blocks, so another request there waits too, while a running one only shares the step.

Between equally loaded cores, the prompt's prefix decides: the core that last served a prompt
starting with the same block-aligned tokens probably still holds those KV blocks in its prefix
cache, and only there does the prefix come for free. The prefix is keyed by chained hashes of the
prompt's first full blocks (the same block size the cores cache by), so a shared system prompt
maps to one core while the user turns after it differ. With no prefix known, ties rotate, so a
sequence of one-at-a-time requests still spreads over every core (and warms every cache).

A request may name its cache key (OpenAI's `prompt_cache_key`: a conversation's id, say). Then the
key, not the prompt's blocks, decides between equally loaded cores: requests with one key go where
the key last went, so a conversation's turns meet their cached prefix even when its system prompt is
shared with other conversations' (whose block keys would spread them by recency).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

# A waiting request counts this much more than one in flight (vLLM weighs waiting 4x running).
WAITING_WEIGHT = 3
# Prefix keys per prompt: enough to tell apart long shared system prompts (64 blocks of 16 = 1024
# tokens) while hashing stays a few microseconds per request.
MAX_PREFIX_BLOCKS = 64
# Prefix keys remembered (least recently used dropped first): a core's cache evicts too.
MAX_PREFIX_ENTRIES = 1 << 16


def prefix_keys(prompt_token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_PREFIX_BLOCKS) -> list[int]:
    """Chained hashes of the prompt's first full blocks: keys[k] stands for tokens [0, (k+1)*block_size)."""
    keys: list[int] = []
    running = 0
    for k in range(min(len(prompt_token_ids) // block_size, max_blocks)):
        running = hash((running, tuple(prompt_token_ids[k * block_size : (k + 1) * block_size])))
        keys.append(running)
    return keys


class DPRouter:
    def __init__(self, num_engines: int, block_size: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines: must be at least 1, got {num_engines}")
        self.num_engines = num_engines
        self.block_size = block_size
        self.in_flight = [0] * num_engines
        self.waiting = [0] * num_engines  # from each core's latest stats snapshot
        self._owner: dict[str, int] = {}  # engine request id -> core
        self._prefix_owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> core that last served it
        self._next = 0  # where the rotation among tied cores starts

    # ---- routing -----------------------------------------------------------------------------
    def load(self, engine: int) -> int:
        return self.in_flight[engine] + WAITING_WEIGHT * self.waiting[engine]

    def route(self, request_id: str, prompt_token_ids: Sequence[int], cache_key: str | None = None) -> int:
        """Pick a core for a new request and record it there."""
        engine = 0
        if self.num_engines > 1:
            loads = [self.load(i) for i in range(self.num_engines)]
            least = min(loads)
            tied = [i for i, load in enumerate(loads) if load == least]
            keys = ([hash(("prompt_cache_key", cache_key))] if cache_key is not None
                    else prefix_keys(prompt_token_ids, self.block_size))
            holder = self._prefix_holder(keys, tied) if len(tied) > 1 else tied[0]
            if holder is None:
                holder = min(tied, key=lambda i: (i - self._next) % self.num_engines)
                self._next = (holder + 1) % self.num_engines
            engine = holder
            self._remember_prefix(keys, engine)
        self.assign(request_id, engine)
        return engine

    def assign(self, request_id: str, engine: int) -> None:
        """Record a request on a given core (a sibling sample follows its first to the same core)."""
        if not 0 <= engine < self.num_engines:
            raise ValueError(f"engine: {engine} is not a core index (data parallel size {self.num_engines})")
        if request_id in self._owner:
            raise ValueError(f"request_id: {request_id!r} is already routed")
        self._owner[request_id] = engine
        self.in_flight[engine] += 1

    def _prefix_holder(self, keys: list[int], candidates: list[int]) -> int | None:
        for key in reversed(keys):  # the longest shared prefix first
            engine = self._prefix_owner.get(key)
            if engine is not None and engine in candidates:
                return engine
        return None

    def _remember_prefix(self, keys: list[int], engine: int) -> None:
        for key in keys:
            self._prefix_owner[key] = engine
            self._prefix_owner.move_to_end(key)
        while len(self._prefix_owner) > MAX_PREFIX_ENTRIES:
            self._prefix_owner.popitem(last=False)

    # ---- bookkeeping -------------------------------------------------------------------------
    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def owned_by(self, engine: int) -> list[str]:
        return [rid for rid, e in self._owner.items() if e == engine]

    def release(self, request_id: str) -> int | None:
        """The request finished or was aborted: it no longer loads its core. Returns that core."""
        engine = self._owner.pop(request_id, None)
        if engine is not None:
            self.in_flight[engine] -= 1
        return engine

    def update_stats(self, engine: int, stats: dict[str, Any]) -> None:
        self.waiting[engine] = int(stats.get("num_waiting", 0) or 0)

    def forget_prefixes(self) -> None:
        """The cores' prefix caches were reset: what they held says nothing any more."""
        self._prefix_owner.clear()
