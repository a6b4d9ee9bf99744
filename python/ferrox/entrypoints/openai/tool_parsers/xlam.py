"""Salesforce xLAM (Llama- and Qwen-based): the calls are one JSON list
`[{"name": ..., "arguments": {...}}, ...]`, the whole reply or, as vLLM's xlam parser also reads,
inside a ```json (or bare ```) fence, after `[TOOL_CALLS]`, or after `<tool_call>` (closed by
`</tool_call>`), with text before and after the fence or marker kept as content.

Where vLLM differs: it skips list items that are no call and keeps the others (here the list stops
at the first such item and the rest is content), reads a bare list only when it is the whole reply
(here text after it is content), and looks for the list after a `</think>` (xLAM-2 does not think, and
with --reasoning-parser the tool parser sees only the answer).
"""

from __future__ import annotations

from ferrox.entrypoints.openai.tool_parsers.call_list import CallListFormat, CallListToolParser

XLAM = CallListFormat(
    markers=("```json", "```", "[TOOL_CALLS]", "<tool_call>"),
    closers=("```", "</tool_call>"),
    bare_list=True,
)


class XLamToolParser(CallListToolParser):
    name = "xlam"
    call_format = XLAM
