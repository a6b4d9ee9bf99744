"""Qwen2-VL's multimodal rotary positions, per request, for the rotary only.

A Qwen2-VL prompt's tokens rotate by three positions each (temporal, height, width: layers/rotary.py
MRotaryEmbedding). Text counts on one position for all three; an image's tokens take their patch's
(t, h, w) offset from the position the image starts at, and the text after it resumes at that start plus
the image's larger side in merged patches (transformers' get_rope_index). A video's tokens take (frame, h, w) offsets the same way, Qwen2.5-VL's
frame offsets spaced by its second_per_grid_ts x tokens_per_second. A Qwen3-VL video (an item whose run holds
its frames' timestamp text, embed_positions marking the pads) is read as one single-frame image per temporal
patch with text between: its timestamps, not its positions, tell the frames' times. An image of 16x16 merged patches
is 256 tokens but advances the position by 16, so every later token's rotary position is its index in the
sequence plus the request's `delta` (negative). The KV slots, sequence lengths and causal order stay the
core's plain positions: only what the rotary is given changes.

Per step (`MRopePositions.adjust`): rows of requests with images get the offset; a step that computes any
prompt tokens of such a request passes the model [3, T] positions (other rows' three equal), which only the
general path takes (a step with image rows runs eagerly anyway); later steps pass [T] positions shifted
by the delta, so decode keeps the fused kernels and CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ferrox.multimodal.inputs import MultiModalItem


def mrope_positions(prompt_len: int, items: list[MultiModalItem], merge: int,
                    tokens_per_second: float | None = None) -> tuple[np.ndarray, int]:
    """([3, prompt_len] int64 rotary positions, delta: a later token's position minus its index).
    tokens_per_second: Qwen2.5-VL's, which spaces a video's temporal patches by its second_per_grid_ts."""
    pos = np.empty((3, prompt_len), dtype=np.int64)
    current = 0
    at = 0
    for offset, t, h, w, seconds in _vision_blocks(items, merge):
        n = offset - at
        pos[:, at:offset] = np.arange(current, current + n)
        current += n
        frames = np.arange(t)
        if tokens_per_second is not None and seconds is not None:
            # transformers scales in float32, then truncates
            interval = np.float32(tokens_per_second * seconds)
            frames = (frames.astype(np.float32) * interval).astype(np.int64)
        tt, hh, ww = np.meshgrid(frames, np.arange(h), np.arange(w), indexing="ij")
        end = offset + t * h * w
        pos[:, offset:end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + current
        # The text after resumes past the larger side, whatever the frames' span (transformers 5's rule).
        current += max(h, w)
        at = end
    pos[:, at:] = np.arange(current, current + prompt_len - at)
    # Generated tokens continue from the largest position of the prompt (a video's frames may reach past
    # its text).
    return pos, int(pos.max()) + 1 - prompt_len if prompt_len else 0


def _vision_blocks(items: list[MultiModalItem], merge: int) -> list[tuple[int, int, int, int, float | None]]:
    """(prompt offset, t, merged h, merged w, Qwen2.5-VL's seconds per temporal patch) of each run of vision
    tokens, in order: an item, or each frame of a Qwen3-VL video (its run's other tokens are text)."""
    blocks: list[tuple[int, int, int, int, float | None]] = []
    for item in items:
        if item.grid is None:
            raise ValueError("a Qwen2-VL image item needs its (t, h, w) grid")
        t, h, w = item.grid[0], item.grid[1] // merge, item.grid[2] // merge
        if item.embed_positions is None:
            seconds = item.second_per_grid_ts if item.modality == "video" else None
            blocks.append((item.offset, t, h, w, seconds))
            continue
        where = item.embed_positions
        if item.modality != "video" or len(where) != t * h * w:
            raise ValueError("only a Qwen3-VL video's item marks its embedding positions, one frame's pads at a time")
        for f in range(t):
            first = where[f * h * w]
            if where[(f + 1) * h * w - 1] != first + h * w - 1:
                raise ValueError(f"frame {f} of a Qwen3-VL video: its pads must be one run")
            blocks.append((item.offset + first, 1, h, w, None))
    return blocks


class MRopePositions:
    """The rotary positions of the runner's requests that have images (others need none)."""

    def __init__(self, merge: int, device: torch.device, tokens_per_second: float | None = None) -> None:
        self.merge = merge
        self.device = device
        self.tokens_per_second = tokens_per_second
        self._prompt: dict[int, np.ndarray] = {}  # slot -> [3, prompt_len]
        self._delta: dict[int, int] = {}

    def add(self, slot: int, prompt_len: int, items: list[MultiModalItem] | None) -> None:
        self.remove([slot])
        if items:
            self._prompt[slot], self._delta[slot] = mrope_positions(prompt_len, items, self.merge,
                                                                         self.tokens_per_second)

    def remove(self, slots: Any) -> None:
        for slot in np.asarray(slots).tolist():
            self._prompt.pop(int(slot), None)
            self._delta.pop(int(slot), None)

    def adjust(self, so: Any, positions: torch.Tensor) -> torch.Tensor:
        """The step's rotary positions from its plain ones (on the device, after any shift back)."""
        if not self._delta:
            return positions
        slots = np.asarray(so.req_slots)
        qsl = np.asarray(so.query_start_loc)
        host = np.asarray(so.positions)
        delta = np.zeros(int(qsl[-1]), dtype=np.int64)
        prompt_rows: list[tuple[np.ndarray, np.ndarray]] = []
        for r, slot in enumerate(slots.tolist()):
            if slot not in self._delta:
                continue
            start, stop = int(qsl[r]), int(qsl[r + 1])
            delta[start:stop] = self._delta[slot]
            table = self._prompt[slot]
            first = int(host[start])
            if first < table.shape[1]:  # prompt tokens: their own three positions
                n = min(stop - start, table.shape[1] - first)
                prompt_rows.append((np.arange(start, start + n), table[:, first:first + n]))
        if not delta.any() and not prompt_rows:
            return positions
        shifted = positions + torch.from_numpy(delta).to(self.device)
        if not prompt_rows:
            return shifted
        three = shifted.unsqueeze(0).repeat(3, 1)
        rows = torch.from_numpy(np.concatenate([r for r, _ in prompt_rows])).to(self.device)
        values = torch.from_numpy(np.concatenate([v for _, v in prompt_rows], axis=1)).to(self.device)
        three[:, rows] = values
        return three
