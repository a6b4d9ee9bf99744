"""--tokenizer-mode mistral: Mistral's tokenizer and chat encoding through mistral_common, the library
vLLM's MistralTokenizer wraps.

- The tokenizer is the folder's tekken.json (Mistral's tiktoken-style BPE). mistral_common encodes text
  (special-token strings in it stay text; add_special_tokens puts <s> first) and decodes it
  (skip_special_tokens drops every special token; otherwise each is written out).
- A chat is a mistral_common ChatCompletionRequest (from the OpenAI-shaped messages and tools) encoded by
  encode_chat_completion: system prompt, tools, tool calls and results, thinking, a continued last assistant
  message (continue_final_message). No Jinja template is involved: a chat template or template variables are
  refused by name, as vLLM refuses them. An image part ({"type": "image"}, where ferrox's chat paths leave each
  image they fetched) is encoded as one [IMG], which the image rules expand (multimodal/mistral_images.py); an
  audio part ({"type": "audio"}, a clip ferrox decoded) as mistral_common's audio chunk, written
  [BEGIN_AUDIO][AUDIO] without reading the audio, which Voxtral's rules expand (multimodal/voxtral_processing.py).
- The Rust core detokenizes with the same ids and bytes as a tokenizers.Tokenizer (loader/tekken.py). Under
  skip_special_tokens it keeps [TOOL_CALLS], [ARGS], [THINK] and [/THINK] in the text, as vLLM's incremental
  detokenizer does for a Mistral tokenizer: the tool-call and reasoning parsers read them.
- sentencepiece Mistral tokenizers (tokenizer.model.v1/v3/v7) are refused by name.

tokenizer_mode "auto" picks this mode where vLLM's does, a folder in Mistral's own layout (tekken.json beside
consolidated*.safetensors), and where mode "hf" has nothing to read (tekken.json, no tokenizer.json).

mistral_common is imported only here, when the mode is used; it does not import torch (the API server loads
the tokenizer without it).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
from typing import Any

from ferrox.loader.errors import ChatTemplateError, ModelLoadError, ModelNotFoundError
from ferrox.loader.json_file import read_json
from ferrox.loader.source import ModelSource
from ferrox.loader.tekken import build_tekken_tokenizer
from ferrox.loader.tokenizer import Tokenizer, _eos_token_ids

logger = logging.getLogger(__name__)

TEKKEN_FILE = "tekken.json"
# What get_chat_template gives in this mode, for the code that reads a chat template to decide what a model
# does with tools: there is no template, mistral_common encodes the tools itself (structured/tools.py keeps
# them in the request) and the model writes calls after [TOOL_CALLS] (tool_parsers/registry.py: `mistral`).
MISTRAL_CHAT_TEMPLATE = ("(no Jinja template: mistral_common encodes the conversation and its tools, and the "
                         "model writes tool calls after [TOOL_CALLS])")
# The special tokens decoding keeps under skip_special_tokens (vLLM's MistralTokenizer.convert_ids_to_tokens).
KEPT_IN_TEXT = ("[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]")
# Where vLLM's MistralTokenizer truncates OpenAI's longer tool call ids: Mistral's are 9 characters.
TOOL_CALL_ID_CHARS = 9
# Media parts mistral_common is never handed: ferrox fetches a chat's images and audio itself, and its chat paths
# leave an {"type": "image"} / {"type": "audio"} part where each one goes (multimodal/mistral_images.py and
# voxtral_processing.py put it there).
_MEDIA_PARTS = {"image_url", "input_image", "video_url", "video", "input_audio", "audio_url"}


def prefers_mistral_tokenizer(folder: str) -> bool:
    """tokenizer_mode "auto": vLLM's rule (tekken.json and a consolidated*.safetensors checkpoint), or a
    tekken.json without the tokenizer.json mode "hf" reads."""
    if not os.path.isfile(os.path.join(folder, TEKKEN_FILE)):
        return False
    return (bool(glob.glob(os.path.join(glob.escape(folder), "consolidated*.safetensors")))
            or not os.path.isfile(os.path.join(folder, "tokenizer.json")))


def load_mistral_tokenizer(source: ModelSource) -> MistralTokenizer:
    if source.format != "hf":
        raise ModelLoadError(f"tokenizer_mode 'mistral' reads {TEKKEN_FILE} from a model folder; {source.path} is a "
                             "GGUF, whose vocabulary is read with tokenizer_mode 'auto' or 'hf'")
    folder = source.path
    path = os.path.join(folder, TEKKEN_FILE)
    if not os.path.isfile(path):
        spm = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(folder), "tokenizer.model.v*")))
        if spm:
            raise ModelLoadError(f"tokenizer_mode 'mistral': {folder} has the sentencepiece tokenizer {spm[0]} and "
                                 f"no {TEKKEN_FILE}; ferrox reads Mistral's tekken tokenizer only (use "
                                 "tokenizer_mode 'hf' with the folder's tokenizer.json)")
        raise ModelNotFoundError(f"tokenizer_mode 'mistral': {folder} has no {TEKKEN_FILE} (Mistral's tokenizer "
                                 "file); use tokenizer_mode 'hf' for a tokenizer.json")
    try:
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer as MistralCommonTokenizer
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    except ImportError as e:
        raise ModelLoadError(f"tokenizer_mode 'mistral' needs the mistral-common package ({e}): install it with "
                             "pip install 'mistral-common>=1.8'") from None
    try:
        mistral = MistralCommonTokenizer.from_file(path, mode=ValidationMode.test)  # vLLM's mode
    except Exception as e:  # mistral_common asserts on a malformed file
        raise ModelLoadError(f"cannot read {path} with mistral_common: {type(e).__name__}: {e}") from e
    tekken = mistral.instruct_tokenizer.tokenizer
    if not isinstance(tekken, Tekkenizer):
        raise ModelLoadError(f"{path}: mistral_common read it as a {type(tekken).__name__}, not a tekken tokenizer")
    return MistralTokenizer(mistral, path, name=source.name, extra_eos=_folder_eos_ids(folder))


def _folder_eos_ids(folder: str) -> list[int]:
    """EOS ids a generation_config.json / config.json adds (as the Hugging Face loader takes them)."""
    eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            eos.extend(_eos_token_ids(read_json(path).get("eos_token_id"), path))
    return eos


class MistralTokenizer(Tokenizer):
    """ferrox's Tokenizer over mistral_common (the module doc says what each part does).

    A rendered chat is the text of its tokens with the special tokens written out. Encoded again as text it
    would not give the same ids (mistral_common encodes each message's text apart, never reading special tokens
    out of it), so apply_chat_template keeps the ids it encoded, and encode() returns them for that very string
    object in the same thread: the chat routes render and then encode, and get mistral_common's ids."""

    encodes_chats = True
    keeps_markers_in_text = True  # (KEPT_IN_TEXT)

    def __init__(self, mistral: Any, path: str, *, name: str, extra_eos: list[int] | None = None):
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        self._policy = SpecialTokenPolicy
        self.mistral = mistral  # mistral_common's MistralTokenizer (vLLM's `.mistral`)
        self._tekken = tekken = mistral.instruct_tokenizer.tokenizer
        self.tokenizer_version = int(str(tekken.version.value).lstrip("v"))
        specials = [str(tekken.id_to_piece(i)) for i in range(tekken.num_special_tokens)]
        self._special_ids = {token: i for i, token in enumerate(specials)}
        vocab = [tekken.id_to_byte_piece(i) for i in range(tekken.num_special_tokens, tekken.n_words)]
        backend = build_tekken_tokenizer(specials, vocab, tekken._model._pat_str, where=path,
                                         kept_in_text=[t for t in KEPT_IN_TEXT if t in self._special_ids],
                                         bos="<s>" if "<s>" in self._special_ids else None)
        names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
        special_tokens: dict[str, str | None] = {k: v if v in self._special_ids else None for k, v in names.items()}
        super().__init__(backend, name=name, special_tokens=special_tokens,
                         eos_token_ids=[tekken.eos_id, *(extra_eos or [])], chat_template=None)
        self._rendered = threading.local()  # .text, .ids: the chat this thread rendered last
        self._image_chats: Any = None  # mistral_common's tokenizer for chats with images (_image_chat_tokenizer)
        self._audio_instruct: Any = None  # its instruct tokenizer writing audio placeholders (audio_instruct)

    @property
    def image_encoder(self) -> Any:
        """mistral_common's ImageEncoder of tekken.json's image settings (None without them): how a Mistral 3 /
        Pixtral model's images are prepared in this mode (multimodal/mistral_images.py)."""
        return getattr(self.mistral.instruct_tokenizer, "image_encoder", None)

    # ---- text -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a str, got {type(text).__name__}")
        if getattr(self._rendered, "text", None) is text:
            return list(self._rendered.ids)
        return self._tekken.encode(text, bos=add_special_tokens, eos=False)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def encode_pairs(self, pairs: list[tuple[str, str]], add_special_tokens: bool = True, *,
                     join_texts: bool = False) -> list[tuple[list[int], int | None]]:
        raise ValueError(f"tokenizer of {self.name}: tokenizer_mode 'mistral' encodes no text pairs (a "
                         "cross-encoder's prompt); vLLM's Mistral tokenizer refuses them too")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        policy = self._policy.IGNORE if skip_special_tokens else self._policy.KEEP
        return str(self._tekken.decode(list(ids), policy))

    # ---- chat -------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        if chat_template is not None and chat_template != MISTRAL_CHAT_TEMPLATE:
            raise ChatTemplateError(f"model {self.name}: tokenizer_mode 'mistral' encodes chats with mistral_common "
                                    "and takes no chat template (vLLM refuses one too)")
        return MISTRAL_CHAT_TEMPLATE

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            content_format: str = "auto", **template_kwargs: Any) -> str:
        """The chat's tokens (encode_chat) as text, special tokens written out; encode() of this string gives
        the tokens. content_format: unused (mistral_common takes OpenAI's content parts as they are)."""
        ids = self.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               chat_template=chat_template, **template_kwargs)
        text = self.decode(ids, skip_special_tokens=False)
        self._rendered.text, self._rendered.ids = text, ids
        return text

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template: str | None = None,
                    continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        """mistral_common's tokens for an OpenAI-shaped conversation, as vLLM's MistralTokenizer encodes it.
        template_kwargs: reasoning_effort (for v15+ tokenizers, which encode it; ignored before, as vLLM) and
        the enable_thinking a request's reasoning_effort implies; any other is refused."""
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        self.get_chat_template(chat_template)
        effort = template_kwargs.pop("reasoning_effort", None)
        if effort is not None:
            template_kwargs.pop("enable_thinking", None)  # (the server derives it from reasoning_effort)
        if template_kwargs:
            raise ChatTemplateError(f"chat_template_kwargs {sorted(template_kwargs)}: tokenizer_mode 'mistral' has "
                                    "no chat template to pass them to (vLLM refuses them too)")
        if not messages:
            raise ChatTemplateError("messages: a conversation needs at least one message")
        last = messages[-1].get("role") if isinstance(messages[-1], dict) else None
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true")
        if add_generation_prompt and last == "assistant":
            raise ChatTemplateError("the last message is the assistant's: set continue_final_message (and "
                                    "add_generation_prompt false) to continue it")
        if continue_final_message and last != "assistant":
            raise ChatTemplateError("continue_final_message needs the assistant's message last")
        extra = {"reasoning_effort": effort} if effort is not None and self.tokenizer_version >= 15 else {}
        try:
            request = ChatCompletionRequest.from_openai(
                _mistral_messages(messages), tools=_mistral_tools(tools) if tools else None,
                continue_final_message=continue_final_message, **extra)
            mistral = self._image_chat_tokenizer() if _has_part(messages, "image") else self.mistral
            if _has_part(messages, "audio"):
                mistral = self._with_audio_placeholders(mistral)
            return list(mistral.encode_chat_completion(request).tokens)
        except ChatTemplateError:
            raise
        except Exception as e:  # mistral_common's validation: pydantic errors, asserts, its own exceptions
            raise ChatTemplateError(f"mistral_common: {type(e).__name__}: {e}") from None

    def _image_chat_tokenizer(self) -> Any:
        """mistral_common's tokenizer writing one [IMG] per image part (multimodal/mistral_images.py)."""
        if self._image_chats is None:
            from ferrox.multimodal.mistral_images import placeholder_chat_tokenizer

            image = self._special_ids.get("[IMG]")
            if image is None:
                raise ChatTemplateError(f"{self.name}: {TEKKEN_FILE} has no [IMG] token, so a chat cannot hold images")
            self._image_chats = placeholder_chat_tokenizer(self.mistral, image)
        return self._image_chats

    @property
    def audio_instruct(self) -> Any:
        """mistral_common's instruct tokenizer writing [BEGIN_AUDIO][AUDIO] per audio chunk, reading no audio (a
        transcription request's too: multimodal/transcription_prompts.py)."""
        if self._audio_instruct is None:
            self._audio_instruct = self._placeholder_audio(self.mistral.instruct_tokenizer)
        return self._audio_instruct

    def _with_audio_placeholders(self, mistral: Any) -> Any:
        """A copy of mistral_common's tokenizer `mistral` whose audio chunks encode as [BEGIN_AUDIO][AUDIO]."""
        import copy

        out = copy.copy(mistral)
        out.instruct_tokenizer = (self.audio_instruct if mistral is self.mistral
                                  else self._placeholder_audio(mistral.instruct_tokenizer))
        return out

    def _placeholder_audio(self, instruct: Any) -> Any:
        from ferrox.multimodal.voxtral_processing import placeholder_instruct

        if getattr(instruct, "audio_encoder", None) is None:
            raise ChatTemplateError(f"{self.name}: {TEKKEN_FILE} has no audio settings, so a chat cannot hold audio")
        return placeholder_instruct(instruct)


def _has_part(messages: list[dict], kind: str) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") == kind for p in m["content"]) for m in messages)


def _mistral_messages(messages: list[dict]) -> list[dict[str, Any]]:
    """Copies for ChatCompletionRequest.from_openai: media parts refused but for {"type": "image"} (an image
    ferrox fetched, which it puts where the chunk's [IMG] lands) and {"type": "audio"} (a clip it decoded, put
    where the chunk's [AUDIO] lands), OpenAI's longer tool call ids cut to their last 9 characters, as vLLM
    does."""
    from ferrox.multimodal.mistral_images import PLACEHOLDER_IMAGE_PART
    from ferrox.multimodal.voxtral_processing import PLACEHOLDER_AUDIO_PART

    placeholders = {"image": PLACEHOLDER_IMAGE_PART, "audio": PLACEHOLDER_AUDIO_PART}

    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                                    f"{type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _MEDIA_PARTS:
                    raise ChatTemplateError(f"messages[{i}].content[{j}]: a {kind!r} part; with tokenizer_mode "
                                            "'mistral' ferrox passes mistral_common text, and {'type': 'image'} "
                                            "or {'type': 'audio'} where an image or clip it decoded goes")
            message["content"] = [_placeholder(p, placeholders) for p in content]
        if message.get("role") == "assistant" and message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "id": _short_id(call["id"])} if isinstance(call, dict) and isinstance(call.get("id"), str)
                else call for call in message["tool_calls"]]
            if message.get("content") == "":
                del message["content"]  # (ferrox's request messages carry "" for a null content)
        if message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = _short_id(message["tool_call_id"])
        out.append(message)
    return out


def _placeholder(part: Any, placeholders: dict[str, dict[str, Any]]) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    return _copy_part(placeholders[kind]) if isinstance(kind, str) and kind in placeholders else part


def _copy_part(part: dict[str, Any]) -> dict[str, Any]:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in part.items()}


def _short_id(call_id: str) -> str:
    if len(call_id) <= TOOL_CALL_ID_CHARS:
        return call_id
    logger.debug("tool call id %r cut to %r for mistral_common", call_id, call_id[-TOOL_CALL_ID_CHARS:])
    return call_id[-TOOL_CALL_ID_CHARS:]


def _mistral_tools(tools: list[dict]) -> list[dict[str, Any]]:
    """vLLM's adaptation: a function's missing parameters / description become {} / "" (mistral_common needs
    them), keys mistral_common's Tool and Function do not have (OpenAI's `strict` in older versions) dropped;
    tools other than functions are refused."""
    from mistral_common.protocol.instruct.tool_calls import Function, Tool

    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise ChatTemplateError(f"tools[{i}]: mistral_common takes function tools only, got "
                                    f"{json.dumps(tool)[:200]}")
        function = {k: v for k, v in tool["function"].items() if k in Function.model_fields}
        function.setdefault("description", "")
        if function.get("parameters") is None:
            function["parameters"] = {}
        tool = {k: v for k, v in tool.items() if k in Tool.model_fields}
        out.append({**tool, "type": "function", "function": function})
    return out
