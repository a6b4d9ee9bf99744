"""Sleep mode through a live `ferrox serve --enable-sleep-mode` (VLLM_SERVER_DEV_MODE=1, as vLLM's routes):
/sleep aborts, waits for or keeps the requests in flight, level 2 discards the weights until
/collective_rpc reloads them, requests sent while asleep wait for /wake_up and
then complete, /is_sleeping follows, bad arguments are 400s naming the parameter. The checks are
functions of a base URL: benches/live/serve_sleep.py runs the same ones against a GPU server."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.error
import urllib.request

import pytest

from tests.server.server_proc import ServerProcess

DEV = {"VLLM_SERVER_DEV_MODE": "1"}


def call(base: str, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict | None]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def completion(base: str, model: str, max_tokens: int, stream: bool = False) -> dict:
    """A greedy completion; streamed, the chunks' text joined and the last finish_reason."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        if not stream:
            out = json.loads(resp.read())
            return {"finish_reason": out["choices"][0]["finish_reason"], "tokens": out["usage"]["completion_tokens"]}
        finish, chunks = None, 0
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            chunks += 1
            finish = choice.get("finish_reason") or finish
        return {"finish_reason": finish, "chunks": chunks}


def is_sleeping(base: str) -> bool:
    status, body = call(base, "GET", "/is_sleeping")
    assert status == 200 and body is not None
    return bool(body["is_sleeping"])


def sleep_states(base: str) -> dict[str, float]:
    """/metrics' engine_sleep_state series of engine 0 (ferrox: or vllm: prefix), by sleep_state."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    states = {}
    for line in text.splitlines():
        if ":engine_sleep_state{" in line and 'engine="0"' in line:
            state = line.split('sleep_state="')[1].split('"')[0]
            states[state] = float(line.rsplit(" ", 1)[1])
    return states


def check_abort_then_queue_until_wake(base: str, model: str) -> None:
    with cf.ThreadPoolExecutor(2) as pool:
        long = pool.submit(completion, base, model, 900, True)
        time.sleep(1.0)  # the stream is running
        status, _ = call(base, "POST", "/sleep?level=1")
        assert status == 200
        assert long.result(timeout=60)["finish_reason"] == "abort"  # mode=abort (the default)
        assert is_sleeping(base)
        assert sleep_states(base) == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
        queued = pool.submit(completion, base, model, 8)
        time.sleep(1.0)
        assert not queued.done(), "a request sent while asleep must wait for the wake-up"
        status, _ = call(base, "POST", "/wake_up?tags=weights")  # one part: still asleep
        assert status == 200 and is_sleeping(base) and not queued.done()
        status, _ = call(base, "POST", "/wake_up")
        assert status == 200 and not is_sleeping(base)
        assert sleep_states(base) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        assert queued.result(timeout=120) == {"finish_reason": "length", "tokens": 8}


def check_wait_mode(base: str, model: str) -> None:
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(completion, base, model, 48)
        time.sleep(0.5)
        status, _ = call(base, "POST", "/sleep?level=1&mode=wait")  # returns once `running` is done
        assert status == 200 and running.done() and is_sleeping(base)
        assert running.result() == {"finish_reason": "length", "tokens": 48}
        status, _ = call(base, "POST", "/wake_up")
        assert status == 200 and not is_sleeping(base)


def check_keep_mode(base: str, model: str, max_tokens: int = 80) -> None:
    """mode=keep: a streaming request stops where it is, then goes on after the wake-up (its KV cache
    recomputed) to all of its tokens."""
    events: list[tuple[float, dict]] = []

    def stream() -> None:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    events.append((time.monotonic(), json.loads(line[6:])))

    with cf.ThreadPoolExecutor(1) as pool:
        done = pool.submit(stream)
        deadline = time.monotonic() + 60
        while len(events) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, _ = call(base, "POST", "/sleep?level=1&mode=keep")
        assert status == 200 and is_sleeping(base)
        seen = len(events)
        time.sleep(1.0)
        assert len(events) <= seen + 1, "a kept request must not run while the engine sleeps"
        assert not done.done()
        status, _ = call(base, "POST", "/wake_up")
        assert status == 200
        done.result(timeout=120)
    finishes = [c["finish_reason"] for _, e in events for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["length"]
    assert events[-1][1]["usage"]["completion_tokens"] == max_tokens


def check_level_2_and_reload(base: str, model: str) -> None:
    """vLLM's level-2 flow over HTTP: the weights discarded, woken, read again by /collective_rpc, then the KV
    cache woken; the same greedy text as before."""
    def text() -> str:
        status, body = call(base, "POST", "/v1/completions", {"model": model, "prompt": "The history of",
                                                              "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert status == 200 and body is not None, body
        return body["choices"][0]["text"]

    before = text()
    assert call(base, "POST", "/sleep?level=2")[0] == 200
    assert sleep_states(base) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
    assert call(base, "POST", "/wake_up?tags=weights")[0] == 200
    status, body = call(base, "POST", "/collective_rpc", {"method": "init_device"})
    assert status == 400 and body is not None and body["error"]["param"] == "method"
    status, body = call(base, "POST", "/collective_rpc", {"method": "reload_weights"})
    assert status == 200 and body is not None and body["results"] == [None], body
    assert call(base, "POST", "/wake_up?tags=kv_cache")[0] == 200 and not is_sleeping(base)
    assert sleep_states(base) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert text() == before


def check_bad_arguments(base: str) -> None:
    for query, param in (("level=3", "level"), ("level=x", "level"), ("mode=later", "mode"), ("tags=gpu", "tags")):
        status, body = call(base, "POST", f"/sleep?{query}")
        assert status == 400 and body is not None and body["error"]["param"] == param, (query, body)
    status, body = call(base, "POST", "/wake_up?tags=nope")
    assert status == 400 and body is not None and body["error"]["param"] == "tags"
    # The engine's state refuses it: the weights sleep (a 409 saying what to do first).
    assert call(base, "POST", "/sleep?level=2")[0] == 200
    status, body = call(base, "POST", "/collective_rpc", {"method": "reload_weights"})
    assert status == 409 and body is not None and "wake_up" in body["error"]["message"], body
    assert call(base, "POST", "/wake_up?tags=weights")[0] == 200
    assert call(base, "POST", "/collective_rpc", {"method": "reload_weights"})[0] == 200
    assert call(base, "POST", "/wake_up")[0] == 200
    assert not is_sleeping(base)


@pytest.fixture(scope="module")
def server():
    # float32: the embedded GGUF dequantized, whose weights level 2 can discard and reload (quantized, they are
    # packed in Rust objects: tests/engine/test_sleep_mode.py checks that refusal).
    srv = ServerProcess("--enable-sleep-mode", "--served-model-name", "m", "--dtype", "float32", env=DEV)
    yield srv
    srv.stop()


def test_sleep_aborts_in_flight_and_queues_new_requests_until_wake_up(server):
    check_abort_then_queue_until_wake(server.base_url, "m")


def test_sleep_mode_wait_lets_running_requests_finish(server):
    check_wait_mode(server.base_url, "m")


def test_sleep_mode_keep_resumes_requests_after_wake_up(server):
    check_keep_mode(server.base_url, "m")


def test_level_2_discards_and_collective_rpc_reloads_the_weights(server):
    check_level_2_and_reload(server.base_url, "m")


def test_bad_sleep_arguments_are_400s_naming_the_parameter(server):
    check_bad_arguments(server.base_url)
    # The engine still serves after all of that.
    assert completion(server.base_url, "m", 4) == {"finish_reason": "length", "tokens": 4}
