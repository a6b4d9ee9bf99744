"""Images under --tokenizer-mode mistral (Mistral Small 3.1 / 3.2, Ministral 3, Pixtral): prepared by mistral_common,
as vLLM prepares them for a Mistral tokenizer.

mistral_common's ImageEncoder, built from tekken.json's `image` settings (image_patch_size, max_image_size,
spatial_merge_size; a v7-v11 file's `multimodal`), takes one image to its tokens and pixels: RGB (transparency over
white); shrunk so that its longer side fits max_image_size (sides rounded); each side rounded up to whole units
(unit: image_patch_size x spatial_merge_size pixels, one embedding row a side) and resized there with OpenCV's
bicubic; divided by 255 and normalized by CLIP's mean and std, channels first: float32 [3, rows * unit, cols * unit].
Its tokens are Pixtral's rows layout, cols x `[IMG]` then `[IMG_BREAK]`, the last one `[IMG_END]`. vLLM feeds those
pixels to its Pixtral tower as they are; so does ferrox (models/mistral3.py: the item's embed_positions are the
`[IMG]`s, the breaks and the end keep their own embeddings). No preprocessor_config.json is read: a params.json-only
folder takes images too.

A chat is encoded by mistral_common in one piece (loader/mistral_tokenizer.py), its image chunks through
PlaceholderImageEncoder, which writes one `[IMG]` per image and processes nothing. These prompt rules (Pixtral's,
with MistralImageProcessor) then put each image's layout and pixels in place of its `[IMG]`, through ferrox's
processor cache and image hash (media.image_hash, the prefix cache's salt). An image chunk's tokens depend on that
image alone and sit where the chunk is, so the ids are those of mistral_common's encode_chat_completion of the chat
with its images (tests/models/test_mistral_images.py compares ids and pixels), and each image is processed once, by
mistral_common's own encoder. The same rules take an offline prompt's token ids with one `[IMG]` per image; a text
prompt's "[IMG]" stays text in this mode (as in vLLM's, which takes token prompts only). A tekken.json without image
settings leaves a Hugging Face folder's own processor (preprocessor_config.json: pixtral_processing.py) in place;
its chats are encoded the same way.

Front-end code: numpy, PIL and mistral_common (whose encoder resizes with OpenCV: mistral-common[image]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from ferrox.errors import UnsupportedModelError
from ferrox.multimodal.pixtral_processing import (
    DEFAULT_IMAGE_TOKEN_ID,
    IMAGE_TOKEN,
    PixtralImagePrompts,
    layout_ids,
)

TEKKEN_FILE = "tekken.json"
# What an image part becomes for mistral_common's ChatCompletionRequest.from_openai: an image_url chunk, which
# PlaceholderImageEncoder encodes without reading (ferrox has fetched the image already).
PLACEHOLDER_IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}


class _Encoding(NamedTuple):  # (what mistral_common reads of an ImageEncoding)
    tokens: list[int]
    image: np.ndarray


@dataclass(frozen=True, slots=True)
class PlaceholderImageEncoder:
    """mistral_common's image encoder for a chat's encoding (the module docstring): one `[IMG]` per image chunk."""

    image_token_id: int

    def __call__(self, chunk: Any) -> _Encoding:
        return _Encoding([self.image_token_id], np.zeros((3, 0, 0), np.float32))


def placeholder_chat_tokenizer(mistral: Any, image_token_id: int) -> Any:
    """A copy of mistral_common's MistralTokenizer `mistral` whose image chunks encode through
    PlaceholderImageEncoder; everything else (the vocabulary, validator, normalizer) is shared with it."""
    import copy

    instruct = copy.copy(mistral.instruct_tokenizer)
    instruct.image_encoder = PlaceholderImageEncoder(image_token_id)
    out = copy.copy(mistral)
    out.instruct_tokenizer = instruct
    return out


@dataclass(eq=False)
class MistralImageProcessor:
    """PixtralImageProcessor's interface over mistral_common's ImageEncoder: `processor(image)` -> (float32 [3,
    rows * unit, cols * unit] pixels, (rows, cols)); ValueError for an image it cannot take. Its fields are the
    encoder's settings: the processor cache tells processors apart by them (the encoder itself is code)."""

    image_config: Any  # mistral_common's ImageConfig: image_patch_size, max_image_size, spatial_merge_size
    special_ids: Any  # its SpecialImageIDs: img, img_break, img_end

    @classmethod
    def of(cls, encoder: Any) -> MistralImageProcessor:
        processor = cls(encoder.image_config, encoder.special_ids)
        processor._encoder = encoder
        return processor

    def __post_init__(self) -> None:
        ids = self.special_ids
        self.image_token_id, self.break_token_id, self.end_token_id = int(ids.img), int(ids.img_break), int(ids.img_end)
        self.patch_size, self.merge = int(self.image_config.image_patch_size), int(self.image_config.spatial_merge_size)
        self._encoder: Any = None

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
        from mistral_common.protocol.instruct.messages import ImageChunk

        try:
            encoding = self._encoder(ImageChunk(image=image))
        except ImportError as e:  # (OpenCV: mistral_common's optional `image` extra)
            raise ValueError(f"mistral_common resizes images with OpenCV, which cannot be imported here ({e}): "
                             "pip install 'mistral-common[image]'") from None
        tokens = list(encoding.tokens)
        rows = sum(t in (self.break_token_id, self.end_token_id) for t in tokens)
        cols = len(tokens) // max(rows, 1) - 1
        if rows < 1 or layout_ids(rows, cols, self.image_token_id, self.break_token_id, self.end_token_id) != tokens:
            raise ValueError(f"mistral_common's tokens for the image are not a rows layout: {tokens[:16]}...")
        return np.ascontiguousarray(encoding.image, dtype=np.float32), (rows, cols)


@dataclass(slots=True)
class MistralImagePrompts(PixtralImagePrompts):
    """Pixtral's prompt rules with MistralImageProcessor: a lone `[IMG]` token per image, which the chat encoding
    writes (a text prompt's "[IMG]" is text here)."""

    def check_placeholders(self, found: int, images: int, what: str, param: str, hint: str = "") -> None:
        if not hint and found != images:
            hint = (" (tokenizer_mode 'mistral' encodes a text prompt's '[IMG]' as text: send a chat, or "
                    "prompt_token_ids with the [IMG] token)")
        PixtralImagePrompts.check_placeholders(self, found, images, what, param, hint)


def mistral_image_prompts(model_dir: str, hf_config: Mapping[str, Any], encoder: Any, *, limit: int | None,
                          allowed_local_media_path: str | None, default_merge: int = 2) -> MistralImagePrompts:
    """The prompt rules of a Mistral 3 (or Pixtral LLaVA) model under tokenizer_mode mistral: `encoder` is the
    tokenizer's mistral_common ImageEncoder. Its `[IMG]` id and its unit (image_patch_size x spatial_merge_size)
    must be the model's (config.json or params.json), or the model is refused by name."""
    processor = MistralImageProcessor.of(encoder)
    token_id = int(hf_config.get("image_token_index", hf_config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID)))
    if token_id != processor.image_token_id:
        raise UnsupportedModelError(f"{TEKKEN_FILE}: its [IMG] token is id {processor.image_token_id}, the model's "
                                    f"image_token_index is {token_id}")
    patch = int((hf_config.get("vision_config") or {}).get("patch_size", 14))
    merge = int(hf_config.get("spatial_merge_size", default_merge))
    if processor.patch_size * processor.merge != patch * merge:
        raise UnsupportedModelError(
            f"{TEKKEN_FILE}: image.image_patch_size {processor.patch_size} x spatial_merge_size {processor.merge} "
            f"differs from the model's vision patch_size {patch} x spatial_merge_size {merge}: each embedding row "
            "would cover other pixels than the tower's")
    return MistralImagePrompts(token_id, 0, IMAGE_TOKEN, processor, model_dir, limit, allowed_local_media_path,
                               processor.break_token_id, processor.end_token_id)
