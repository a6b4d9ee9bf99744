"""Image embeddings in the prompt rows that take them.

A request's images arrive with it (multimodal/inputs.py MultiModalItem: a placeholder run of the prompt
and the image's pixels). A step that schedules part of such a run needs the image's embeddings for
those rows: the vision tower and projector run over the whole image the first time any of its rows is
scheduled (a chunked prefill may cut an image across steps), and the rows are kept until the prefill
has passed the image's end. After a preemption the recomputed prefill encodes the image again.
The step then starts from the token embeddings with those rows replaced (model.embed_input_ids,
model.forward(inputs_embeds=...)), eagerly: the CUDA graphs read token ids.

Under tensor parallelism every rank holds the same image state (worker/rank_images.py) and encodes a step's new
images at the same point of the step, in the same order, so a tower sharded over the ranks (--mm-encoder-tp-mode
weights) runs its collectives in step. With --mm-encoder-tp-mode data the tower is whole on every rank and the
model carries its TP group (`mm_encoder_data_group`): each of the step's new images goes to one rank (the largest
first, each to the least loaded rank), each rank encodes its own, and one all-gather gives every rank all their
rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferrox._core import InvalidArgumentError
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.prompt_embeds import EMBEDS_MODALITY


def check_items(items: list[MultiModalItem], prompt: list[int], model: Any, what: str) -> None:
    """A request's images against its prompt and the model, before anything is queued: runs inside the
    prompt, in order, not overlapping, over the model's image token, with the pixel shape and row count
    the model's tower takes (InvalidArgumentError naming multi_modal_data)."""
    if not getattr(model, "takes_images", False):
        why = ("its vision encoder is not loaded: --language-model-only, or --limit-mm-per-prompt 0 for every "
               "modality" if getattr(model, "vision_encoder_skipped", False) else "a text-only model")
        raise InvalidArgumentError(f"{what}: the model takes no images ({why})", param="multi_modal_data")
    end = 0
    for k, item in enumerate(items):
        if item.modality != "image" and not (item.modality == "video" and getattr(model, "takes_videos", False)) \
                and not (item.modality == "audio" and getattr(model, "takes_audio", False)):
            taken = ["images"] + ["videos"] * bool(getattr(model, "takes_videos", False)) + [
                "audio"] * bool(getattr(model, "takes_audio", False))
            raise InvalidArgumentError(f"{what}: item {k} is {item.modality!r}; the model takes "
                                       f"{' and '.join(taken)} only", param="multi_modal_data")
        if item.offset < end or item.length < 1 or item.end > len(prompt):
            raise InvalidArgumentError(f"{what}: image {k}'s placeholder run [{item.offset}, {item.end}) is not "
                                       f"inside the {len(prompt)}-token prompt after the previous image",
                                       param="multi_modal_data")
        check = getattr(model, "check_image_item", None)
        problem = _embed_positions_problem(item) or (check(item) if check is not None
                                                     else _fixed_size_problem(item, model))
        if problem:
            raise InvalidArgumentError(f"{what}: image {k}: {problem}", param="multi_modal_data")
        if len(item.pixels) != 4 * int(np.prod(item.shape)):
            raise InvalidArgumentError(f"{what}: image {k}'s pixel bytes do not match its shape",
                                       param="multi_modal_data")
        end = item.end


def _embed_positions_problem(item: MultiModalItem) -> str | None:
    where = item.embed_positions
    if where is None:
        return None
    if any(b <= a for a, b in zip(where[:-1], where[1:], strict=True)) or (
            where and (where[0] < 0 or where[-1] >= item.length)):
        return "embed_positions must rise within the image's run"
    return None


def _fixed_size_problem(item: MultiModalItem, model: Any) -> str | None:
    """What is wrong with an image item for a model whose images all have one size and token count (LLaVA,
    Gemma 3, Idefics3's tiles); models with variable images define check_image_item instead."""
    if item.length != model.image_tokens:
        return f"{item.length} placeholder tokens, the model's images take {model.image_tokens}"
    if list(item.shape) != list(model.pixel_shape):
        return f"pixels {list(item.shape)}, the model's vision tower takes {list(model.pixel_shape)}"
    return None


class ImageEmbeddings:
    """The images of the runner's requests, by core slot, and the embeddings being consumed."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._items: dict[int, list[MultiModalItem]] = {}
        self._encoded: dict[tuple[int, int], torch.Tensor] = {}  # (slot, image) -> [length, hidden]
        self._dtype: torch.dtype | None = None  # the token embeddings' (prompt embeddings are cast to it)
        self._gather_format: tuple[int, torch.dtype] | None = None  # --mm-encoder-tp-mode data: rows' width, dtype
        self.tower_runs = 0  # images (videos) this rank ran through the vision tower

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, slot: int, items: list[MultiModalItem] | None) -> None:
        self._drop(slot)
        if items:
            self._items[slot] = list(items)

    def remove(self, slots: Any) -> None:
        for slot in np.asarray(slots).tolist():
            self._drop(int(slot))

    def _drop(self, slot: int) -> None:
        items = self._items.pop(slot, None)
        for k in range(len(items or ())):
            self._encoded.pop((slot, k), None)

    def _encode_one(self, item: MultiModalItem) -> torch.Tensor:
        embed_item = getattr(self.model, "embed_image_item", None)  # variable-size images (Qwen2-VL)
        if item.modality == EMBEDS_MODALITY:  # a prompt of embeddings: its rows are the encoding
            rows = self._prompt_embeds_rows(item)
        elif embed_item is not None:
            rows = embed_item(item, self.device)
            self.tower_runs += 1
        else:
            rows = self.model.embed_multimodal(item.pixel_values().to(self.device).unsqueeze(0))[0]
            self.tower_runs += 1
        if rows.shape[0] != item.num_embeds:
            raise RuntimeError(f"the model gave {rows.shape[0]} embedding rows for an image of {item.num_embeds}")
        return rows

    def _encode(self, pending: list[tuple[tuple[int, int], MultiModalItem]]) -> None:
        """Encode the step's new items (by (slot, image) key) into _encoded: here, or split among the ranks
        under --mm-encoder-tp-mode data (module docstring)."""
        group = getattr(self.model, "mm_encoder_data_group", None)
        towers = [(key, item) for key, item in pending if item.modality != EMBEDS_MODALITY]
        if group is None or group.size == 1 or not towers:
            for key, item in pending:
                self._encoded[key] = self._encode_one(item)
            return
        for key, item in pending:
            if item.modality == EMBEDS_MODALITY:
                self._encoded[key] = self._encode_one(item)
        owners = assign_items([int(np.prod(item.shape)) for _, item in towers], group.size)
        mine = [self._encode_one(item) for (_, item), owner in zip(towers, owners, strict=True) if owner == group.rank]
        if self._gather_format is None:  # the rows' width and dtype, the same for every item: learnt once
            local = [mine[0].shape[-1], _DTYPES.index(mine[0].dtype)] if mine else [0, 0]
            width, dtype = max((tuple(v) for v in group.gather_ints(local)), key=lambda v: v[0])
            self._gather_format = (int(width), _DTYPES[int(dtype)])
        width, dtype = self._gather_format
        counts = [sum(item.num_embeds for (_, item), owner in zip(towers, owners, strict=True) if owner == r)
                  for r in range(group.size)]
        buffer = torch.zeros(max(counts), width, dtype=dtype, device=self.device)
        if mine:
            buffer[:counts[group.rank]] = torch.cat(mine)
        parts = group.all_gather(buffer)
        at = [0] * group.size
        for (key, item), owner in zip(towers, owners, strict=True):
            self._encoded[key] = parts[owner][at[owner]:at[owner] + item.num_embeds]
            at[owner] += item.num_embeds

    def _prompt_embeds_rows(self, item: MultiModalItem) -> torch.Tensor:
        """An embeddings prompt's rows in the model dtype, as transformers' forward(inputs_embeds=...) takes
        them: times the family's prompt_embeds_scale where transformers scales inputs_embeds after the lookup
        and ferrox folded that scale into its embedding weights (Granite's embedding_multiplier)."""
        if self._dtype is None:
            self._dtype = self.model.embed_input_ids(torch.zeros(1, dtype=torch.int64, device=self.device)).dtype
        rows = item.pixel_values().to(device=self.device, dtype=self._dtype)
        scale = getattr(self.model, "prompt_embeds_scale", 1.0)
        return rows if scale == 1.0 else rows * scale

    def step_rows(self, so: Any) -> StepImages | None:
        """The image rows this step computes (their embeddings, and for a model whose image tokens
        attend both ways, each request row's image ranges), or None when it computes none."""
        if not self._items:
            return None
        slots = np.asarray(so.req_slots)
        qsl = np.asarray(so.query_start_loc)
        positions = np.asarray(so.positions)
        # (request row, slot, image, item, the row's first token row and position, the image's positions in it)
        uses: list[tuple[int, int, int, MultiModalItem, int, int, int, int]] = []
        passed: list[tuple[int, int]] = []  # images the prefill is past after this step
        for r, slot in enumerate(slots.tolist()):
            items = self._items.get(slot)
            if not items:
                continue
            start, stop = int(qsl[r]), int(qsl[r + 1])
            first = int(positions[start])  # a row's positions run on from its first
            last = first + stop - start
            for k, item in enumerate(items):
                lo, hi = max(first, item.offset), min(last, item.end)
                if lo < hi:
                    uses.append((r, slot, k, item, start, first, lo, hi))
                if item.end <= last:
                    passed.append((slot, k))
        # Every image whose rows the step computes, encoded now if it is new (the same list on every rank).
        self._encode([((slot, k), item) for _, slot, k, item, *_ in uses if (slot, k) not in self._encoded])
        rows: list[np.ndarray] = []
        parts: list[torch.Tensor] = []
        spans: dict[int, list[tuple[int, int]]] = {}
        for r, slot, k, item, start, first, lo, hi in uses:
            if item.modality != "audio":  # (an audio clip's tokens stay causal: Gemma 4's overlay is for vision)
                spans.setdefault(r, []).append((item.offset, item.end))
            encoded = self._encoded[(slot, k)]
            if item.embed_positions is None:
                rows.append(np.arange(start + lo - first, start + hi - first, dtype=np.int64))
                parts.append(encoded[lo - item.offset:hi - item.offset])
            else:  # only some of the run's positions take rows (Pixtral's breaks keep theirs)
                where = np.asarray(item.embed_positions, dtype=np.int64)
                a, b = np.searchsorted(where, [lo - item.offset, hi - item.offset])
                if a < b:
                    rows.append(start + item.offset + where[a:b] - first)
                    parts.append(encoded[int(a):int(b)])
        for key in passed:
            self._encoded.pop(key, None)
        if not rows:
            return None
        both_ways = spans if spans and getattr(self.model, "bidirectional_images", False) else None
        embeds = torch.cat(parts)
        deepstack = None
        layers = getattr(self.model, "deepstack_layers", 0)
        if layers:  # Qwen3-VL: each image row carries its DeepStack rows after its own (models/qwen3_vl.py)
            embeds, *sets = embeds.chunk(1 + layers, dim=-1)
            deepstack = torch.stack(sets)
        return StepImages(torch.from_numpy(np.concatenate(rows)).to(self.device), embeds, both_ways, deepstack)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def assign_items(costs: list[int], ranks: int) -> list[int]:
    """The rank that encodes each item (--mm-encoder-tp-mode data): the costliest first, each to the rank with
    the least work so far (the lowest such rank on a tie), so every rank computes the same assignment."""
    load = [0] * ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owner = min(range(ranks), key=lambda r: load[r])
        owners[i] = owner
        load[owner] += costs[i]
    return owners


@dataclass(slots=True)
class StepImages:
    rows: torch.Tensor  # [k] int64: the step's token rows that are image rows
    embeds: torch.Tensor  # [k, hidden]: their embeddings
    # Request row -> its images' position ranges, for a model whose image tokens attend to each other
    # both ways (AttentionMetadata.bidirectional); None for causal models.
    bidirectional: dict[int, list[tuple[int, int]]] | None
    # [layers, k, hidden]: what a DeepStack model (Qwen3-VL) adds at these rows after each of its first decoder
    # layers; None for other models.
    deepstack: torch.Tensor | None = None
