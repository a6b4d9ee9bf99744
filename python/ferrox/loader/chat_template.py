"""Chat templates rendered with jinja2 the way Hugging Face transformers renders them.

Same environment (sandboxed, immutable; trim_blocks + lstrip_blocks; loop controls), the same
extras (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII and takes `indent`),
the same variables (messages, tools, documents, add_generation_prompt, special tokens, caller
kwargs), so a template written for transformers renders byte-for-byte the same here.

A message's content reaches the template in one of vLLM's two shapes (--chat-template-content-format):
"string" (text parts joined by newlines) or "openai" (a list of {"type": "text", "text": ...} parts, a
plain string becoming one part). "auto" picks "openai" for templates that loop over a message's content
(Llama 4's, Gemma 3's: they print each part) and "string" for the rest, by reading the template's syntax
tree, never by rendering it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from ferrox.loader.errors import ChatTemplateError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
CONTENT_FORMATS = ("auto", "string", "openai")


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


def content_text(content: Any, where: str = "content") -> str:
    """A message's content as one string: text parts joined by newlines (vLLM's joiner), None as ""."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ChatTemplateError(f"{where} must be a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if part in _MEDIA_PARTS:
            continue  # an image's, video's or audio clip's place (multimodal/chat_parts.py): no text
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where}[{i}]: content part type {kind!r} is not supported (only 'text' parts "
                                    "with a 'text' string)")
        texts.append(part["text"])
    return "\n".join(texts)


def _content_parts(content: Any, where: str) -> list[dict[str, str]]:
    """A message's content as OpenAI text parts (a string is one part; None none), with the
    `{"type": "image"}` parts a chat's images left in their place (multimodal/chat_parts.py)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    content_text(content, where)  # the same checks
    return [{"type": "text", "text": p} if isinstance(p, str) else
            dict(p) if p in _MEDIA_PARTS else {"type": "text", "text": p["text"]} for p in content]


_MEDIA_PARTS = ({"type": "image"}, {"type": "video"}, {"type": "audio"})


def _shape_contents(messages: list[dict], content_format: str) -> list[dict]:
    """Each message's content in the template's shape. Tool results stay strings in both (vLLM's rule:
    templates print a tool message's content whole)."""
    out = []
    for i, message in enumerate(messages):
        if "content" in message:
            where = f"messages[{i}].content"
            if content_format == "openai" and message.get("role") != "tool":
                message = {**message, "content": _content_parts(message["content"], where)}
            elif not isinstance(message["content"], str):
                message = {**message, "content": content_text(message["content"], where)}
        out.append(message)
    return out


@lru_cache(maxsize=16)
def detect_content_format(source: str) -> str:
    """"openai" when the template loops over a message's content, else "string" (also for a template
    that does not parse: rendering reports that error)."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationBlock]).parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists, items, contents = {"messages"}, set(), set()

    def bare(node):  # `x | filter(...)` reads x
        while isinstance(node, nodes.Filter) and node.node is not None:
            node = node.node
        return node

    def is_list(node) -> bool:  # messages, messages[1:], loop_messages
        node = bare(node)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = bare(node.node)
        return isinstance(node, nodes.Name) and node.name in lists

    def is_item(node) -> bool:  # message, messages[0]
        node = bare(node)
        if isinstance(node, nodes.Name):
            return node.name in items
        return isinstance(node, nodes.Getitem) and not isinstance(node.arg, nodes.Slice) and is_list(node.node)

    def is_content(node) -> bool:  # message['content'], message.content, a name set to one of them
        node = bare(node)
        if isinstance(node, nodes.Name):
            return node.name in contents
        if isinstance(node, nodes.Getattr):
            return node.attr == "content" and is_item(node.node)
        return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
                and node.arg.value == "content" and is_item(node.node))

    for _ in range(3):  # names bound later in the template can feed loops earlier in its text
        for loop in tree.find_all(nodes.For):
            if isinstance(loop.target, nodes.Name) and is_list(loop.iter):
                items.add(loop.target.name)
        for assign in tree.find_all(nodes.Assign):
            target, value = assign.target, assign.node
            if not isinstance(target, nodes.Name):
                continue
            if is_list(value):
                lists.add(target.name)
            elif is_item(value):
                items.add(target.name)
            elif is_content(value):
                contents.add(target.name)
    return "openai" if any(is_content(loop.iter) for loop in tree.find_all(nodes.For)) else "string"


def resolve_content_format(content_format: str, template: str) -> str:
    if content_format not in CONTENT_FORMATS:
        raise ChatTemplateError(f"chat_template_content_format must be one of {list(CONTENT_FORMATS)}, "
                                f"got {content_format!r}")
    return detect_content_format(template) if content_format == "auto" else content_format


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
    content_format: str = "auto",
    **template_kwargs: Any,
) -> str:
    """Render `messages`; any template failure raises ChatTemplateError naming `template_name`.

    continue_final_message: leave the last (assistant) message open so generation continues it
    (the rendered text is cut right after its content), as transformers does.
    content_format: "auto", "string" or "openai" (the module docstring).
    """
    chat = _plain_messages(messages)
    if continue_final_message:
        if not chat or chat[-1].get("content") is None:
            raise ChatTemplateError("continue_final_message needs a last message with content")
        final = content_text(chat[-1]["content"], f"messages[{len(chat) - 1}].content")
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    chat = _shape_contents(chat, resolve_content_format(content_format, template))
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
