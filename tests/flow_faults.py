"""Worker calls that end the way a worker ends them, for the router's flow tests: the
in-process workers' Decode and Prefill handlers are wrapped (before a cluster starts: gRPC
binds the handlers then) so that the first call of a chosen request fails as scripted. The
router under test is the real one; only how a worker answers is chosen here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from protos import pdserve_pb2 as pb

ENGINE_ERROR = "engine error: RuntimeError: injected for this request"
# What grpc itself reports for a stream reset on the wire: INTERNAL, but not the engine's.
TRANSPORT_INTERNAL = "Received RST_STREAM with error code 2"

# How a scripted Decode ends, after ``Script.decode_after`` tokens: (code, details), or the
# decode worker's own "preempted" finish.
DECODE_ENDINGS = {
    "engine_error": (grpc.StatusCode.INTERNAL, ENGINE_ERROR),
    "transport_internal": (grpc.StatusCode.INTERNAL, TRANSPORT_INTERNAL),
    "worker_lost": (grpc.StatusCode.UNAVAILABLE, "worker error: injected"),
    "preempted": None,
}


@dataclass
class Script:
    """What the first matching call of each kind does (later ones run as usual)."""

    matches: Callable[[str], bool] = lambda request_id: False  # by the attempt's request id
    decode: str | None = None  # a DECODE_ENDINGS key
    decode_after: int = 2  # tokens streamed before the Decode ends so
    decode_delay_s: float = 0.0  # before the Decode reaches the worker (a late attach)
    prefill_engine_error: bool = False  # the Prefill fails before its first token


@dataclass
class WorkerFaults:
    script: Script = field(default_factory=Script)
    decode_calls: list[str] = field(default_factory=list)  # request ids, in arrival order
    prefill_calls: list[str] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)  # faults that happened, by kind
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self, script: Script) -> None:
        with self._lock:
            self.script = script
            self.decode_calls.clear()
            self.prefill_calls.clear()
            self.fired.clear()

    def _take(self, calls: list[str] | None, kind: str, armed: bool, request_id: str) -> bool:
        """Record the call; True for the first matching call of an ``armed`` ``kind`` (the
        fault's one shot)."""
        with self._lock:
            if calls is not None:
                calls.append(request_id)
            if not armed or kind in self.fired or not self.script.matches(request_id):
                return False
            self.fired.append(kind)
            return True

    def install(self, monkeypatch) -> None:
        from decode_worker.server import DecodeServicer
        from prefill_worker.server import PrefillServicer

        monkeypatch.setattr(DecodeServicer, "Decode", self._wrap_decode(DecodeServicer.Decode))
        monkeypatch.setattr(PrefillServicer, "Prefill", self._wrap_prefill(PrefillServicer.Prefill))

    def _wrap_decode(self, real):
        faults = self

        def decode(servicer, request, context):
            script, rid = faults.script, request.request_id
            if faults._take(None, "decode_delay", script.decode_delay_s > 0, rid):
                time.sleep(script.decode_delay_s)
            if not faults._take(faults.decode_calls, "decode", script.decode is not None, rid):
                yield from real(servicer, request, context)
                return
            chunks, sent = real(servicer, request, context), 0
            for chunk in chunks:
                # Mid-decode whatever the chunking: a slow consumer gets tokens coalesced, and
                # a first chunk that already carried the finish would end the request before
                # the fault (a flake seen under CI load). Only the tokens before the fault go.
                yield _first_tokens(chunk, script.decode_after - sent)
                sent += len(chunk.token_ids)
                if sent >= script.decode_after:
                    break
            chunks.close()  # the worker's own request ends with the call (its abort callback)
            ending = DECODE_ENDINGS[script.decode]
            if ending is None:
                yield pb.TokenChunk(finish_reason="preempted")
                return
            context.abort(*ending)

        return decode

    def _wrap_prefill(self, real):
        faults = self

        def prefill(servicer, request, context):
            armed = faults.script.prefill_engine_error
            if faults._take(faults.prefill_calls, "prefill", armed, request.request_id):
                context.abort(grpc.StatusCode.INTERNAL, ENGINE_ERROR)
            yield from real(servicer, request, context)

        return prefill


def _first_tokens(chunk: pb.TokenChunk, n: int) -> pb.TokenChunk:
    """``chunk`` cut to its first ``n`` tokens (and their logprobs), without its finish when
    tokens were cut or it would finish early (the fault comes after them)."""
    if len(chunk.token_ids) < n or (len(chunk.token_ids) == n and not chunk.finish_reason):
        return chunk
    cut = pb.TokenChunk()
    cut.CopyFrom(chunk)
    del cut.token_ids[n:]
    del cut.logprobs[n:]
    cut.finish_reason = ""
    return cut
