"""Images and videos through the shared-memory store (`--mm-processor-cache-type shm`, multimodal/shm_store.py).

The front-end swaps an item's pixel bytes for a reference (`MultiModalItem.shm`, `pixels` empty) just before the
request goes down one core's socket, so the reference names that core's reader slot and counts one read per message
sent: each of the n samples of a request is a message of its own, and under data parallelism each request goes to
one core, which acknowledges in its own slot. The engine core puts the bytes back (`resolve_items`) as soon as it
decodes the message -- before the request can be held, refused or aborted -- so every reference sent is read
exactly once while the core lives, and the writer never waits on a request that will not run.

What goes inline as before: an item without a content hash (prompt embeddings: nothing to share it by), one larger
than --mm-shm-cache-max-object-size-mb, and one that finds no room (the ring's oldest entry still owed a read).
The item's hash and so the prefix-cache salt are unchanged; only where its bytes travel differs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.shm_store import ShmRef, ShmWriter, read

logger = logging.getLogger("ferrox.multimodal.shm_items")

GIB = 1 << 30
MIB = 1 << 20


class ShmItemSender:
    """The front-end's side: one writer for every core of the engine (one reader slot each)."""

    def __init__(self, writer: ShmWriter) -> None:
        self.writer = writer

    @classmethod
    def for_config(cls, config: Any, readers: int) -> ShmItemSender | None:
        """The store `config` asks for (mm_processor_cache_type 'shm', mm_processor_cache_gb > 0), for `readers`
        engine cores; None otherwise (items inline, as with 'lru')."""
        if config.mm_processor_cache_type != "shm" or not config.mm_processor_cache_gb > 0:
            return None
        writer = ShmWriter(int(config.mm_processor_cache_gb * GIB), config.mm_shm_cache_max_object_size_mb * MIB,
                           readers)
        logger.info("multimodal items go to the engine core%s through shared memory %s (%.2f GiB, objects up to "
                    "%d MiB)", "s" if readers > 1 else "", writer.name, writer.capacity / GIB,
                    config.mm_shm_cache_max_object_size_mb)
        return cls(writer)

    def send(self, items: Sequence[MultiModalItem], reader: int) -> tuple[list[MultiModalItem], list[ShmRef]]:
        """(the items as they go to core `reader`, the references made). The caller's items are not changed."""
        out: list[MultiModalItem] = []
        refs: list[ShmRef] = []
        for item in items:
            ref = None
            if item.shm is None and item.hash and item.pixels:
                ref = self.writer.put(_key(item), item.pixels, reader)
            if ref is None:
                out.append(item)
            else:
                out.append(msgspec.structs.replace(item, pixels=b"", shm=ref))
                refs.append(ref)
        return out, refs

    def cancel(self, refs: list[ShmRef]) -> None:
        """The message carrying `refs` was never sent: nobody will read them."""
        if refs:
            self.writer.cancel(refs)

    def close(self) -> None:
        self.writer.close()


def _key(item: MultiModalItem) -> str:
    """The store's key: the item's content hash, with what reshapes its bytes (two items with one hash and other
    shapes, which should not exist, would then never share an entry)."""
    return f"{item.modality}\x00{item.hash}\x00{item.shape}"


def resolve_items(items: list[MultiModalItem]) -> list[MultiModalItem]:
    """The engine core's side: every referenced item with its bytes back (read from the store and acknowledged);
    the others as they are. shm_store.ShmStoreError when a reference cannot be honoured."""
    if not any(item.shm is not None for item in items):
        return items
    return [item if item.shm is None else msgspec.structs.replace(item, pixels=read(item.shm), shm=None)
            for item in items]
