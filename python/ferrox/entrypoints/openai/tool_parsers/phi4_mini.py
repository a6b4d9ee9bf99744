"""Phi-4-mini: the calls are one JSON list after the word `functools`, with no closing marker:
`functools[{"name": ..., "arguments": {...}}, ...]` (vLLM's tool_chat_template_phi4_mini.jinja
teaches it; `parameters` is read as `arguments`, as vLLM does).

vLLM's phi4_mini_json parser drops the text before `functools`, cuts the list at its first `]` (so
arguments holding a list break it) and streams nothing; here the list is read as JSON, text around
it stays content, and calls stream as the other parsers stream them.
"""

from __future__ import annotations

from ferrox.entrypoints.openai.tool_parsers.call_list import CallListFormat, CallListToolParser

PHI4_MINI = CallListFormat(markers=("functools",))


class Phi4MiniJsonToolParser(CallListToolParser):
    name = "phi4_mini_json"
    call_format = PHI4_MINI
