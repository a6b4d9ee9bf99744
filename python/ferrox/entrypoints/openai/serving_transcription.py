"""POST /v1/audio/transcriptions and /v1/audio/translations: a recording in, its text out (vLLM's speech-to-text API).

The body is multipart/form-data (protocol_transcription.py: the fields; any other is refused by name). The `file`
part, at most VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25 MB, vLLM's) and decodable by PyAV (multimodal/audio.py: wav, mp3,
flac, ogg...; resampled to the model's 16 kHz mono), is cut into clips the model takes whole (multimodal/
audio_chunks.py: at the quietest 100 ms before each 30 s limit); each clip becomes one engine request with the
prompt its family builds (multimodal/transcription_prompts.py), the clips' requests run side by side (a stream:
one after the other, in order), and the texts are joined in order, with a space unless the output language is
written without spaces (ja, zh: vLLM's no_space_languages); Voxtral takes a recording whole (several 30 s windows),
as vLLM does. The served model must take audio (Gemma 4 with an audio tower, Qwen2-Audio, Voxtral); any other is
answered 400 "The model does not support Transcriptions API" naming why.

Answers, as vLLM's: response_format json `{"text": ..., "usage": {"type": "duration", "seconds": <ceil>}}` for a
transcription, `{"text": ...}` for a translation (vLLM gives those no usage); text: the text itself (text/plain).
verbose_json (segment timestamps, which these models do not produce), srt and vtt are refused by name, as are
timestamp_granularities. stream=true (vLLM's extension) sends `transcription.chunk` / `translation.chunk` events,
`choices[0].delta.content` each (the finishing one of every clip with its finish_reason and stop_reason), the
usage ({prompt_tokens, completion_tokens, total_tokens}; prompt tokens summed over the clips, audio tokens
included) on every event with stream_continuous_usage_stats and in a last event with no choices under
stream_include_usage (or --enable-force-include-usage), then `data: [DONE]`.

Sampling follows vLLM: temperature defaults to 0 (greedy); a transcription's top_p, top_k, min_p and
repetition_penalty fall back to the model's generation_config, a translation's sampling is temperature and seed
only (its fields); max_completion_tokens caps each clip's answer, which otherwise runs up to the model's length.
A family whose prompt has no place for the request's `prompt` refuses a non-empty one by name, and a transcription
refuses to_language (it names a translation's target) rather than ignore either; a family's post_process (the
language tag Qwen2-Audio may start with) cleans a whole answer, not a stream's deltas, as vLLM's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from multidict import MultiMapping
from pydantic import ValidationError

from ferrox.entrypoints.openai.errors import APIError, from_validation_error
from ferrox.entrypoints.openai.protocol_transcription import (
    LIST_FIELDS,
    SpeechRequest,
    TranscriptionRequest,
    TranslationRequest,
    form_fields,
)
from ferrox.entrypoints.openai.serving import (
    SSE_DONE,
    STREAM_ERRORS,
    ServingContext,
    api_error,
    end_sse,
    first_output,
    json_response,
    request_ids,
    sampling_knobs,
    send_sse,
    sse_event,
    start_sse,
    stream_error_event,
    usage_body,
    validate_request,
)
from ferrox.errors import FerroxError, InvalidArgumentError
from ferrox.multimodal.audio import Audio, decode_audio
from ferrox.multimodal.audio_chunks import ENERGY_WINDOW_SAMPLES, OVERLAP_SECONDS, split_audio
from ferrox.multimodal.media import MediaError
from ferrox.multimodal.transcription_prompts import SpeechFamily, SpeechTask, check_language, speech_family
from ferrox.outputs import RequestOutput
from ferrox.sampling_params import RequestOutputKind, SamplingParams

FILESIZE_ENV = "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB"
DEFAULT_MAX_FILESIZE_MB = 25.0  # vLLM's
NO_SPACE_LANGUAGES = frozenset({"ja", "zh"})  # vLLM's: clips' texts are joined without a space
# Engine field name -> the form field it comes from (the prompt is the recording's clip).
FIELDS = {"prompt": "file", "prompt_token_ids": "file", "max_tokens": "max_completion_tokens",
          "extra_args": "vllm_xargs"}
# The request's key for its form as --enable-log-requests logs it (server.py: the body is no JSON to log).
LOGGED_FORM = "logged_form"


@dataclass(frozen=True, slots=True)
class SpeechRoute:
    task: str  # "transcribe" | "translate": vLLM's task_type, the request ids' prefix too
    api: str
    path: str
    request_model: type[SpeechRequest]
    chunk_object: str


TRANSCRIPTIONS = SpeechRoute("transcribe", "Transcriptions API", "/v1/audio/transcriptions", TranscriptionRequest,
                             "transcription.chunk")
TRANSLATIONS = SpeechRoute("translate", "Translations API", "/v1/audio/translations", TranslationRequest,
                           "translation.chunk")


async def create_transcription(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    """Transcribe an audio file (multipart form: file, model, language, response_format, stream...)."""
    return await _speech_to_text(ctx, request, TRANSCRIPTIONS)


async def create_translation(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    """Translate an audio file (multipart form: file, model, language, to_language, response_format, stream...)."""
    return await _speech_to_text(ctx, request, TRANSLATIONS)


async def _speech_to_text(ctx: ServingContext, request: web.Request, route: SpeechRoute) -> web.StreamResponse:
    req = await read_form(request, route)
    ctx.check_model(req.model)
    ctx.check_engine()
    prompts = ctx.engine.image_prompts
    family = speech_family(prompts)
    if family is None:
        why = getattr(prompts, "audio_refusal", None) or "it takes no audio input"
        raise APIError(400, f"The model does not support {route.api}: {ctx.model_name}: {why}", param="model",
                       code="model_not_supported")
    task = _check_request(req, route, family)
    rate = prompts.audio_processor.sampling_rate
    try:
        audio = await asyncio.to_thread(decode_audio, req.file, rate)
    except MediaError as e:
        raise APIError(400, f"file: {e}", param="file") from None
    clips = split_audio(audio.samples, prompts.audio_processor.max_samples, OVERLAP_SECONDS * rate,
                        ENERGY_WINDOW_SAMPLES)
    engine_prompts = await ctx.engine.run_in_prompt_pool(_clip_prompts, ctx, family, task, clips, rate)
    params = [_sampling_params(ctx, req, len(p["prompt_token_ids"])) for p in engine_prompts]
    for prompt, clip_params in zip(engine_prompts, params, strict=True):
        validate_request(ctx, prompt["prompt_token_ids"], clip_params, FIELDS)
    request_id, header_id = request_ids(request, None, route.task)
    headers = {"X-Request-Id": header_id}
    language = task.to_language if task.task == "translate" else task.language
    separator = "" if language in NO_SPACE_LANGUAGES else " "
    if req.stream:
        return await _stream(ctx, request, route, req, engine_prompts, params, request_id, headers, separator)
    lora = ctx.lora_request(req.model)
    try:
        finals = await _side_by_side([_final(ctx, prompt, clip_params, f"{request_id}_{i}", lora)
                                      for i, (prompt, clip_params) in enumerate(zip(engine_prompts, params,
                                                                                    strict=True))])
    except STREAM_ERRORS as exc:
        raise api_error(exc, default_param="file", rename=FIELDS) from None
    text = separator.join(family.post_process(final.outputs[0].text) for final in finals)
    if req.response_format == "text":
        return web.Response(text=text, content_type="text/plain", headers=headers)
    body: dict[str, Any] = {"text": text}
    if route.task == "transcribe":  # (vLLM's translations carry no usage)
        body["usage"] = {"type": "duration", "seconds": math.ceil(audio.seconds)}
    return json_response(body, headers=headers)


async def read_form(request: web.Request, route: SpeechRoute) -> SpeechRequest:
    """The route's request from a multipart form: its fields by name (a list field from its repeated `name[]`
    parts), the `file` part's bytes within the size limit; every error a 400 naming its field."""
    if request.content_type != "multipart/form-data":
        raise APIError(400, f"file: {route.path} takes a multipart/form-data body, the audio in its `file` part (got "
                       f"{request.content_type or 'no content type'})", param="file")
    try:
        form = await request.post()
    except ValueError as e:  # a malformed multipart body (aiohttp: a part without a name, a broken boundary)
        raise APIError(400, f"file: the multipart body could not be read: {e}", param="file") from None
    # For --enable-log-requests, taken now: the file part is closed once read (and a refused form is logged too).
    request[LOGGED_FORM] = logged_form(form)
    allowed = form_fields(route.request_model)
    values: dict[str, Any] = {}
    for name in dict.fromkeys(form.keys()):
        if name not in allowed:
            raise APIError(400, f"{name}: not a field of {route.path} (its fields: {', '.join(sorted(allowed))})",
                           param=name)
        parts = form.getall(name)
        if name != "file" and any(isinstance(part, web.FileField) for part in parts):
            raise APIError(400, f"{name}: must be a text field, not a file part", param=name)
        if name in LIST_FIELDS:
            values.setdefault(LIST_FIELDS[name], []).extend(parts)
        elif len(parts) > 1:
            raise APIError(400, f"{name}: given {len(parts)} times; give it once", param=name)
        else:
            values[name] = parts[0]
    upload = values.pop("file", None)
    if upload is None:
        raise APIError(400, "file: missing: the audio goes in the form's `file` part", param="file")
    if not isinstance(upload, web.FileField):
        raise APIError(400, "file: must be a file part (a form part with a filename), not a text field",
                       param="file")
    data = await asyncio.to_thread(_read_upload, upload)
    try:
        return route.request_model.model_validate({**values, "file": data})
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def logged_form(form: MultiMapping[Any]) -> dict[str, Any]:
    """The form's parameters as --enable-log-requests logs them (vLLM logs a speech request's parameters, not its
    audio): text fields as sent (a repeated one as a list), a file part as its filename, content type and size in
    bytes, never its bytes."""
    logged: dict[str, Any] = {}
    for name in dict.fromkeys(form.keys()):
        values = [_logged_part(part) for part in form.getall(name)]
        logged[name] = values[0] if len(values) == 1 else values
    return logged


def _logged_part(part: Any) -> Any:
    if isinstance(part, (bytes, bytearray)):  # (aiohttp keeps a text field sent with a non-text type as bytes)
        return f"<{len(part)} bytes>"
    if not isinstance(part, web.FileField):
        return part
    where = part.file.tell()
    size = part.file.seek(0, os.SEEK_END)
    part.file.seek(where)
    return {"filename": part.filename, "content_type": part.content_type, "size": size}


def max_audio_filesize_mb() -> float:
    """$VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (MiB), else 25."""
    raw = os.environ.get(FILESIZE_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_FILESIZE_MB
    try:
        limit = float(raw)
    except ValueError:
        limit = math.nan
    if not limit > 0:
        raise APIError(500, f"{FILESIZE_ENV}={raw!r}: the server's audio file size limit must be a positive number "
                       "of MB")
    return limit


def _read_upload(upload: web.FileField) -> bytes:
    """The file part's bytes; a 400 naming `file` past the size limit (checked before reading them)."""
    limit = max_audio_filesize_mb()
    with contextlib.closing(upload.file):
        size = upload.file.seek(0, os.SEEK_END)
        if size / 2**20 > limit:
            raise APIError(400, f"file: Maximum file size exceeded: {size / 2**20:.2f} MB, more than the {limit:g} MB "
                           f"this server takes ({FILESIZE_ENV})", param="file")
        upload.file.seek(0)
        return upload.file.read()


def _check_request(req: SpeechRequest, route: SpeechRoute, family: SpeechFamily) -> SpeechTask:
    """The fields the model cannot honour, refused by name; the task with its checked languages."""
    if req.response_format in ("verbose_json", "srt", "vtt"):
        why = ("segment timestamps, which this model's output does not carry" if req.response_format == "verbose_json"
               else "subtitle timestamps, which this model's output does not carry")
        raise APIError(400, f"response_format: {req.response_format!r} needs {why}; use 'json' or 'text'",
                       param="response_format")
    if getattr(req, "timestamp_granularities", None):
        raise APIError(400, "timestamp_granularities: word and segment timestamps come with response_format "
                       "verbose_json, which this model cannot give", param="timestamp_granularities")
    if not req.stream:
        for option in ("stream_include_usage", "stream_continuous_usage_stats"):
            if getattr(req, option):
                raise APIError(400, f"{option}: Stream options can only be defined when `stream=True`.", param=option)
    if req.prompt:
        raise APIError(400, f"prompt: {family.name}'s speech-to-text prompt has no place for a text prompt (vLLM builds "
                       "it without one); leave `prompt` out", param="prompt")
    try:
        language = check_language(family, req.language, "language")
        if route.task == "transcribe" and req.to_language is not None:
            raise InvalidArgumentError("to_language: a transcription keeps the spoken language; translate with "
                                       "/v1/audio/translations", param="to_language")
        to_language = check_language(family, req.to_language, "to_language")
    except InvalidArgumentError as e:
        raise api_error(e) from None
    return SpeechTask("transcribe" if route.task == "transcribe" else "translate", language, to_language)


def _clip_prompts(ctx: ServingContext, family: SpeechFamily, task: SpeechTask, clips: list[Any],
                  rate: int) -> list[dict[str, Any]]:
    """Each clip's engine prompt: the family's prompt with the clip's audio tokens expanded (its features computed
    here: blocking, in the prompt threads)."""
    prompts = ctx.engine.image_prompts
    try:
        base = family.build(task, prompts, ctx.engine.tokenizer, ctx.engine.chat_template)
    except (FerroxError, ValueError) as e:  # a chat template that is missing or fails: the server's set-up
        raise APIError(400, f"model: {ctx.model_name}'s {family.name} speech-to-text prompt could not be built: {e}",
                       param="model") from None
    out = []
    for clip in clips:
        try:
            ids, items = prompts.expand(base.token_ids, [Audio(clip, rate)], "file", param="file")
        except InvalidArgumentError as e:
            raise api_error(e, rename=FIELDS) from None
        out.append({"prompt": base.text, "prompt_token_ids": ids, "multi_modal_items": items})
    return out


def _sampling_params(ctx: ServingContext, req: SpeechRequest, num_prompt_tokens: int) -> SamplingParams:
    """vLLM's sampling for the route (module docstring); max_tokens: max_completion_tokens, at most what the
    clip's prompt leaves of the model's length (vLLM's engine stops there), all of it when not given."""
    room = ctx.max_model_len - num_prompt_tokens
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else max(room, 1)
    if room >= 1:
        max_tokens = min(max_tokens, room)
    kwargs: dict[str, Any] = dict(temperature=req.temperature, seed=req.seed, max_tokens=max_tokens,
                                  output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)
    if isinstance(req, TranscriptionRequest):
        kwargs.update(frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                      extra_args=req.vllm_xargs or None)
        kwargs.update(sampling_knobs(ctx.engine.generation_defaults, temperature=req.temperature, top_p=req.top_p,
                                     top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty))
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError, msgspec.ValidationError) as exc:
        raise api_error(exc, rename=FIELDS) from None


async def _side_by_side(requests: list[Coroutine[Any, Any, RequestOutput]]) -> list[RequestOutput]:
    """The clips' requests run together (the engine batches them); the first to fail cancels the others, which
    aborts them, and is raised."""
    tasks = [asyncio.ensure_future(one) for one in requests]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # (also when this handler is cancelled: the client left)
        for task in tasks:
            task.cancel()
    # (every failure read, so that none is logged as never retrieved; the first raised)
    failed = [error for task in tasks if task.done() and not task.cancelled() and (error := task.exception())]
    if failed:
        raise failed[0]
    return [task.result() for task in tasks]


async def _final(ctx: ServingContext, prompt: Mapping[str, Any], params: SamplingParams, request_id: str,
                 lora: Any) -> RequestOutput:
    final: RequestOutput | None = None
    async with contextlib.aclosing(ctx.engine.generate(dict(prompt), params, request_id, lora_request=lora)) as gen:
        async for out in gen:
            final = out
    assert final is not None
    return final


async def _stream(ctx: ServingContext, request: web.Request, route: SpeechRoute, req: SpeechRequest,
                  engine_prompts: list[dict[str, Any]], params: list[SamplingParams], request_id: str,
                  headers: dict[str, str], separator: str) -> web.StreamResponse:
    created = int(time.time())
    include_usage = req.stream_include_usage or ctx.options.enable_force_include_usage
    continuous = include_usage and req.stream_continuous_usage_stats
    lora = ctx.lora_request(req.model)
    prompt_tokens = completion_tokens = 0

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": request_id, "object": route.chunk_object, "created": created,
                                "model": ctx.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def generate(i: int) -> Any:
        return ctx.engine.generate(engine_prompts[i], params[i], f"{request_id}_{i}", lora_request=lora)

    first_gen = generate(0)
    tail: list[bytes] = []
    async with contextlib.aclosing(first_gen):  # (closed, which aborts its request, however this ends)
        # The first clip's first output before the headers: a request the engine refuses is still a plain 4xx.
        first = await first_output(first_gen, "file", FIELDS)
        resp = await start_sse(request, headers)
        try:
            for i in range(len(engine_prompts)):
                gen = first_gen if i == 0 else generate(i)
                async with contextlib.aclosing(gen):
                    prompt_tokens += len(engine_prompts[i]["prompt_token_ids"])
                    out = first if i == 0 else await anext(gen, None)
                    lead = separator if i else ""  # (the clips' texts joined as a whole answer joins them)
                    while out is not None:
                        comp = out.outputs[0]
                        completion_tokens += len(comp.token_ids)
                        choice: dict[str, Any] = {"delta": {"content": lead + comp.text}}
                        lead = ""
                        if comp.finish_reason is not None:
                            choice.update(finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)
                        usage = usage_body(prompt_tokens, completion_tokens) if continuous else None
                        await send_sse(resp, event([choice], usage))
                        out = await anext(gen, None)
            if include_usage:
                tail.append(sse_event(event([], usage_body(prompt_tokens, completion_tokens))))
        except STREAM_ERRORS as exc:
            tail.append(stream_error_event(exc))
    tail.append(SSE_DONE)
    await end_sse(resp, tail)
    return resp
