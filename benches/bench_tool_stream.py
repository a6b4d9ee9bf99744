"""Streaming one tool call through a tool parser: the resumable scan against the full rescans it replaced.

A call whose arguments are A characters of JSON (what an agent that writes a file through a tool sends:
a long string with quotes, backslashes and newlines, beside nested objects and arrays) streams through
the parser in D-character deltas, as the server feeds a reply's text. Each setting is timed for the
current parser ("new") and for the parser as it was before ("old", kept below): that one rescanned
the whole call body with scan_object on every delta, so a call cost O(A^2 / D) in Python.
qwen3_coder's old parser likewise reran _scan_call over the whole XML call on every delta; its call
holds the same arguments as many small parameters (one per line of the file).

    python benches/bench_tool_stream.py [--sizes 1000,13000,100000] [--deltas 4,1] [--parsers hermes]

The old parser's full run is quadratic (100 KB in 1-character deltas takes minutes), so where it would
rescan more than --old-budget characters it is fed `stride` deltas at a time and its time is multiplied
by stride (marked ~). Its cost is one rescan of the body so far per feed, so this estimates the full
run; the new parser always takes every delta. Both runs are checked against extract().

The last line is `tool_stream_100k_1char_ms: <new ms>` (the largest size in the smallest deltas).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from typing import Any

from ferrox.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from ferrox.entrypoints.openai.tool_parsers.base import (
    ARGUMENT_KEYS,
    DeltaMessage,
    DeltaToolCall,
    _arguments_text,
    _json_string,
    held_back,
    new_tool_call_id,
)
from ferrox.entrypoints.openai.tool_parsers.hermes import END, START, HermesToolParser
from ferrox.entrypoints.openai.tool_parsers.json_scan import Member, ObjectScan
from ferrox.entrypoints.openai.tool_parsers.llama3_json import (
    _SEPARATORS,
    Llama3JsonToolParser,
    _calls_start,
)
from ferrox.entrypoints.openai.tool_parsers.llama3_json import PYTHON_TAG as LLAMA_TAG
from ferrox.entrypoints.openai.tool_parsers.qwen3_coder import (
    _AFTER_PARAMETER,
    _NOT_IN_NAME,
    FUNCTION,
    FUNCTION_END,
    PARAMETER,
    PARAMETER_END,
    TOOL_CALL,
    TOOL_CALL_END,
    Qwen3CoderToolParser,
    _Arguments,
    _Call,
)


# ---- the old implementation: scan_object from the start of the body on every delta ----------
def _old_skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _old_string_end(text: str, i: int) -> int | None:
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _old_value_end(text: str, i: int) -> int | None:
    c = text[i]
    if c == '"':
        return _old_string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _old_string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < len(text) and text[i] not in ",}] \t\r\n":
        i += 1
    return i if i < len(text) else None


def old_scan_object(text: str, start: int = 0) -> ObjectScan:
    """json_scan.scan_object as it was: one pass over the whole text, a character at a time."""
    scan = ObjectScan()
    i = _old_skip_ws(text, start)
    if i == len(text):
        return scan
    if text[i] != "{":
        scan.error = f"expected '{{' at offset {i}"
        return scan
    i += 1
    while True:
        i = _old_skip_ws(text, i)
        if i == len(text):
            return scan
        if text[i] == "}" and not scan.members:
            scan.end = i + 1
            return scan
        if text[i] != '"':
            scan.error = f"expected a key at offset {i}"
            return scan
        key_end = _old_string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except json.JSONDecodeError:
            scan.error = f"bad key at offset {i}"
            return scan
        i = _old_skip_ws(text, key_end)
        if i == len(text):
            return scan
        if text[i] != ":":
            scan.error = f"expected ':' at offset {i}"
            return scan
        i = _old_skip_ws(text, i + 1)
        if i == len(text):
            return scan
        member = Member(key, i)
        scan.members.append(member)
        end = _old_value_end(text, i)
        if end is None:
            return scan
        member.value_end = end
        i = _old_skip_ws(text, end)
        if i == len(text):
            return scan
        if text[i] == ",":
            i += 1
            continue
        if text[i] == "}":
            scan.end = i + 1
            return scan
        scan.error = f"expected ',' or '}}' at offset {i}"
        return scan


class OldCallStreamer:
    """base.CallStreamer as it was: update() gets the whole body so far and scans all of it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_tool_call_id()
        self.name: str | None = None
        self.arguments_sent = ""

    def update(self, body: str) -> list[DeltaToolCall]:
        scan = old_scan_object(body)
        if scan.error:
            return []
        deltas: list[DeltaToolCall] = []
        if self.name is None:
            member = scan.member("name")
            if member is None or member.value_end is None:
                return []
            name = _json_string(body[member.value_start : member.value_end])
            if name is None:
                return []
            self.name = name
            deltas.append(DeltaToolCall(self.index, id=self.id, name=name, arguments=""))
        arguments = _arguments_text(body, scan.member(*ARGUMENT_KEYS), complete=scan.end is not None)
        if arguments is not None and len(arguments) > len(self.arguments_sent):
            fragment = arguments[len(self.arguments_sent) :]
            self.arguments_sent = arguments
            if deltas:
                deltas[0].arguments = fragment
            else:
                deltas.append(DeltaToolCall(self.index, arguments=fragment))
        return deltas


class OldHermesToolParser(HermesToolParser):
    """hermes streaming as it was (extract() is unchanged)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._pos = 0
        self._old_call: OldCallStreamer | None = None
        self._body_start = 0

    def feed(self, delta: str) -> DeltaMessage:
        self._text += delta
        out = DeltaMessage()
        text = self._text
        while True:
            if self._old_call is None:
                start = text.find(START, self._pos)
                if start < 0:
                    keep = held_back(text[self._pos :], START)
                    self._emit_content(out, text[self._pos : len(text) - keep])
                    self._pos = len(text) - keep
                    return out
                self._emit_content(out, text[self._pos : start])
                self._pending_ws = ""
                self._old_call = OldCallStreamer(self._num_calls)
                self._body_start = self._pos = start + len(START)
                continue
            end = text.find(END, self._body_start)
            body_end = end if end >= 0 else len(text) - held_back(text[self._body_start :], END)
            out.tool_calls += self._old_call.update(text[self._body_start : body_end])
            if end < 0:
                return out
            self._close_old(out, text[self._body_start : end], closed=True)
            self._pos = end + len(END)

    def _close_old(self, out: DeltaMessage, body: str, closed: bool) -> None:
        assert self._old_call is not None
        if self._old_call.name is None:
            self._emit_content(out, START + body + (END if closed else ""))
        else:
            self.tools_called = True
            self._num_calls += 1
        self._old_call = None

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._old_call is not None:
            body = self._text[self._body_start :]
            out.tool_calls += self._old_call.update(body)
            self._close_old(out, body, closed=False)
        else:
            self._emit_content(out, self._text[self._pos :])
        self._pos = len(self._text)
        return out


class OldLlama3JsonToolParser(Llama3JsonToolParser):
    """llama3_json streaming as it was (extract() is unchanged)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._pos = 0
        self._old_calls: list[OldCallStreamer] = []

    def feed(self, delta: str) -> DeltaMessage:
        self._text += delta
        out = DeltaMessage()
        if self._mode is None:
            head = self._text.lstrip()
            if head.startswith(LLAMA_TAG):
                head = head[len(LLAMA_TAG) :].lstrip()
            elif LLAMA_TAG.startswith(head):
                return out
            if not head:
                return out
            start = _calls_start(self._text)
            if start is None:
                self._mode = "content"
                out.content = self._text
                return out
            self._mode, self._pos = "calls", start
            self._old_calls.append(OldCallStreamer(0))
        elif self._mode == "content":
            out.content = delta
            return out
        while True:
            call = self._old_calls[-1]
            scan = old_scan_object(self._text, self._pos)
            if scan.error:
                return out
            if scan.member(*ARGUMENT_KEYS) is not None or scan.end is not None:
                out.tool_calls += call.update(self._text[self._pos : scan.end or len(self._text)])
                self.tools_called = self.tools_called or call.name is not None
            if scan.end is None:
                return out
            i = scan.end
            while i < len(self._text) and self._text[i] in _SEPARATORS:
                i += 1
            if i == len(self._text):
                return out
            self._pos = i
            self._old_calls.append(OldCallStreamer(len(self._old_calls)))

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._mode is None and self._text:
            out.content = self._text
        elif self._mode == "calls" and not self.tools_called:
            out.content = self._text
        return out


# ---- qwen3_coder as it was: _scan_call from the call's start on every delta -----------------
def _old_parameter_end(text: str, start: int, final: bool) -> int | None:
    k = start
    while True:
        close = text.find(PARAMETER_END, k)
        if close < 0:
            return None
        after = _old_skip_ws(text, close + len(PARAMETER_END))
        if text.startswith(_AFTER_PARAMETER, after):
            return close
        if after == len(text):
            return close if final else None
        if not final and any(tag.startswith(text[after:]) for tag in _AFTER_PARAMETER):
            return None
        k = close + 1


def old_scan_call(text: str, start: int, final: bool) -> _Call:
    i = _old_skip_ws(text, start)
    if not text.startswith(FUNCTION, i):
        return _Call("open" if not final and FUNCTION.startswith(text[i:]) else "invalid")
    name_start = i + len(FUNCTION)
    gt = text.find(">", name_start)
    name = text[name_start : gt if gt >= 0 else len(text)]
    if any(c in _NOT_IN_NAME for c in name) or (gt >= 0 and not name):
        return _Call("invalid")
    if gt < 0:
        return _Call("invalid" if final else "open")
    call = _Call("open", name=name)

    def close(end: int) -> _Call:
        call.state, call.end, call.function_closed = "closed", end, True
        return call

    pos = gt + 1
    while True:
        p = _old_skip_ws(text, pos)
        if text.startswith(FUNCTION_END, p):
            call.function_closed = True
            q = _old_skip_ws(text, p + len(FUNCTION_END))
            if text.startswith(TOOL_CALL_END, q):
                return close(q + len(TOOL_CALL_END))
            if not final and TOOL_CALL_END.startswith(text[q:]):
                return call
            return close(p + len(FUNCTION_END))
        if text.startswith(TOOL_CALL_END, p):
            return close(p + len(TOOL_CALL_END))
        if text.startswith(PARAMETER, p):
            key_start = p + len(PARAMETER)
            key_end = text.find(">", key_start)
            if key_end < 0:
                return close(len(text)) if final else call
            value_start = key_end + 1
            value_end = _old_parameter_end(text, value_start, final)
            if value_end is not None:
                call.params.append((text[key_start:key_end], text[value_start:value_end]))
                pos = value_end + len(PARAMETER_END)
                continue
            if not final:
                return call
            function_end = text.find(FUNCTION_END, value_start)
            if function_end >= 0:
                call.params.append((text[key_start:key_end], text[value_start:function_end]))
                pos = function_end
                continue
            value = text[value_start : len(text) - held_back(text[value_start:], PARAMETER_END)]
            call.params.append((text[key_start:key_end], value))
            return close(len(text))
        found = [j for j in (text.find(tag, p) for tag in _AFTER_PARAMETER) if j >= 0]
        if not found:
            return close(len(text)) if final else call
        pos = min(found)


class OldQwen3CoderToolParser(Qwen3CoderToolParser):
    """qwen3_coder streaming as it was (extract() is unchanged)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._pos = 0
        self._call_start: int | None = None
        self._old_arguments: _Arguments | None = None
        self._params_sent = 0

    def feed(self, delta: str) -> DeltaMessage:
        self._text += delta
        return self._old_advance(final=False)

    def finish(self) -> DeltaMessage:
        return self._old_advance(final=True)

    def _old_advance(self, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        text = self._text
        while True:
            if self._call_start is None:
                tag = text.find(TOOL_CALL, self._pos)
                if tag < 0:
                    end = len(text) if final else len(text) - held_back(text[self._pos :], TOOL_CALL)
                    self._gate.into(out, text[self._pos : end])
                    self._pos = end
                    return out
                self._gate.into(out, text[self._pos : tag])
                self._call_start = self._pos = tag + len(TOOL_CALL)
                continue
            call = old_scan_call(text, self._call_start, final)
            if call.state == "invalid":
                self._gate.into(out, TOOL_CALL)
                self._call_start = None
                continue
            self._old_stream(out, call)
            if call.state == "open":
                return out
            self._pos = call.end
            self._call_start = None
            self._num_calls += 1
            self._old_arguments = None
            self._params_sent = 0
            self._closed_sent = False

    def _old_stream(self, out: DeltaMessage, call: _Call) -> None:
        if call.name is None:
            return
        fragment = ""
        first = self._old_arguments is None
        if self._old_arguments is None:
            self._gate.call()
            self.tools_called = True
            self._old_arguments = _Arguments(self.function_parameters(call.name))
            fragment = "{"
        for key, raw in call.params[self._params_sent :]:
            fragment += self._old_arguments.add(key, raw)
        self._params_sent = len(call.params)
        if call.function_closed and not self._closed_sent:
            fragment += "}"
            self._closed_sent = True
        if first:
            out.tool_calls.append(DeltaToolCall(self._num_calls, id=new_tool_call_id(), name=call.name, arguments=fragment))
        elif fragment:
            out.tool_calls.append(DeltaToolCall(self._num_calls, arguments=fragment))


OLD_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": OldHermesToolParser,
    "llama3_json": OldLlama3JsonToolParser,
    "qwen3_coder": OldQwen3CoderToolParser,
}


# ---- the bench ------------------------------------------------------------------------------
def arguments_json(size: int, seed: int = 0) -> str:
    """About `size` characters of arguments: a file's path and content, and a list of edits."""
    rng = random.Random(seed)
    words = ["def", "return", "x", "self", "{", "}", "[0]", '"q"', "\\n", "'s'", "->", "#", "é", "\t"]
    lines: list[str] = []
    edits: list[dict[str, Any]] = []
    while True:
        arguments = {"path": "src/module.py", "edits": edits, "content": "\n".join(lines)}
        text = json.dumps(arguments, ensure_ascii=False)
        if len(text) >= size:
            return text
        lines.append("    " * rng.randint(0, 3) + " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))))
        if rng.random() < 0.1:
            edits.append({"line": len(lines), "replace": {"old": lines[-1][:20], "ranges": [[1, 2], [3, 4]]}})


def call_text(parser: str, arguments: str) -> str:
    if parser == "qwen3_coder":
        return qwen3_call_text(arguments)
    if parser == "hermes":
        return f'Writing it.\n<tool_call>\n{{"name": "write_file", "arguments": {arguments}}}\n</tool_call>'
    return f'<|python_tag|>{{"name": "write_file", "parameters": {arguments}}}'


def qwen3_call_text(arguments: str) -> str:
    """The same arguments as a Qwen3-Coder call with many small parameters: the path, each line of
    the content as a parameter of its own (some hold tag-like text), and the edits as JSON."""
    obj = json.loads(arguments)
    params = [("path", obj["path"])]
    params += [(f"line_{i}", line) for i, line in enumerate(obj["content"].split("\n"))]
    params.append(("edits", json.dumps(obj["edits"], ensure_ascii=False)))
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"Writing it.\n<tool_call>\n<function=write_file>\n{body}</function>\n</tool_call>"


def run(parser: ToolParser, text: str, step: int) -> tuple[float, str]:
    """Seconds to stream text in `step`-character deltas; the arguments the deltas reassemble to."""
    arguments = []
    t = time.perf_counter()
    for i in range(0, len(text), step):
        for call in parser.feed(text[i : i + step]).tool_calls:
            arguments.append(call.arguments or "")
    for call in parser.finish().tool_calls:
        arguments.append(call.arguments or "")
    return time.perf_counter() - t, "".join(arguments)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,13000,100000", help="arguments sizes in characters")
    p.add_argument("--deltas", default="4,1", help="delta sizes in characters")
    p.add_argument("--parsers", default="hermes", help="hermes, llama3_json and/or qwen3_coder")
    p.add_argument("--repeat", type=int, default=3, help="runs per setting; the fastest counts")
    p.add_argument("--old-budget", type=float, default=1e8, help="characters an old run may rescan in full")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    steps = [int(s) for s in args.deltas.split(",")]
    print(f"machine: {platform.machine()}, python {platform.python_version()}")
    print(f"{'parser':<12} {'args KB':>8} {'delta':>6} {'deltas':>7} {'old ms':>11} {'new ms':>9} {'old/new':>9}")
    headline = 0.0
    for name in args.parsers.split(","):
        for size in sizes:
            text = call_text(name, arguments_json(size))
            expected = get_tool_parser(name)().extract(text).tool_calls[0].arguments
            for step in steps:
                deltas = -(-len(text) // step)
                new = []
                for _ in range(args.repeat):
                    seconds, got = run(get_tool_parser(name)(), text, step)
                    assert got == expected, "the new parser's deltas do not reassemble to extract()"
                    new.append(seconds)
                rescanned = len(text) * deltas / 2  # characters the old parser scans: the body so far, per delta
                stride = max(1, int(-(-rescanned // args.old_budget)))
                old = []
                for _ in range(args.repeat if rescanned < args.old_budget / 10 else 1):
                    seconds, got = run(OLD_PARSERS[name](), text, step * stride)
                    assert got == expected, "the old parser's deltas do not reassemble to extract()"
                    old.append(seconds * stride)
                mark = "~" if stride > 1 else " "
                ratio = min(old) / min(new)
                print(
                    f"{name:<12} {size / 1000:>8.1f} {step:>6} {deltas:>7} {mark}{min(old) * 1e3:>10.1f} "
                    f"{min(new) * 1e3:>9.2f} {ratio:>8.0f}x"
                )
                if size == max(sizes) and step == min(steps) and not headline:
                    headline = min(new) * 1e3
    print(f"tool_stream_{max(sizes) // 1000}k_{min(steps)}char_ms: {headline:.2f}")


if __name__ == "__main__":
    main()
