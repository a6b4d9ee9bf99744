"""Prompt rules of a family that takes videos beside images and whose processors a request's
mm_processor_kwargs read again (Qwen2-VL / 2.5-VL / 3-VL, Gemma 4): the video fields they share, the check of a
prompt's video count, and the copies derived per distinct kwargs, cached because a processor reads the model
folder's files (`with_processor_kwargs`; the family says how to derive one: `derive`). The audio fields are set
by a family that takes audio clips (Gemma 4: multimodal/gemma4_audio_processing.py); the rest leave them
unset, so a clip is refused naming the model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.multimodal.processing import ImagePrompts, token_runs

_DERIVED_CACHE_SIZE = 32  # distinct per-request mm_processor_kwargs whose processors are kept


@dataclass(slots=True)
class MediaPrompts(ImagePrompts):
    video_processor: Any = None  # the family's video processor; None: this folder's videos are refused
    video_token_id: int = -1  # (-1: the family has no video token)
    video_placeholder: str | None = None  # what a string-content chat template gets per video
    video_limit: int | None = None  # --limit-mm-per-prompt's videos per prompt
    video_refusal: str | None = None  # why this folder's videos are refused
    tokenizer: Any = None  # encodes the text a video's frames carry (their timestamps), where the family writes it
    server_kwargs: Mapping[str, Any] = field(default_factory=dict)  # --mm-processor-kwargs
    audio_processor: Any = None  # the family's audio feature extractor; None: this folder's audio is refused
    audio_token_id: int = -1  # (-1: the family has no audio token)
    boa_token_id: int = -1  # begin- and end-of-audio around a clip's soft tokens
    eoa_token_id: int = -1
    audio_placeholder: str | None = None  # what a string-content chat template gets per clip
    audio_limit: int | None = None  # --limit-mm-per-prompt's audio clips per prompt
    audio_refusal: str | None = None  # why this folder's audio is refused
    # Rules derived for a request's mm_processor_kwargs, by those kwargs.
    _derived: dict[tuple[tuple[str, str], ...], MediaPrompts] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    _derived_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def derive(self, kwargs: Mapping[str, Any]) -> MediaPrompts:
        """A copy whose processors (each class's from_model_dir) read the folder with `kwargs` (the server's, the
        request's over them); ModelLoadError / UnsupportedModelError for a value a processor refuses."""
        image = (type(self.image_processor).from_model_dir(self.model_dir, kwargs)
                 if self.image_processor is not None else None)
        video = (type(self.video_processor).from_model_dir(self.model_dir, kwargs)
                 if self.video_processor is not None else None)
        return replace(self, image_processor=image, video_processor=video)

    def media_runs(self, prompt_ids: Sequence[int], media: Sequence[Any], what: str, param: str
                   ) -> tuple[list[Any], list[Any], list[int], list[tuple[int, int]], list[tuple[int, int]]]:
        """(stills, videos, ids, image runs, video runs): a prompt's decoded media split by kind in order (the stills
        counted against --limit-mm-per-prompt), its ids, and the (start, length) runs of its image and video
        tokens."""
        from ferrox.multimodal.video import split_media

        stills, videos = split_media(media)
        self.check_count(len(stills), what, param)
        ids = list(prompt_ids)
        runs = token_runs(ids, self.image_token_id)
        video_runs = token_runs(ids, self.video_token_id) if self.video_token_id >= 0 else []
        return stills, videos, ids, runs, video_runs

    def with_processor_kwargs(self, kwargs: Mapping[str, Any]) -> MediaPrompts:
        """A copy whose processors read the folder with the server's kwargs and then the request's over them; the
        shared processors stay as they are. Cached per distinct kwargs (a flood of distinct values evicts the
        oldest)."""
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        with self._derived_lock:  # (the prompt threads derive concurrently)
            if (found := self._derived.get(key)) is not None:
                return found
        try:
            derived = self.derive({**self.server_kwargs, **kwargs})
        except (ModelLoadError, UnsupportedModelError) as e:  # a value a processor refuses (names file and kwargs)
            raise InvalidArgumentError(str(e), param="mm_processor_kwargs") from None
        with self._derived_lock:
            if len(self._derived) >= _DERIVED_CACHE_SIZE:
                self._derived.pop(next(iter(self._derived)))
            self._derived[key] = derived
        return derived

    def check_audio_count(self, count: int, what: str, param: str = "multi_modal_data") -> None:
        if self.audio_limit is not None and count > self.audio_limit:
            raise InvalidArgumentError(f"{what}: {count} audio clips, at most {self.audio_limit} may be given in one "
                                       "prompt (--limit-mm-per-prompt)", param=param)

    def processed_clips(self, clips: Sequence[Any], what: str, param: str,
                        tokens_of: Callable[[Any, Any], int]) -> list[tuple[Any, int, str]]:
        """(features, soft-token count, prefix-cache hash) of each decoded clip, by the family's audio_processor
        (cached as an image's pixels are), after the checks every audio family makes: a processor, the per-prompt
        limit, the processor's sampling rate. tokens_of(clip, features): the family's count."""
        from ferrox.multimodal.inputs import seen_hash

        extractor = self.audio_processor
        if extractor is None:
            raise InvalidArgumentError(f"{what}: {self.audio_refusal or 'this model takes no audio inputs'}",
                                       param=param)
        self.check_audio_count(len(clips), what, param)
        processed = []
        for k, clip in enumerate(clips):
            if getattr(clip, "rate", extractor.sampling_rate) != extractor.sampling_rate:
                raise InvalidArgumentError(f"{what}: audio {k}: {clip.rate} Hz, the model's feature extractor takes "
                                           f"{extractor.sampling_rate} Hz", param=param)
            try:
                features = self.process_item(extractor, clip, clip.hash(), "features")
            except ValueError as e:
                raise InvalidArgumentError(f"{what}: audio {k}: {e}", param=param) from None
            processed.append((features, tokens_of(clip, features), seen_hash(clip.hash(), features)))
        return processed

    def check_video_count(self, count: int, what: str, param: str = "multi_modal_data") -> None:
        if self.video_limit is not None and count > self.video_limit:
            raise InvalidArgumentError(f"{what}: {count} videos, at most {self.video_limit} may be given in one "
                                       "prompt (--limit-mm-per-prompt)", param=param)
