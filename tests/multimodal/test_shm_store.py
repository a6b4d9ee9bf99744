"""The shared-memory store behind `--mm-processor-cache-type shm` (multimodal/shm_store.py, shm_items.py): one writer,
readers acknowledging in their own slots; an entry owed a read is never overwritten; no room or too large goes
inline; references and acknowledgements balance across data-parallel cores; the segment is gone after close."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest
from ferrox.multimodal import shm_store
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.shm_items import ShmItemSender, resolve_items
from ferrox.multimodal.shm_store import ShmStoreError, ShmWriter, read

KIB = 1024


def _blob(fill: int, n: int = KIB) -> bytes:
    return bytes([fill]) * n


@pytest.fixture
def writer():
    # Room for three 1 KiB objects: a 64-byte header each, 3 x 1088 = 3264 of 3300 bytes.
    w = ShmWriter(3300, 2 * KIB, readers=1)
    yield w
    w.close()


def _segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name)) if os.path.isdir("/dev/shm") else True


def test_write_read_and_a_repeat_is_a_reference(writer):
    first = writer.put("a", _blob(1), 0)
    again = writer.put("a", _blob(1), 0)  # already there: the same entry, no copy
    assert first is not None and again == first and (writer.stored, writer.referenced) == (1, 1)
    assert writer.pending() == 2
    assert read(first) == _blob(1) and writer.pending() == 1  # each reference sent is one read
    assert read(again) == _blob(1) and writer.pending() == 0


def test_unread_entries_are_never_overwritten_and_a_full_ring_goes_inline(writer):
    refs = [writer.put(key, _blob(i), 0) for i, key in enumerate("abc")]
    assert all(refs) and [r.offset for r in refs] == [0, 1088, 2176]
    assert writer.put("d", _blob(9), 0) is None and writer.inline == 1  # all three unread: no room, nothing lost
    assert writer.put("big", _blob(5, 3 * KIB), 0) is None  # larger than the max object size
    assert read(refs[0]) == _blob(0)
    d = writer.put("d", _blob(9), 0)  # "a" was read: the ring's next space is its own
    assert d is not None and d.offset == 0 and d.seq == 4
    assert read(refs[1]) == _blob(1) and read(refs[2]) == _blob(2) and read(d) == _blob(9)
    with pytest.raises(ShmStoreError, match="not the referenced 1"):
        read(refs[0])  # (a stale reference is refused, never answered with another entry's bytes)
    # Read entries are reclaimed oldest first only when room is needed: "b" and "c" stay as cached references.
    assert writer.put("b", _blob(1), 0) == refs[1] and read(refs[1]) == _blob(1)
    e = writer.put("e", _blob(7, 2 * KIB), 0)  # takes the space of "b" and "c" together
    assert e is not None and e.offset == 1088 and len(writer) == 2 and writer.pending() == 1
    f = writer.put("f", _blob(3), 0)  # the ring's end is too short: wrap-around to its start, over "d" (read)
    assert f is not None and f.offset == 0
    assert writer.put("g", _blob(4), 0) is None  # the next space is unread "e"'s
    assert read(e) == _blob(7, 2 * KIB)
    g = writer.put("g", _blob(4), 0)
    assert g is not None and g.offset == 1088 and read(f) == _blob(3) and read(g) == _blob(4)
    assert writer.pending() == 0


def test_an_object_larger_than_the_ring_goes_inline():
    w = ShmWriter(4 * KIB, 64 * KIB, readers=1)
    try:
        assert w.put("huge", _blob(3, 8 * KIB), 0) is None and w.inline == 1 and len(w) == 0
    finally:
        w.close()


def test_a_cancelled_send_is_not_waited_for(writer):
    refs = [writer.put(key, _blob(i), 0) for i, key in enumerate("abc")]
    writer.cancel([refs[0]])  # (its message never left: the send failed)
    assert writer.pending() == 2
    assert writer.put("d", _blob(4), 0) is not None  # "a"'s space is free without a read


def test_data_parallel_slots_balance_and_a_reader_in_another_process():
    """Two cores share one entry (the same image sent to each): each acknowledges in its own slot, one of them
    from another process; the entry is reusable only after both read. The reader maps the segment without
    registering it anywhere: its exit leaves the writer's segment in place."""
    w = ShmWriter(2200, 4 * KIB, readers=2)
    try:
        to_core0 = w.put("img", _blob(6), 0)
        to_core1 = w.put("img", _blob(6), 1)
        assert to_core0 is not None and to_core1 is not None and to_core0.offset == to_core1.offset
        assert w.put("other", _blob(8), 0) is not None
        code = ("import sys, hashlib, msgspec\n"
                "from ferrox.multimodal.shm_store import ShmRef, read\n"
                "ref = msgspec.json.decode(sys.stdin.read(), type=ShmRef)\n"
                "print(hashlib.sha256(read(ref)).hexdigest())\n")
        child = subprocess.run([sys.executable, "-c", code], input=msgspec.json.encode(to_core1).decode(),
                               capture_output=True, text=True, timeout=60, check=False)
        assert child.returncode == 0, child.stderr
        assert child.stdout.strip() == hashlib.sha256(_blob(6)).hexdigest()
        assert _segment_exists(w.name) and w.pending() == 2  # core 0 has not read "img" yet, nor "other"
        assert w.put("third", _blob(9), 0) is None  # "img" is owed core 0's read: nothing behind it is reused
        assert read(to_core0) == _blob(6)
        assert w.put("third", _blob(9), 0) is not None  # now it is
    finally:
        w.close()
    assert not _segment_exists(w.name)


def test_items_go_by_reference_and_come_back_whole(writer):
    pixels = np.arange(12, dtype=np.float32).reshape(3, 4)
    image = MultiModalItem.from_pixels(2, 5, pixels, "h1")
    embeds = MultiModalItem(0, 3, b"saved-tensor", [3, 1], "", modality="embeds")  # no hash: inline
    big = MultiModalItem.from_pixels(9, 5, np.zeros((40, 40), np.float32), "h2")  # 6400 bytes > 2 KiB max
    sender = ShmItemSender(writer)
    sent, refs = sender.send([image, embeds, big], reader=0)
    assert len(refs) == 1 and sent[0].pixels == b"" and sent[0].shm == refs[0]
    assert sent[1] is embeds and sent[2] is big and image.pixels  # (the caller's item is unchanged)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=list[MultiModalItem])  # the core's socket
    with pytest.raises(RuntimeError, match="still in shared memory"):
        wire[0].pixel_values()
    back = resolve_items(wire)
    assert back == [image, embeds, big] and writer.pending() == 0
    assert np.array_equal(back[0].pixel_values().numpy(), pixels)
    assert resolve_items(back) is back  # (nothing referenced: as it is)


def test_close_unlinks_and_a_later_reference_is_refused():
    w = ShmWriter(4 * KIB, KIB, readers=1)
    ref = w.put("a", _blob(1, 100), 0)
    w.close()
    w.close()  # idempotent
    assert ref is not None and not _segment_exists(w.name)
    with pytest.raises(ShmStoreError, match="is gone"):
        read(ref)  # (the core's request fails by name; the engine is shutting down anyway)
    assert w.put("b", _blob(2, 100), 0) is None  # a send racing the shutdown goes inline


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux /dev/shm")
def test_a_dead_writers_segment_is_swept():
    """A front-end killed with its resource tracker leaves its segment; the next writer in the same pid namespace
    removes it (a live pid's, or another namespace's, stays)."""
    namespace = shm_store._pid_namespace()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    names = {"dead": f"{shm_store.NAME_PREFIX}{namespace}_{dead}_0abc",
             "alive": f"{shm_store.NAME_PREFIX}{namespace}_{os.getppid()}_0abc",
             "elsewhere": f"{shm_store.NAME_PREFIX}{namespace + 1}_{dead}_0abc"}
    for name in names.values():
        with open(os.path.join("/dev/shm", name), "wb") as f:
            f.write(b"x")
    try:
        removed = shm_store.sweep_stale()
        assert names["dead"] in removed and not _segment_exists(names["dead"])
        assert _segment_exists(names["alive"]) and _segment_exists(names["elsewhere"])
    finally:
        for name in names.values():
            if _segment_exists(name):
                os.unlink(os.path.join("/dev/shm", name))
