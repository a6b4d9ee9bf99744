"""GLM-4.5 / 4.6's tool calls (`glm45`): each call on its own, the function name, then key / value pairs,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

(GLM-4.7's template drops the newlines: `<tool_call>NAME<arg_key>...`; both read, and the `glm47` parser,
glm47.py, also takes the literal `\\n` GLM-4.7 may write between the parts.) The chat template writes
a string argument as its bare text and any other value as JSON, so a value's type comes from the
request's tools, as in vLLM's parser: a parameter whose schema type is string keeps the text; any other
(or one the tools do not describe) is read as JSON, then as JSON whose quotes were escaped, then as a
Python literal, and stays text when none reads. Values are stripped of the blanks around them. A body
holding anything but the name and complete pairs is no call: its text stays content. What counts as a
call, and how calls stream: marked_calls.py.
"""

from __future__ import annotations

import ast
import json
from typing import Any, ClassVar

from ferrox.entrypoints.openai.tool_parsers.base import ToolCall
from ferrox.entrypoints.openai.tool_parsers.marked_calls import MarkedCallsParser, skip_ws, valid_name

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
KEY_BEGIN, KEY_END = "<arg_key>", "</arg_key>"
VALUE_BEGIN, VALUE_END = "<arg_value>", "</arg_value>"


def _is_string(schema: Any) -> bool:
    declared = schema.get("type") if isinstance(schema, dict) else None
    return declared == "string" or (isinstance(declared, list) and "string" in declared)


def _read_value(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:  # JSON written with its quotes escaped ({\"a\": 1})
        return json.loads(json.loads('"' + text + '"'))
    except (ValueError, RecursionError):
        pass
    try:  # a Python literal ({'a': True})
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def convert_value(text: str, schema: Any) -> Any:
    """An <arg_value>'s text (stripped) -> its value, typed by the parameter's schema (None: unknown)."""
    return text if _is_string(schema) else _read_value(text)


def _arguments_json(arguments: dict[str, Any], raw: dict[str, str]) -> str:
    values = {}
    for key, value in arguments.items():
        try:  # a set, bytes, NaN...: the text as written
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            value = raw[key]
        values[key] = value
    return json.dumps(values, ensure_ascii=False)


class Glm45ToolParser(MarkedCallsParser):
    name = "glm45"
    call_begin = CALL_BEGIN
    call_end = CALL_END
    # What ends the function name (the first one found), besides the first <arg_key>.
    name_ends: ClassVar[tuple[str, ...]] = ("\n",)

    def skip_blanks(self, body: str, i: int) -> int:
        """The position after the blanks from i on (between the name and the pairs, and around them)."""
        return skip_ws(body, i)

    def read_call(self, body: str) -> ToolCall | None:
        ends = (*self.name_ends, KEY_BEGIN)
        cut = min((i for i in (body.find(end) for end in ends) if i >= 0), default=len(body))
        name = body[:cut].strip()
        if not valid_name(name):
            return None
        properties = self.function_parameters(name)
        arguments: dict[str, Any] = {}
        raw: dict[str, str] = {}
        i = self.skip_blanks(body, cut)
        while i < len(body):
            if not body.startswith(KEY_BEGIN, i):
                return None
            key_end = body.find(KEY_END, i)
            if key_end < 0:
                return None
            key = body[i + len(KEY_BEGIN) : key_end].strip()
            i = self.skip_blanks(body, key_end + len(KEY_END))
            if not body.startswith(VALUE_BEGIN, i):
                return None
            value_end = body.find(VALUE_END, i)
            if value_end < 0:
                return None
            text = body[i + len(VALUE_BEGIN) : value_end].strip()
            arguments[key], raw[key] = convert_value(text, properties.get(key)), text
            i = self.skip_blanks(body, value_end + len(VALUE_END))
        return ToolCall(name=name, arguments=_arguments_json(arguments, raw))
