"""OpenTelemetry tracing, optional (``pip install 'pdserve[tracing]'``): the one module that
imports OpenTelemetry, and only once an endpoint is given.

Off (no ``--otlp-traces-endpoint``), every process holds ``None`` where it would hold a
``Tracing``: no span object is made, and the request path pays one ``is None`` check at each
point a span would start. On, each process (router, prefill worker, decode worker) exports
its own spans over OTLP/gRPC under its own ``service.name``; the trace context crosses gRPC as
W3C ``traceparent`` metadata, and an HTTP client's ``traceparent`` header is honoured.

Names follow vLLM's where they overlap (the request span ``llm_request``, ``gen_ai.*``
attributes); the rest are ``pdserve.*``. Torch-free, like everything in grpc_plumbing.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Iterable, Mapping

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
EXTRA = "pdserve[tracing]"


class TracingUnavailable(RuntimeError):
    """An endpoint was given but the OpenTelemetry packages are not installed."""


def tracing_missing() -> str | None:
    """Why this Python cannot export traces (the extra is not installed), or None."""
    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"OpenTelemetry is not installed ({module}): pip install '{EXTRA}'"
    return None


def start_tracing(endpoint: str | None, service_name: str) -> Tracing | None:
    """A ``Tracing`` exporting to ``endpoint`` (OTLP over gRPC: ``host:port``, or
    ``http://`` / ``https://host:port``; TLS only with https), or None when no endpoint is
    given. Spans are batched (OTEL_BSP_* environment variables tune the batching)."""
    if not endpoint:
        return None
    try:
        exporter_module = _otel("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
        resources, sdk_trace = (
            _otel("opentelemetry.sdk.resources"),
            _otel("opentelemetry.sdk.trace"),
        )
        export = _otel("opentelemetry.sdk.trace.export")
    except ImportError as e:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint {endpoint}: OpenTelemetry is not installed "
            f"(pip install '{EXTRA}'): {e}"
        ) from None
    resource = resources.Resource.create({"service.name": service_name})
    provider = sdk_trace.TracerProvider(resource=resource)
    # Without a scheme the exporter would assume TLS; a collector on a private network or
    # loopback usually listens in the clear, and https:// says otherwise.
    insecure = not endpoint.startswith("https://")
    exporter = exporter_module.OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    provider.add_span_processor(export.BatchSpanProcessor(exporter))
    return Tracing(provider)


def _otel(module: str):
    """An OpenTelemetry module of the optional extra, loaded only once tracing starts."""
    return importlib.import_module(module)


class Tracing:
    """One process's tracer. Spans are started and ended explicitly (never through the
    context variables: a request's work hops between tasks, threads and generators), each
    given its parent: a span, a context from ``context_from``, or None for a new trace."""

    def __init__(self, provider):
        trace = _otel("opentelemetry.trace")
        tracecontext = _otel("opentelemetry.trace.propagation.tracecontext")
        self._provider = provider
        self._trace = trace
        self._propagator = tracecontext.TraceContextTextMapPropagator()
        self.tracer = provider.get_tracer("pdserve")
        self._kinds = {
            "internal": trace.SpanKind.INTERNAL,
            "server": trace.SpanKind.SERVER,
            "client": trace.SpanKind.CLIENT,
        }

    def start(self, name: str, parent=None, kind: str = "internal", attributes=None, at=None):
        """A span started now (or at ``at``, a time.monotonic() reading), child of ``parent``."""
        return self.tracer.start_span(
            name,
            context=self._context(parent),
            kind=self._kinds[kind],
            attributes=attributes,
            start_time=None if at is None else epoch_ns(at),
        )

    def start_call(self, name: str, context, attributes=None):
        """A gRPC call's server span, child of the caller's (the call's traceparent); None for
        a caller that sent none (a router tracing nothing: no stray one-span traces)."""
        parent = self.context_from(context.invocation_metadata())
        if parent is None:
            return None
        return self.start(name, parent, kind="server", attributes=attributes)

    def record(self, name: str, parent, start: float, end: float, attributes=None):
        """A span measured already: from ``start`` to ``end`` (time.monotonic() readings)."""
        span = self.start(name, parent, attributes=attributes, at=start)
        span.end(end_time=epoch_ns(max(start, end)))
        return span

    def end(self, span, error: BaseException | str | None = None, at=None) -> None:
        """End ``span`` (once: a second end is a no-op), with an error status if ``error``."""
        if not span.is_recording():
            return
        if error is not None:
            status = self._trace.Status(
                self._trace.StatusCode.ERROR, str(error) or type(error).__name__
            )
            span.set_status(status)
        span.end(end_time=None if at is None else epoch_ns(at))

    def metadata(self, span) -> tuple[tuple[str, str], ...]:
        """gRPC metadata carrying ``span`` as the parent of the callee's spans."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._context(span))
        return tuple(carrier.items())

    def context_from(self, carrier: Mapping[str, str] | Iterable[tuple[str, str]]):
        """The remote parent a W3C ``traceparent`` in HTTP headers or gRPC metadata names;
        None when it carries none (or a malformed one, which W3C says to ignore)."""
        if not isinstance(carrier, Mapping):
            carrier = {k: v for k, v in carrier if k in (TRACEPARENT, TRACESTATE)}
        if TRACEPARENT not in carrier:
            return None
        context = self._propagator.extract(carrier)
        span = self._trace.get_current_span(context)
        return context if span.get_span_context().is_valid else None

    def _context(self, parent):
        if parent is None or not hasattr(parent, "get_span_context"):
            return parent  # None (a new trace) or a Context already
        return self._trace.set_span_in_context(parent)

    def shutdown(self) -> None:
        """Export what is batched and stop (bounded by the exporter's own timeout)."""
        self._provider.shutdown()


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as nanoseconds since the epoch (what OTLP carries)."""
    return time.time_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


def add_tracing_arg(parser) -> None:
    """``--otlp-traces-endpoint`` (vLLM's name), shared by the router and the workers."""
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="Target URL to which OpenTelemetry traces will be sent (OTLP/gRPC, host:port or "
        f"http(s)://host:port; needs pip install '{EXTRA}'). Default: no tracing.",
    )
