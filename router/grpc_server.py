"""The client API over gRPC (async): Generate (server streaming), ListModels, Health, and the
standard grpc.health.v1 service (router/health.py)."""

from __future__ import annotations

import logging

import grpc

from engine.errors import InvalidRequestError
from grpc_plumbing.reflection import enable_reflection
from grpc_plumbing.server import EXCLUSIVE_PORT, bind
from grpc_plumbing.tls import TlsFiles
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.auth import ApiKeyInterceptor
from router.core import Router
from router.drain import Draining
from router.flow.types import EngineFailure, Overloaded, WorkerFailure
from router.health import GENERATION_SERVICE, HEALTH_SERVICE, RouterHealth
from router.offload import Offload
from router.tokenize import detokenize, tokenize

log = logging.getLogger("pdserve.router")


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, router: Router):
        self.router = router
        self.offload = Offload()  # tokenization and templates, off the event loop

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        tok = self.router.tokenizer
        if kind == "prompt":
            return tok.encode(request.prompt)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise InvalidRequestError("chat.messages", "must not be empty")
            return tok.encode_chat(messages)
        raise InvalidRequestError("input", "one of prompt, token_ids or chat is required")

    async def Generate(self, request, context):
        if request.model and request.model != self.router.cfg.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served")
        try:
            ids = await self.offload.run(self._prompt_ids, request)
            # A caller's traceparent (gRPC metadata), read only while tracing is on.
            carrier = context.invocation_metadata() if self.router.tracing is not None else None
            inp = self.router.prepare(ids, request.sampling, request.request_id, carrier)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            async for delta in self.router.generate(inp):
                msg = pb.GenerateResponse(
                    request_id=inp.request_id,
                    token_ids=delta.token_ids,
                    text=delta.text,
                    logprobs=delta.logprobs,
                    prompt_logprobs=delta.prompt_logprobs,
                    index=delta.index,
                )
                if delta.finish_reason:
                    msg.finish_reason = delta.finish_reason
                if delta.usage is not None:  # the request's last message
                    msg.usage.CopyFrom(delta.usage)
                    if request.include_timings:
                        t = delta.timings
                        msg.timings.CopyFrom(
                            pb.Timings(
                                prefill_queue_s=t.prefill_queue_s,
                                prefill_s=t.prefill_s,
                                kv_transfer_s=t.kv_transfer_s,
                                decode_queue_s=t.decode_queue_s,
                                ttft_s=t.ttft_s,
                                e2e_s=t.e2e_s,
                                kv_bytes=t.kv_bytes,
                                prefill_cached_tokens=t.prefill_cached_tokens,
                                decode_cached_tokens=t.decode_cached_tokens,
                            )
                        )
                yield msg
        except InvalidRequestError as e:  # admission: a request id already in flight
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Draining as e:  # stopping: another router (or this one, restarted) serves it
            retry = (("retry-after", str(e.retry_after_s)),)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e), retry)
        except Overloaded as e:
            retry = (("retry-after", str(e.retry_after_s)),)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), retry)
        except EngineFailure as e:  # the engine failed this request: its own error, not ours
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except WorkerFailure as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except grpc.aio.AioRpcError as e:
            log.warning("%s failed at a worker: %s %s", inp.request_id, e.code().name, e.details())
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker error: {e.details()}")

    async def ListModels(self, request, context):
        cfg = self.router.cfg
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id=cfg.model_name, max_model_len=cfg.max_model_len)]
        )

    async def _check_model(self, model: str, context) -> None:
        if model and model != self.router.cfg.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served")

    async def Tokenize(self, request, context):
        await self._check_model(request.model, context)
        chat = request.WhichOneof("input") == "chat"
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        try:
            ids = await self.offload.run(
                tokenize,
                self.router.tokenizer,
                None if chat else request.prompt,
                messages if chat else None,
                request.add_special_tokens if request.HasField("add_special_tokens") else None,
                not request.HasField("add_generation_prompt") or request.add_generation_prompt,
            )
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(
            tokens=ids, count=len(ids), max_model_len=self.router.cfg.max_model_len
        )

    async def Detokenize(self, request, context):
        await self._check_model(request.model, context)
        try:
            text = await self.offload.run(detokenize, self.router.tokenizer, request.tokens)
            return pb.DetokenizeResponse(prompt=text)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Health(self, request, context):
        return pb.HealthResponse(
            ready=self.router.ready,
            prefill_workers=len(self.router.prefill.routable()),
            decode_workers=len(self.router.decode.routable()),
        )


async def start_grpc_server(
    router: Router, host: str = "127.0.0.1", port: int = 0, tls: TlsFiles | None = None
):
    """Start the async gRPC server for ``router``, with server reflection v1 and v1alpha
    (grpcurl, grpcui and Postman can call it without the .proto), the API key check when one is configured,
    requests capped at the router's max_request_bytes and TLS with ``tls``; returns
    (server, address)."""
    api_key = router.cfg.api_key
    max_bytes = router.cfg.limits.max_request_bytes
    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(api_key)] if api_key else None,
        options=EXCLUSIVE_PORT + [("grpc.max_receive_message_length", max_bytes)],
    )
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(router), server)
    health = RouterHealth(router)
    health.add_to(server)
    enable_reflection((GENERATION_SERVICE, HEALTH_SERVICE), server)
    bound = bind(server, f"{host}:{port}", tls)
    await server.start()
    await health.start()
    server.pdserve_health = health  # stopped with the server (RouterServers.stop)
    return server, f"{host}:{bound}"
