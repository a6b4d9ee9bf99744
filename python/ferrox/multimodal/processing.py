"""A multimodal model's prompt rules: which token marks an image in a prompt, and what it becomes.

A prompt says where each image goes with one placeholder token (LLaVA's `<image>`, written by the chat
template or by the user). The model replaces a run of tokens with the image's embeddings, one per
row the vision tower and projector produce, so the placeholder is expanded into that many tokens
before the prompt reaches the engine (its length, KV blocks and positions count them), as the Hugging
Face processors do. Built in the front-end from the model folder (config.json, preprocessor_config.json):
the model itself lives in the engine core, maybe another process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ferrox._core import InvalidArgumentError
from ferrox.media_io_config import MediaIOOptions, parse_media_io_kwargs
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.processor_cache import ProcessorCache

# transformers' vision config defaults (image and patch size) by model_type, and LLaVA's default tower.
_VISION_SIZES = {"clip_vision_model": (224, 32), "siglip_vision_model": (224, 16)}
LLAVA_DEFAULT_VISION = {"model_type": "clip_vision_model", "intermediate_size": 4096, "hidden_size": 1024,
                        "patch_size": 14, "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16,
                        "projection_dim": 768}


def llava_vision_config(multimodal: Mapping[str, Any]) -> dict[str, Any]:
    """A LLaVA checkpoint's vision_config as LlavaConfig reads it (a CLIP tower when unsaid)."""
    vision = multimodal.get("vision_config")
    if vision is None:
        return dict(LLAVA_DEFAULT_VISION)
    return {"model_type": "clip_vision_model", **vision}


def llava_image_tokens(multimodal: Mapping[str, Any]) -> int:
    """Embedding rows per image: the tower's patches, its class token (CLIP), less one under the
    "default" feature strategy (which drops the first row)."""
    vision = llava_vision_config(multimodal)
    kind = vision["model_type"]
    if kind not in _VISION_SIZES:
        raise InvalidArgumentError(f"config.json: vision_config.model_type {kind!r} is not supported "
                                   f"(supported: {', '.join(_VISION_SIZES)})", param="model")
    image_size, patch_size = _VISION_SIZES[kind]
    patches = (int(vision.get("image_size", image_size)) // int(vision.get("patch_size", patch_size))) ** 2
    rows = patches + (1 if kind == "clip_vision_model" else 0)
    return rows - 1 if multimodal.get("vision_feature_select_strategy", "default") == "default" else rows


@dataclass(slots=True)
class ImagePrompts:
    """One model's image placeholders and pixels: `expand` makes a prompt and its images what the
    engine core takes."""

    image_token_id: int
    tokens_per_image: int
    placeholder: str  # the placeholder's text: what a string-content chat template gets per image
    image_processor: Any  # multimodal.image_processor.ImageProcessor, or None: the folder has no config
    model_dir: str
    limit: int | None = None  # --limit-mm-per-prompt's images per prompt
    allowed_local_media_path: str | None = None  # --allowed-local-media-path
    # --media-io-kwargs (media_io_config.py); keyword-only, so subclasses keep their positional fields
    media_io: MediaIOOptions = field(default_factory=MediaIOOptions, kw_only=True)
    # --mm-processor-cache-gb (processor_cache.py): processed items kept for a repeat; None: off. Rules derived for a
    # request's mm_processor_kwargs share it (their processors' settings keep their entries apart).
    processor_cache: ProcessorCache | None = field(default=None, kw_only=True)

    def check_count(self, count: int, what: str, param: str = "multi_modal_data") -> None:
        if self.limit is not None and count > self.limit:
            raise InvalidArgumentError(f"{what}: {count} images, at most {self.limit} may be given in one prompt "
                                       "(--limit-mm-per-prompt)", param=param)

    def check_placeholders(self, found: int, images: int, what: str, param: str, hint: str = "") -> None:
        """One placeholder per image, or InvalidArgumentError naming both counts."""
        if found != images:
            raise InvalidArgumentError(
                f"{what}: the prompt has {found} image placeholder(s) ({self.placeholder!r}) for {images} image(s); "
                f"put one placeholder where each image goes{hint}", param=param)

    def tile_placeholders(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
                          param: str) -> tuple[list[int], list[int]]:
        """(the prompt's ids, its placeholder positions) for a family whose image is one placeholder token expanded
        here into its tiles (Idefics3, InternVL): every image token is one image's (a template may write two side
        by side); a prompt already holding expanded tiles has far more of them than images, refused by the count."""
        self.check_count(len(images), what, param)
        ids = list(prompt_ids)
        places = [i for i, t in enumerate(ids) if t == self.image_token_id]
        self.check_placeholders(len(places), len(images), what, param, " (its tiles are expanded here)")
        return ids, places

    def processor_for(self, what: str, param: str) -> Any:
        """The image processor, or InvalidArgumentError: the model folder has no config to prepare images by."""
        if self.image_processor is None:
            raise InvalidArgumentError(f"{what}: model folder {self.model_dir} has no preprocessor_config.json (nor an "
                                       "image_processor in processor_config.json), so its images cannot be prepared",
                                       param=param)
        return self.image_processor

    def process_item(self, processor: Any, item: Any, digest: str, method: str = "__call__") -> Any:
        """`processor.<method>(item)` for one image or video (`digest`: its content's hash, media.image_hash or
        processor_cache.video_key), through the processor cache when there is one."""
        if self.processor_cache is None:
            return getattr(processor, method)(item)
        return self.processor_cache.process(processor, method, item, digest)

    def load(self, source: Any, what: str, param: str = "multi_modal_data") -> Any:
        """A PIL image from a url, path, bytes or PIL image (offline callers; the server fetches
        asynchronously with media.fetch_image)."""
        from ferrox.multimodal.media import MediaError, image_fetch_timeout, load_image

        try:
            return load_image(source, allowed_local_media_path=self.allowed_local_media_path,
                              timeout=image_fetch_timeout())
        except MediaError as e:
            raise InvalidArgumentError(f"{what}: {e}", param=param) from None

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any], what: str,
               param: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        """(expanded ids, one item per image). `images`: decoded PIL images, in prompt order. A
        placeholder is one image token (expanded here) or a run already of the image's length."""
        from ferrox.multimodal.media import image_hash

        self.check_count(len(images), what, param)
        ids = self.insert_image_runs(list(prompt_ids))
        runs = self._placeholders(ids)
        self.check_placeholders(len(runs), len(images), what, param)
        if not images:
            return ids, []
        processor = self.processor_for(what, param)
        digests = [image_hash(image) for image in images]
        pixels = [self.process_item(processor, image, digest, "one") for image, digest in zip(images, digests,
                                                                                             strict=True)]
        out: list[int] = []
        items: list[MultiModalItem] = []
        at = 0
        for k, (start, length) in enumerate(runs):
            out.extend(ids[at:start])
            items.append(MultiModalItem.from_pixels(len(out), self.tokens_per_image, pixels[k], digests[k]))
            out.extend([self.image_token_id] * self.tokens_per_image)
            at = start + length
        out.extend(ids[at:])
        return out, items

    def insert_image_runs(self, ids: list[int]) -> list[int]:
        """A family's own placeholder rewrite before the runs are read (Gemma 3's: below)."""
        return ids

    def processor_kwargs(self) -> tuple[str, ...]:
        """The mm_processor_kwargs keys this family's processors take (PROCESSOR_KWARGS): none by default."""
        return ()

    def with_processor_kwargs(self, kwargs: Mapping[str, Any]) -> ImagePrompts:
        """These rules with processors that take `kwargs` (keys already checked against processor_kwargs)."""
        raise InvalidArgumentError(f"mm_processor_kwargs: {type(self).__name__} takes none", param="mm_processor_kwargs")

    def _placeholders(self, ids: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each image's tokens: a run of image tokens whose length is a multiple of the
        image's is that many images already expanded; any other run is one placeholder per token (a
        template may write two side by side)."""
        n = self.tokens_per_image
        out: list[tuple[int, int]] = []
        for start, length in token_runs(ids, self.image_token_id):
            size = n if n > 1 and length % n == 0 else 1
            out.extend((start + k, size) for k in range(0, length, size))
        return out


def token_runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


@dataclass(slots=True)
class Gemma3ImagePrompts(ImagePrompts):
    """Gemma 3: the prompt marks an image with `<start_of_image>`, which Gemma3Processor replaces by
    "\n\n<start_of_image>" + mm_tokens_per_image x `<image_soft_token>` + "<end_of_image>\n\n" in the
    text before tokenizing. The tokenizer splits text at its added tokens, so the same ids come from
    re-encoding the text segments next to each image with the "\n\n" joined to them (newlines merge
    into one token with the text's own)."""

    boi_token_id: int = 0
    eoi_token_id: int = 0
    tokenizer: Any = None

    def insert_image_runs(self, ids: list[int]) -> list[int]:
        if self.boi_token_id not in ids:
            return ids
        added = set(self.tokenizer.backend.get_added_tokens_decoder())
        out: list[int] = []
        segment = 0  # where the current text segment (tokens since the last added token) starts in out
        prefix = ""  # "\n\n" owed to the text after an image

        def reencode(suffix: str = "") -> None:
            text = prefix + self.tokenizer.decode(out[segment:], skip_special_tokens=False) + suffix
            out[segment:] = self.tokenizer.encode(text, add_special_tokens=False) if text else []

        for i, token in enumerate(ids):
            expand = token == self.boi_token_id and (i + 1 >= len(ids) or ids[i + 1] != self.image_token_id)
            if token in added or expand:
                if expand or prefix:
                    reencode("\n\n" if expand else "")
                prefix = ""
                if expand:
                    out.extend([token, *[self.image_token_id] * self.tokens_per_image, self.eoi_token_id])
                    prefix = "\n\n"
                else:
                    out.append(token)
                segment = len(out)
            else:
                out.append(token)
        if prefix:
            reencode()
        return out


# --mm-processor-kwargs and a request's mm_processor_kwargs: the processor fields each family lets a caller set
# (vLLM passes them to the Hugging Face processor; ferrox's processors read these, and refuse the rest by name).
# Qwen3-VL's video processor also samples frames by fps within [min_frames, max_frames] (a video marked
# do_sample_frames); Qwen2-VL's and Qwen2.5-VL's never sample again, so those keys would do nothing there.
PROCESSOR_KWARGS = {"Qwen2VLForConditionalGeneration": ("min_pixels", "max_pixels"),
                    "Qwen2_5_VLForConditionalGeneration": ("min_pixels", "max_pixels"),
                    "Qwen3VLForConditionalGeneration": ("min_pixels", "max_pixels", "fps", "min_frames", "max_frames"),
                    "Qwen3VLMoeForConditionalGeneration": ("min_pixels", "max_pixels", "fps", "min_frames",
                                                           "max_frames"),
                    "Qwen3_5ForConditionalGeneration": ("min_pixels", "max_pixels", "fps", "min_frames", "max_frames"),
                    "Qwen3_5MoeForConditionalGeneration": ("min_pixels", "max_pixels", "fps", "min_frames",
                                                           "max_frames"),
                    # (its patch and pooling sizes are the tower's: not a request's to change; its videos are
                    # sampled by num_frames, transformers' fps beside it being an error)
                    "Gemma4ForConditionalGeneration": ("max_soft_tokens", "num_frames")}


def processor_kwargs_for(archs: Sequence[str]) -> tuple[str, ...]:
    """The mm_processor_kwargs keys a model of these architectures takes (PROCESSOR_KWARGS; none for the rest)."""
    return next((PROCESSOR_KWARGS[a] for a in archs if a in PROCESSOR_KWARGS), ())


def check_processor_kwargs(kwargs: Mapping[str, Any], allowed: Sequence[str], model: str) -> None:
    """InvalidArgumentError naming `mm_processor_kwargs.<key>` for the first key the model does not take."""
    if not isinstance(kwargs, Mapping):
        raise InvalidArgumentError(f"mm_processor_kwargs: must be an object, got {kwargs!r}",
                                   param="mm_processor_kwargs")
    for key in kwargs:
        if key not in allowed:
            raise InvalidArgumentError(
                f"mm_processor_kwargs.{key}: not a processor setting ferrox takes for {model}"
                + (f" (it takes {', '.join(allowed)})" if allowed else " (it takes none)"), param="mm_processor_kwargs")


def request_image_prompts(prompts: ImagePrompts | None, kwargs: Mapping[str, Any] | None,
                          model: str = "this model") -> ImagePrompts | None:
    """The prompt rules for one request: `prompts` itself without mm_processor_kwargs, else rules whose
    processors take the request's kwargs over the server's (the shared ones are never changed). A key the model
    does not take, or a value its processor refuses, is an InvalidArgumentError naming it."""
    if not kwargs:
        return prompts
    check_processor_kwargs(kwargs, prompts.processor_kwargs() if prompts is not None else (), model)
    assert prompts is not None  # (a model without image rules takes no keys: refused above)
    return prompts.with_processor_kwargs(kwargs)


def image_prompts_for_model(model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any, *,
                            limits: Mapping[str, int] | None = None,
                            allowed_local_media_path: str | None = None,
                            processor_kwargs: Mapping[str, Any] | None = None,
                            media_io_kwargs: Mapping[str, Any] | None = None,
                            processor_cache_gb: float = 0) -> ImagePrompts | None:
    """The prompt rules of a model that takes images (None for a text-only one). hf_config: config.json;
    limits: --limit-mm-per-prompt; processor_kwargs: --mm-processor-kwargs (PROCESSOR_KWARGS);
    media_io_kwargs: --media-io-kwargs (how video files are sampled); processor_cache_gb:
    --mm-processor-cache-gb (0: no cache; nothing to cache for a text-only model)."""
    media_io = parse_media_io_kwargs(media_io_kwargs)
    prompts = _image_prompts_for_model(model_dir, hf_config, tokenizer, limits=limits,
                                       allowed_local_media_path=allowed_local_media_path,
                                       processor_kwargs=processor_kwargs)
    if prompts is not None:
        prompts.media_io = media_io
        prompts.processor_cache = ProcessorCache.of_gib(processor_cache_gb)
    return prompts


def _image_prompts_for_model(model_dir: str, hf_config: Mapping[str, Any], tokenizer: Any, *,
                             limits: Mapping[str, int] | None,
                             allowed_local_media_path: str | None,
                             processor_kwargs: Mapping[str, Any] | None) -> ImagePrompts | None:
    archs = hf_config.get("architectures") or []
    limit = (limits or {}).get("image")
    if processor_kwargs:
        check_processor_kwargs(processor_kwargs, processor_kwargs_for(archs), archs[0] if archs else "this model")
    if "Idefics3ForConditionalGeneration" in archs or "SmolVLMForConditionalGeneration" in archs:
        from ferrox.multimodal.idefics3_processing import idefics3_image_prompts

        return idefics3_image_prompts(model_dir, hf_config, tokenizer, limit=limit,
                                      allowed_local_media_path=allowed_local_media_path)
    if {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
            "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
            "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"} & set(archs):
        # Qwen3-VL (dense and MoE) and Qwen3.5 / Qwen3.6 (its processor): the same rules, 16-pixel patches
        from ferrox.multimodal.qwen2_vl_processing import qwen_vl_image_prompts

        return qwen_vl_image_prompts(model_dir, hf_config, tokenizer, limit=limit,
                                     allowed_local_media_path=allowed_local_media_path,
                                     processor_kwargs=processor_kwargs, video_limit=(limits or {}).get("video"))
    if "Gemma4ForConditionalGeneration" in archs:
        from ferrox.multimodal.gemma4_processing import gemma4_image_prompts

        return gemma4_image_prompts(model_dir, hf_config, tokenizer, limit=limit,
                                    allowed_local_media_path=allowed_local_media_path,
                                    processor_kwargs=processor_kwargs, video_limit=(limits or {}).get("video"),
                                    audio_limit=(limits or {}).get("audio"))
    if "Qwen2AudioForConditionalGeneration" in archs:  # audio clips only (images and videos refused by name)
        from ferrox.multimodal.qwen2_audio_processing import qwen2_audio_prompts

        return qwen2_audio_prompts(model_dir, hf_config, tokenizer, audio_limit=(limits or {}).get("audio"),
                                   allowed_local_media_path=allowed_local_media_path)
    if "VoxtralForConditionalGeneration" in archs:  # audio clips only, through mistral_common's tekken.json
        from ferrox.multimodal.voxtral_processing import voxtral_prompts

        return voxtral_prompts(model_dir, hf_config, tokenizer, audio_limit=(limits or {}).get("audio"),
                               allowed_local_media_path=allowed_local_media_path)
    if "InternVLChatModel" in archs:  # InternVL's remote-code layout: `<image>` placeholders, its own tiling
        from ferrox.multimodal.internvl_chat_processing import internvl_chat_image_prompts

        return internvl_chat_image_prompts(model_dir, hf_config, tokenizer, limit=limit,
                                           allowed_local_media_path=allowed_local_media_path)
    if "InternVLForConditionalGeneration" in archs:
        from ferrox.multimodal.internvl_processing import internvl_image_prompts

        return internvl_image_prompts(model_dir, hf_config, tokenizer, limit=limit,
                                      allowed_local_media_path=allowed_local_media_path)
    if "LlavaNextForConditionalGeneration" in archs:
        from ferrox.multimodal.llava_next_processing import llava_next_image_prompts

        return llava_next_image_prompts(model_dir, hf_config, tokenizer, limit=limit,
                                        allowed_local_media_path=allowed_local_media_path)
    if "LlavaOnevisionForConditionalGeneration" in archs:
        from ferrox.multimodal.llava_onevision_processing import llava_onevision_image_prompts

        return llava_onevision_image_prompts(model_dir, hf_config, tokenizer, limit=limit,
                                             allowed_local_media_path=allowed_local_media_path,
                                             video_limit=(limits or {}).get("video"))
    pixtral_llava = ("LlavaForConditionalGeneration" in archs
                     and (hf_config.get("vision_config") or {}).get("model_type") == "pixtral")
    if "Mistral3ForConditionalGeneration" in archs or pixtral_llava:
        from ferrox.multimodal.pixtral_processing import pixtral_image_prompts

        # (LLaVA over a Pixtral tower, Pixtral-12B: a row per patch, PixtralProcessor's default merge of 1.)
        merge = 1 if pixtral_llava else 2
        if getattr(tokenizer, "image_encoder", None) is not None:  # tokenizer_mode mistral: mistral_common's images
            from ferrox.multimodal.mistral_images import mistral_image_prompts

            return mistral_image_prompts(model_dir, hf_config, tokenizer.image_encoder, limit=limit,
                                         allowed_local_media_path=allowed_local_media_path, default_merge=merge)
        return pixtral_image_prompts(model_dir, hf_config, tokenizer, limit=limit,
                                     allowed_local_media_path=allowed_local_media_path, default_merge=merge)
    if "LlavaForConditionalGeneration" not in archs and "Gemma3ForConditionalGeneration" not in archs:
        return None
    from ferrox.multimodal.image_processor import ImageProcessor

    processor = ImageProcessor.from_model_dir(model_dir) if os.path.isdir(model_dir) else None
    if "Gemma3ForConditionalGeneration" in archs:
        token_id = int(hf_config.get("image_token_index", hf_config.get("image_token_id", 262_144)))
        boi = int(hf_config.get("boi_token_index", 255_999))
        return Gemma3ImagePrompts(token_id, int(hf_config.get("mm_tokens_per_image", 256)),
                                  tokenizer.id_to_token(boi) or "<start_of_image>", processor, model_dir, limit,
                                  allowed_local_media_path, boi, int(hf_config.get("eoi_token_index", 256_000)),
                                  tokenizer)
    token_id = int(hf_config.get("image_token_index", hf_config.get("image_token_id", 32_000)))
    placeholder = tokenizer.id_to_token(token_id) if hasattr(tokenizer, "id_to_token") else None
    return ImagePrompts(token_id, llava_image_tokens(hf_config), placeholder or "<image>", processor, model_dir,
                        limit, allowed_local_media_path)
