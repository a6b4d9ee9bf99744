"""Seed-OSS's tool calls (`seed_oss`, vLLM's name): Qwen3-Coder's XML-ish call between Seed's own markers,

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    <parameter=days>3</parameter>
    </function>
    </seed:tool_call>

which is how Seed-OSS's chat template writes a call back into the conversation. Inside the markers
everything is qwen3_coder's (qwen3_coder.py): values are bare text, one newline after `>` and one before
`</parameter>` dropped, typed by the parameter's JSON schema in the request's tools; a call cut short after
its function header stands; streaming sends the id and name at the header, each parameter once complete,
then the closing brace.

Seed-OSS thinks in `<seed:think>...</seed:think>` before it answers. As in vLLM's parser, no call is read
inside the thinking: a `<seed:think>` block (one left open runs to the end) is content as written. With
`--reasoning-parser seed_oss` the thinking never reaches this parser. Where vLLM differs: it falls back to
reading a bare `<function=...>` when no `<seed:tool_call>` is written (ferrox reads calls between the
markers only, as its qwen3_coder does), and its streamed arguments are strings whatever the schema says
(ferrox streams the same typed arguments extract() gives).
"""

from __future__ import annotations

from typing import ClassVar

from ferrox.entrypoints.openai.tool_parsers.qwen3_coder import CallTags, Qwen3CoderToolParser

TOOL_CALL = "<seed:tool_call>"
TOOL_CALL_END = "</seed:tool_call>"
THINK = "<seed:think>"
THINK_END = "</seed:think>"


class SeedOssToolParser(Qwen3CoderToolParser):
    name = "seed_oss"
    tags: ClassVar[CallTags] = CallTags(TOOL_CALL, TOOL_CALL_END)
    quiet: ClassVar[tuple[str, str] | None] = (THINK, THINK_END)
