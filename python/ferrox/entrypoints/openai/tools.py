"""Hooks for tool calling on /v1/chat/completions.

The structured-output engineer fills these in (constraints for tool_choice "required" /
named functions, and parsers that turn generated text into `tool_calls`). Until then the
server passes `tools` to the chat template and returns plain text, which is correct for
tool_choice "none" and a valid (if unhelpful) answer for "auto".
"""

from __future__ import annotations

from typing import Any

from ferrox.structured.params import StructuredOutputsParams


def validate_tools(request: Any) -> None:
    """Raise ValueError naming tool_choice / tools when they are inconsistent."""
    tools = request.tools or []
    choice = request.tool_choice
    names = {t.get("function", {}).get("name") for t in tools if isinstance(t, dict)}
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {choice!r}")
    if choice not in (None, "none", "auto") and not tools:
        raise ValueError("tool_choice: requires tools")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(f"tool_choice: function {name!r} is not among the tools")


def tool_constraint(request: Any) -> StructuredOutputsParams | None:
    """The constraint forcing a tool call (tool_choice 'required' or named); None otherwise."""
    return None


def parse_tool_calls(text: str, request: Any) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) from a finished completion; tool_calls None when there are none."""
    return text, None
