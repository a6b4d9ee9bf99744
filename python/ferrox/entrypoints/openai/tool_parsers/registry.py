"""Tool parsers by name (the server's --tool-call-parser), with a default from the chat template."""

from __future__ import annotations

from ferrox.entrypoints.openai.tool_parsers.base import ToolParser
from ferrox.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from ferrox.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "qwen2_5": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"tool_call_parser: unknown parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})"
        )
    return parser


def default_tool_parser(chat_template: str | None) -> str:
    """Llama 3 templates mention <|python_tag|> / ipython; everything else gets Hermes, which is
    also what ferrox's own tool prompt (structured/tools.py) asks for."""
    if chat_template and ("<|python_tag|>" in chat_template or "ipython" in chat_template):
        return "llama3_json"
    return "hermes"
