"""OpenTelemetry traces of requests (vLLM's `--otlp-traces-endpoint`).

With an endpoint, each finished engine request (each sample of an n > 1 request) becomes one span,
as vLLM's: named "llm_request", kind SERVER, starting at the request's arrival and ending as it
finishes, the child of the trace context its HTTP request carried (W3C `traceparent` / `tracestate`
headers), else a trace of its own. Its attributes are vLLM's `gen_ai.*` names: the request id, the
served model, temperature / top_p / max_tokens / n, prompt and completion tokens, and the latencies
(time in queue, to first token, prefill, decode, inference, end to end) that the Prometheus
histograms also take (metrics/request_stats.py).

Spans go out in batches from a background thread (the SDK's BatchSpanProcessor) over OTLP: gRPC unless
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` is `http/protobuf`, with the SDK's other OTEL_* settings
(`OTEL_EXPORTER_OTLP_TRACES_INSECURE`, headers, `OTEL_SERVICE_NAME`). The packages are optional:
`pip install 'ferrox[otel]'`; without them the setting is refused by name at start-up.

The front-end's HTTP layer puts each request's trace headers in a context variable (`trace_headers_var`);
AsyncLLM.generate reads it when not given `trace_headers` itself.
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferrox.metrics.request_stats import FinishedRequestStats, IterationStats

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"

# The trace headers of the HTTP request being handled (set by the server for each request's task).
trace_headers_var: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "ferrox_trace_headers", default=None)


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace-context headers among `headers` (case-insensitive), lower-cased."""
    found = {}
    for name in TRACE_HEADERS:
        value = headers.get(name)
        if value is not None:
            found[name] = value
    return found


@dataclass(slots=True)
class _Traced:
    request_id: str  # the user's request id (the samples of n > 1 share it)
    trace_headers: Mapping[str, str] | None
    temperature: float
    top_p: float
    max_tokens: int | None
    n: int


def _exporter_class() -> Any:
    """The OTLP span exporter of the protocol OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names (gRPC by default)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: ferrox exports traces over 'grpc' or "
                         "'http/protobuf'")
    return OTLPSpanExporter


def check_tracing_available(endpoint: str | None) -> None:
    """At start-up: an endpoint needs the OpenTelemetry SDK and an OTLP exporter (ValueError naming the setting)."""
    if not endpoint:
        return
    try:
        import opentelemetry.sdk.trace  # noqa: F401
        _exporter_class()
    except ImportError as exc:
        raise ValueError(f"otlp_traces_endpoint: tracing needs the OpenTelemetry SDK and its OTLP exporters, which "
                         f"are not installed ({exc.name}): pip install 'ferrox[otel]'") from None


class RequestTracer:
    """A stat logger (metrics/request_stats.StatLogger) that turns finished requests into spans."""

    def __init__(self, endpoint: str, model_name: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.model_name = model_name
        self._provider = TracerProvider(resource=Resource.create({"ferrox.process_id": os.getpid()}))
        self._provider.add_span_processor(BatchSpanProcessor(_exporter_class()(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("ferrox.engine")
        self._propagator = TraceContextTextMapPropagator()
        self._traced: dict[str, _Traced] = {}  # engine request id -> what its span says

    def track(self, engine_request_id: str, request_id: str, params: Any, trace_headers: Mapping[str, str] | None,
              max_tokens: int | None) -> None:
        self._traced[engine_request_id] = _Traced(request_id, trace_headers, params.temperature, params.top_p,
                                                  max_tokens, params.n)

    def on_scheduler_stats(self, stats: dict[str, Any]) -> None:
        pass

    def on_iteration(self, stats: IterationStats) -> None:
        for finished in stats.finished:
            traced = self._traced.pop(finished.request_id, None) if finished.request_id else None
            if traced is not None:
                self._span(traced, finished)

    def _span(self, traced: _Traced, stats: FinishedRequestStats) -> None:
        from opentelemetry.trace import SpanKind

        start, end = stats.arrival_time, max(stats.finish_time, stats.arrival_time)
        context = self._propagator.extract(traced.trace_headers) if traced.trace_headers else None
        attributes: dict[str, Any] = {
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.id": traced.request_id,
            "gen_ai.request.temperature": traced.temperature,
            "gen_ai.request.top_p": traced.top_p,
            "gen_ai.request.n": traced.n,
            "gen_ai.usage.prompt_tokens": stats.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": stats.num_generation_tokens,
            "gen_ai.latency.e2e": stats.e2e_latency,
            "gen_ai.response.finish_reasons": [stats.finish_reason],
        }
        if traced.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = traced.max_tokens
        for name, value in (("gen_ai.latency.time_in_queue", stats.queue_time),
                            ("gen_ai.latency.time_to_first_token", stats.time_to_first_token),
                            ("gen_ai.latency.time_in_model_prefill", stats.prefill_time),
                            ("gen_ai.latency.time_in_model_decode", stats.decode_time),
                            ("gen_ai.latency.time_in_model_inference", stats.inference_time)):
            if value is not None:
                attributes[name] = value
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=SpanKind.SERVER, attributes=attributes,
                                       start_time=int(start * 1e9))
        span.end(end_time=int(end * 1e9))

    def forget(self, engine_request_id: str) -> None:
        self._traced.pop(engine_request_id, None)

    def close(self) -> None:
        """Send what is batched and stop the export thread."""
        self._provider.shutdown()
