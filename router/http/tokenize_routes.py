"""POST /tokenize, POST /detokenize and GET /tokenizer_info in vLLM's shapes:

/tokenize    {"prompt": str} or {"messages": [...], "add_generation_prompt": bool}
             (+ "model", "add_special_tokens", "return_token_strs")
             -> {"count", "max_model_len", "tokens", "token_strs"}
/detokenize  {"tokens": [int]} -> {"prompt": str}
/tokenizer_info -> special tokens, chat template, max length (lm-eval's remote tokenizer
             reads it, then tokenizes through /tokenize)
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequestError
from router.core import Router
from router.http.openai_requests import ChatMessage, TokenId, openapi_body
from router.tokenize import detokenize, tokenize


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[TokenId] = Field(min_length=0)


def add_tokenize_routes(api: APIRouter, router: Router, parse, bad_request, offload) -> None:
    """``parse(model_cls, raw)`` validates a body (400/404); ``bad_request`` turns an
    ``InvalidRequestError`` into the 400 to raise; ``offload`` (router/offload.py) runs
    the tokenizer and templates off the event loop."""

    def answer(req: TokenizeRequest) -> bytes:
        """The response body, JSON-encoded here too: a 1 MiB prompt's ids are 100k's of
        numbers, too long to encode on the event loop (or in one call holding the GIL)."""
        messages = None if req.messages is None else [m.as_template_input() for m in req.messages]
        tok = router.tokenizer
        add_special, add_generation = req.add_special_tokens, req.add_generation_prompt
        ids = tokenize(tok, req.prompt, messages, add_special, add_generation)
        strs = [tok.id_to_token(t) for t in ids] if req.return_token_strs else None
        head = {"count": len(ids), "max_model_len": router.cfg.max_model_len}
        return b"".join(
            [json.dumps(head)[:-1].encode(), b', "tokens": ', _json_list(ids)]
            + [b', "token_strs": ', _json_list(strs), b"}"]
        )

    @api.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize_route(request: Request) -> Response:
        req = parse(TokenizeRequest, await request.body())
        try:
            body = await offload.run(answer, req)
        except InvalidRequestError as e:
            raise bad_request(e) from None
        return Response(body, media_type="application/json")

    @api.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        tok = router.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.bos_token or None,
            "eos_token": tok.eos_token or None,
            "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": router.cfg.max_model_len,
        }

    @api.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> dict:
        req = parse(DetokenizeRequest, await request.body())
        try:
            return {"prompt": await offload.run(detokenize, router.tokenizer, req.tokens)}
        except InvalidRequestError as e:
            raise bad_request(e) from None


JSON_SLICE = 2048  # list items per json.dumps call: each holds the GIL well under 1 ms


def _json_list(items: list | None) -> bytes:
    """``json.dumps(items)`` in slices, letting go of the GIL between them: one call over
    350k numbers holds it for 75 ms, and a thread running Python keeps it up to the switch
    interval (5 ms) each time the event loop's thread asks; both would delay every stream."""
    if items is None:
        return b"null"
    parts = []
    for i in range(0, len(items), JSON_SLICE):
        parts.append(json.dumps(items[i : i + JSON_SLICE])[1:-1])
        time.sleep(0)  # the loop's thread takes the GIL now if it waits for it
    return ("[" + ", ".join(p for p in parts if p) + "]").encode()
