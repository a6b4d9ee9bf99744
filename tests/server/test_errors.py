"""Every error status of the API, in OpenAI's shape (Anthropic's on /v1/messages)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.server.conftest import BODY_LIMIT, MAX_MODEL_LEN

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def post(base_url: str, path: str, body: Any = None, *, data: bytes | None = None,
         headers: dict[str, str] | None = None, method: str = "POST") -> tuple[int, Any]:
    async def run() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            kwargs: dict[str, Any] = {"headers": headers or {}}
            if data is not None:
                kwargs["data"] = data
            elif body is not None:
                kwargs["json"] = body
            async with session.request(method, base_url + path, **kwargs) as resp:
                return resp.status, await resp.json(content_type=None)

    return asyncio.run(run())


def assert_openai_error(body: Any, status: int, param: str | None = "__any__") -> dict[str, Any]:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


def test_invalid_json(base_url):
    status, body = post(base_url, CHAT, data=b"{not json", headers={"Content-Type": "application/json"})
    assert status == 400
    assert assert_openai_error(body, 400)["type"] == "invalid_request_error"


def test_body_not_an_object(base_url):
    status, body = post(base_url, CHAT, body=[1, 2])
    assert status == 400
    assert_openai_error(body, 400)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),  # wrong type
        ("temperature", 5.0),  # out of range
        ("top_p", 0.0),
        ("n", 0),
        ("max_tokens", 0),
        ("top_logprobs", 99),
        ("presence_penalty", 3),
        ("stop", [""]),
        ("messages", []),
    ],
)
def test_bad_field_names_param(base_url, field, value):
    body = {"messages": MESSAGES, "max_tokens": 2, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    status, resp = post(base_url, CHAT, body)
    assert status == 400, resp
    err = assert_openai_error(resp, 400)
    assert err["param"] is not None and err["param"].split(".")[0] == field


def test_bad_message_role_and_content(base_url):
    status, resp = post(base_url, CHAT, {"messages": [{"role": "wizard", "content": "x"}]})
    assert status == 400 and assert_openai_error(resp, 400)["param"].startswith("messages.0")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    status, resp = post(base_url, CHAT, {"messages": image})
    assert status == 400 and "takes no images" in resp["error"]["message"]
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
    status, resp = post(base_url, CHAT, {"messages": audio})
    assert status == 400 and "not supported" in resp["error"]["message"]


def test_prompt_plus_max_tokens_over_model_length(base_url):
    status, resp = post(base_url, CHAT, {"messages": MESSAGES, "max_tokens": MAX_MODEL_LEN})
    assert status == 400
    err = assert_openai_error(resp, 400, param="max_tokens")
    assert str(MAX_MODEL_LEN) in err["message"]
    # A prompt alone longer than the model: the prompt is at fault.
    status, resp = post(base_url, "/v1/completions", {"prompt": [1] * (MAX_MODEL_LEN + 5), "max_tokens": 1})
    assert status == 400
    assert_openai_error(resp, 400, param="prompt")


def test_token_ids_outside_vocab(base_url):
    status, resp = post(base_url, "/v1/completions", {"prompt": [10**7], "max_tokens": 1})
    assert status == 400
    assert_openai_error(resp, 400, param="prompt")


def test_unknown_model_is_404(base_url):
    status, resp = post(base_url, CHAT, {"model": "gpt-17", "messages": MESSAGES})
    assert status == 404
    err = assert_openai_error(resp, 404, param="model")
    assert err["code"] == "model_not_found"


def test_unknown_route_is_404(base_url):
    status, resp = post(base_url, "/v1/nothing-here", {"x": 1})
    assert status == 404
    assert_openai_error(resp, 404)
    status, resp = post(base_url, "/v1/models", method="DELETE")
    assert status == 405
    assert_openai_error(resp, 405)


def test_body_over_limit_is_413(base_url):
    big = {"messages": [{"role": "user", "content": "x" * (BODY_LIMIT + 10)}]}
    status, resp = post(base_url, CHAT, big)
    assert status == 413
    assert_openai_error(resp, 413)


def test_anthropic_route_errors_have_anthropic_shape(base_url):
    status, resp = post(base_url, "/v1/messages", {"messages": MESSAGES})  # max_tokens missing
    assert status == 400
    assert resp["type"] == "error" and resp["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in resp["error"]["message"]
    status, resp = post(base_url, "/v1/messages", data=b"nope", headers={"Content-Type": "application/json"})
    assert status == 400 and resp["type"] == "error"


def test_bad_request_does_not_disturb_others(base_url):
    async def run() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as session:
            async def one(body: dict[str, Any]) -> tuple[int, Any]:
                async with session.post(base_url + CHAT, json=body) as resp:
                    return resp.status, await resp.json()

            good = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
            bad = {"messages": MESSAGES, "max_tokens": 4, "logit_bias": {"999999999": 5}}
            return await asyncio.gather(one(good), one(bad), one(good))

    (s1, r1), (s2, r2), (s3, r3) = asyncio.run(run())
    assert s1 == s3 == 200 and s2 == 400, (r1, r2, r3)
    assert r1["choices"][0]["message"]["content"] == r3["choices"][0]["message"]["content"]
    assert_openai_error(r2, 400, param="logit_bias")


# ---- the request rules over HTTP: `param` comes from the exception, spelled as the route takes it ----

COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        (CHAT, {"messages": MESSAGES, "max_tokens": 2, "min_tokens": 3}, "min_tokens", "invalid_value"),
        (CHAT, {"messages": MESSAGES, "min_tokens": MAX_MODEL_LEN}, "min_tokens", "invalid_value"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 2, "stop": ["ok", ""]}, "stop", "invalid_value"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 2, "stop_token_ids": [-1]}, "stop_token_ids", "invalid_value"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 2, "stop_token_ids": [10**7]}, "stop_token_ids", "invalid_value"),
        (CHAT, {"messages": [{"role": "user", "content": "hi " * (MAX_MODEL_LEN + 10)}]}, "messages",
         "context_length_exceeded"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 2, "guided_regex": "("}, "guided_regex", "invalid_value"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format", "invalid_value"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 2, "tool_choice": {"type": "function", "function": {"name": "f"}},
                "tools": [{"type": "function", "function": {"name": "g"}}]}, "tool_choice", "invalid_value"),
        (COMPLETIONS, {"prompt": "", "max_tokens": 2}, "prompt", "invalid_value"),
        (COMPLETIONS, {"prompt": [[5], []], "max_tokens": 2}, "prompt", "invalid_value"),
        (COMPLETIONS, {"prompt": [5, -1], "max_tokens": 2}, "prompt", "invalid_value"),
        (COMPLETIONS, {"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 2}, "prompt", "context_length_exceeded"),
        (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "logit_bias": {"49152": 1}}, "logit_bias", "invalid_value"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_request_rule_names_param(base_url, path, body, param, code, stream):
    """Refused before anything is queued: a plain 400 (also for a stream: no header was sent yet)."""
    status, resp = post(base_url, path, {**body, "stream": stream})
    assert status == 400, resp
    err = assert_openai_error(resp, 400, param=param)
    assert err["type"] == "invalid_request_error" and err["code"] == code, err


def test_messages_route_refuses_with_anthropic_shape(base_url):
    too_long = [{"role": "user", "content": "hi " * (MAX_MODEL_LEN + 10)}]
    for body in ({"messages": MESSAGES, "max_tokens": 2, "stop_sequences": [""]},
                 {"messages": too_long, "max_tokens": 2}):
        status, resp = post(base_url, "/v1/messages", body)
        assert status == 400 and resp["type"] == "error", resp
        assert resp["error"]["type"] == "invalid_request_error"


def test_engine_clean_after_refusals(base_url):
    """Every refusal above left nothing queued: the next good request runs, and no KV block is held."""
    status, resp = post(base_url, CHAT, {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert status == 200 and resp["usage"]["completion_tokens"] == 3, resp

    async def metrics() -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(base_url + "/metrics") as r:
                return await r.text()

    lines = [line for line in asyncio.run(metrics()).splitlines() if not line.startswith("#")]
    for name in ("ferrox:num_requests_running", "ferrox:num_requests_waiting", "ferrox:kv_cache_usage_perc"):
        values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)]
        assert values and all(v == 0 for v in values), (name, values)
