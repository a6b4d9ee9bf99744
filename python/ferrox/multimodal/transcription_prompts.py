"""The prompt a speech-to-text request becomes, per audio family (vLLM's `get_generation_prompt`, on the model side).

/v1/audio/transcriptions and /v1/audio/translations (entrypoints/openai/serving_transcription.py) take a recording,
not a prompt: each family says here how a clip, the task ("transcribe" or "translate") and the languages become
its prompt text and token ids, which languages it takes, and how its raw output is cleaned. A new audio family
adds one SpeechFamily to FAMILIES, keyed by its prompt rules' class (the multimodal/*_processing.py class that
expands its audio placeholder).

- Gemma 4 (E2B / E4B with an audio tower): vLLM's Gemma 3n prompt, a user turn "Transcribe this audio[ into
  <language>]: <audio>" or "Translate this audio[ from <language>][ into <to_language>]: <audio>", then the
  model's turn; the turns are the model's own chat template's (the server's --chat-template when given), the
  ids encoded without adding special tokens again (the template writes `<bos>`).
- Qwen2-Audio: the base model's ASR form in Qwen's model card and evaluation code, no chat turns:
  "<|audio_bos|><|AUDIO|><|audio_eos|>Detect the language and recognize the speech:[ <|<language>|>]"; and for
  translation "... Detect the language and translate the speech into <to_language>:[ <|<language>|>]" (English when
  to_language is not given: what the translations endpoint means). Without a language the model announces the one
  it heard as a `<|xx|>` tag first, which post_process strips from a whole answer (as vLLM's post_process_output,
  not from a stream's deltas).

- Voxtral: mistral_common's transcription request, as vLLM's get_generation_prompt encodes it (under
  --tokenizer-mode mistral, which Voxtral's audio needs): `<s>[INST][BEGIN_AUDIO][AUDIO][/INST]`, then
  "lang:<language>" when a language is given, then [TRANSCRIBE] (the clip's [AUDIO] expanded by its rules). A
  translation is refused by name: vLLM's Voxtral builds the same transcription prompt whatever the task.

Languages are ISO-639-1 codes; Gemma 4 and Qwen2-Audio take the list OpenAI documents for its speech-to-text
endpoints (the one vLLM gives Gemma 3n, ISO639_1_SUPPORTED_LANGS), Voxtral the nine vLLM gives it; a code outside
a family's list is refused naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ferrox.errors import InvalidArgumentError
from ferrox.multimodal.gemma4_processing import Gemma4ImagePrompts
from ferrox.multimodal.qwen2_audio_processing import Qwen2AudioPrompts
from ferrox.multimodal.voxtral_processing import PLACEHOLDER_AUDIO_DATA, VoxtralPrompts

Task = Literal["transcribe", "translate"]

# ISO-639-1 code -> the language's English name (OpenAI's speech-to-text languages).
LANGUAGES: Mapping[str, str] = {
    "af": "Afrikaans", "ar": "Arabic", "hy": "Armenian", "az": "Azerbaijani", "be": "Belarusian",
    "bs": "Bosnian", "bg": "Bulgarian", "ca": "Catalan", "zh": "Chinese", "hr": "Croatian", "cs": "Czech",
    "da": "Danish", "nl": "Dutch", "en": "English", "et": "Estonian", "fi": "Finnish", "fr": "French",
    "gl": "Galician", "de": "German", "el": "Greek", "he": "Hebrew", "hi": "Hindi", "hu": "Hungarian",
    "is": "Icelandic", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "kn": "Kannada", "kk": "Kazakh",
    "ko": "Korean", "lv": "Latvian", "lt": "Lithuanian", "mk": "Macedonian", "ms": "Malay", "mr": "Marathi",
    "mi": "Maori", "ne": "Nepali", "no": "Norwegian", "fa": "Persian", "pl": "Polish", "pt": "Portuguese",
    "ro": "Romanian", "ru": "Russian", "sr": "Serbian", "sk": "Slovak", "sl": "Slovenian", "es": "Spanish",
    "sw": "Swahili", "sv": "Swedish", "tl": "Tagalog", "ta": "Tamil", "th": "Thai", "tr": "Turkish",
    "uk": "Ukrainian", "ur": "Urdu", "vi": "Vietnamese", "cy": "Welsh",
}


# Voxtral's languages (vLLM's voxtral.py ISO639_1_SUPPORTED_LANGS).
VOXTRAL_LANGUAGES: Mapping[str, str] = {code: LANGUAGES[code] for code in ("ar", "nl", "en", "fr", "de", "hi", "it",
                                                                          "pt", "es")}


@dataclass(frozen=True, slots=True)
class SpeechTask:
    """What a request asks of one clip: the task, the spoken language and (translation) the target, as codes."""

    task: Task
    language: str | None = None
    to_language: str | None = None


@dataclass(frozen=True, slots=True)
class SpeechPrompt:
    """A clip's prompt: its text (one audio placeholder, for the clip) and that text's token ids, unexpanded."""

    text: str
    token_ids: list[int]


# (task, the model's prompt rules, its tokenizer, the chat template to render turns with or None) -> the prompt
PromptBuilder = Callable[[SpeechTask, Any, Any, "str | None"], SpeechPrompt]


def _unchanged(text: str) -> str:
    return text


@dataclass(frozen=True, slots=True)
class SpeechFamily:
    name: str
    build: PromptBuilder
    languages: Mapping[str, str]
    post_process: Callable[[str], str] = _unchanged  # applied to a whole (non-streamed) answer


def _gemma4_prompt(task: SpeechTask, prompts: Any, tokenizer: Any, chat_template: str | None) -> SpeechPrompt:
    spoken, target = LANGUAGES.get(task.language or ""), LANGUAGES.get(task.to_language or "")
    if task.task == "transcribe":
        ask = "Transcribe this audio" + (f" into {spoken}" if spoken else "")
    else:
        ask = "Translate this audio" + (f" from {spoken}" if spoken else "") + (f" into {target}" if target else "")
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{ask}: {prompts.audio_placeholder}"}],
                                         add_generation_prompt=True, chat_template=chat_template)
    return SpeechPrompt(text, list(tokenizer.encode(text, add_special_tokens=False)))


def _qwen2_audio_prompt(task: SpeechTask, prompts: Any, tokenizer: Any, chat_template: str | None) -> SpeechPrompt:
    if task.task == "transcribe":
        ask = "Detect the language and recognize the speech:"
    else:
        ask = f"Detect the language and translate the speech into {LANGUAGES[task.to_language or 'en']}:"
    text = f"{prompts.audio_placeholder}{ask}" + (f" <|{task.language}|>" if task.language else "")
    return SpeechPrompt(text, list(tokenizer.encode(text)))


def _voxtral_prompt(task: SpeechTask, prompts: Any, tokenizer: Any, chat_template: str | None) -> SpeechPrompt:
    if task.task != "transcribe":
        raise InvalidArgumentError("Voxtral transcribes only: vLLM's Voxtral has no translation prompt (it would "
                                   "transcribe); use /v1/audio/transcriptions", param="model")
    instruct = getattr(tokenizer, "audio_instruct", None)
    if instruct is None:
        raise InvalidArgumentError(f"model: {prompts.audio_refusal or 'Voxtral needs --tokenizer-mode mistral'}",
                                   param="model")
    from mistral_common.protocol.transcription.request import TranscriptionRequest

    # (mistral_common's own request; PlaceholderAudioEncoder writes the clip's [BEGIN_AUDIO][AUDIO] unread)
    request = TranscriptionRequest.model_validate({"model": "voxtral", "audio": PLACEHOLDER_AUDIO_DATA,
                                                   "language": task.language})
    ids = [int(t) for t in instruct.encode_transcription(request).tokens]
    return SpeechPrompt(tokenizer.decode(ids, skip_special_tokens=False), ids)


_LANGUAGE_TAG = re.compile(r"^\s*<\|[a-z]{2,3}(?:[-_][A-Za-z]+)?\|>")


def _strip_language_tag(text: str) -> str:
    return _LANGUAGE_TAG.sub("", text, count=1)


# The prompt rules' class of each family that transcribes (the first whose class the served model's rules are).
FAMILIES: tuple[tuple[type, SpeechFamily], ...] = (
    (Gemma4ImagePrompts, SpeechFamily("Gemma 4", _gemma4_prompt, LANGUAGES)),
    (Qwen2AudioPrompts, SpeechFamily("Qwen2-Audio", _qwen2_audio_prompt, LANGUAGES, _strip_language_tag)),
    (VoxtralPrompts, SpeechFamily("Voxtral", _voxtral_prompt, VOXTRAL_LANGUAGES)),
)


def speech_family(prompts: Any) -> SpeechFamily | None:
    """The family whose prompts a model with these prompt rules gets; None when it takes no audio (a text or vision
    model, a Gemma 4 without an audio tower) or its family has no speech-to-text prompt."""
    if prompts is None or getattr(prompts, "audio_processor", None) is None:
        return None
    return next((family for rules, family in FAMILIES if isinstance(prompts, rules)), None)


def check_language(family: SpeechFamily, code: str | None, field: str) -> str | None:
    """The code, if the family takes it (None: not given); InvalidArgumentError naming `field` otherwise."""
    if code is None or code in family.languages:
        return code
    raise InvalidArgumentError(f"{field}: unsupported language {code!r}: {family.name} takes an ISO-639-1 code among "
                               f"{', '.join(family.languages)}", param=field)


def speech_prompt(prompts: Any, task: SpeechTask, tokenizer: Any, chat_template: str | None = None) -> SpeechPrompt:
    """The prompt of one clip for a model with these prompt rules (what the server sends with the clip, and what an
    offline caller passes LLM.generate with multi_modal_data={"audio": clip} to get the same answer)."""
    family = speech_family(prompts)
    if family is None:
        raise InvalidArgumentError("model: this model has no speech-to-text prompt (audio families: "
                                   f"{', '.join(f.name for _, f in FAMILIES)})", param="model")
    return family.build(task, prompts, tokenizer, chat_template)
