"""OpenAI tools + tool_choice -> the constraint (if any) that a chat request decodes under.

Pure functions over plain dicts (the server's pydantic models dump to these), tested alone.

The tool-call wire format ferrox constrains to is the Hermes/Qwen one,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

because it is what tool-trained chat templates teach (Qwen2.5, Hermes, SmolLM3...), and the
"hermes" tool parser reads it back for `required` the same way it does for `auto`. A named
tool_choice is constrained to the function's parameters schema alone: the output *is* the
arguments object and the server wraps it in a tool call with the given name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from ferrox.loader.chat_template import content_text
from ferrox.structured.backend import close_objects, lark_string_literal
from ferrox.structured.params import StructuredOutputsParams

ToolChoiceMode = Literal["none", "auto", "required", "named"]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# Same compact-but-natural JSON as plain json schemas (see backend.JSON_COMPILE_OPTIONS),
# given through the schema itself because %json blocks inside Lark read their options there.
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object


@dataclass(frozen=True, slots=True)
class ToolConstraint:
    mode: ToolChoiceMode
    # The constraint to decode under; None for "none" / "auto" (free text, parsed afterwards).
    structured_outputs: StructuredOutputsParams | None
    function_name: str | None = None  # for "named": the output is this function's arguments


def parse_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    """Validate OpenAI `tools` ([{"type": "function", "function": {...}}]); errors name the field."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list of tool objects")
    result: list[FunctionTool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        field = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{field}: must be an object")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{field}.type: only 'function' tools are supported, got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{field}.function: must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{field}.function.name: must be a non-empty string")
        if name in seen:
            raise ValueError(f"{field}.function.name: duplicate tool name {name!r}")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = _NO_ARGUMENTS
        if not isinstance(parameters, dict):
            raise ValueError(f"{field}.function.parameters: must be a JSON schema object")
        if not parameters:  # {}: any arguments, but arguments are always an object
            parameters = {"type": "object"}
        result.append(FunctionTool(name, str(function.get("description") or ""), parameters))
    return result


def _choice_mode(
    tool_choice: str | dict[str, Any] | None, has_tools: bool
) -> tuple[ToolChoiceMode, str | None]:
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(
                f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}"
            )
        return tool_choice, None  # type: ignore[return-value]
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}')
        return "named", name
    raise ValueError(f"tool_choice: unsupported value {tool_choice!r}")


def call_schema(tool: FunctionTool) -> dict[str, Any]:
    """Schema of one Hermes call body: {"name": <const>, "arguments": <parameters>}. The parameters'
    objects are closed as a named tool's and a response_format's are (backend.close_objects: an
    object that lists properties takes no others unless it says so)."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": close_objects(tool.parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def required_tool_grammar(tools: list[FunctionTool], parallel_tool_calls: bool = True) -> str:
    """Lark grammar: one (or, with parallel_tool_calls, one or more) Hermes tool calls."""
    if not tools:
        raise ValueError("tool_choice: 'required' needs at least one tool in tools")
    body = {"anyOf": [call_schema(t) for t in tools], "x-guidance": _X_GUIDANCE}
    call = (
        f"{lark_string_literal(TOOL_CALL_START + chr(10))} %json {json.dumps(body)} "
        + lark_string_literal(chr(10) + TOOL_CALL_END)
    )
    start = 'call ("\\n" call)*' if parallel_tool_calls else "call"
    return f"start: {start}\ncall: {call}\n"


def tool_choice_constraint(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    *,
    parallel_tool_calls: bool = True,
) -> ToolConstraint:
    """The constraint for a chat request's tools + tool_choice. Raises ValueError naming the
    field (tools[i]..., tool_choice) on bad input, e.g. a named function not in tools."""
    functions = parse_tools(tools)
    mode, name = _choice_mode(tool_choice, bool(functions))
    if mode == "none":
        return ToolConstraint("none", None)
    if not functions:
        raise ValueError(f"tool_choice: {tool_choice!r} needs a non-empty tools list")
    if mode == "auto":
        return ToolConstraint("auto", None)
    if mode == "required":
        grammar = required_tool_grammar(functions, parallel_tool_calls)
        return ToolConstraint("required", StructuredOutputsParams(grammar=grammar))
    by_name = {f.name: f for f in functions}
    if name not in by_name:
        raise ValueError(f"tool_choice: function {name!r} is not in tools (have: {', '.join(by_name)})")
    return ToolConstraint("named", StructuredOutputsParams(json=by_name[name].parameters), function_name=name)


# ---- prompting models whose chat template knows nothing of tools ---------------------------------
def template_supports_tools(chat_template: str | None) -> bool:
    """A template that reads a `tools` variable renders them itself; others need our system text."""
    return chat_template is not None and "tools" in chat_template


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes-style instructions listing the tools, for templates without tool support."""
    specs = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in parse_tools(tools)
    ]
    listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
    return (
        "You may call one or more functions to assist with the user query.\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n"
        "For each function call, return a json object with function name and arguments within "
        f"{TOOL_CALL_START}{TOOL_CALL_END} XML tags:\n"
        f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_END}'
    )


def prepare_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render with `template`: unchanged when the template handles tools (or
    none are in play); otherwise the tools move into the system message (tools -> None) and tool
    calls / results become text. Shared by the server and the offline `LLM.chat`."""
    uses_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if not uses_tools or template_supports_tools(template):
        return messages, tools
    return messages_for_plain_template(messages, tools), None


def messages_for_plain_template(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Rewrite OpenAI chat messages so a template without tool support can render them:
    the tool listing joins (or becomes) the system message, assistant tool_calls become Hermes
    text, and `role: tool` results become <tool_response> text. Contents end up plain strings."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        content = content_text(content, "content")
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = call.get("function", {})
                arguments = function.get("arguments", "{}")
                try:
                    arguments_obj = json.loads(arguments) if isinstance(arguments, str) else arguments
                except json.JSONDecodeError:
                    arguments_obj = arguments
                body = json.dumps(
                    {"name": function.get("name"), "arguments": arguments_obj}, ensure_ascii=False
                )
                calls.append(f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}")
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
