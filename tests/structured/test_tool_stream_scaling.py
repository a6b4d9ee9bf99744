"""Streaming a tool call reads each character once (hermes, llama3_json, qwen3_coder), with the output it always had.

The parsers used to rescan the whole call body on every delta, which made a long call quadratic to
stream. The reference for "the output it always had" is that implementation, kept in
benches/bench_tool_stream.py to time against: the parsers must send the same deltas, feed by feed,
for any text, broken ones included.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from ferrox.entrypoints.openai.tool_parsers import get_tool_parser, json_scan, qwen3_coder
from ferrox.entrypoints.openai.tool_parsers.json_scan import ObjectScanner, scan_object

from .test_tool_parsers import stream

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
import bench_tool_stream  # noqa: E402

PARSERS = ["hermes", "llama3_json"]
BREAKS = ["<tool_call>", "</tool_call>", "</tool", "<tool_c", "{", "}", "[", "]", '"', "\\", ":", ",", " ",
          "\n", "\\q", "\\u12", "nul", "x", ";", "<|python_tag|>"]


def json_value(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([1, -2.5, True, False, None, 1e5, "", "}", '"{', "a\\b", rand_string(rng)])
    if r < 0.65:
        return {rand_string(rng, 4): json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def rand_string(rng: random.Random, n: int = 8) -> str:
    return "".join(rng.choice('ab xyz"\\{}[],:;\n\té<>/') for _ in range(rng.randint(0, n)))


def call_body(rng: random.Random, key: str) -> str:
    """A call object: the name, the arguments (an object; now and then a JSON string of one), extras."""
    arguments = json_value(rng)
    if not isinstance(arguments, dict):
        arguments = {"v": arguments}
    indent = rng.choice([None, None, 1])
    arguments_text = json.dumps(arguments, ensure_ascii=rng.random() < 0.5, indent=indent)
    if rng.random() < 0.1:
        arguments_text = json.dumps(arguments_text)
    name = json.dumps(rng.choice(["get_weather", "f", 'a"b', "é", "x y"]))
    members = [f'"name": {name}', f'"{key}": {arguments_text}']
    if rng.random() < 0.2:
        members.reverse()
    if rng.random() < 0.1:
        members.append(f'"extra": {json.dumps(json_value(rng))}')
    return "{" + rng.choice([", ", ",", ",\n  "]).join(members) + "}"


def hermes_text(rng: random.Random) -> str:
    pieces = [rng.choice(["", "Let me check.\n", "ok ", "a <toolbox> b\n", "<tool"])]
    for _ in range(rng.randint(1, 3)):
        pieces.append("<tool_call>" + rng.choice(["\n", "", " "]) + call_body(rng, "arguments"))
        pieces.append(rng.choice(["\n", "", " "]) + "</tool_call>" + rng.choice(["\n", "", " text after ", "\n\n"]))
    return "".join(pieces)


def llama3_text(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return rng.choice(["The answer is 4.", "Just text {not a call}", "<|python_tag|> [1]"])
    calls = [call_body(rng, rng.choice(["parameters", "parameters", "arguments"])) for _ in range(rng.randint(1, 3))]
    lead = rng.choice(["", "<|python_tag|>", " ", "\n<|python_tag|> "])
    return lead + rng.choice(["; ", ";", "\n", " ; "]).join(calls) + rng.choice(["", " ", ";"])


QWEN3_TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "s": {"type": "string"}, "l": {"type": ["array", "null"]}}}}},
]
QWEN3_VALUES = ["1", "2.5", "true", "null", "{\"a\": 1}", "[1, 2]", "{'a': None}", "text", "", " x ",
                "</parameter>", "a</parameter>b", "</parameter>\n</parameter>", "<parameter=k>", "</function>",
                "</tool_call>", "<tool_call>", "</para", "</function", "\n\n", "é<>"]
QWEN3_BREAKS = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
                "</parameter>\n", "</param", "</func", "<tool_c", ">", "\n", " ", "x", "\n</parameter>\n<"]


def qwen3_text(rng: random.Random) -> str:
    pieces = [rng.choice(["", "Let me write it.\n", "ok ", "a <toolbox> b\n", "<tool", " \n"])]
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(["f", "f", "write_file", "g h", ""])
        params = []
        for _ in range(rng.randint(0, 8)):
            key = rng.choice(["n", "x", "b", "o", "s", "l", "other", " s ", "n"])
            value = rng.choice(QWEN3_VALUES) if rng.random() < 0.7 else rand_string(rng, 12)
            nl = rng.choice(["\n", "\n", "", " "])
            params.append(f"<parameter={key}>{nl}{value}{nl}</parameter>" + rng.choice(["\n", "", "  \n", " junk "]))
        end = rng.choice(["</function>\n</tool_call>", "</function>\n</tool_call>", "</function>", "</tool_call>",
                          "</function> x</tool_call>", ""])
        pieces.append("<tool_call>" + rng.choice(["\n", "", " "]) + f"<function={name}>" + rng.choice(["\n", ""])
                      + "".join(params) + end + rng.choice(["\n", "", " text after ", "\n\n"]))
    return "".join(pieces)


TEXTS = {"hermes": hermes_text, "llama3_json": llama3_text}


def broken(rng: random.Random, text: str, breaks: list[str] = BREAKS) -> str:
    """Cut short, and/or with markers, brackets, quotes and bad escapes (`breaks`) put in at random places."""
    if rng.random() < 0.3:
        text = text[: rng.randint(0, len(text))]
    for _ in range(rng.randint(0 if len(text) else 1, 3)):
        at = rng.randint(0, len(text))
        text = text[:at] + rng.choice(breaks) + text[at + rng.randint(0, 2) :]
    return text


def chunk_sizes(rng: random.Random, text: str) -> list[int]:
    if rng.random() < 0.2:
        return [1] * len(text)
    return [rng.randint(1, 9) for _ in range(len(text))]


def feeds(parser, text: str, sizes: list[int]) -> tuple[list[tuple], bool]:
    """What each feed (and finish) sends, ids reduced to whether there is one (they are random)."""
    sent, pos = [], 0
    for size in sizes:
        if pos >= len(text):
            break
        sent.append(parser.feed(text[pos : pos + size]))
        pos += size
    sent.append(parser.finish())
    return [
        (d.content, [(t.index, t.id is not None, t.name, t.arguments) for t in d.tool_calls]) for d in sent
    ], parser.tools_called


def members(scan) -> tuple:
    return [(m.key, m.value_start, m.value_end) for m in scan.members], scan.end, scan.error


@pytest.mark.parametrize("seed", range(4))
def test_scanner_fed_in_pieces_is_scan_object_of_the_text_so_far(seed):
    rng = random.Random(seed)
    for _ in range(60):
        text = call_body(rng, "arguments")
        valid = rng.random() < 0.5
        if not valid:
            text = broken(rng, text)
        start = rng.randint(0, 3)
        text = " " * start + text
        scanner, pos = ObjectScanner(start), start
        for size in chunk_sizes(rng, text):
            if pos >= len(text):
                break
            if rng.random() < 0.5:  # a piece, or the text so far and where the new part begins
                scanner.feed(text[pos : pos + size])
            else:
                scanner.feed(text[: pos + size], pos)
            pos = min(pos + size, len(text))
            assert members(scanner.scan) == members(bench_tool_stream.old_scan_object(text[:pos], start))
            assert members(scan_object(text[:pos], start)) == members(scanner.scan)
            a, b = sorted(rng.randint(start, pos) for _ in range(2))
            assert scanner.text(a, b) == text[a:b]
        if valid:  # the spans are the values json reads
            obj = json.loads(text)
            scan = scanner.scan
            assert scan.end == len(text) and [m.key for m in scan.members] == list(obj)
            for m in scan.members:
                assert json.loads(text[m.value_start : m.value_end]) == obj[m.key]


@pytest.mark.parametrize("name", PARSERS)
def test_stream_in_any_chunks_equals_one_feed_and_extract(name):
    rng = random.Random(name)
    for _ in range(80):
        text = TEXTS[name](rng)
        whole = get_tool_parser(name)().extract(text)
        expected = [(c.name, c.arguments) for c in whole.tool_calls]
        for sizes in ([len(text)], chunk_sizes(rng, text)):
            content, calls = stream(name, text, sizes)
            assert [(c["name"], c["arguments"]) for c in calls] == expected
            # Up to whitespace: hermes drops a whitespace-only stretch after a call while streaming, and
            # whether one is whitespace-only depends on where the deltas cut (as it always did).
            assert content.split() == (whole.content or "").split()


@pytest.mark.parametrize("name", PARSERS)
def test_stream_sends_what_the_rescanning_parser_sent(name):
    """Feed by feed, valid and broken texts: the same content and deltas as the old implementation."""
    rng = random.Random(name)
    old = bench_tool_stream.OLD_PARSERS[name]
    for k in range(400):
        text = TEXTS[name](rng) if k else '{"name": "Bob", "age": 3}'  # (llama3_json streams that as a call)
        if k and rng.random() < 0.6:
            text = broken(rng, text)
        for sizes in (chunk_sizes(rng, text), [len(text) + 1]):
            assert feeds(get_tool_parser(name)(), text, sizes) == feeds(old(), text, sizes), (text, sizes)


@pytest.mark.parametrize("name", PARSERS)
def test_streaming_a_long_call_reads_each_character_once(name):
    """A ~50 KB call in 1-character deltas: the scanners read about the text's length in all, where a
    rescan of the body per delta (the old parsers) reads about its square over two."""
    text = bench_tool_stream.call_text(name, bench_tool_stream.arguments_json(50_000))
    body_start = text.index("{")
    parser = get_tool_parser(name)()
    before = json_scan.chars_examined()
    rescans, arguments = 0, ""
    for i, c in enumerate(text):
        for call in parser.feed(c).tool_calls:
            arguments += call.arguments or ""
        rescans += max(0, i + 1 - body_start)
    for call in parser.finish().tool_calls:
        arguments += call.arguments or ""
    examined = json_scan.chars_examined() - before
    assert arguments == get_tool_parser(name)().extract(text).tool_calls[0].arguments
    assert 0 < examined <= 2 * len(text), (examined, len(text))
    assert rescans > 1000 * len(text)  # so the bound above fails for anything that rescans


# Random values reach ast.literal_eval (Python-literal arguments), which warns on odd escapes.
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::SyntaxWarning")
def test_qwen3_coder_stream_sends_what_the_rescanning_parser_sent():
    """Feed by feed, valid and broken Qwen3-Coder texts: the same content and deltas as the old
    implementation (kept in benches/bench_tool_stream.py), and the same calls as extract()."""
    rng = random.Random("qwen3_coder")
    old = bench_tool_stream.OLD_PARSERS["qwen3_coder"]
    for k in range(1500):
        text = qwen3_text(rng)
        if rng.random() < 0.6:
            text = broken(rng, text, QWEN3_BREAKS)
        tools = QWEN3_TOOLS if k % 2 else None
        for sizes in (chunk_sizes(rng, text), [1] * len(text), [len(text) + 1]):
            new_sent = feeds(get_tool_parser("qwen3_coder")(tools), text, sizes)
            assert new_sent == feeds(old(tools), text, sizes), (text, sizes)
        whole = get_tool_parser("qwen3_coder")(tools).extract(text)
        content, calls = stream("qwen3_coder", text, chunk_sizes(rng, text)) if tools is None else (None, None)
        if calls is not None:
            assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def _qwen3_examined(text: str, parser) -> tuple[int, str]:
    before = qwen3_coder.chars_examined()
    arguments = ""
    for c in text:
        for call in parser.feed(c).tool_calls:
            arguments += call.arguments or ""
    for call in parser.finish().tool_calls:
        arguments += call.arguments or ""
    return qwen3_coder.chars_examined() - before, arguments


@pytest.mark.parametrize("shape", ["many_parameters", "one_long_value"])
def test_qwen3_coder_streaming_a_long_call_looks_at_each_character_a_few_times(shape):
    """A ~50 KB call (~1000 parameters, or one long value) in 1-character deltas: the scan looks at a
    few times the text's length in all, where rescanning the call per delta (the old parser) looks at
    about its square over two."""
    if shape == "many_parameters":
        text = bench_tool_stream.call_text("qwen3_coder", bench_tool_stream.arguments_json(50_000))
        assert text.count("<parameter=") > 900
    else:
        content = bench_tool_stream.json.loads(bench_tool_stream.arguments_json(50_000))["content"]
        text = f"<tool_call>\n<function=write_file>\n<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call>"
    examined, arguments = _qwen3_examined(text, get_tool_parser("qwen3_coder")())
    assert arguments == get_tool_parser("qwen3_coder")().extract(text).tool_calls[0].arguments
    assert 0 < examined <= 4 * len(text), (examined, len(text))
    call_start = text.index("<tool_call>")
    rescans = sum(max(0, i + 1 - call_start) for i in range(len(text)))
    assert rescans > 1000 * len(text)  # what rescanning the call per delta looks at: the bound above fails for it
