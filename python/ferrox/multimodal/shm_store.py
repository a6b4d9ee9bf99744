"""vLLM's `--mm-processor-cache-type shm` store: a shared-memory ring of byte objects with one writer (the front-end,
which prepares prompts) and readers (the engine cores), so a processed image's pixels reach a core without being
serialized through its socket, and an image already in the ring travels as a reference only.

Layout of the segment (`ferrox_mm_<pid namespace>_<pid>_<random>`, POSIX shared memory, /dev/shm on Linux):

    [0, 64)          magic, the number of reader slots, the ring's capacity
    [64, 64 + cap)   the ring: entries at 64-byte aligned offsets, each
                     [seq int64][nbytes int64][reads int64 x slots] (padded to 64) then the object's bytes

Bookkeeping that keeps an entry alive is split by who writes it, so no lock crosses processes:
- the writer counts, in its own memory, the references it sent to each entry (`sends`);
- a reader, after copying an entry's bytes out, adds one to its own slot's counter in the entry's header (a core
  writes only its own slot: data-parallel cores never race on one word);
- the writer reuses an entry's space only once the slots add up to its sends. Entries are allocated in FIFO order
  and reclaimed from the oldest, only when room is needed (a read entry stays as a cache for the next reference).
  An entry still owed a read stops reclaiming behind it; then, as for an object larger than the ring or
  `max_object_bytes`, `put` returns None and the caller sends the bytes inline: nothing waits, nothing is lost.
The counters are aligned int64 words, each stored by one process; the writer reads them. A reader copies the bytes
before it stores its count, in program order, which x86 keeps. Python has no memory fence: a weakly ordered CPU
(aarch64) may show the count before the copy's last loads retire, a window of nanoseconds against the writer's
next allocation, which must take its lock, scan the counters and start writing before it could matter.

Lifetime: the writer unlinks the segment on close (and at interpreter exit). If the front-end dies without closing,
multiprocessing's resource tracker (a separate process that registered the segment at creation) unlinks it; if that
died too, the next writer in the same pid namespace removes segments whose pid is gone (`sweep_stale`). The whole
segment is allocated up front (posix_fallocate), so an undersized /dev/shm (a container's default 64 MiB) fails at
start with a clear error instead of a SIGBUS when the ring first reaches a page it cannot have.
numpy and the standard library only: the API server process never imports torch.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import msgspec
import numpy as np

logger = logging.getLogger("ferrox.multimodal.shm_store")

MAGIC = b"FRXMMSH1"
SEGMENT_HEADER = 64  # bytes before the ring
ALIGN = 64  # entries start on cache lines: their int64 counters are aligned words
NAME_PREFIX = "ferrox_mm_"
_NAME = re.compile(rf"^{NAME_PREFIX}(\d+)_(\d+)_[0-9a-f]+$")
_SHM_DIR = "/dev/shm"


class ShmStoreError(RuntimeError):
    """A reference the store cannot honour (its segment is gone, or its entry is not the one referenced)."""


class ShmRef(msgspec.Struct, array_like=True, frozen=True):
    """Where one object lies in a writer's segment; crosses the core's socket in place of the bytes."""

    segment: str  # the shared memory's name
    offset: int  # the entry's header, from the ring's start
    seq: int  # the entry's sequence number (checked: the entry must not have been replaced)
    nbytes: int
    reader: int  # the reader slot that acknowledges this reference (the core it was sent to)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def entry_header_bytes(readers: int) -> int:
    return _align(16 + 8 * readers)


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where there is none to read): pids compare only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def sweep_stale() -> list[str]:
    """Unlink the segments of writers in this pid namespace whose process is gone (a front-end killed together
    with its resource tracker). Linux only (/dev/shm); a pid that is alive, or of another namespace, is left."""
    if not os.path.isdir(_SHM_DIR):
        return []
    namespace = _pid_namespace()
    removed: list[str] = []
    for name in os.listdir(_SHM_DIR):
        found = _NAME.match(name)
        if found is None or int(found.group(1)) != namespace or not namespace:
            continue
        pid = int(found.group(2))
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        logger.info("removed %d shared-memory segment(s) left by ferrox processes that are gone: %s", len(removed),
                    ", ".join(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # (another user's)
    return True


@dataclass(slots=True)
class _Entry:
    key: str
    start: int  # absolute ring position of its header (grows without bound; modulo the capacity in the segment)
    size: int  # header + bytes, aligned
    seq: int
    nbytes: int
    sends: int = 0


class ShmWriter:
    """The writer's side: `put(key, data, reader)` -> a reference, or None (send the bytes inline)."""

    def __init__(self, capacity_bytes: int, max_object_bytes: int, readers: int) -> None:
        if capacity_bytes < ALIGN or max_object_bytes <= 0 or readers <= 0:
            raise ValueError(f"ShmWriter: capacity {capacity_bytes}, max object {max_object_bytes} and readers "
                             f"{readers} must be positive (capacity at least {ALIGN} bytes)")
        sweep_stale()
        self.capacity = int(capacity_bytes) // ALIGN * ALIGN
        self.max_object_bytes = int(max_object_bytes)
        self.readers = int(readers)
        self.header_bytes = entry_header_bytes(self.readers)
        name = f"{NAME_PREFIX}{_pid_namespace()}_{os.getpid()}_{secrets.token_hex(4)}"
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=SEGMENT_HEADER + self.capacity)
        try:
            _reserve(self._shm, SEGMENT_HEADER + self.capacity)
        except BaseException:
            self._shm.close()
            self._shm.unlink()
            raise
        self.name = self._shm.name.lstrip("/")
        self._bytes: np.ndarray | None = np.ndarray(SEGMENT_HEADER + self.capacity, np.uint8, buffer=self._shm.buf)
        self._bytes[:8] = np.frombuffer(MAGIC, np.uint8)
        self._bytes[8:24].view(np.int64)[:] = (self.readers, self.capacity)
        self._entries: deque[_Entry] = deque()  # oldest first
        self._by_key: dict[str, _Entry] = {}
        self._head = 0  # where the next entry may start (absolute)
        self._seq = 0
        self._lock = threading.Lock()
        self.stored = 0  # objects written into the ring
        self.referenced = 0  # references to an object already there (no copy)
        self.inline = 0  # objects refused (too large, or no room): sent inline by the caller
        self._finalizer = weakref.finalize(self, _release, self._shm)

    # ---- writing ------------------------------------------------------------------------------------------------
    def put(self, key: str, data: Any, reader: int) -> ShmRef | None:
        """A reference to `data` (bytes-like) for reader slot `reader`, which must read it exactly once; None when
        the object does not fit (the caller sends it inline). An object already stored under `key` is not copied
        again."""
        if not 0 <= reader < self.readers:
            raise ValueError(f"reader slot {reader} out of range (the store has {self.readers})")
        view = memoryview(data).cast("B")
        nbytes = view.nbytes
        with self._lock:
            if self._bytes is None:  # (closed: the engine is shutting down; its send fails as it would inline)
                self.inline += 1
                return None
            entry = self._by_key.get(key)
            if entry is not None and entry.nbytes == nbytes:
                entry.sends += 1
                self.referenced += 1
                return self._ref(entry, reader)
            size = self.header_bytes + _align(nbytes)
            start = self._allocate(size) if 0 < nbytes <= self.max_object_bytes else None
            if start is None:
                self.inline += 1
                return None
            self._seq += 1
            entry = _Entry(key, start, size, self._seq, nbytes, sends=1)
            at = SEGMENT_HEADER + start % self.capacity
            header = self._bytes[at:at + self.header_bytes].view(np.int64)
            header[:] = 0  # (reads of this space's last entry: all were counted before it was reclaimed)
            header[0], header[1] = entry.seq, nbytes
            self._bytes[at + self.header_bytes:at + self.header_bytes + nbytes] = np.frombuffer(view, np.uint8)
            self._entries.append(entry)
            self._by_key[key] = entry
            self._head = start + size
            self.stored += 1
            return self._ref(entry, reader)

    def cancel(self, refs: list[ShmRef]) -> None:
        """References made but never sent (the send failed): they will not be read, so they no longer count."""
        with self._lock:
            live = {e.seq: e for e in self._entries}
            for ref in refs:
                entry = live.get(ref.seq)
                if entry is not None and entry.sends > 0:
                    entry.sends -= 1

    def _ref(self, entry: _Entry, reader: int) -> ShmRef:
        return ShmRef(self.name, entry.start % self.capacity, entry.seq, entry.nbytes, reader)

    def _allocate(self, size: int) -> int | None:
        """The absolute start of `size` contiguous bytes, reclaiming read entries oldest first; None: no room."""
        if size > self.capacity:
            return None
        while True:
            start = self._head
            if start % self.capacity + size > self.capacity:  # no room before the ring's end: wrap to its start
                start += self.capacity - start % self.capacity
            tail = self._entries[0].start if self._entries else start
            if start + size - tail <= self.capacity:
                return start
            if not self._reclaim_oldest():
                return None

    def _reclaim_oldest(self) -> bool:
        if not self._entries:
            return False
        oldest = self._entries[0]
        if self._reads(oldest) < oldest.sends:
            return False  # a reference sent and not yet read: its bytes must stay
        self._entries.popleft()
        if self._by_key.get(oldest.key) is oldest:
            del self._by_key[oldest.key]
        if not self._entries:
            self._head = 0  # (empty: start again at the ring's start, the most contiguous room)
        return True

    def _reads(self, entry: _Entry) -> int:
        assert self._bytes is not None
        at = SEGMENT_HEADER + entry.start % self.capacity
        return int(self._bytes[at + 16:at + 16 + 8 * self.readers].view(np.int64).sum())

    # ---- state --------------------------------------------------------------------------------------------------
    def pending(self) -> int:
        """References sent and not yet read, over every entry (0 once the readers caught up)."""
        with self._lock:
            return sum(max(0, e.sends - self._reads(e)) for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        """Unmap and unlink the segment (idempotent). Readers that mapped it keep their mapping until they exit."""
        with self._lock:
            self._bytes = None  # (the buffer export must go before the mapping can close)
            self._entries.clear()
            self._by_key.clear()
        self._finalizer()

    def __repr__(self) -> str:
        return (f"ShmWriter({self.name}, {self.capacity} bytes, {len(self._entries)} entries, "
                f"stored={self.stored}, referenced={self.referenced}, inline={self.inline})")


def _reserve(shm: shared_memory.SharedMemory, size: int) -> None:
    """Take every page of the segment now (Linux), so a full /dev/shm is an error at start, not a SIGBUS later."""
    fallocate = getattr(os, "posix_fallocate", None)
    fd = getattr(shm, "_fd", -1)
    if fallocate is None or fd < 0:
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        free = ""
        try:
            stat = os.statvfs(_SHM_DIR)
            free = f" ({stat.f_bavail * stat.f_frsize / (1 << 30):.2f} GiB free there)"
        except OSError:
            pass
        raise OSError(exc.errno, f"mm_processor_cache_type 'shm': cannot allocate a {size / (1 << 30):.2f} GiB "
                                 f"shared-memory store in {_SHM_DIR}{free}: lower --mm-processor-cache-gb or give "
                                 f"the container more shared memory (docker --shm-size)") from None


def _release(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # (a view still exported: the mapping goes at exit; the name is removed below anyway)
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


# ---- the readers' side: one mapping per segment per process ----------------------------------------------------
class _Mapped:
    def __init__(self, name: str) -> None:
        try:
            self.mapping = _attach(name)
        except FileNotFoundError:
            raise ShmStoreError(f"shared-memory segment {name} is gone (its writer closed or died)") from None
        buffer = self.mapping if isinstance(self.mapping, mmap.mmap) else self.mapping.buf
        assert buffer is not None  # (an open SharedMemory's)
        self.bytes = np.ndarray(len(buffer), np.uint8, buffer=buffer)
        if self.bytes[:8].tobytes() != MAGIC:
            raise ShmStoreError(f"shared-memory segment {name} is not a ferrox multimodal store")
        self.readers, self.capacity = (int(v) for v in self.bytes[8:24].view(np.int64))
        self.header_bytes = entry_header_bytes(self.readers)


def _attach(name: str) -> mmap.mmap | shared_memory.SharedMemory:
    """Map a writer's segment. On Linux the file under /dev/shm is mapped directly: SharedMemory(name) would register
    it with this process's resource tracker (before Python 3.13), which unlinks it when a reader that is not the
    writer's multiprocessing child exits. Elsewhere SharedMemory (an engine core shares its front-end's tracker)."""
    path = os.path.join(_SHM_DIR, name)
    if os.path.isdir(_SHM_DIR):
        fd = os.open(path, os.O_RDWR)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    return shared_memory.SharedMemory(name=name)


_mapped: dict[str, _Mapped] = {}
_mapped_lock = threading.Lock()


def read(ref: ShmRef) -> bytes:
    """The referenced object's bytes (a copy), then this reader's acknowledgement: the writer may reuse the space
    once every reference sent to the entry is acknowledged. ShmStoreError when the entry is not the one referenced
    (then nothing is acknowledged)."""
    with _mapped_lock:
        mapped = _mapped.get(ref.segment)
        if mapped is None:
            mapped = _mapped[ref.segment] = _Mapped(ref.segment)
    if (not 0 <= ref.reader < mapped.readers or ref.offset < 0 or ref.nbytes < 0
            or ref.offset + mapped.header_bytes + ref.nbytes > mapped.capacity):
        raise ShmStoreError(f"shared-memory reference {ref} is outside segment {ref.segment}")
    at = SEGMENT_HEADER + ref.offset
    header = mapped.bytes[at:at + mapped.header_bytes].view(np.int64)
    if int(header[0]) != ref.seq or int(header[1]) != ref.nbytes:
        raise ShmStoreError(f"shared-memory entry at {ref.offset} of {ref.segment} holds sequence {int(header[0])}, "
                            f"not the referenced {ref.seq}")
    start = at + mapped.header_bytes
    data = mapped.bytes[start:start + ref.nbytes].tobytes()
    header[2 + ref.reader] += 1  # (after the copy: from here on the writer may overwrite it)
    return data
