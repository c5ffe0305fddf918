"""POST /tokenize, POST /detokenize and GET /tokenizer_info in vLLM's shapes:

/tokenize    {"prompt": str} or {"messages": [...], "add_generation_prompt": bool}
             (+ "model", "add_special_tokens", "return_token_strs")
             -> {"count", "max_model_len", "tokens", "token_strs"}
/detokenize  {"tokens": [int]} -> {"prompt": str}
/tokenizer_info -> special tokens, chat template, max length (lm-eval's remote tokenizer
             reads it, then tokenizes through /tokenize)
"""

from __future__ import annotations

from fastapi import APIRouter, Request
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


def add_tokenize_routes(api: APIRouter, router: Router, parse, bad_request) -> None:
    """``parse(model_cls, raw)`` validates a body (400/404); ``bad_request`` turns an
    ``InvalidRequestError`` into the 400 to raise."""

    @api.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize_route(request: Request) -> dict:
        req = parse(TokenizeRequest, await request.body())
        messages = None if req.messages is None else [m.as_template_input() for m in req.messages]
        try:
            ids = tokenize(
                router.tokenizer,
                req.prompt,
                messages,
                req.add_special_tokens,
                req.add_generation_prompt,
            )
        except InvalidRequestError as e:
            raise bad_request(e) from None
        strs = [router.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": router.cfg.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

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
            return {"prompt": detokenize(router.tokenizer, req.tokens)}
        except InvalidRequestError as e:
            raise bad_request(e) from None
