"""Kimi-K2's tool calls (`kimi_k2`): a section of calls, each an id, then the arguments object,

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The id is `functions.NAME:IDX` (IDX counts the conversation's calls); the call keeps it as its id, as vLLM
returns it, since Kimi's chat template writes the id back when the call returns in the conversation. The
name is the id's part before the colon, after its last dot. The arguments are the object's JSON text as
written (anything but one JSON object is no call: its text stays content). What counts as a call, and
how calls stream: marked_calls.py.
"""

from __future__ import annotations

from ferrox.entrypoints.openai.tool_parsers.base import ToolCall
from ferrox.entrypoints.openai.tool_parsers.marked_calls import (
    MarkedCallsParser,
    json_object_text,
    valid_name,
)

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"


def name_of_id(call_id: str) -> str | None:
    """`functions.NAME:IDX` (or `NAME:IDX`) -> NAME; None for anything else."""
    head, colon, index = call_id.rpartition(":")
    if not colon or not index.isdigit() or not index.isascii():
        return None
    name = head.rpartition(".")[2]
    return name if valid_name(head) and valid_name(name) else None


class KimiK2ToolParser(MarkedCallsParser):
    name = "kimi_k2"
    # The markers are special tokens of Kimi's tokenizer: the reply must keep them.
    needs_special_tokens = True
    section_begin = SECTION_BEGIN
    section_end = SECTION_END
    call_begin = CALL_BEGIN
    call_end = CALL_END

    def read_call(self, body: str) -> ToolCall | None:
        call_id, sep, rest = body.partition(ARGUMENT_BEGIN)
        call_id = call_id.strip()
        name = name_of_id(call_id)
        arguments = json_object_text(rest)
        if not sep or name is None or arguments is None:
            return None
        return ToolCall(name=name, arguments=arguments, id=call_id)
