"""/openapi.json (a real OpenAPI description of the routes), /ping, /v1/models/{id}, X-Request-Id on the
routes that name their request, and the access log (one line per request) over raw HTTP."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
import uuid

import jsonschema
import pytest

ROUTES = {  # what a vLLM user reaches for, and this server's own additions
    "/v1/models": {"get"}, "/v1/models/{model}": {"get"}, "/v1/completions": {"post"},
    "/v1/chat/completions": {"post"}, "/v1/responses": {"post"}, "/v1/messages": {"post"},
    "/v1/messages/count_tokens": {"post"}, "/tokenize": {"post"}, "/detokenize": {"post"},
    "/health": {"get"}, "/ping": {"get", "post"}, "/invocations": {"post"}, "/version": {"get"}, "/metrics": {"get"},
    "/openapi.json": {"get"}, "/status": {"get"}, "/": {"get"}, "/load": {"get"},
    "/v1/embeddings": {"post"}, "/pooling": {"post"}, "/score": {"post"}, "/v1/score": {"post"},
    "/rerank": {"post"}, "/v1/rerank": {"post"}, "/v2/rerank": {"post"}, "/classify": {"post"},
    "/v1/load_lora_adapter": {"post"}, "/v1/unload_lora_adapter": {"post"},
    "/v1/responses/{response_id}": {"get", "delete"}, "/v1/responses/{response_id}/cancel": {"post"},
    "/v1/responses/{response_id}/input_items": {"get"},
    "/v1/audio/transcriptions": {"post"}, "/v1/audio/translations": {"post"},
}


def _call(base_url: str, path: str, body: dict | None = None, method: str | None = None,
          headers: dict | None = None) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base_url + path, data, {"Content-Type": "application/json", **(headers or {})},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@pytest.fixture(scope="module")
def spec(base_url) -> dict:
    status, _, body = _call(base_url, "/openapi.json")
    assert status == 200
    return json.loads(body)


def test_openapi_lists_every_route(spec):
    assert spec["openapi"].startswith("3.") and spec["info"]["title"] == "ferrox"
    assert {path: set(ops) for path, ops in spec["paths"].items()} == ROUTES
    op = spec["paths"]["/v1/models/{model}"]["get"]
    assert op["parameters"][0]["name"] == "model" and op["parameters"][0]["in"] == "path"


def test_openapi_request_bodies_are_the_pydantic_schemas(spec):
    schemas = spec["components"]["schemas"]
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    text = json.dumps(spec)
    for ref in set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', text)):
        assert ref in schemas, ref  # every reference resolves
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = schemas[body["$ref"].rsplit("/", 1)[1]]
    assert "messages" in chat["required"] and "temperature" in chat["properties"]
    responses = schemas["ResponsesRequest"]
    assert {"input", "instructions", "max_output_tokens", "tools", "text"} <= set(responses["properties"])
    assert "tools" in schemas["MessagesRequest"]["properties"]
    # A real request validates against the published schema; a bad one does not.
    validator = jsonschema.Draft202012Validator({**responses, "components": spec["components"]})
    validator.validate({"model": "smol", "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 8})
    assert not validator.is_valid({"input": "hi", "max_output_tokens": 0})


def test_ping_and_model_by_id(base_url):
    assert _call(base_url, "/ping")[0] == 200
    assert _call(base_url, "/ping", method="POST")[0] == 200
    status, _, body = _call(base_url, "/v1/models/smol")
    assert status == 200 and json.loads(body)["id"] == "smol"
    status, _, body = _call(base_url, "/v1/models/nope")
    assert status == 404 and json.loads(body)["error"]["param"] == "model"


def test_scoring_routes_refuse_a_generation_model(base_url):
    """/score, /rerank and /classify need a pooling model: this server's generation model answers vLLM's 400."""
    for path, body, api in (("/v1/score", {"text_1": "a", "text_2": ["b"]}, "Score API"),
                            ("/rerank", {"query": "a", "documents": ["b"]}, "Rerank (Score) API"),
                            ("/classify", {"input": "a"}, "Classification API")):
        status, _, answer = _call(base_url, path, body)
        assert status == 400, answer
        assert json.loads(answer)["error"]["message"] == f"The model does not support {api}"


def _wait_for_line(server, pattern: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in reversed(server.log):
            if re.search(pattern, line):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no log line matching {pattern!r} in:\n" + "\n".join(server.log[-20:]))


def test_access_log_and_request_id(server, base_url):
    probe = uuid.uuid4().hex
    _call(base_url, f"/ping?probe={probe}")
    _wait_for_line(server, rf'ferrox\.access: 127\.0\.0\.1 "GET /ping\?probe={probe}" 200 \d+\.\dms$')
    _call(base_url, f"/no-such-route-{probe}")
    _wait_for_line(server, rf'"GET /no-such-route-{probe}" 404 ')
    status, headers, body = _call(base_url, "/v1/responses", {"input": "hi", "max_output_tokens": 2})
    assert status == 200
    rid = json.loads(body)["id"]
    assert headers["X-Request-Id"] == rid
    _wait_for_line(server, rf'"POST /v1/responses" 200 \d+\.\dms request_id={rid}$')
    # The client's own id comes back and is the one logged.
    status, headers, _ = _call(base_url, "/v1/responses", {"input": "hi", "max_output_tokens": 2},
                               headers={"X-Request-Id": f"mine-{probe}"})
    assert status == 200 and headers["X-Request-Id"] == f"mine-{probe}"
    _wait_for_line(server, rf'"POST /v1/responses" 200 \d+\.\dms request_id=mine-{probe}$')
    # A stream is logged when it ends, with the id it sent in its headers.
    status, headers, _ = _call(base_url, "/v1/messages", {"max_tokens": 2, "stream": True,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and headers["X-Request-Id"].startswith("msg_")
    _wait_for_line(server, rf'"POST /v1/messages" 200 \d+\.\dms request_id={headers["X-Request-Id"]}$')
