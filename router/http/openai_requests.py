"""OpenAI API requests at the HTTP edge: the request models (pydantic, strict types) of
/v1/completions and /v1/chat/completions (their responses: ``router/http/openai_responses.py``).

Types are checked here (``"max_tokens": "abc"`` is a 400 naming ``max_tokens``); value ranges
that the engine defines (temperature, top_k, min_tokens vs max_tokens, the context length) are
checked once, by ``Router.prepare``, for HTTP and gRPC alike.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequestError
from engine.request import MAX_LOGPROBS, MAX_N
from protos import pdserve_pb2 as pb
from router.http.guides import request_guide

UINT32 = 2**32 - 1
INT32 = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=UINT32)]
StopString = Annotated[str, Field(min_length=1)]
MAX_PROMPTS = 64  # prompts in one completions request
# Parameters of OpenAI's API and vLLM's extensions that pdserve does not implement, each with
# the values that ask for nothing (what it does anyway): any other value is a 400 naming the
# parameter, never silence; a client that asks for JSON output, tools or guided decoding
# must not get free text as if it had. Unknown names are ignored, as vLLM does.
NEUTRAL_VALUES = {
    "suffix": ("",),
    "functions": ([],),  # OpenAI's older tools
    "function_call": ("none", "auto"),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),  # beam search's
    "bad_words": ([],),
    "prompt_logprobs": (),  # completions: echo with logprobs gives them
    "truncate_prompt_tokens": (),
    "priority": (0,),  # no priority scheduling
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's usage on every chunk: not implemented


def _is_one_of(value, neutral: tuple) -> bool:
    # type() too: True == 1 and 1 == 1.0 in Python, but "priority": true is no priority 0.
    return any(type(value) is type(n) and value == n for n in neutral)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


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
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions.
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=UINT32)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False  # the stop string that ends the text stays in it
    skip_special_tokens: bool = True  # false: special tokens (EOS, chat markers) show in the text
    return_timings: bool = False  # attach the TTFT breakdown ("timings") to the response
    # Ranges are the engine's (SamplingParams); logit_bias keys are token ids as strings.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension, as vLLM
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension, as vLLM; 0 = off
    # Structured output (router/http/guides.py): one of them, any JSON shape, checked there.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # See NEUTRAL_VALUES.
    suffix: Any = None
    functions: Any = None
    function_call: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    priority: Any = None

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "is only allowed with stream=true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise InvalidRequestError("stream_options.continuous_usage_stats", "is not supported")
        for name, neutral in NEUTRAL_VALUES.items():
            value = getattr(self, name)
            if value is not None and not _is_one_of(value, neutral):
                raise InvalidRequestError(name, f"is not supported (got {_short(value)})")

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
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 0.0,
            logit_bias=self.token_logit_bias(),
            n=self.n,
            min_p=self.min_p or 0.0,
        )
        if self.seed is not None:
            msg.seed = self.seed
        guide = request_guide(self)
        if guide is not None:
            msg.guide.kind, msg.guide.spec = guide
        logprobs, prompt_logprobs = self.logprob_counts()
        if logprobs is not None:
            msg.logprobs = logprobs
        if prompt_logprobs is not None:
            msg.prompt_logprobs = prompt_logprobs
        return msg

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """Top-k logprobs asked for generated and prompt positions (None: none at all)."""
        return None, None

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
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top-k per position
    echo: bool = False  # the prompt comes back before the completion (with logprobs if asked)
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            # Ranking best_of candidates by logprob is not implemented (vLLM V1 dropped it too).
            raise InvalidRequestError("best_of", f"must equal n ({self.n}) when set")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts: one text or token-id list, or a batch of them (choice k * n + i is
        sequence i of prompt k, as in OpenAI and vLLM)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) > MAX_PROMPTS:
                raise InvalidRequestError("prompt", f"at most {MAX_PROMPTS} prompts, got {len(p)}")
            return list(p)
        return [p]


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


# Chat's own extensions (vLLM's) that pdserve does not implement, as NEUTRAL_VALUES.
CHAT_NEUTRAL_VALUES = {
    "echo": (False,),
    "continue_final_message": (False,),
    "chat_template": (),  # the model's own template only
    "chat_template_kwargs": ({},),
    "documents": (),
    "modalities": (["text"],),
    "audio": (),
}


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32)  # the newer max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: false renders the messages without the assistant turn's opening.
    add_generation_prompt: bool = True
    # Tool calls: one named function, or "required" (router/http/guides.py).
    tools: Any = None
    tool_choice: Any = None
    # See CHAT_NEUTRAL_VALUES.
    echo: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    modalities: Any = None
    audio: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, neutral in CHAT_NEUTRAL_VALUES.items():
            value = getattr(self, name)
            if value is not None and not _is_one_of(value, neutral):
                raise InvalidRequestError(name, f"is not supported (got {_short(value)})")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def openapi_body(model_cls: type[BaseModel]) -> dict:
    """A route's ``openapi_extra`` declaring ``model_cls`` as its JSON body. The handlers parse
    the raw body themselves (so errors keep OpenAI's shape), which leaves FastAPI nothing to
    document: this puts the schema back, for clients and for the schema-driven fuzz test."""
    schema = model_cls.model_json_schema()
    defs = schema.pop("$defs", {})
    content = {"application/json": {"schema": _inline_refs(schema, defs)}}
    return {"requestBody": {"required": True, "content": content}}


def _inline_refs(node, defs: dict):
    """``$ref``s to ``#/$defs/X`` replaced by X (the request models are not recursive)."""
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node
