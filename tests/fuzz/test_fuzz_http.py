"""Fuzzing the HTTP request models: random JSON shaped like each route's schema, sent to a live server.

Bodies start from a valid request of the route and get some of the route's own fields (read from its
pydantic model, so new fields are fuzzed too) set to plausible or arbitrary JSON values, or a
required field dropped. Every answer must be a 2xx (a JSON body, or a stream that finishes the way
its API says) or a 4xx in the route's error shape (Anthropic's on /v1/messages, OpenAI's elsewhere);
never a 5xx. After the run the server is healthy and idle, and its output holds no traceback.
The server runs a tiny random Llama with a 256-token context, so even a request that asks for
everything finishes fast.
"""

from __future__ import annotations

import http.client
import json
import urllib.request
from collections import Counter, defaultdict

import pytest

hypothesis = pytest.importorskip("hypothesis")
from ferrox.entrypoints.openai.server import _REQUEST_MODELS  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.fuzz.fuzzing import fuzz_settings  # noqa: E402
from tests.helpers.tiny_models import make_tiny_llama  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402

MODEL = "fuzz"
MSG = [{"role": "user", "content": "hello"}]
BASE_BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "The quick brown", "max_tokens": 4},
    "/v1/chat/completions": {"model": MODEL, "messages": MSG, "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hello", "max_output_tokens": 4},
    "/v1/messages": {"model": MODEL, "messages": MSG, "max_tokens": 4},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": MSG},
    "/tokenize": {"model": MODEL, "prompt": "hello"},
    "/detokenize": {"model": MODEL, "tokens": [5, 6, 7]},
}

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
SMALL_INT = st.integers(-2, 300)
PROB = st.floats(-0.5, 2.5, allow_nan=False)
TEXTS = st.text(max_size=12) | st.sampled_from(["", " ", "\n", "<|im_end|>", "<|im_start|>", "é東🦀"])
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "x"]),
                                 "content": TEXTS | st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url", "input_text", "x"]),
                                      "text": TEXTS}), max_size=2) | st.none()})
SCHEMA = st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                          {"type": "string", "maxLength": 3}, {"type": "nonsense"}, {"enum": []}, {}])
FUNCTION = st.fixed_dictionaries({"name": st.sampled_from(["f", "get_weather", ""]), "parameters": SCHEMA})
# Field name -> values that get past the type check, so the fuzzer reaches the checks behind it.
PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "max_tokens": SMALL_INT, "max_completion_tokens": SMALL_INT, "max_output_tokens": SMALL_INT, "n": SMALL_INT,
    "best_of": SMALL_INT, "min_tokens": SMALL_INT, "logprobs": st.booleans() | SMALL_INT, "top_logprobs": SMALL_INT,
    "prompt_logprobs": SMALL_INT, "top_k": SMALL_INT, "seed": st.integers(-(2**64), 2**64), "priority": SMALL_INT,
    "temperature": PROB, "top_p": PROB, "min_p": PROB, "presence_penalty": PROB, "frequency_penalty": PROB,
    "repetition_penalty": PROB, "length_penalty": PROB, "stream": st.booleans(), "echo": st.booleans(),
    "ignore_eos": st.booleans(), "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "stop": TEXTS | st.lists(TEXTS, max_size=3), "stop_sequences": st.lists(TEXTS, max_size=3),
    "stop_token_ids": st.lists(SMALL_INT, max_size=3), "allowed_token_ids": st.lists(SMALL_INT, max_size=3),
    "bad_words": st.lists(TEXTS, max_size=2), "logit_bias": st.dictionaries(st.integers(-5, 500).map(str), PROB),
    "prompt": TEXTS | st.lists(SMALL_INT, max_size=6) | st.lists(TEXTS, max_size=2),
    "messages": st.lists(MESSAGE, max_size=3), "input": TEXTS | st.lists(MESSAGE, max_size=2),
    "tokens": st.lists(st.integers(-3, 2**33), max_size=6), "system": TEXTS, "instructions": TEXTS,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "x"]),
                                              "json_schema": st.fixed_dictionaries({"name": st.just("s"),
                                                                                    "schema": SCHEMA})}),
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar"]),
                                          SCHEMA | st.sampled_from(["[ab]+", "(", ["x", "y"], []]), max_size=2),
    "guided_json": SCHEMA, "guided_regex": st.sampled_from(["a+", "(", "[0-9]{2}", ""]),
    "guided_choice": st.lists(TEXTS, max_size=3),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTION}), max_size=2)
    | st.lists(FUNCTION.map(lambda f: {"name": f["name"], "input_schema": f["parameters"]}), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", "any", {"type": "function", "function": {"name": "f"}},
                                    {"type": "tool", "name": "f"}]),
    "chat_template": st.sampled_from(["{{ messages[0]['content'] }}", "{% for", "{{ raise_exception('no') }}", ""]),
    "truncate_prompt_tokens": SMALL_INT, "model": st.sampled_from([MODEL, "other", ""]),
}


# route -> status -> count, so the last test can check that the fuzzing reached both the refusals and
# the generation behind them (a fuzzer whose every body fails validation tests little).
STATUSES: dict[str, Counter] = defaultdict(Counter)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("fuzz-llama"))
    srv = ServerProcess(folder, "--max-model-len", "256", "--kv-cache-memory", "4MiB", "--served-model-name", MODEL)
    yield srv
    srv.stop()


def bodies(route: str) -> st.SearchStrategy[dict]:
    fields = sorted(_REQUEST_MODELS[route].model_fields)
    base = BASE_BODIES[route]

    @st.composite
    def build(draw) -> dict:
        body = dict(base)
        for name in draw(st.lists(st.sampled_from(fields), max_size=4, unique=True)):
            body[name] = draw(PLAUSIBLE.get(name, JSON) if draw(st.booleans()) else JSON)
        if draw(st.integers(0, 9)) == 0 and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        return body

    return build()


def post(port: int, route: str, body: dict) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read().decode("utf-8")
    finally:
        conn.close()


def check_answer(route: str, body: dict, status: int, content_type: str, text: str) -> None:
    where = f"{route} {json.dumps(body)[:300]} -> {status} {text[:300]!r}"
    assert status < 500, where
    if status >= 400:
        err = json.loads(text)
        if route.startswith("/v1/messages"):
            assert err["type"] == "error" and isinstance(err["error"]["message"], str), where
        else:
            assert isinstance(err["error"]["message"], str) and isinstance(err["error"]["type"], str), where
        return
    assert status == 200, where
    if content_type.startswith("application/json"):
        json.loads(text)
        return
    assert content_type.startswith("text/event-stream"), where
    datas = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert datas, where
    events = [json.loads(d) for d in datas if d != "[DONE]"]
    # An error inside a stream is fine when it is the API's own (e.g. a request refused after the
    # headers went out); an internal one is a 500 in disguise.
    for event in events:
        error = event.get("error") if isinstance(event.get("error"), dict) else None
        if event.get("type") == "response.failed":
            error = event["response"].get("error")
        assert not error or error.get("type") not in ("internal_error", "api_error"), where
    if route in ("/v1/completions", "/v1/chat/completions"):
        assert datas[-1] == "[DONE]", where
    elif route == "/v1/messages":
        assert events[-1]["type"] in ("message_stop", "error"), where
    else:
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed"), where


@pytest.mark.parametrize("route", list(BASE_BODIES))
def test_random_bodies_get_a_2xx_or_a_shaped_4xx(server, route):
    @fuzz_settings(30)
    @given(body=bodies(route))
    def check(body: dict) -> None:
        status, content_type, text = post(server.port, route, body)
        STATUSES[route][status] += 1
        check_answer(route, body, status, content_type, text)

    check()


@pytest.mark.parametrize("field", [{"structured_outputs": {"regex": {"type": "object"}}},
                                   {"structured_outputs": {"grammar": 5}}, {"structured_outputs": {"choice": "ab"}},
                                   {"guided_regex": ["a+"]}, {"guided_grammar": {}}, {"guided_choice": [1, 2]}])
def test_structured_outputs_of_the_wrong_type_are_a_400(server, field):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **field}
    status, _, text = post(server.port, "/v1/completions", body)
    assert status == 400, text
    name, error = next(iter(field)), json.loads(text)["error"]
    assert error["param"].startswith(name) and error["message"].startswith(name), text


def test_server_is_healthy_and_idle_after_the_fuzzing(server):
    from tests.server.test_metrics_disconnect import scrape, value

    for route in BASE_BODIES:
        if STATUSES[route]:  # (empty when only this test was selected)
            assert STATUSES[route][200] and sum(STATUSES[route].values()) > STATUSES[route][200], \
                (route, STATUSES[route])

    with urllib.request.urlopen(server.base_url + "/health", timeout=10) as resp:
        assert resp.status == 200
    text = scrape(server.base_url)
    assert value(text, "ferrox:num_requests_running") == 0
    assert value(text, "ferrox:num_requests_waiting") == 0
    assert value(text, "ferrox:kv_cache_usage_perc") == 0
    tracebacks = [i for i, line in enumerate(server.log) if "Traceback" in line]
    assert not tracebacks, "\n".join(server.log[tracebacks[0]:tracebacks[0] + 40])
