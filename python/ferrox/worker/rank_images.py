"""Images under tensor parallelism: every rank embeds the images of a step itself.

A vision model's language model is sharded like its text class; its vision tower's blocks are sharded too
(--mm-encoder-tp-mode weights) or the tower is whole on every rank ('data'), the projector whole either way
(models/vision/encoder_setup.py). Only the
driver (rank 0) hears of a request's images, when the core adds the request; the other ranks see the step
arrays alone (distributed/step_channel.py). So the driver logs every change to the slots its image state
follows (an add: slot, prompt length and the request's MultiModalItems; a removal) and sends the log with
the next step, the items as msgpack bytes (the struct that already crosses the core's socket). Each other
rank replays the log into an ImageEmbeddings and MRopePositions of its own before running the step, so it
computes the driver's image rows (the same tower over the same pixels), bidirectional spans and rotary
positions, and takes the image path (with its embedding all-reduce) on exactly the driver's steps.

Pixels travel once per request, not per step. Every rank runs every image through its shard of the tower
('weights', the encoder's collectives in step because every rank encodes the same images in the same order), or
each rank encodes its share of a step's new images and one all-gather gives all ranks their rows ('data',
worker/multimodal.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from ferrox.multimodal.inputs import MultiModalItem
from ferrox.worker.mrope import MRopePositions
from ferrox.worker.multimodal import ImageEmbeddings, StepImages

_REMOVED = -1  # an event's prompt length when it removes the slot


def multimodal_rope(model: Any, device: torch.device) -> MRopePositions | None:
    """The rotary positions a model that takes images needs per request (Qwen-VL's), else None."""
    merge = getattr(model, "mrope_merge_size", 0)
    return MRopePositions(merge, device, getattr(model, "mrope_tokens_per_second", None)) if merge else None


class ImageEventLog:
    """The driver's record of slot adds and removals since the last step, in order."""

    def __init__(self) -> None:
        self._events: list[tuple[int, int, int]] = []  # (slot, prompt length or _REMOVED, items)
        self._items: list[MultiModalItem] = []

    def add(self, slot: int, prompt_len: int, items: list[MultiModalItem] | None) -> None:
        # Logged with or without images: an add resets the slot's state on every rank alike.
        self._events.append((slot, prompt_len, len(items or ())))
        self._items.extend(items or ())

    def remove(self, slots: Any) -> None:
        self._events.extend((int(s), _REMOVED, 0) for s in np.asarray(slots).tolist())

    def drain_into(self, arrays: dict[str, np.ndarray], so: Any) -> None:
        """Put the log (then empty it) and the step's request slots into the step's message."""
        arrays["req_slots"] = np.asarray(so.req_slots, dtype=np.int32)
        if not self._events:
            return
        arrays["mm_events"] = np.array(self._events, dtype=np.int64).reshape(-1, 3)
        if self._items:
            arrays["mm_items"] = np.frombuffer(msgspec.msgpack.encode(self._items), dtype=np.uint8)
        self._events, self._items = [], []


class RankImages:
    """A non-driver rank's copy of the driver's image state, kept by replaying its log."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.images = ImageEmbeddings(model, device)
        self.mrope = multimodal_rope(model, device)

    @classmethod
    def for_model(cls, model: Any, device: torch.device) -> RankImages | None:
        return cls(model, device) if getattr(model, "takes_images", False) else None

    def step_inputs(self, arrays: dict[str, np.ndarray], step: Any) -> tuple[
            StepImages | None, Callable[[torch.Tensor], torch.Tensor] | None]:
        """Replay the step's log, then (image rows, rotary positions) for ModelForward.run, as the driver's
        runner computes them."""
        self._replay(arrays)
        image_rows = self.images.step_rows(step) if self.images else None
        mrope = self.mrope
        return image_rows, (lambda p: mrope.adjust(step, p)) if mrope is not None else None

    def _replay(self, arrays: dict[str, np.ndarray]) -> None:
        events = arrays.get("mm_events")
        if events is None:
            return
        raw = arrays.get("mm_items")
        items = [] if raw is None else msgspec.msgpack.decode(raw.tobytes(), type=list[MultiModalItem])
        at = 0
        for slot, prompt_len, count in events.tolist():
            if prompt_len == _REMOVED:
                self.images.remove([slot])
                if self.mrope is not None:
                    self.mrope.remove([slot])
                continue
            mine = items[at:at + count]
            at += count
            self.images.add(slot, mine)
            if self.mrope is not None:
                self.mrope.add(slot, prompt_len, mine)
