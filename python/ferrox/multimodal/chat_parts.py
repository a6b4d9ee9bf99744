"""A chat's image and video parts: taken out of the messages before the chat template renders them.

OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` (vLLM also takes the url as a plain string,
and offline callers `{"type": "image_pil", "image_pil": <PIL image>}`) becomes what the template expects
(vLLM's rules): a template that loops over a message's parts ("openai" content format: LLaVA's, Gemma
3's) gets `{"type": "image"}` in the image's place and writes the model's placeholder itself; a
template that prints content as one string gets each image's placeholder text on a line of its own
before the message's text. A `{"type": "video_url", "video_url": {"url": ...}}` part does the same as
`{"type": "video"}` and the video placeholder (multimodal/video.py loads it). OpenAI's
`{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}` and vLLM's
`{"type": "audio_url", "audio_url": {"url": ...}}` do the same as `{"type": "audio"}` and the audio placeholder
(multimodal/audio.py loads them), for a model that takes audio; any other model refuses them naming the part.
The sources come back in prompt order, for the caller to fetch and decode.
"""

from __future__ import annotations

from typing import Any

from ferrox._core import InvalidArgumentError

_REFUSED = {"image_embeds": "image embeddings", "file": "files"}
_AUDIO_PARTS = ("input_audio", "audio_url")

# The families whose videos ferrox takes (the refusals name them).
VIDEO_FAMILIES = "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision and Gemma 4"


def image_source(part: dict[str, Any], where: str) -> Any:
    """The url (or PIL image) of an image part, a VideoSource of a video part's url, an AudioSource of an audio
    part; None for a text part."""
    kind = part.get("type")
    if kind in _AUDIO_PARTS:
        from ferrox.multimodal.audio import part_source

        try:
            return part_source(part, where)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(str(e), param="messages") from None
    if kind == "video_url":
        from ferrox.multimodal.video import VideoSource

        url = part.get("video_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidArgumentError(f"{where}.video_url.url: a video part needs a url (https://..., "
                                       "data:video/mp4;base64,...)", param="messages")
        return VideoSource(url)
    if kind == "image_url":
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url:
            raise InvalidArgumentError(f"{where}.image_url.url: an image part needs a url (https://..., "
                                       "data:image/...;base64,...)", param="messages")
        return url
    if kind == "image_pil":
        if part.get("image_pil") is None:
            raise InvalidArgumentError(f"{where}.image_pil: missing", param="messages")
        return part["image_pil"]
    if kind in _REFUSED:
        raise InvalidArgumentError(f"{where}: content part type {kind!r} is not supported ({_REFUSED[kind]} inputs); "
                                   "send text, image_url, video_url and audio parts", param="messages")
    return None


def audio_refusal(kind: str, where: str, model_name: str) -> InvalidArgumentError:
    """An audio part for a model that takes no audio, named."""
    from ferrox.multimodal.gemma4_audio_processing import AUDIO_FAMILIES

    return InvalidArgumentError(f"{where}: content part type {kind!r} is not supported by {model_name}: it takes no "
                                f"audio inputs (ferrox takes audio for {AUDIO_FAMILIES})", param="messages")


def take_images(messages: list[dict[str, Any]], content_format: str, placeholder: str | None,
                model_name: str = "this model",
                video_placeholder: str | None = None,
                audio_placeholder: str | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages for the template, image, video and audio sources in order). placeholder: the model's image
    placeholder text, None for a text-only model (whose image parts are refused naming the part);
    video_placeholder: its video one, None for a model that takes no videos; audio_placeholder: its audio one,
    None for a model that takes no audio."""
    from ferrox.multimodal.audio import AudioSource
    from ferrox.multimodal.video import VideoSource

    sources: list[Any] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[Any] = []
        marks: list[str] = []  # each media part's placeholder, in order
        for j, part in enumerate(content):
            source = image_source(part, f"messages[{i}].content[{j}]") if isinstance(part, dict) else None
            if source is None:
                parts.append(part)
                continue
            if isinstance(source, AudioSource):
                if audio_placeholder is None:
                    raise audio_refusal(part["type"], f"messages[{i}].content[{j}]", model_name)
                sources.append(source)
                marks.append(audio_placeholder)
                parts.append({"type": "audio"})
                continue
            video = isinstance(source, VideoSource)
            if video and video_placeholder is None:
                raise InvalidArgumentError(f"messages[{i}].content[{j}]: content part type 'video_url': {model_name} "
                                           f"takes no video inputs (ferrox takes videos for {VIDEO_FAMILIES})",
                                           param="messages")
            if placeholder is None:
                raise InvalidArgumentError(f"messages[{i}].content[{j}]: {model_name} takes no images (a text-only "
                                           "model)", param="messages")
            sources.append(source)
            marks.append(video_placeholder if video else placeholder)  # type: ignore[arg-type]
            parts.append({"type": "video" if video else "image"})
        if not marks:
            out.append(message)
        elif content_format == "openai":
            out.append({**message, "content": parts})
        else:
            texts = [p if isinstance(p, str) else p.get("text", "") for p in parts
                     if p not in ({"type": "image"}, {"type": "video"}, {"type": "audio"})]
            out.append({**message, "content": "\n".join(marks + texts)})
    return out, sources


def image_sources(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(where, source) of every image part, in order (the server fetches them before rendering); refused
    part kinds raise naming the part."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                source = image_source(part, where) if isinstance(part, dict) else None
                if source is not None:
                    found.append((where, source))
    return found
