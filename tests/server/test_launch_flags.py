"""vLLM's launch commands: its flag spellings work with its meaning (here one live server started the
way a vLLM user would: `python -m ferrox serve --config FILE.yaml --model ... --ssl-* --root-path ...`),
and a flag ferrox lacks is refused at start-up by name."""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from ferrox.engine.defaults import resolve_generation_defaults
from ferrox.entrypoints import cli
from ferrox.loader.source import resolve_model

from tests.server.server_proc import FERROX, ROOT, ServerProcess, free_port


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FERROX), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_unknown_flags_are_refused_by_name():
    res = run("serve", "--max-parallel-loading-workers", "4", "--eplb-config={}")
    assert res.returncode == 2
    assert "--max-parallel-loading-workers, --eplb-config: ferrox does not support these flags" in res.stderr
    res = run("serve", "--tokenizer-mode", "slow")  # a vLLM value ferrox lacks
    assert res.returncode == 2 and "--tokenizer-mode" in res.stderr and "slow" in res.stderr
    res = run("serve", "--tool-call-parser", "jamba")  # a vLLM parser ferrox lacks
    assert res.returncode == 2 and "--tool-call-parser" in res.stderr and "jamba" in res.stderr
    res = run("serve", "--reasoning-parser", "hunyuan_a13b")  # a vLLM parser ferrox lacks
    assert res.returncode == 2 and "--reasoning-parser" in res.stderr and "hunyuan_a13b" in res.stderr
    res = run("serve", "--api-server-count", "2")  # vLLM's several front-end processes
    assert res.returncode == 2 and "ferrox serves with one API server process" in res.stderr
    res = run("serve", "--enable-prefix")  # no abbreviations: a vLLM flag must not pass as the prefix of ours
    assert res.returncode == 2 and "--enable-prefix: ferrox does not support this flag" in res.stderr


def test_config_file_flags_come_first_so_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9001\nmax_model_len: 512\nenable-log-requests: true\nenable-prefix-caching: false\n"
                    "allowed-origins: ['https://a.example']\n")
    argv = cli.expand_config_file(["serve", "--config", str(path), "--port", "9002"])
    args = cli.build_parser().parse_args(argv)
    assert (args.port, args.max_model_len, args.enable_log_requests) == (9002, 512, True)
    assert args.enable_prefix_caching is False and args.allowed_origins == ["https://a.example"]


def test_generation_config_choices(tmp_path):
    model = {"temperature": 0.2, "top_p": 0.9}
    assert resolve_generation_defaults("auto", model, None) == model
    assert resolve_generation_defaults("vllm", model, {"top_k": 5}) == {"top_k": 5}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "_from_model_config": True}))
    assert resolve_generation_defaults(str(tmp_path), model, None) == {"temperature": 0.0}
    with pytest.raises(ValueError, match="generation_config"):
        resolve_generation_defaults(str(tmp_path / "absent"), model, None)


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def start_serving(cmd: list[str], ready_line: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Start `ferrox serve` and wait (up to 240 s) for its log line saying it serves; its log keeps
    filling the list."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line.rstrip())
            if ready_line in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 240
    while not ready.wait(0.2):
        assert proc.poll() is None and time.monotonic() < deadline, "\n".join(log)
    return proc, log


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    cert, key = _self_signed(tmp)
    (tmp / "gen").mkdir()
    (tmp / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    (tmp / "serve.yaml").write_text(
        "served-model-name: cfg-smol\nmax-model-len: 512\nkv-cache-memory: 64MiB\nenable-log-requests: true\n"
        "allowed-origins: ['https://app.example']\nuvicorn-log-level: debug\n")
    port = free_port()
    cmd = [sys.executable, "-m", "ferrox", "serve", "--config", str(tmp / "serve.yaml"),
           "--model", resolve_model(None).path, "--port", str(port), "--ssl-certfile", str(cert),
           "--ssl-keyfile", str(key), "--root-path", "/proxy", "--enable-auto-tool-choice",
           "--generation-config", str(tmp / "gen"), "--disable-log-stats", "--max-log-len", "40",
           "--trust-remote-code"]
    proc, log = start_serving(cmd, "serving on https://")
    context = ssl.create_default_context(cafile=str(cert))
    yield f"https://127.0.0.1:{port}", context, log
    proc.terminate()
    proc.wait(30)


def _call(url, context, method="GET", body=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, context=context, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_tls_root_path_and_config_file(tls_server):
    base, context, log = tls_server
    for path in ("/proxy/v1/models", "/v1/models"):  # under the root path, and as a stripping proxy forwards it
        status, _, body = _call(base + path, context)
        assert status == 200 and json.loads(body)["data"][0]["id"] == "cfg-smol"  # served-model-name from YAML
    spec = json.loads(_call(base + "/proxy/openapi.json", context)[2])
    assert spec["servers"] == [{"url": "/proxy"}] and "/v1/models" in spec["paths"]
    assert not any(p.startswith("/proxy/") for p in spec["paths"])
    with pytest.raises(OSError):  # plain HTTP is not served (the server drops the connection)
        urllib.request.urlopen(base.replace("https", "http") + "/health", timeout=10)


def test_cors_preflight_and_response_headers(tls_server):
    base, context, _ = tls_server
    url = base + "/proxy/v1/chat/completions"
    asks = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization"}
    status, headers, _ = _call(url, context, "OPTIONS", headers=asks)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "content-type, authorization"
    status, _, body = _call(url, context, "OPTIONS", headers={**asks, "Origin": "https://evil.example"})
    assert status == 400 and b"origin" in body
    status, headers, _ = _call(base + "/v1/models", context, headers={"Origin": "https://app.example"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    _, headers, _ = _call(base + "/v1/models", context, headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers


def _wait_for(log, pattern, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log:
            if re.search(pattern, line):
                return line
        time.sleep(0.1)
    raise AssertionError(f"no log line matches {pattern!r}:\n" + "\n".join(log[-40:]))


def test_request_and_error_logs_and_generation_config(tls_server):
    base, context, log = tls_server
    prompt = "Once upon a time, " * 10
    body = {"prompt": prompt, "max_tokens": 8}
    status, headers, out = _call(base + "/proxy/v1/completions", context, "POST", body,
                                 headers={"X-Request-Id": "launch-req-1"})
    assert status == 200 and headers["X-Request-Id"] == "launch-req-1"
    line = _wait_for(log, r"request launch-req-1: POST /proxy/v1/completions")
    assert '"max_tokens": 8' in line and "...<180 chars>" in line  # parameters, prompt cut at --max-log-len
    # --generation-config DIR (temperature 0): a request without temperature is greedy.
    greedy = json.loads(_call(base + "/v1/completions", context, "POST", {**body, "temperature": 0})[2])
    assert json.loads(out)["choices"][0]["text"] == greedy["choices"][0]["text"]
    # A 4xx: logged at debug with the id its response carries.
    status, headers, _ = _call(base + "/v1/completions", context, "POST", {"prompt": "x", "max_tokens": -1})
    assert status == 400
    error_id = headers["X-Request-Id"]
    _wait_for(log, rf"DEBUG ferrox.server: request {re.escape(error_id)}: POST /v1/completions -> 400")


def test_request_log_of_a_speech_form(tls_server):
    """A transcription's multipart form is logged as its parameters: the text fields (a repeated one as a list, a
    long one cut at --max-log-len 40) and the file part's filename, content type and size, never its bytes; the
    line is written for the refusal that follows too (the text-only SmolLM2 takes no audio)."""
    base, context, log = tls_server
    audio = b"RIFF" + b"secret-audio-bytes " * 30
    fields = [("model", "cfg-smol"), ("language", "en"), ("prompt", "A long prompt about the weather. " * 3),
              ("timestamp_granularities[]", "word"), ("timestamp_granularities[]", "segment")]
    boundary = "ferrox-log-boundary"
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
                    for name, value in fields)
    body += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="take 1.wav"\r\n'
             "Content-Type: audio/wav\r\n\r\n").encode() + audio + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(base + "/v1/audio/transcriptions", data=body, headers={
        "Content-Type": f"multipart/form-data; boundary={boundary}", "X-Request-Id": "launch-form-1"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, context=context, timeout=60)
    assert err.value.code == 400 and b"does not support Transcriptions API" in err.value.read()
    line = _wait_for(log, r"request launch-form-1: POST /v1/audio/transcriptions \{")  # (not the 400's debug line)
    logged = json.loads(line.split("POST /v1/audio/transcriptions ", 1)[1])
    assert logged == {"model": "cfg-smol", "language": "en",
                      "prompt": "A long prompt about the weather. A long ...<99 chars>",
                      "timestamp_granularities[]": ["word", "segment"],
                      "file": {"filename": "take 1.wav", "content_type": "audio/wav", "size": len(audio)}}, line
    assert "secret-audio" not in "\n".join(log)


KEY = "sk-ferrox-test-7d1e9c"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Forces the model's text to be a Llama-3-style JSON call, which only the llama3_json parser reads
# as a tool call (the embedded model's template picks hermes, which wants <tool_call> tags).
LLAMA_CALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                     "properties": {"name": {"const": "get_weather"}, "parameters": {
                         "type": "object", "additionalProperties": False, "required": ["city"],
                         "properties": {"city": {"const": "Paris"}}}}}


def _post(base: str, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _stream(base: str, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(base + path, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        lines = [raw.decode().strip()[6:] for raw in resp if raw.startswith(b"data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def _head_status(base: str, headers: dict[str, str]) -> int:
    """The status of GET /health with these headers (a request head past the limits: 400)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(base + "/health", headers=headers), timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _server_load(base: str) -> int:
    with urllib.request.urlopen(base + "/load", timeout=30) as resp:  # open: no API key
        return json.loads(resp.read())["server_load"]


def test_serving_defaults_are_honoured_and_the_key_is_never_logged():
    """--response-role, --return-tokens-as-token-ids, --enable-prompt-tokens-details, --tool-call-parser,
    --stream-interval, --enable-force-include-usage, --enable-server-load-tracking, --disable-fastapi-docs,
    --enable-tokenizer-info-endpoint, --exclude-tools-when-tool-choice-none, --log-error-stack, the h11 limits and --num-gpu-blocks-override with vLLM's meaning, on a server that logs every request (and debug lines) yet
    never the API key."""
    srv = ServerProcess("--response-role", "bot", "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
                        "--stream-interval", "3",
                        "--tool-call-parser", "llama3_json", "--api-key", KEY, "--enable-log-requests",
                        "--enable-log-outputs", "--log-level", "debug", "--chat-template-content-format", "string",
                        "--trust-request-chat-template", "--enable-force-include-usage",
                        "--enable-server-load-tracking", "--disable-fastapi-docs", "--enable-request-id-headers",
                        "--num-gpu-blocks-override", "400", "--disable-custom-all-reduce",
                        "--enable-tokenizer-info-endpoint", "--exclude-tools-when-tool-choice-none",
                        "--log-error-stack", "--api-server-count", "1", "--h11-max-incomplete-event-size", "16KiB",
                        "--h11-max-header-count", "40")
    try:
        base = srv.base_url
        # --disable-fastapi-docs: no /openapi.json; /load counts the model routes' requests in flight.
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/openapi.json", timeout=30)
        assert err.value.code == 404
        assert _server_load(base) == 0
        # --enable-tokenizer-info-endpoint: the embedded GGUF's tokens and template (no tokenizer_config.json).
        req = urllib.request.Request(base + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            info = json.loads(resp.read())
        assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["eos_token"] == "<|im_end|>", info
        assert "<|im_start|>" in info["chat_template"]
        running = threading.Thread(target=_stream, args=(base, "/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}))
        running.start()
        deadline = time.monotonic() + 60
        while _server_load(base) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _server_load(base) == 1
        running.join(timeout=300)
        assert _server_load(base) == 0
        question = [{"role": "user", "content": "What is the capital of France?"}]
        chat = {"messages": question, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        status, body = _post(base, "/v1/chat/completions", chat)
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["message"]["role"] == "bot"
        assert all(re.fullmatch(r"token_id:\d+", t["token"]) for t in choice["logprobs"]["content"]), choice
        # The request's own field wins over the server default.
        status, body = _post(base, "/v1/chat/completions", {**chat, "return_tokens_as_token_ids": False})
        assert not any(t["token"].startswith("token_id:") for t in body["choices"][0]["logprobs"]["content"])
        # A continued message keeps its own role (vLLM: the response role is for a new turn only).
        status, body = _post(base, "/v1/chat/completions", {
            "messages": [*question, {"role": "assistant", "content": "The capital"}], "max_tokens": 2,
            "add_generation_prompt": False, "continue_final_message": True})
        assert body["choices"][0]["message"]["role"] == "assistant", body
        events = _stream(base, "/v1/chat/completions", {"messages": question, "max_tokens": 2})
        assert events[0]["choices"][0]["delta"]["role"] == "bot"
        # --stream-interval 3: after the first token, chunks of 3 tokens or more (the last may be shorter);
        # a request's stream_interval wins.
        for body, interval in (({}, 3), ({"stream_interval": 5}, 5)):
            events = _stream(base, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 14,
                                                       "ignore_eos": True, "logprobs": 0, **body})
            sizes = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"]]
            assert sum(sizes) == 14 and len(sizes) >= 3, sizes
            assert all(n >= interval for n in sizes[1:-1]), sizes
            # --enable-force-include-usage: a usage chunk last, though no stream_options asked for it.
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 14, events[-1]
        # Completions: token ids in logprobs; usage always says how much of the prompt was cached.
        prompt = "Counting blocks of cached prompt tokens, " * 6
        status, first = _post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "logprobs": 1})
        assert status == 200, first
        assert all(re.fullmatch(r"token_id:\d+", t) for t in first["choices"][0]["logprobs"]["tokens"])
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        _, second = _post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16, second["usage"]
        # --tool-call-parser llama3_json reads a bare JSON call.
        status, body = _post(base, "/v1/chat/completions", {
            "messages": question, "tools": [WEATHER_TOOL], "tool_choice": "auto", "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": LLAMA_CALL_SCHEMA}}})
        assert status == 200, body
        calls = body["choices"][0]["message"].get("tool_calls")
        assert calls and calls[0]["function"]["name"] == "get_weather", body
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        # --exclude-tools-when-tool-choice-none: under tool_choice none the prompt is the one without tools.
        prompt_tokens = []
        for extra in ({}, {"tools": [WEATHER_TOOL], "tool_choice": "none"}, {"tools": [WEATHER_TOOL]}):
            status, body = _post(base, "/v1/chat/completions", {"messages": question, "max_tokens": 1, **extra})
            assert status == 200, body
            prompt_tokens.append(body["usage"]["prompt_tokens"])
        assert prompt_tokens[0] == prompt_tokens[1] < prompt_tokens[2] - 20, prompt_tokens
        # --chat-template-content-format string: contents are strings even for a template that loops over
        # parts (it then loops over characters), the parts joined by newlines.
        parts_template = ("{% for m in messages %}{% for p in m.content %}{% if p is mapping %}{{ p.text }}{% else %}"
                          "{{ p }}{% endif %}|{% endfor %}{% endfor %}")
        two_parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]
        status, body = _post(base, "/tokenize", {"messages": two_parts, "chat_template": parts_template})
        assert status == 200, body
        _, body = _post(base, "/detokenize", {"tokens": body["tokens"]})
        assert body["prompt"] == "a|b|\n|c|", body
        # A beam search is logged once, its beams as its choices (not every one-token step of the search).
        status, body = _post(base, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "n": 2,
                                                       "temperature": 0, "use_beam_search": True, "ignore_eos": True})
        assert status == 200, body
        # --h11-max-incomplete-event-size 16KiB (a 12 KB header passes, where aiohttp's own limit is 8 KB; 20 KB does
        # not) and --h11-max-header-count 40.
        assert _head_status(base, {"X-Big": "a" * 12_000}) == 200
        assert _head_status(base, {"X-Big": "a" * 20_000}) == 400
        assert _head_status(base, {f"X-H{i}": "1" for i in range(45)}) == 400
        # --log-error-stack: a 400 is logged at info with the stack that raised it.
        status, body = _post(base, "/v1/completions", {"prompt": "x", "max_tokens": -1})
        assert status == 400, body
        # A wrong key is refused; neither key appears in any log line (request log, access log, debug errors).
        status, body = _post(base, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key="sk-wrong-guess-1234")
        assert status == 401, body
    finally:
        code = srv.stop()
    log = "\n".join(srv.log)
    assert code == 0, log[-3000:]
    assert "ferrox.requests" in log and "ferrox.access" in log and "-> 401" in log, log[-3000:]
    assert "num_gpu_blocks_override: 400 KV blocks" in log
    assert KEY not in log and "sk-wrong-guess-1234" not in log
    assert re.search(r" INFO ferrox\S*: request \S+: POST /v1/completions -> 400: .*\nTraceback", log), log[-3000:]
    # --enable-log-outputs: each streamed 14-token completion's whole answer once, in one line.
    outputs = re.findall(r"response \S+: choice 0, finish_reason length, 14 tokens: .*; output_token_ids: \[(.*)\]", log)
    assert len(outputs) == 2 and all(len(ids.split(",")) == 14 for ids in outputs), outputs
    beams = re.findall(r"response (\S+): choice (\d), finish_reason length, 5 tokens", log)
    assert len(beams) == 2 and {c for _, c in beams} == {"0", "1"} and beams[0][0] == beams[1][0], beams
    assert not re.search(r"response cmpl-[0-9a-f]+-\d+-\d+: ", log)  # no line of a beam's step (id-step-beam)


def test_log_config_file_formats_the_server_and_its_core(tmp_path):
    """--log-config-file (vLLM's; a dictConfig JSON object): the API server's lines and the engine core's
    (another process) come out in its format; a file that is not JSON stops the start, naming the flag."""
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"tagged": {"format": "CUSTOMFMT %(levelname)s %(name)s | %(message)s"}},
              "handlers": {"err": {"class": "logging.StreamHandler", "formatter": "tagged", "stream": "ext://sys.stderr"}},
              "root": {"level": "INFO", "handlers": ["err"]}}
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    srv = ServerProcess("--log-config-file", str(path), "--max-model-len", "512", "--kv-cache-memory", "64MiB")
    try:
        status, _ = _post(srv.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 200
    finally:
        assert srv.stop() == 0
    assert any(ln.startswith("CUSTOMFMT INFO ferrox.engine.engine_core | engine ready") for ln in srv.log), srv.log[-20:]
    assert any(ln.startswith("CUSTOMFMT INFO ferrox.serve | ready: model") for ln in srv.log), srv.log[-20:]
    (tmp_path / "bad.json").write_text("{not json")
    res = run("serve", "--log-config-file", str(tmp_path / "bad.json"))
    assert res.returncode == 1 and "--log-config-file: logging config" in res.stderr and "not JSON" in res.stderr


PLUGIN = """
import json

from ferrox.entrypoints.openai.tool_parsers import ExtractedToolCalls, ToolCall, register_tool_parser
from ferrox.entrypoints.openai.tool_parsers.hermes import HermesToolParser


@register_tool_parser("every_reply_a_call")
class EveryReplyACall(HermesToolParser):
    \"\"\"A test parser: whatever the model says is a call of get_weather with the text as its city.\"\"\"

    def extract(self, text):
        return ExtractedToolCalls(None, [ToolCall(name="get_weather", arguments=json.dumps({"city": text}))])
"""


def test_tool_parser_plugin_registers_a_parser_the_server_uses(tmp_path):
    """--tool-parser-plugin (vLLM's): the file's register_tool_parser names a parser --tool-call-parser then takes;
    the chat route reads replies with it. A file that fails to load stops the start naming the flag and file."""
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(PLUGIN)
    srv = ServerProcess("--tool-parser-plugin", str(plugin), "--tool-call-parser", "every_reply_a_call",
                        "--max-model-len", "512", "--kv-cache-memory", "64MiB")
    try:
        status, body = _post(srv.base_url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL],
            "tool_choice": "auto", "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        calls = body["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather"], body
    finally:
        assert srv.stop() == 0
    broken = tmp_path / "broken.py"
    broken.write_text("import vllm.entrypoints.openai.tool_parsers\n")
    res = run("serve", "--tool-parser-plugin", str(broken), "--tool-call-parser", "x")
    assert res.returncode == 2 and f"--tool-parser-plugin {broken}: loading it failed" in res.stderr, res.stderr


def test_log_outputs_need_the_request_log():
    res = run("serve", "--enable-log-outputs")
    assert res.returncode == 1 and "--enable-log-outputs needs --enable-log-requests" in res.stderr


def test_unix_domain_socket(tmp_path):
    """--uds: the server listens on a Unix socket (a stale socket file left by a dead server is replaced,
    another file is not touched), answers over it, and removes the file when it exits."""
    import http.client
    import signal
    import socket

    path = tmp_path / "ferrox.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens
    (tmp_path / "not-a-socket").write_text("keep me")
    res = run("serve", "--uds", str(tmp_path / "not-a-socket"))
    assert res.returncode == 1 and "is not a socket" in res.stderr
    assert (tmp_path / "not-a-socket").read_text() == "keep me"

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(path))

    proc, log = start_serving([str(FERROX), "serve", "--uds", str(path), "--max-model-len", "256",
                               "--kv-cache-memory", "32MiB"], f"serving on unix:{path}")
    try:
        conn = UnixConnection("localhost", timeout=120)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        conn = UnixConnection("localhost", timeout=120)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.load(resp)["usage"]["completion_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "\n".join(log)
    assert not path.exists()
