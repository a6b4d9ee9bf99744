"""IBM Granite 3.0 / 3.1 / 3.2: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`.

`<|tool_call|>` is a special token: with special tokens skipped (the default, which vLLM's granite
parser keeps too) the reply is the bare list, so a reply that starts with a list of calls is read as
calls, as vLLM does. Some Granite templates teach the plain text `<tool_call>` instead, and a template
may give both (a `</tool_call>` after the list is dropped as markup). Unlike vLLM, text before a
marker stays content (vLLM reads such a reply as all text), and so does text after the list.
"""

from __future__ import annotations

from ferrox.entrypoints.openai.tool_parsers.call_list import CallListFormat, CallListToolParser

GRANITE = CallListFormat(markers=("<|tool_call|>", "<tool_call>"), closers=("</tool_call>",), bare_list=True)


class GraniteToolParser(CallListToolParser):
    name = "granite"
    call_format = GRANITE
