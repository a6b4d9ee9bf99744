"""GLM-4.7's tool calls (`glm47`, vLLM's name for GLM-4.7 / GLM-5): glm45's format without its newlines,

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>

and a call without arguments is the name alone (`<tool_call>get_time</tool_call>`). glm45's reader takes both
already; what vLLM's glm47 parser adds is that GLM-4.7 sometimes writes the two characters `\\n` (a backslash
and an n, not a newline) where GLM-4.5's template had a newline: vLLM skips them between an `</arg_key>` and
its `<arg_value>`; ferrox skips them wherever blanks may stand (after the name, around each pair), and a
name ends at the first of them. Values are typed by the request's tools as glm45's (glm45.py).
"""

from __future__ import annotations

from typing import ClassVar

from ferrox.entrypoints.openai.tool_parsers.glm45 import Glm45ToolParser
from ferrox.entrypoints.openai.tool_parsers.marked_calls import skip_ws

# The escaped newline GLM-4.7 may write as text: a backslash, then "n".
LITERAL_NEWLINE = "\\n"


class Glm47ToolParser(Glm45ToolParser):
    name = "glm47"
    name_ends: ClassVar[tuple[str, ...]] = ("\n", LITERAL_NEWLINE)

    def skip_blanks(self, body: str, i: int) -> int:
        while True:
            i = skip_ws(body, i)
            if not body.startswith(LITERAL_NEWLINE, i):
                return i
            i += len(LITERAL_NEWLINE)
