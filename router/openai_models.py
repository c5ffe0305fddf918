"""OpenAI API shapes at the HTTP edge: request models (pydantic, strict types) and the response
and stream-chunk bodies of /v1/completions and /v1/chat/completions.

Types are checked here (``"max_tokens": "abc"`` is a 400 naming ``max_tokens``); value ranges
that the engine defines (temperature, top_k, min_tokens vs max_tokens, the context length) are
checked once, by ``Router.prepare``, for HTTP and gRPC alike.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequestError
from protos import pdserve_pb2 as pb

UINT32 = 2**32 - 1
INT32 = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=UINT32)]
StopString = Annotated[str, Field(min_length=1)]
# OpenAI parameters pdserve does not implement: accepted only at their neutral values, so a
# user who asks for more gets a 400 instead of silence.
NEUTRAL_VALUES = {
    "best_of": 1,
    "echo": False,
    "logprobs": False,
    "top_logprobs": 0,
    "suffix": "",
    "tools": [],
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _GenerateRequest(BaseModel):
    """Fields shared by completions and chat; the extensions follow vLLM's names."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32)
    temperature: float | None = None  # OpenAI's default is 1.0 (sampling); 0 is greedy
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32)  # extension; -1 or 0 = off
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: StopString | list[StopString] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions.
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=UINT32)
    stop_token_ids: list[TokenId] | None = None
    return_timings: bool = False  # attach the TTFT breakdown ("timings") to the response
    # Ranges are the engine's (SamplingParams); logit_bias keys are token ids as strings.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension, as vLLM
    logit_bias: dict[str, float] | None = None
    # See NEUTRAL_VALUES.
    best_of: Any = None
    echo: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    suffix: Any = None
    tools: Any = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise InvalidRequestError("n", f"only n=1 is supported, got {self.n!r}")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "is only allowed with stream=true")
        for name, neutral in NEUTRAL_VALUES.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise InvalidRequestError(name, f"is not supported (got {value!r})")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling(
        self, prompt_len: int, max_model_len: int, default_max: int
    ) -> pb.SamplingParams:
        """The wire SamplingParams; with no max_tokens, as many as fit, up to ``default_max``."""
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(0, min(default_max, max_model_len - prompt_len))  # 0: prepare says why
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if (
            self.repetition_penalty is not None and self.repetition_penalty <= 0
        ):  # 0 is unset on the wire
            raise InvalidRequestError("repetition_penalty", "must be in (0, 2]")
        msg = pb.SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p or 1.0,
            top_k=max(0, self.top_k or 0),
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 0.0,
            logit_bias=self.token_logit_bias(),
        )
        if self.seed is not None:
            msg.seed = self.seed
        return msg

    def token_logit_bias(self) -> dict[int, float]:
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(
                    "logit_bias", f"keys are token ids, got {key!r}"
                ) from None
            if not 0 <= token <= UINT32:
                raise InvalidRequestError("logit_bias", f"token id {token} is out of range")
            out[token] = bias
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerateRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text, or token ids. A batch of prompts is a 400 (n=1 only)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequestError("prompt", f"one prompt per request, got {len(p)}")
            p = p[0]
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32)  # the newer max_tokens

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses -------------------------------------------------------------------------


def usage_body(usage: pb.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def timings_body(t) -> dict:
    """Where the first token's time went; ``other_s`` is the rest of TTFT (routing, the
    reservation, network)."""
    parts = t.prefill_queue_s + t.prefill_s + t.kv_transfer_s + t.decode_queue_s
    return {
        "prefill_queue_s": t.prefill_queue_s,
        "prefill_s": t.prefill_s,
        "kv_transfer_s": t.kv_transfer_s,
        "decode_queue_s": t.decode_queue_s,
        "other_s": max(0.0, t.ttft_s - parts),
        "ttft_s": t.ttft_s,
        "e2e_s": getattr(t, "e2e_s", 0.0),
        "kv_bytes": t.kv_bytes,
        "cached_tokens": t.cached_tokens,
        "preemptions": t.preemptions,
    }


class ResponseShape:
    """Builds one request's response bodies: whole, or as stream chunks."""

    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.sent_role = True  # chat sends the assistant role in its first chunk

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta_choice(self, text: str, finish_reason: str | None) -> dict:
        return self.choice(text, finish_reason)

    def whole(self, text: str, finish_reason: str, **extra) -> dict:
        return self._body(self.object_name, [self.choice(text, finish_reason)], **extra)

    def chunk(self, text: str, finish_reason: str | None = None, **extra) -> dict:
        return self._body(self.chunk_object, [self.delta_choice(text, finish_reason)], **extra)

    def usage_chunk(self, **extra) -> dict:
        return self._body(self.chunk_object, [], **extra)


class ChatResponseShape(ResponseShape):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str):
        super().__init__(model)
        self.sent_role = False

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }

    def delta_choice(self, text: str, finish_reason: str | None) -> dict:
        delta = {"content": text} if text or not self.sent_role else {}
        if not self.sent_role:
            delta = {"role": "assistant", **delta}
            self.sent_role = True
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
