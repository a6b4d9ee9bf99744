"""Turns what users pass (text, token ids, chat conversations) into prompt token ids.

Shared by the offline `LLM` and the async/server front-ends, so that a prompt means the same
thing everywhere. Errors are InvalidArgumentErrors whose `param` is the argument at fault
("prompts", "prompt_token_ids", "messages"); the message names the prompt's index in a batch.
The rules on the prompt's tokens (empty, too long, outside the vocabulary) are the engine's
(ferrox.engine.validation); here only the shape of what was passed is checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferrox._core import InvalidArgumentError
from ferrox.multimodal.chat_parts import VIDEO_FAMILIES
from ferrox.multimodal.prompt_embeds import is_embeds, item_from_tensor

PromptInput = str | Mapping[str, Any] | Sequence[int]
"""A prompt: text, {"prompt": text}, {"prompt_token_ids": [...]} (optionally with "prompt"),
{"prompt_embeds": tensor} (enable_prompt_embeds), or (inside a list of prompts) a bare list of token ids."""


@dataclass(slots=True)
class ProcessedPrompt:
    prompt: str | None  # the text, when there was one
    prompt_token_ids: list[int]
    # Images of the prompt, in order (vLLM's multi_modal_data, a chat's image parts): sources until
    # attach_images decodes and expands them into mm_items (the engine core's MultiModalItems).
    images: list[Any] | None = None
    mm_items: list[Any] | None = None
    # vLLM's per-prompt mm_processor_kwargs: this prompt's processor settings over the server's.
    processor_kwargs: Mapping[str, Any] | None = None


def _images_of(prompt: Mapping[str, Any], index: int) -> list[Any] | None:
    """vLLM's {"multi_modal_data": {"image": one or a list, "video": one or a list, "audio": one or a list}},
    images, videos then audio clips (each kind pairs with its own placeholders, so the order between them does not
    matter); other modalities are refused by name."""
    data = prompt.get("multi_modal_data")
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise InvalidArgumentError(f"prompts[{index}].multi_modal_data: must be a dict like {{'image': ...}}",
                                   param="multi_modal_data")
    for key in data:
        if key not in ("image", "video", "audio"):
            raise InvalidArgumentError(f"prompts[{index}].multi_modal_data.{key}: only images, videos and audio are "
                                       "supported", param="multi_modal_data")
    images = data.get("image")
    media = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    if data.get("video") is not None:
        from ferrox.multimodal.video import VideoSource, videos_of

        media.extend(VideoSource(v) for v in videos_of(data["video"]))
    if data.get("audio") is not None:
        from ferrox.multimodal.audio import AudioSource, audios_of

        media.extend(AudioSource(a) for a in audios_of(data["audio"]))
    return media or None


def attach_images(processed: ProcessedPrompt, image_prompts: Any, what: str, *,
                  model_name: str = "this model",
                  processor_kwargs: Mapping[str, Any] | None = None) -> ProcessedPrompt:
    """Decode the prompt's images and videos and expand its placeholders (multimodal/processing.py
    ImagePrompts). A prompt without media is returned as is; images for a text-only model, and videos for
    a family that takes none, are refused by name. processor_kwargs: mm_processor_kwargs for this prompt
    (LLM.chat's), else the prompt's own; a key the model does not take is refused even without media."""
    kwargs = processor_kwargs if processor_kwargs is not None else processed.processor_kwargs
    if kwargs:
        from ferrox.multimodal.processing import request_image_prompts

        try:
            image_prompts = request_image_prompts(image_prompts, kwargs, model_name)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{what}: {e}", param="mm_processor_kwargs") from None
    if processed.images is None:
        return processed
    if image_prompts is None:
        raise InvalidArgumentError(f"{what}: {model_name} takes no images (a text-only model)",
                                   param="multi_modal_data")
    from ferrox.multimodal.audio import is_audio, load_audio_source
    from ferrox.multimodal.video import load_video_source, split_media

    images, videos = split_media(processed.images)
    clips = [m for m in processed.images if is_audio(m)]
    image_prompts.check_count(len(images), what)
    if videos:  # an offline prompt's videos are its multi_modal_data.video; a chat's, its messages' parts
        check_videos(image_prompts, len(videos), what if what.startswith("messages") else f"{what}.multi_modal_data.video",
                     model_name)
    if clips:
        check_audio(image_prompts, len(clips), what if what.startswith("messages") else f"{what}.multi_modal_data.audio",
                    model_name)
    media: list[Any] = [load_video_source(image_prompts, source, f"{what}: video {i}")
                        for i, source in enumerate(videos)]
    media[:0] = [image_prompts.load(source, f"{what}: image {i}") for i, source in enumerate(images)]
    media += [load_audio_source(image_prompts, source, f"{what}: audio {i}") for i, source in enumerate(clips)]
    ids, items = image_prompts.expand(processed.prompt_token_ids, media, what)
    return ProcessedPrompt(processed.prompt, ids, None, items or None)


def check_videos(image_prompts: Any, count: int, what: str, model_name: str = "this model",
                 param: str = "multi_modal_data") -> None:
    """A model whose family takes videos, and no more of them than --limit-mm-per-prompt allows."""
    if getattr(image_prompts, "video_processor", None) is None:
        reason = getattr(image_prompts, "video_refusal", None) or (
            f"{model_name} takes no video inputs (ferrox takes videos for {VIDEO_FAMILIES})")
        raise InvalidArgumentError(f"{what}: {reason}", param=param)
    image_prompts.check_video_count(count, what, param)


def check_audio(image_prompts: Any, count: int, what: str, model_name: str = "this model",
                param: str = "multi_modal_data") -> None:
    """A model that takes audio clips (multimodal/gemma4_audio_processing.py), and no more of them than
    --limit-mm-per-prompt allows; any other is refused naming the field."""
    if getattr(image_prompts, "audio_processor", None) is None:
        from ferrox.multimodal.gemma4_audio_processing import AUDIO_FAMILIES

        reason = getattr(image_prompts, "audio_refusal", None) or (
            f"{model_name} takes no audio inputs (ferrox takes audio for {AUDIO_FAMILIES})")
        raise InvalidArgumentError(f"{what}: only images and videos are supported here: {reason}", param=param)
    image_prompts.check_audio_count(count, what, param)


def refuse_images(processed: ProcessedPrompt, what: str, path: str) -> ProcessedPrompt:
    """A prompt for a path that takes no images (beam search, pooling) must not carry any: refused by
    name rather than run without them."""
    if is_embeds(processed.mm_items):
        raise InvalidArgumentError(f"{what}: {path} takes no prompt embeddings (prompt_embeds)", param="prompt_embeds")
    if processed.images is not None or processed.mm_items is not None:
        raise InvalidArgumentError(f"{what}: {path} takes no images or videos (multi_modal_data)",
                                   param="multi_modal_data")
    return processed


# Prompt work up to this size (prompt_size) runs inline on the front-end's event loop
# (AsyncLLM.prompt_work): encoding ~1k characters takes well under a millisecond.
INLINE_PROMPT_SIZE = 1024


def prompt_size(prompt: Any, limit: int = INLINE_PROMPT_SIZE) -> int:
    """The work of turning `prompt` into token ids, in characters to encode: text counts its
    length, token ids a quarter each (checked, not encoded), a dict, list or request model
    (prompts, chat messages and their parts, tools) what it holds. Stops counting past `limit`,
    so a huge batch of prompts costs no more to size than a small one."""
    kind = type(prompt)
    if kind is str:
        return len(prompt)
    if kind is dict:
        if prompt.get("multi_modal_data") is not None or prompt.get("prompt_embeds") is not None:
            return limit + 1  # images to decode and resize, a tensor to save: never on the event loop
        items: Any = prompt.values()
    elif kind is list or kind is tuple:
        if prompt and type(prompt[0]) is int:
            return len(prompt) // 4
        items = prompt
    elif prompt is None or kind in _SCALARS:
        return 0
    elif isinstance(prompt, str):
        return len(prompt)
    elif isinstance(prompt, Mapping):
        items = prompt.values()
    elif isinstance(prompt, Sequence):
        items = list(prompt)
        if items and isinstance(items[0], int):
            return len(items) // 4
    elif hasattr(prompt, "__dict__"):
        items = vars(prompt).values()  # a pydantic request or message: its fields
    else:
        return 0
    total = 0
    for item in items:
        kind = type(item)
        if kind is str:
            total += len(item)
        elif item is not None and kind not in _SCALARS:  # most fields of a request model are scalars
            total += prompt_size(item, limit - total)
        if total > limit:
            break
    return total


_SCALARS = (int, float, bool)


def _all_ints(values: Sequence[Any]) -> bool:
    """Every value is exactly an int: a bool (an int subclass), a float or a numpy integer is not. One
    pass in C (a 4k-token prompt in ~50 us instead of ~1 ms of isinstance calls)."""
    return set(map(type, values)) <= _INT_ONLY


_INT_ONLY = {int}


def normalize_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt or a list of them -> a list (a list of ints is one prompt of token ids)."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence):
        items: list[Any] = list(prompts)  # token ids (one prompt) or prompts: told apart below
        if items and _all_ints(items):
            return [{"prompt_token_ids": items}]
        return items
    raise InvalidArgumentError(
        f"prompts: expected a string, a dict or a list of them, got {type(prompts).__name__}", param="prompts"
    )


def process_prompt(tokenizer: Any, prompt: PromptInput, index: int = 0) -> ProcessedPrompt:
    if isinstance(prompt, str):
        return ProcessedPrompt(prompt, list(tokenizer.encode(prompt)))
    if isinstance(prompt, Mapping) and "prompt_embeds" in prompt:
        return _embeds_prompt(prompt, index)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str) or not _all_ints(ids):
                raise InvalidArgumentError(
                    f"prompts[{index}].prompt_token_ids: must be a list of integers", param="prompt_token_ids"
                )
            text = prompt.get("prompt")
            if prompt.get("multi_modal_items") is not None:
                # A front-end that expanded the prompt's images itself (the server's chat route).
                return ProcessedPrompt(text if isinstance(text, str) else None, list(ids), None,
                                       list(prompt["multi_modal_items"]) or None)
            return ProcessedPrompt(text if isinstance(text, str) else None, list(ids), _images_of(prompt, index),
                                   processor_kwargs=prompt.get("mm_processor_kwargs"))
        if isinstance(prompt.get("prompt"), str):
            return ProcessedPrompt(prompt["prompt"], list(tokenizer.encode(prompt["prompt"])),
                                   _images_of(prompt, index), processor_kwargs=prompt.get("mm_processor_kwargs"))
        raise InvalidArgumentError(
            f"prompts[{index}]: a dict prompt needs 'prompt' (text) or 'prompt_token_ids'", param="prompts"
        )
    if isinstance(prompt, Sequence) and prompt and _all_ints(prompt):
        return ProcessedPrompt(None, [*prompt])  # a bare list of token ids (a str was taken above)
    raise InvalidArgumentError(
        f"prompts[{index}]: expected a string, a dict or a list of token ids, got {type(prompt).__name__}",
        param="prompts",
    )


def _embeds_prompt(prompt: Mapping[str, Any], index: int) -> ProcessedPrompt:
    """vLLM's EmbedsPrompt {"prompt_embeds": tensor [L, hidden] or [1, L, hidden]}: L placeholder ids and one
    item the engine core decodes and checks (multimodal/prompt_embeds.py; refused there unless the engine
    runs with enable_prompt_embeds)."""
    others = sorted(k for k in ("prompt", "prompt_token_ids", "multi_modal_data") if prompt.get(k) is not None)
    if others:
        raise InvalidArgumentError(f"prompts[{index}]: prompt_embeds replaces the prompt's tokens; it cannot be "
                                   f"given with {', '.join(others)}", param="prompt_embeds")
    ids, item = item_from_tensor(prompt["prompt_embeds"], f"prompts[{index}].prompt_embeds")
    return ProcessedPrompt(None, ids, None, [item])


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    index: int = 0,
    content_format: str = "auto",
    image_placeholder: str | None = None,
    video_placeholder: str | None = None,
    audio_placeholder: str | None = None,
) -> ProcessedPrompt:
    """Apply the chat template and tokenize; the template adds the special tokens it wants.
    With tools and a template that ignores them (the embedded SmolLM2's), the tools go into the
    system message, as the server does (structured.tools.prepare_tool_messages). Image parts come
    back as the prompt's `images` (for attach_images); image_placeholder: the model's (None: a
    text-only model, whose image parts are refused); video_placeholder: its video one (None: video parts
    are refused)."""
    if not isinstance(messages, Sequence) or not messages:
        raise InvalidArgumentError(
            f"messages[{index}]: a conversation must be a non-empty list of messages", param="messages"
        )
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise InvalidArgumentError(
                f"messages[{index}][{j}]: each message must be a dict with a 'role'", param="messages"
            )
    from ferrox.structured.tools import prepare_tool_messages

    conversation = [dict(m) for m in messages]
    images = None
    if any(isinstance(m.get("content"), list) for m in conversation):
        from ferrox.loader.chat_template import resolve_content_format
        from ferrox.multimodal.chat_parts import take_images

        fmt = content_format if content_format != "auto" else resolve_content_format(
            content_format, tokenizer.get_chat_template(chat_template, tools))
        if getattr(tokenizer, "encodes_chats", False):
            fmt = "openai"  # (tokenizer_mode mistral: mistral_common takes the parts, an image where it goes)
        conversation, sources = take_images(conversation, fmt, image_placeholder,
                                            video_placeholder=video_placeholder, audio_placeholder=audio_placeholder)
        images = sources or None
    if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in conversation):
        # Resolve the template first: with tools a model may pick its "tool_use" one.
        chat_template = tokenizer.get_chat_template(chat_template, tools)
        conversation, tools = prepare_tool_messages(conversation, tools, chat_template)
    text = tokenizer.apply_chat_template(
        conversation,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        chat_template=chat_template,
        content_format=content_format,
        **dict(chat_template_kwargs or {}),
    )
    return ProcessedPrompt(text, list(tokenizer.encode(text, add_special_tokens=False)), images)


def is_conversation_list(messages: Any) -> bool:
    """`chat([m1, m2])` is one conversation; `chat([[m1], [m2]])` a list of them."""
    return isinstance(messages, Sequence) and bool(messages) and all(
        isinstance(c, Sequence) and not isinstance(c, (str, Mapping)) for c in messages
    )
