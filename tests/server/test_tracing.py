"""--otlp-traces-endpoint (vLLM's; ferrox/metrics/tracing.py): request spans exported to an OpenTelemetry
collector of the test's own.

- a live server exporting over gRPC: a chat request carrying a W3C traceparent becomes one "llm_request"
  SERVER span in that trace, the child of the caller's span, with vLLM's gen_ai.* attributes agreeing with
  the response (model, token usage, sampling settings) and latencies in order; a request without one
  starts a trace of its own; n = 2 gives a span per sample;
- the tracer over OTLP/HTTP (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf) to an HTTP collector;
- the offline LLM refuses the setting by name.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("opentelemetry.sdk")
grpc = pytest.importorskip("grpc")

from ferrox.errors import InvalidArgumentError  # noqa: E402
from ferrox.metrics.request_stats import FinishedRequestStats, IterationStats  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from tests.server.server_proc import ServerProcess  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait(self, count: int, timeout: float = 30.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"{len(self.spans)} spans arrived, {count} expected")


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = list(v.string_value for v in value.array_value.values) if kind == "array_value" \
            else getattr(value, kind)
    return out


def _chat(base: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_server_exports_a_span_per_request_in_the_callers_trace():
    collector = _Collector()
    grpc_server = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    srv = ServerProcess("--otlp-traces-endpoint", f"http://127.0.0.1:{port}", "--served-model-name", "traced",
                        "--max-model-len", "512", "--kv-cache-memory", "64MiB", env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        body = {"model": "traced", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5,
                "temperature": 0.5, "top_p": 0.9, "ignore_eos": True}
        reply = _chat(srv.base_url, body, {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"})
        [span] = collector.wait(1)
        assert span.name == "llm_request" and span.kind == 2  # SPAN_KIND_SERVER
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT
        attrs = _attrs(span)
        assert attrs["gen_ai.response.model"] == "traced"
        assert attrs["gen_ai.usage.prompt_tokens"] == reply["usage"]["prompt_tokens"]
        assert attrs["gen_ai.usage.completion_tokens"] == reply["usage"]["completion_tokens"] == 5
        assert attrs["gen_ai.request.max_tokens"] == 5 and attrs["gen_ai.request.n"] == 1
        assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
        assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert attrs["gen_ai.request.id"]
        ttft, e2e = attrs["gen_ai.latency.time_to_first_token"], attrs["gen_ai.latency.e2e"]
        assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= ttft <= e2e
        assert attrs["gen_ai.latency.time_in_model_inference"] <= e2e
        assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(e2e, abs=1e-3)

        _chat(srv.base_url, {**body, "n": 2})
        spans = collector.wait(3)[1:]
        assert {s.trace_id.hex() for s in spans} != {TRACE_ID} and all(not s.parent_span_id for s in spans)
        assert len({_attrs(s)["gen_ai.request.id"] for s in spans}) == 1 and _attrs(spans[0])["gen_ai.request.n"] == 2
    finally:
        assert srv.stop() == 0
        grpc_server.stop(0)


def test_tracer_exports_over_http(monkeypatch):
    from ferrox import SamplingParams
    from ferrox.metrics.tracing import RequestTracer

    received: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    tracer = RequestTracer(f"http://127.0.0.1:{server.server_port}/v1/traces", "m")
    tracer.track("req-0", "req", SamplingParams(temperature=0.7, max_tokens=3), {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}, 3)
    now = time.time()
    tracer.on_iteration(IterationStats(0, finished=[FinishedRequestStats(
        engine=0, finish_reason="stop", num_prompt_tokens=4, num_generation_tokens=3, e2e_latency=0.5,
        time_to_first_token=0.1, request_id="req-0", arrival_time=now - 0.5, finish_time=now)]))
    tracer.close()  # flushes
    server.shutdown()
    request = trace_service_pb2.ExportTraceServiceRequest.FromString(received[0])
    [span] = [s for r in request.resource_spans for sc in r.scope_spans for s in sc.spans]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT
    attrs = _attrs(span)
    assert attrs["gen_ai.request.id"] == "req" and attrs["gen_ai.usage.completion_tokens"] == 3
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(0.1)
    assert "gen_ai.latency.time_in_queue" not in attrs  # (never scheduled: no phases to report)


def test_offline_llm_refuses_it():
    from ferrox import LLM

    with pytest.raises(InvalidArgumentError, match="otlp_traces_endpoint"):
        LLM(otlp_traces_endpoint="http://127.0.0.1:4317")
