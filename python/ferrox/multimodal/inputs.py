"""An image of a prompt as the engine core receives it, and the prefix-cache salt that keeps images apart.

The front-end turns each image into pixel values (multimodal/image_processor.py) and the prompt's
placeholder into the run of tokens the image's embeddings replace (multimodal/processing.py). The core
sees only token ids: two prompts with different images have the same placeholder ids, so their KV
blocks must not be shared. Each image's hash and placeholder run go to the Rust core with the request
(Scheduler.add_request's mm_items), which mixes the hash into the block holding the image and so into
every block after it, as vLLM's extra keys do: prompts with the same images in the same places share
their prefix (a multi-turn chat about one picture reuses its KV), a system prompt before different
images is shared, and nothing from an image on is shared with another image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from ferrox.multimodal.shm_store import ShmRef

if TYPE_CHECKING:
    import torch


class MultiModalItem(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image (or video: modality "video"): its placeholder run in the prompt and its pixel values (float32, C order, so the
    struct crosses the core's socket as plain bytes)."""

    offset: int  # prompt position of the first placeholder token
    length: int  # placeholder tokens: the rows of the image's embeddings
    pixels: bytes
    shape: list[int]
    hash: str
    modality: str = "image"
    # Qwen2-VL's (t, h, w) patch grid: its pixels are [t * h * w, patch values] patches, not a fixed image.
    grid: list[int] | None = None
    # The run's positions (from offset) that take the image's embedding rows, in order, when not all do
    # (Pixtral's row-break tokens sit inside an image's run and keep their own embeddings). None: every one.
    embed_positions: list[int] | None = None
    # Qwen2.5-VL videos: seconds one temporal patch spans (its rotary spaces frames by time). None otherwise.
    second_per_grid_ts: float | None = None
    # --mm-processor-cache-type shm: where the pixels lie in the front-end's shared memory while the item crosses to
    # the engine core (pixels empty meanwhile); the core reads them back on receipt (multimodal/shm_items.py).
    shm: ShmRef | None = None

    @classmethod
    def from_pixels(cls, offset: int, length: int, pixel_values: np.ndarray, digest: str,
                    grid: list[int] | None = None, embed_positions: list[int] | None = None, *,
                    modality: str = "image", second_per_grid_ts: float | None = None) -> MultiModalItem:
        array = np.ascontiguousarray(pixel_values, dtype=np.float32)
        return cls(offset, length, array.tobytes(), list(array.shape), digest, modality=modality, grid=grid,
                   embed_positions=embed_positions, second_per_grid_ts=second_per_grid_ts)

    @property
    def num_embeds(self) -> int:
        """Embedding rows the image gives: its run's length, or the positions that take them."""
        return self.length if self.embed_positions is None else len(self.embed_positions)

    def pixel_values(self) -> torch.Tensor:
        import torch  # (the engine core's side; the front-end that builds items has no torch)

        if self.shm is not None:
            raise RuntimeError(f"multimodal item {self.hash[:16]}: its pixels are still in shared memory "
                               "(multimodal.shm_items.resolve_items puts them back when the core receives them)")
        return torch.from_numpy(np.frombuffer(self.pixels, dtype=np.float32).reshape(self.shape).copy())

    @property
    def end(self) -> int:
        return self.offset + self.length


def seen_hash(source: str, pixel_values: np.ndarray, grid: Sequence[int] | None = None) -> str:
    """sha256 of an item's source hash, its patch grid and the pixel values the model sees. A request's
    mm_processor_kwargs resize the same source to other pixels (other embeddings, maybe the same placeholder
    ids in a block): the source's hash alone would let their KV blocks be shared."""
    array = np.ascontiguousarray(pixel_values, dtype=np.float32)
    digest = hashlib.sha256(f"{source}\x00{list(array.shape)}\x00{list(grid or [])}\x00".encode())
    digest.update(array.data)  # (C-contiguous: hashed in place, not copied)
    return digest.hexdigest()

