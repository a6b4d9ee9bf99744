"""DeepSeek's tool calls, between the tokenizer's tool markers (fullwidth bars `｜`, U+FF5C, and `▁`,
U+2581, as DeepSeek spells its special tokens):

- `deepseek_v3` (DeepSeek-V3, V3-0324, R1, R1-0528): each call names its type and function, then the
  arguments in a fenced JSON block,

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
      ```json
      {"city": "Paris"}
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

- `deepseek_v31` (DeepSeek-V3.1): the name, the separator, the arguments object as they are,

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Several calls follow one another inside the one section. The arguments are the object's JSON text as
written (a body whose arguments are not one JSON object is no call: its text stays content). What
counts as a call, and how calls stream: marked_calls.py.
"""

from __future__ import annotations

from ferrox.entrypoints.openai.tool_parsers.base import ToolCall
from ferrox.entrypoints.openai.tool_parsers.marked_calls import (
    MarkedCallsParser,
    json_object_text,
    valid_name,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3ToolParser(MarkedCallsParser):
    name = "deepseek_v3"
    # The markers are added tokens: kept in the reply's text whatever the tokenizer says of them.
    needs_special_tokens = True
    section_begin = CALLS_BEGIN
    section_end = CALLS_END
    call_begin = CALL_BEGIN
    call_end = CALL_END

    def read_call(self, body: str) -> ToolCall | None:
        # TYPE<sep>NAME \n ```json \n {...} \n ```
        kind, sep, rest = body.partition(SEP)
        if not sep or not kind.strip():
            return None
        newline = rest.find("\n")
        if newline < 0:
            return None
        name, block = rest[:newline].strip(), rest[newline + 1 :].strip()
        if not valid_name(name) or not block.startswith(FENCE) or not block.endswith(FENCE) or len(block) < 6:
            return None
        block = block[len(FENCE) : -len(FENCE)]
        if block.startswith("json"):
            block = block[len("json") :]
        arguments = json_object_text(block)
        return None if arguments is None else ToolCall(name=name, arguments=arguments)


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"

    def read_call(self, body: str) -> ToolCall | None:
        # NAME<sep>{...}
        name, sep, rest = body.partition(SEP)
        name = name.strip()
        arguments = json_object_text(rest)
        if not sep or not valid_name(name) or arguments is None:
            return None
        return ToolCall(name=name, arguments=arguments)
