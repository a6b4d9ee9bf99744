"""Chat templates rendered with jinja2 the way Hugging Face transformers renders them.

Same environment (sandboxed, immutable; trim_blocks + lstrip_blocks; loop controls), the same
extras (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII and takes `indent`),
the same variables (messages, tools, documents, add_generation_prompt, special tokens, caller
kwargs), so a template written for transformers renders byte-for-byte the same here.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from ferrox.loader.errors import ChatTemplateError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@lru_cache(maxsize=16)
def compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters and forces ASCII; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _generation_extension():
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in
    transformers); for inference it renders its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    return GenerationBlock


_GenerationBlock = _generation_extension()


def _plain_messages(messages: list[dict]) -> list[dict]:
    """Copies with None-valued keys dropped: OpenAI clients send content=None / tool_calls=None,
    which templates handle as 'absent' but would print as 'None'."""
    out = []
    for i, message in enumerate(messages):
        if hasattr(message, "model_dump"):
            message = message.model_dump()
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    template_name: str,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    continue_final_message: bool = False,
    special_tokens: dict[str, Any] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render `messages`; any template failure raises ChatTemplateError naming `template_name`.

    continue_final_message: leave the last (assistant) message open so generation continues it
    (the rendered text is cut right after its content), as transformers does.
    """
    chat = _plain_messages(messages)
    if continue_final_message:
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise ChatTemplateError("continue_final_message needs a last message with string content")
        final = chat[-1]["content"]
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    context = {**(special_tokens or {}), **template_kwargs}
    try:
        compiled = compile_template(template)
        text = compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **context)
    except ChatTemplateError:
        raise
    except Exception as e:  # TemplateSyntaxError, TemplateError from raise_exception, TypeError, ...
        raise ChatTemplateError(f"chat template of {template_name}: {type(e).__name__}: {e}") from e
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        at = text.rfind(tag)
        if at < 0:
            raise ChatTemplateError(f"chat template of {template_name} drops the final message; cannot continue it")
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
