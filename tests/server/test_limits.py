"""The sizes a request controls are bounded (protocol.py's MAX_*), each with a 400 naming the field,
and request-supplied chat templates render in jinja2's sandbox. Runs on the session's server."""

from __future__ import annotations

from typing import Any

import pytest
from ferrox.entrypoints.openai import protocol

from tests.server.test_errors import assert_openai_error, post

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _tool(i: int, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": parameters or {"type": "object"}}}


BIG_SCHEMA = {"type": "object", "description": "x" * (protocol.MAX_SCHEMA_BYTES + 1)}

CASES = [
    (COMPLETIONS, {"stop": [f"s{i}" for i in range(protocol.MAX_STOP_SEQUENCES + 1)]}, "stop"),
    (COMPLETIONS, {"stop": "x" * (protocol.MAX_STOP_CHARS + 1)}, "stop"),
    (CHAT, {"logit_bias": {str(i): 1.0 for i in range(protocol.MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    (CHAT, {"tools": [_tool(i) for i in range(protocol.MAX_TOOLS + 1)]}, "tools"),
    (CHAT, {"tools": [_tool(0, BIG_SCHEMA)]}, "tools"),
    (CHAT, {"tools": [_tool(0, _nested(protocol.MAX_SCHEMA_DEPTH // 2 + 1))]}, "tools"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_SCHEMA}}},
     "response_format"),
    (COMPLETIONS, {"structured_outputs": {"json": _nested(protocol.MAX_SCHEMA_DEPTH // 2 + 1)}}, "structured_outputs"),
    (COMPLETIONS, {"guided_json": _nested(protocol.MAX_SCHEMA_DEPTH // 2 + 1)}, "guided_json"),
    (COMPLETIONS, {"guided_regex": "a" * (protocol.MAX_GRAMMAR_CHARS + 1)}, "guided_regex"),
    (CHAT, {"chat_template": "x" * (protocol.MAX_CHAT_TEMPLATE_CHARS + 1)}, "chat_template"),
    # n x max_tokens past 64 x max_model_len (1024 on the session's server): 128 x 600 tokens.
    (COMPLETIONS, {"n": 128, "max_tokens": 600}, "n"),
    (CHAT, {"n": 100, "max_tokens": None}, "n"),  # max_tokens unset: each sample may run up to max_model_len
]


@pytest.mark.parametrize(("path", "fields", "param"), CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_oversized_fields_are_a_400_naming_them(base_url, path, fields, param):
    body = {"messages": MESSAGES} if path == CHAT else {"prompt": "Hi"}
    status, resp = post(base_url, path, {"max_tokens": 2, **body, **fields})
    assert status == 400, resp
    err = assert_openai_error(resp, 400, param)
    assert "at most" in err["message"] or "more than" in err["message"], err


def test_limits_leave_ordinary_requests_alone(base_url):
    body = {"prompt": "Hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(protocol.MAX_STOP_SEQUENCES)],
            "logit_bias": {"1": 0.5}, "n": 2, "guided_json": _nested(protocol.MAX_SCHEMA_DEPTH // 2 - 1)}
    status, resp = post(base_url, COMPLETIONS, body)
    assert status == 200, resp


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/messages", {"stop_sequences": ["x"] * (protocol.MAX_STOP_SEQUENCES + 1)}),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": BIG_SCHEMA}]}),
])
def test_anthropic_limits(base_url, path, fields):
    status, resp = post(base_url, path, {"model": "smol", "max_tokens": 2, "messages": MESSAGES, **fields})
    assert status == 400, resp
    assert resp["type"] == "error" and "at most" in resp["error"]["message"], resp


def test_responses_limits(base_url):
    status, resp = post(base_url, "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "tools": [
        {"type": "function", "name": "f", "parameters": BIG_SCHEMA}]})
    assert_openai_error(resp, 400, "tools")
    assert status == 400


def test_deeply_nested_body_is_a_400(base_url):
    data = b'{"prompt": "x", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, resp = post(base_url, COMPLETIONS, data=data, headers={"Content-Type": "application/json"})
    assert status == 400, resp
    assert "nests deeper" in resp["error"]["message"]


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the classic escape to arbitrary classes
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% set x = messages.append(1) %}{{ x }}",  # the environment is immutable too
])
def test_request_chat_templates_are_sandboxed(base_url, template):
    status, resp = post(base_url, CHAT, {"messages": MESSAGES, "max_tokens": 1, "chat_template": template})
    assert status == 400, resp
    err = assert_openai_error(resp, 400, "messages")
    assert "unsafe" in err["message"] or "SecurityError" in err["message"], err
