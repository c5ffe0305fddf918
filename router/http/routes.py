"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), on the router's asyncio loop and the
same request path as gRPC (``Router.prepare`` then ``Router.generate``).

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with
``"stream": true``), GET /v1/models and /v1/models/{id}, POST /tokenize and /detokenize (vLLM's),
GET /health and GET/POST /ping (503 until every pool has a ready worker), GET /version, GET
/metrics (Prometheus). Errors use OpenAI's shape ``{"error": {message, type, param, code}}``:
400 bad parameter (named in
``param``), 401 bad API key, 404 unknown model or route, 429 overloaded, 500 an engine error of
the request, 503 workers failed.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
from collections.abc import AsyncIterator

import grpc
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import InvalidRequestError
from router.auth import bearer_ok
from router.core import Router
from router.flow.types import EngineFailure, Overloaded, WorkerFailure
from router.http.guides import forced_tool, required_tools
from router.http.openai_requests import ChatCompletionRequest, CompletionRequest, openapi_body
from router.http.openai_responses import (
    ChatResponseShape,
    RequiredToolCallsShape,
    ResponseBuilder,
    ResponseShape,
    TokenText,
    ToolCallShape,
    timings_body,
    usage_body,
)
from router.http.prompt_batch import merge_prompts
from router.http.pump import Pump
from router.http.tokenize_routes import add_tokenize_routes
from router.limits import check_batch_limits
from router.offload import Offload

log = logging.getLogger("pdserve.router")


def _package_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


_VERSION = _package_version()

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }


def _bad_request(e: InvalidRequestError) -> ApiError:
    return ApiError(400, str(e), e.param)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_error(e: ValidationError) -> ApiError:
    """The first problem, named by its field path (``max_tokens``, ``messages.0.content``)."""
    err = e.errors()[0]
    # Union member tags (``str``, ``list[int]``) are not fields: leave them out of the path.
    path = [
        str(p)
        for p in err["loc"]
        if isinstance(p, int) or p.isidentifier() and p not in _UNION_TAGS
    ]
    param = ".".join(path) or "body"
    return ApiError(400, f"{param}: {err['msg']}", param)


def _worker_error(e: Exception) -> ApiError:
    if isinstance(e, Overloaded):
        retry = {"Retry-After": str(e.retry_after_s)}
        return ApiError(429, f"overloaded: {e}", code="overloaded", headers=retry)
    if isinstance(e, EngineFailure):  # the request's own failure in the engine, not retried
        return ApiError(500, str(e), code="engine_error")
    if isinstance(e, grpc.aio.AioRpcError):
        log.warning("request failed at a worker: %s %s", e.code().name, e.details())
        return ApiError(503, f"worker error: {e.details()}")
    return ApiError(503, str(e))


WORKER_ERRORS = (Overloaded, WorkerFailure, grpc.aio.AioRpcError)


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


class OpenAIHandlers:
    def __init__(self, router: Router):
        self.router = router
        self.token_text = TokenText(router.tokenizer)
        self.offload = Offload()  # tokenization and templates, off the event loop

    def _parse(self, model_cls, raw: bytes):
        try:
            req = model_cls.model_validate_json(raw or b"{}")
        except ValidationError as e:
            raise _validation_error(e) from None
        if req.model is not None and req.model != self.router.cfg.model_name:
            raise ApiError(
                404, f"The model `{req.model}` does not exist.", "model", "model_not_found"
            )
        return req

    async def completions(self, raw: bytes, headers=None) -> Response:
        req = self._parse(CompletionRequest, raw)
        tok = self.router.tokenizer
        try:
            prompts = req.prompt_inputs()
            ids = await self.offload.run(
                lambda: [tok.encode(p) if isinstance(p, str) else p for p in prompts]
            )
        except InvalidRequestError as e:
            raise _bad_request(e) from None
        echoes = None
        if req.echo:
            echoes = await self.offload.run(
                lambda: [
                    (p if isinstance(p, str) else tok.decode(i), i) for p, i in zip(prompts, ids)
                ]
            )
        shape = ResponseShape(self.router.cfg.model_name, with_logprobs=req.logprobs is not None)
        return await self._respond(req, ids, shape, echoes, headers)

    async def chat(self, raw: bytes, headers=None) -> Response:
        req = self._parse(ChatCompletionRequest, raw)
        messages = [m.as_template_input() for m in req.messages]
        try:
            tool, required = forced_tool(req), required_tools(req)
        except InvalidRequestError as e:
            raise _bad_request(e) from None
        # The tools go to the template when the answer must call one (as vLLM renders them).
        tools = req.tools if tool is not None or required is not None else None
        try:
            ids = await self.offload.run(
                self.router.tokenizer.encode_chat, messages, req.add_generation_prompt, tools
            )
        except InvalidRequestError as e:
            raise _bad_request(e) from None
        except Exception as e:  # noqa: BLE001 - a template's raise_exception on these messages
            raise ApiError(400, f"messages: the chat template failed: {e}", "messages") from None
        model = self.router.cfg.model_name
        if tool is not None:
            shape = ToolCallShape(model, tool["name"], with_logprobs=req.logprobs)
        elif required is not None:
            shape = RequiredToolCallsShape(model, with_logprobs=req.logprobs)
        else:
            shape = ChatResponseShape(model, with_logprobs=req.logprobs)
        return await self._respond(req, [ids], shape, headers=headers)

    async def _respond(self, req, prompts, shape: ResponseShape, echoes=None, headers=None):
        """Run the request's prompts (a batch on completions) and answer, whole or streamed;
        ``headers``: the HTTP request's, for a W3C traceparent while tracing is on."""
        cfg = self.router.cfg
        try:
            req.check_supported()
            inputs = []
            for ids in prompts:
                sampling = req.to_sampling(len(ids), cfg.max_model_len, cfg.default_max_tokens)
                inputs.append(self.router.prepare(ids, sampling, trace_carrier=headers))
            max_tokens = [inp.params.max_tokens for inp in inputs]
            check_batch_limits(self.router.cfg.limits, req.n, max_tokens)  # n x prompts
        except InvalidRequestError as e:
            if e.param == "logprobs" and isinstance(req, ChatCompletionRequest):
                e = InvalidRequestError("top_logprobs", e.reason)  # chat's name for it
            raise _bad_request(e) from None
        deltas = merge_prompts([self.router.generate(inp) for inp in inputs], req.n)
        try:
            first = await deltas.__anext__()  # admission errors become a status, not a stream
        except InvalidRequestError as e:
            raise _bad_request(e) from None
        except WORKER_ERRORS as e:
            raise _worker_error(e) from None
        builder = ResponseBuilder(shape, self.token_text, req.n, echoes, len(prompts))
        if req.stream:
            events = self._stream(req, builder, first, deltas)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return JSONResponse(await self._collect(req, builder, first, deltas))

    async def _collect(self, req, builder: ResponseBuilder, first, deltas) -> dict:
        """The whole response; the delta with ``usage`` is the request's last."""
        try:
            builder.add(first)
            while builder.usage is None:
                builder.add(await deltas.__anext__())
        except WORKER_ERRORS as e:
            raise _worker_error(e) from None
        finally:
            await deltas.aclose()
        extra = {"usage": usage_body(builder.usage)}
        if req.return_timings:
            extra["timings"] = timings_body(builder.timings)
        return builder.shape.whole(builder.choices, **extra)

    async def _stream(self, req, builder: ResponseBuilder, first, deltas) -> AsyncIterator[str]:
        usage_field = {"usage": None} if req.include_usage else {}
        timings = req.return_timings
        pump = Pump(deltas)
        delta = first
        try:
            while True:
                choice = builder.add(delta)
                done = builder.usage is not None
                if choice is not None:
                    extra = usage_field
                    if done and timings and not req.include_usage:  # on the last chunk
                        extra = {"timings": timings_body(builder.timings)}
                    yield _sse(builder.shape.chunk(choice, **extra))
                if done:
                    break
                delta = await pump.next()
        except WORKER_ERRORS as e:  # too late for a status code: an error event ends the stream
            yield _sse(_worker_error(e).body())
            return
        finally:
            pump.stop()
        if req.include_usage:
            last = {"timings": timings_body(builder.timings)} if timings else {}
            yield _sse(builder.shape.usage_chunk(usage=usage_body(builder.usage), **last))
        yield _sse("[DONE]")


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up; nobody reads it


async def _unless_client_leaves(request: Request, answer) -> Response:
    """Await the handler's ``answer``, cancelling it if the client hangs up first. A whole
    (non-streaming) response is built before anything is sent, so nothing else would notice
    the hang-up: the request would decode to its end for nobody, holding KV on both pools.
    The handler runs in a plain task cancelled once, so its cleanup (aborting the worker calls,
    releasing a lease over gRPC) runs to its end. A streamed answer returns at its first
    token; from there StreamingResponse watches the connection itself."""
    work = asyncio.ensure_future(answer)
    hang_up = asyncio.ensure_future(_hang_up(request))
    try:
        await asyncio.wait([work, hang_up], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping
        work.cancel()
        raise
    finally:
        hang_up.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)  # its cleanup, to the end
        log.info("client left before its response; request cancelled")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if work.cancelled():  # a cancel that leaked out of a worker call, not the client's
        log.error("request cancelled inside the router; answered 503")
        return _error_response(ApiError(503, "the request was cancelled at a worker; retry"))
    return work.result()


async def _hang_up(request: Request) -> None:
    """Returns once the client has disconnected (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(router: Router, api_key: str | None = None) -> FastAPI:
    """The FastAPI app for ``router``; with ``api_key``, /v1/* requires ``Bearer <api_key>``."""
    app = FastAPI(title="pdserve", summary="OpenAI-compatible API of a pdserve cluster")
    handlers = OpenAIHandlers(router)

    async def require_key(request: Request) -> None:
        if api_key and not bearer_ok(request.headers.get("authorization"), api_key):
            raise ApiError(
                401,
                "Incorrect or missing API key (Authorization: Bearer <key>).",
                code="invalid_api_key",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.post("/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await request.body()
        return await _unless_client_leaves(request, handlers.completions(body, request.headers))

    @v1.post("/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _unless_client_leaves(
            request, handlers.chat(await request.body(), request.headers)
        )

    def model_card() -> dict:
        cfg = router.cfg
        return {
            "id": cfg.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": cfg.max_model_len,
        }

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model:path}")  # OpenAI's retrieve: a served name may hold a '/'
    async def model(model: str) -> dict:
        if model != router.cfg.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return model_card()

    app.include_router(v1)
    tokens = APIRouter(dependencies=[Depends(require_key)])  # vLLM's paths: no /v1
    add_tokenize_routes(tokens, router, handlers._parse, _bad_request, handlers.offload)
    app.include_router(tokens)
    _add_operational_routes(app, router)
    _add_error_handlers(app)
    return app


def _add_operational_routes(app: FastAPI, router: Router) -> None:
    async def health() -> Response:
        body = {
            "status": "ok" if router.ready else "unavailable",
            "prefill_workers": len(router.prefill.routable()),
            "decode_workers": len(router.decode.routable()),
        }
        return JSONResponse(body, status_code=200 if router.ready else 503)

    # /ping is vLLM's (and SageMaker's) name for the same probe, GET or POST.
    for path, method in (("/health", "GET"), ("/ping", "GET"), ("/ping", "POST")):
        name = f"{path[1:]}_{method.lower()}"  # one OpenAPI operation id each
        app.add_api_route(path, health, methods=[method], operation_id=name)

    @app.get("/version")  # vLLM's: the server's version
    async def version() -> dict:
        return {"version": _VERSION}

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = router.metrics.render()
        return Response(data, media_type=content_type)


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("HTTP request failed")
        return JSONResponse(
            ApiError(500, f"internal error: {type(e).__name__}").body(), status_code=500
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code
        )
