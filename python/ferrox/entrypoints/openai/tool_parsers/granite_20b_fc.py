"""granite-20b-functioncalling: each call is `<function_call> {"name": ..., "arguments": {...}}`,
one object per marker, several markers in a row for parallel calls.

As vLLM's granite-20b-fc parser, text before the first marker is content; unlike it, text between
or after the calls is content too (vLLM drops it), and a marker followed by no call object is text.
The model's template asks for `no_function` when no tool fits: that comes back as a call, as in vLLM.
"""

from __future__ import annotations

from ferrox.entrypoints.openai.tool_parsers.call_list import CallListFormat, CallListToolParser

GRANITE_20B_FC = CallListFormat(markers=("<function_call>",), one_object=True)


class Granite20bFCToolParser(CallListToolParser):
    name = "granite-20b-fc"
    call_format = GRANITE_20B_FC
