"""vLLM's multimodal processor cache (`--mm-processor-cache-gb`, type `lru`; type `shm` keeps it too, and carries the
pixels to the engine cores through shared memory: shm_store.py): a repeated image or video is not processed again.

What one image processor (or video processor) returns for one item -- pixel values, patches, a grid, tile counts,
frame timestamps -- is kept in an LRU bounded by the bytes of its arrays, keyed by
- the processor's identity: a digest of every setting it holds (the folder's preprocessor config with the server's
  and the request's mm_processor_kwargs applied), so two processors that would compute the same pixels share
  entries and a request with other kwargs gets its own;
- which of its methods ran (Qwen3-VL's videos go through `prepare`, which also resamples frames and times them);
- the item's content: the image's hash (media.image_hash, the one its prefix-cache blocks are named by) or the
  decoded video's frames and metadata (`video_key`). media_io_kwargs act before this point (they pick a file's
  frames), so they are in the decoded frames the key hashes.

A hit returns fresh copies of the stored arrays: the caller may change them in place without touching the entry,
and gets exactly what processing the item again would give. An item larger than the whole budget is not kept.
The cache lives in the process that prepares prompts (the API server, or the offline LLM's process); its queries
and hits are vLLM's `mm_cache_queries` / `mm_cache_hits` counters (metrics/prometheus.py). numpy only: the API
server process never imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

GIB = 1 << 30
_MAX_DEPTH = 8  # how deep a processor's settings are described (they are a few levels of plain data)


class ProcessorCache:
    """Processed multimodal items by (processor identity, method, item digest), least recently used evicted first
    once their arrays pass `capacity_bytes`. Thread-safe: the front-end prepares prompts on several threads."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be > 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.queries = 0  # items looked up (vLLM's mm_cache_queries)
        self.hits = 0  # items found (vLLM's mm_cache_hits)
        self._entries: OrderedDict[tuple[str, str, str], tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._identities: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    @classmethod
    def of_gib(cls, gib: float) -> ProcessorCache | None:
        """The cache for `--mm-processor-cache-gb` (None: 0, no cache)."""
        return cls(max(1, int(gib * GIB))) if gib > 0 else None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, int]:
        return {"mm_cache_queries": self.queries, "mm_cache_hits": self.hits}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def process(self, processor: Any, method: str, item: Any, digest: str) -> Any:
        """`processor.<method>(item)`, from the cache when an equal item went through an equal processor. An
        exception from the processor propagates and nothing is stored."""
        run = getattr(processor, method)
        identity = self._identity(processor)
        if identity is None:  # settings that cannot be described: processed every time, never counted
            return run(item)
        key = (identity, method, digest)
        with self._lock:
            self.queries += 1
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
        if entry is not None:
            return _thawed(entry[0])
        result = run(item)  # (outside the lock: other threads' items go on meanwhile)
        self._store(key, result)
        return result

    def _store(self, key: tuple[str, str, str], result: Any) -> None:
        try:
            frozen, size = _frozen(result)
        except TypeError:  # a result of a kind this cache does not copy: not kept
            return
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)  # (another thread processed the same item meanwhile)
            if old is not None:
                self._bytes -= old[1]
            while self._entries and self._bytes + size > self.capacity_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
            self._entries[key] = (frozen, size)
            self._bytes += size

    def _identity(self, processor: Any) -> str | None:
        """A digest of the processor's settings, computed once per processor object (they are not changed after
        construction: mm_processor_kwargs make new processors)."""
        with self._lock:
            try:
                found = self._identities.get(processor)
            except TypeError:  # not weakly referenceable
                found = None
        if found is not None:
            return found
        try:
            identity = hashlib.sha256(repr(_describe(processor, 0)).encode()).hexdigest()
        except TypeError:
            return None
        with self._lock:
            try:
                self._identities[processor] = identity
            except TypeError:
                pass
        return identity


def video_key(video: Any) -> str:
    """A decoded video's digest for the cache: Video.hash() (frames, sampled fps, do_sample_frames) and what else a
    video processor may read -- the source's frame rate and frame count and the picked frames' indices (Qwen3-VL
    resamples by them and writes their timestamps)."""
    meta = f"{video.fps!r}\x00{video.total_frames!r}\x00{video.indices!r}".encode()
    return f"{video.hash()}:{hashlib.sha256(meta).hexdigest()}"


def _describe(value: Any, depth: int) -> Any:
    """Plain data standing for `value`, equal for equal settings; TypeError for anything it cannot stand for
    (which keeps that processor out of the cache rather than risk a wrong hit)."""
    if depth > _MAX_DEPTH:
        raise TypeError("settings nested too deep")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)  # (an IntEnum, PIL's Resampling, keeps its name)
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str, repr(value.item()))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, hashlib.sha256(np.ascontiguousarray(value).data).hexdigest())
    if isinstance(value, (list, tuple, frozenset, set)):
        items = [_describe(v, depth + 1) for v in value]
        return (type(value).__name__, sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items)
    if isinstance(value, Mapping):
        return ("map", sorted((repr(k), _describe(v, depth + 1)) for k, v in value.items()))
    if depth > 0 and (callable(value) or isinstance(value, types.ModuleType)):
        raise TypeError(f"a setting that is code, not data: {value!r}")  # (functions, classes: no telling them apart)
    fields = _fields(value)
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    return (name, [(k, _describe(v, depth + 1)) for k, v in fields])


def _fields(value: Any) -> list[tuple[str, Any]]:
    """An object's attributes: its __dict__, or its slots (a slots dataclass)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return sorted(vars(value).items())
    raise TypeError(f"cannot describe a {type(value).__name__}")


def _frozen(value: Any) -> tuple[Any, int]:
    """(a private copy of a processor's result, its bytes): arrays copied and made read-only, containers rebuilt;
    TypeError for anything else that is not immutable plain data."""
    if isinstance(value, np.ndarray):
        copy = np.array(value, copy=True)
        copy.setflags(write=False)
        return copy, copy.nbytes
    if isinstance(value, (tuple, list)):
        parts = [_frozen(v) for v in value]
        items = [p[0] for p in parts]
        return (tuple(items) if isinstance(value, tuple) else items), sum(p[1] for p in parts) + sys.getsizeof(value)
    if value is None or isinstance(value, (bool, int, float, str, np.generic)):
        return value, sys.getsizeof(value)
    raise TypeError(f"cannot cache a {type(value).__name__}")


def _thawed(value: Any) -> Any:
    """A caller's own copy of a stored result: writable arrays, new lists."""
    if isinstance(value, np.ndarray):
        return np.array(value, copy=True)
    if isinstance(value, tuple):
        return tuple(_thawed(v) for v in value)
    if isinstance(value, list):
        return [_thawed(v) for v in value]
    return value
