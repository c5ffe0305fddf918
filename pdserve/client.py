"""Python client for the pdserve gRPC API (``pdserve.v1.Generation``), sync and async, with
streaming. For HTTP, use any OpenAI client against ``http://<router>/v1``.

Sync::

    from pdserve.client import Client
    with Client("127.0.0.1:50051", api_key="sk-...") as client:   # api_key only if configured
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32):
            print(chunk.text, end="", flush=True)
        out = client.generate("Once upon a time", max_tokens=16, temperature=0.8, seed=1)
        print(out.text, out.finish_reason, out.usage.completion_tokens)

Async::

    from pdserve.client import AsyncClient
    client = AsyncClient("127.0.0.1:50051")
    async for chunk in client.stream(token_ids=[1, 2, 3], max_tokens=8, include_timings=True):
        ...
    await client.close()

Input is one of ``prompt`` (text), ``token_ids`` or ``messages`` (rendered with the model's
chat template). Sampling keywords are the fields of ``SamplingParams`` in
``protos/pdserve.proto`` (max_tokens, temperature, top_p, top_k, min_p, seed, stop,
include_stop_str_in_output, skip_special_tokens, stop_token_ids, ignore_eos, min_tokens,
presence_penalty, frequency_penalty, repetition_penalty, logit_bias, logprobs, prompt_logprobs,
n; ``guide={"kind": "json" | "json_object" | "regex" | "choice" | "grammar", "spec": ...}`` for
structured output);
``include_timings=True`` puts the TTFT breakdown on the last chunk. With n > 1, chunks carry
``index`` and ``Completion.sequences`` holds each sequence. The API key travels as metadata
``authorization: Bearer <key>``. Errors are ``grpc.RpcError``: INVALID_ARGUMENT (the message
names the parameter), UNAUTHENTICATED, NOT_FOUND (model), RESOURCE_EXHAUSTED (overloaded: retry
later), UNAVAILABLE (workers failed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

SAMPLING_FIELDS = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}


@dataclass
class Sequence:
    """One of a request's n sequences."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # with sampling.logprobs
    finish_reason: str = ""


@dataclass
class Completion:
    """A request's result; ``text``, ``token_ids`` and ``finish_reason`` are sequence 0's,
    ``sequences`` has all n."""

    request_id: str = ""
    usage: pb.Usage | None = None
    timings: pb.Timings | None = None
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # with echo's ask
    sequences: list[Sequence] = field(default_factory=lambda: [Sequence()])

    @property
    def text(self) -> str:
        return self.sequences[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.sequences[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.sequences[0].finish_reason

    def add(self, chunk: pb.GenerateResponse) -> None:
        self.request_id = chunk.request_id
        while len(self.sequences) <= chunk.index:
            self.sequences.append(Sequence())
        seq = self.sequences[chunk.index]
        seq.text += chunk.text
        seq.token_ids.extend(chunk.token_ids)
        seq.logprobs.extend(chunk.logprobs)
        seq.finish_reason = chunk.finish_reason or seq.finish_reason
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        if chunk.HasField("usage"):  # the request's last message
            self.usage = chunk.usage
            self.timings = chunk.timings if chunk.HasField("timings") else None


def build_request(
    prompt=None,
    *,
    token_ids=None,
    messages=None,
    model="",
    request_id="",
    include_timings=False,
    **sampling,
) -> pb.GenerateRequest:
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    req = pb.GenerateRequest(
        model=model,
        request_id=request_id,
        include_timings=include_timings,
        sampling=pb.SamplingParams(**sampling),
    )
    if prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif messages is not None:
        req.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
    return req


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).expanduser().read_bytes()


def channel_credentials(
    tls: bool = False,
    ca: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
):
    """TLS credentials for a router's gRPC API, or None for plaintext. ``ca`` (a PEM path; the
    system's roots without it) implies TLS; ``client_cert``/``client_key``: mutual TLS."""
    if not (tls or ca or client_cert):
        return None
    return grpc.ssl_channel_credentials(_read(ca), _read(client_key), _read(client_cert))


class Client:
    """``Client(address, api_key=None, tls=False, ca=None, client_cert=None, client_key=None)``:
    plaintext gRPC unless ``tls`` or ``ca`` is given (see ``channel_credentials``)."""

    def __init__(self, address: str, api_key: str | None = None, **tls):
        creds = channel_credentials(**tls)
        self._channel = (
            grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        )
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = _metadata(api_key)

    def stream(self, prompt=None, **kw) -> Iterator[pb.GenerateResponse]:
        yield from self._stub.Generate(build_request(prompt, **kw), metadata=self._metadata)

    def generate(self, prompt=None, **kw) -> Completion:
        out = Completion()
        for chunk in self.stream(prompt, **kw):
            out.add(chunk)
        return out

    def list_models(self) -> list[pb.ModelInfo]:
        return list(self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata).models)

    def health(self) -> pb.HealthResponse:
        return self._stub.Health(pb.HealthRequest(), metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """As ``Client``, on asyncio."""

    def __init__(self, address: str, api_key: str | None = None, **tls):
        creds = channel_credentials(**tls)
        aio = grpc.aio
        self._channel = (
            aio.secure_channel(address, creds) if creds else aio.insecure_channel(address)
        )
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = _metadata(api_key)

    async def stream(self, prompt=None, **kw) -> AsyncIterator[pb.GenerateResponse]:
        async for chunk in self._stub.Generate(
            build_request(prompt, **kw), metadata=self._metadata
        ):
            yield chunk

    async def generate(self, prompt=None, **kw) -> Completion:
        out = Completion()
        async for chunk in self.stream(prompt, **kw):
            out.add(chunk)
        return out

    async def close(self) -> None:
        await self._channel.close()
