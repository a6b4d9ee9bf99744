"""A request's images, videos and audio clips, fetched before its prompt renders (the chat, Anthropic messages and
Responses routes).

Each image part's url is fetched concurrently on the event loop (multimodal/media.py: data URLs, http(s)
under VLLM_IMAGE_FETCH_TIMEOUT, files under --allowed-local-media-path) and decoded; a bad one is a 400
naming its part, and nothing reaches the engine. The rendering (in the prompt threads) then takes the
parts out of the messages and expands the prompt's placeholders with these images.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ferrox.entrypoints.openai.errors import APIError
from ferrox.errors import InvalidArgumentError


async def fetch_images(ctx: Any, messages: list[dict[str, Any]], field: str = "messages",
                       media_io_kwargs: dict[str, Any] | None = None) -> list[Any]:
    """The decoded images and videos (multimodal/video.py Video) of the messages' media parts, in prompt
    order ([] when there are none). field: the request's name for its messages in errors (the Responses API's
    `input`). media_io_kwargs: the request's (a chat's) loader arguments over the server's --media-io-kwargs."""
    from ferrox.engine.input_processor import check_videos
    from ferrox.media_io_config import parse_media_io_kwargs
    from ferrox.multimodal.audio import AudioSource, fetch_audio, part_error
    from ferrox.multimodal.chat_parts import audio_refusal, image_sources
    from ferrox.multimodal.media import MediaError, fetch_image, image_fetch_timeout, load_image
    from ferrox.multimodal.video import VideoSource, fetch_video, split_media, to_video

    prompts = ctx.engine.image_prompts
    try:  # (checked with or without media: a bad value is a 400 whatever the messages hold)
        media_io = parse_media_io_kwargs(media_io_kwargs, prompts.media_io if prompts is not None else None)
    except InvalidArgumentError as e:
        raise APIError(400, str(e), param="media_io_kwargs") from None
    try:
        sources = [(where.replace("messages", field, 1), source) for where, source in image_sources(messages)]
    except InvalidArgumentError as e:
        raise APIError(400, str(e).replace("messages", field, 1), param=field) from None
    if not sources:
        return []
    clips = [(where, source) for where, source in sources if isinstance(source, AudioSource)]
    if clips and getattr(prompts, "audio_processor", None) is None:  # (named before the model's other media rules)
        where, source = clips[0]
        kind = "audio_url" if source.format is None else "input_audio"
        refusal = audio_refusal(kind, where, ctx.model_name)
        reason = getattr(prompts, "audio_refusal", None)
        raise APIError(400, f"{refusal}" + (f" ({reason})" if reason else ""), param=field)
    if prompts is None:
        raise APIError(400, f"{sources[0][0]}: {ctx.model_name} takes no images (a text-only model)", param=field)
    images, videos = split_media([source for _, source in sources])
    try:
        if clips:
            prompts.check_audio_count(len(clips), field, param=field)
        prompts.check_count(len(images), field, param=field)
        if videos:
            first = next(where for where, source in sources if isinstance(source, VideoSource))
            check_videos(prompts, len(videos), first, ctx.model_name, param=field)
    except InvalidArgumentError as e:
        raise APIError(400, str(e), param=field) from None

    async def one(where: str, source: Any) -> Any:
        local = prompts.allowed_local_media_path
        if isinstance(source, AudioSource):
            try:
                return await fetch_audio(source, prompts.audio_processor.sampling_rate, allowed_local_media_path=local)
            except MediaError as e:
                raise APIError(400, part_error(where, source, e), param=field) from None
        try:
            if isinstance(source, VideoSource):
                if not isinstance(source.source, str):
                    return to_video(source.source, allowed_local_media_path=local, media_io=media_io)
                return await fetch_video(source.source, allowed_local_media_path=local, media_io=media_io)
            if not isinstance(source, str):  # an image object (offline-style callers of the same helper)
                return load_image(source)
            return await fetch_image(source, allowed_local_media_path=local, timeout=image_fetch_timeout())
        except MediaError as e:
            kind = "video_url" if isinstance(source, VideoSource) else "image_url"
            raise APIError(400, f"{where}.{kind}.url: {e}", param=field) from None

    return list(await asyncio.gather(*(one(where, source) for where, source in sources)))


def take_template_images(ctx: Any, messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """The messages with their image parts in the template's shape (multimodal/chat_parts.py)."""
    from ferrox.loader.chat_template import resolve_content_format
    from ferrox.multimodal.chat_parts import take_images

    prompts = ctx.engine.image_prompts
    try:
        fmt = resolve_content_format(ctx.options.chat_template_content_format, template or "")
        if getattr(ctx.engine.tokenizer, "encodes_chats", False):
            fmt = "openai"  # (tokenizer_mode mistral: mistral_common takes the parts, an image where it goes)
        return take_images(messages, fmt, prompts.placeholder if prompts is not None else None, ctx.model_name,
                           video_placeholder=getattr(prompts, "video_placeholder", None),
                           audio_placeholder=getattr(prompts, "audio_placeholder", None))[0]
    except (InvalidArgumentError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from None


def request_image_prompts(ctx: Any, processor_kwargs: dict[str, Any] | None) -> Any:
    """The server's prompt rules with a request's mm_processor_kwargs over its own (the shared rules stay as
    they are); a key the model does not take, or a bad value, is a 400 naming mm_processor_kwargs.<key>."""
    from ferrox.multimodal.processing import request_image_prompts as derive

    try:
        return derive(ctx.engine.image_prompts, processor_kwargs, ctx.model_name)
    except InvalidArgumentError as e:
        raise APIError(400, str(e), param="mm_processor_kwargs") from None


def expand_images(ctx: Any, ids: list[int], images: list[Any], prompts: Any = None) -> tuple[list[int], list[Any]]:
    """(ids with each image placeholder expanded, the engine's MultiModalItems): a placeholder count that
    does not match the images is a 400 naming messages. prompts: a request's own rules (request_image_prompts;
    None: the server's)."""
    try:
        return (prompts or ctx.engine.image_prompts).expand(ids, images, "messages", param="messages")
    except InvalidArgumentError as e:
        raise APIError(400, str(e), param="messages") from None
