"""A test OTLP trace receiver: the collector's TraceService (opentelemetry-proto) on grpcio,
on 127.0.0.1, keeping every span the exporters send."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc


@dataclass
class ReceivedSpan:
    service: str  # the exporting process's service.name resource attribute
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    kind: int
    attributes: dict
    error: bool  # status code ERROR


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver(ts_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        ts_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{port}"

    def Export(self, request, context):
        received = []
        for rs in request.resource_spans:
            service = _attributes(rs.resource.attributes).get("service.name", "")
            for scope in rs.scope_spans:
                for s in scope.spans:
                    received.append(
                        ReceivedSpan(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.kind,
                            _attributes(s.attributes),
                            s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return ts.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate, timeout: float = 20.0) -> list[ReceivedSpan]:
        """The spans received once ``predicate(spans)`` holds; AssertionError at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"spans not received within {timeout} s; have {names}")
            time.sleep(0.05)

    def __enter__(self):
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)
