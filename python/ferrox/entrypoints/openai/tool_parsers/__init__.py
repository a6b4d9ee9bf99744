"""Tool-call parsers: model text -> OpenAI tool_calls, whole or streamed."""

from ferrox.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
)
from ferrox.entrypoints.openai.tool_parsers.registry import (
    TOOL_PARSERS,
    default_tool_parser,
    get_tool_parser,
    register_tool_parser,
)

__all__ = [
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolParser",
    "TOOL_PARSERS",
    "default_tool_parser",
    "get_tool_parser",
    "register_tool_parser",
]
