"""OpenAI response bodies of /v1/completions and /v1/chat/completions: whole responses and
stream chunks, one choice per sequence (``n``), with logprobs in each API's shape.

Completions: ``logprobs: {tokens, token_logprobs, top_logprobs, text_offset}``; with ``echo``
the prompt's text and logprobs come first (its first token has none: null). Chat:
``logprobs: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
Tokens are named by their own decoded text, as vLLM does.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.tokenizer import Tokenizer
from protos import pdserve_pb2 as pb


class Token(NamedTuple):
    text: str  # decoded alone, as logprobs name tokens
    raw: bytes  # its own bytes (part of a character, for some tokens): chat's ``bytes``


# One position: (token, its logprob or None, [(alternative, logprob)] or None).
Record = tuple[Token, float | None, list[tuple[Token, float]] | None]


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
        "prefill_cached_tokens": t.prefill_cached_tokens,
        "decode_cached_tokens": t.decode_cached_tokens,
        "preemptions": t.preemptions,
    }


class TokenText:
    """Each token's own text (decoded alone, special tokens kept) and bytes, cached per id."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, Token] = {}

    def __call__(self, token_id: int) -> Token:
        token = self._cache.get(token_id)
        if token is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            token = self._cache[token_id] = Token(text, self._tok.token_bytes(token_id))
        return token

    def records(self, ids, entries) -> list[Record]:
        """``entries``: a ``pb.TokenLogprobs`` per id, or None where a position has none."""
        out = []
        for token, entry in zip(ids, entries):
            if entry is None:
                out.append((self(token), None, None))
                continue
            top = [(self(t.token_id), t.logprob) for t in entry.top]
            out.append((self(token), entry.logprob, top))
        return out


@dataclass
class Choice:
    """One sequence's text and logprob records so far."""

    index: int
    text: str = ""
    records: list[Record] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # a chunk went out (chat: with the role)
    echoed: bool = False  # the prompt went out before the completion (echo)
    # Where the next record's token starts: the sum of the token texts so far (text_offset).
    token_offset: int = 0


class ResponseShape:
    """Builds one request's response bodies: whole, or as stream chunks."""

    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, with_logprobs: bool = False):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.with_logprobs = with_logprobs

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def logprobs_body(self, records: list[Record], offset: int) -> dict | None:
        if not self.with_logprobs:
            return None
        offsets = []
        for token, _, _ in records:
            offsets.append(offset)
            offset += len(token.text)
        return {
            "tokens": [r[0].text for r in records],
            "token_logprobs": [r[1] for r in records],
            "top_logprobs": [
                None if r[2] is None else {t.text: lp for t, lp in r[2]} for r in records
            ],
            "text_offset": offsets,
        }

    def choice(self, c: Choice) -> dict:
        lp = self.logprobs_body(c.records, 0)
        return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}

    def delta_choice(self, c: Choice, text: str, records: list[Record], offset: int) -> dict:
        lp = self.logprobs_body(records, offset)
        c.started = True
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}

    def wants_chunk(self, c: Choice, text: str, records: list) -> bool:
        return bool(text or records or c.finish_reason)

    def whole(self, choices: list[Choice], **extra) -> dict:
        return self._body(self.object_name, [self.choice(c) for c in choices], **extra)

    def chunk(self, choice: dict, **extra) -> dict:
        return self._body(self.chunk_object, [choice], **extra)

    def usage_chunk(self, **extra) -> dict:
        return self._body(self.chunk_object, [], **extra)


class ChatResponseShape(ResponseShape):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def logprobs_body(self, records: list[Record], offset: int) -> dict | None:
        if not self.with_logprobs:
            return None

        def one(token: Token, logprob: float) -> dict:
            return {"token": token.text, "logprob": logprob, "bytes": list(token.raw)}

        content = [
            {**one(token, lp), "top_logprobs": [one(t, v) for t, v in top or ()]}
            for token, lp, top in records
        ]
        return {"content": content, "refusal": None}

    def choice(self, c: Choice) -> dict:
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": self.logprobs_body(c.records, 0),
            "finish_reason": c.finish_reason,
        }

    def delta_choice(self, c: Choice, text: str, records: list[Record], offset: int) -> dict:
        delta = {"content": text} if text or not c.started else {}
        if not c.started:
            delta = {"role": "assistant", **delta}
            c.started = True
        lp = self.logprobs_body(records, offset) if records else None
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason}

    def wants_chunk(self, c: Choice, text: str, records: list) -> bool:
        return not c.started or super().wants_chunk(c, text, records)


class ToolCallShape(ChatResponseShape):
    """A chat answered with a forced call of one function (``tool_choice`` naming it): the
    generated text, held to the function's parameters schema, is the call's ``arguments``;
    ``content`` is null. Streamed: the first chunk opens the call (id, name), later ones add
    to its arguments. ``finish_reason`` stays the request's (OpenAI answers a forced call with
    "stop")."""

    def __init__(self, model: str, function: str, with_logprobs: bool = False):
        super().__init__(model, with_logprobs)
        self.function = function
        self._call_ids: dict[int, str] = {}  # by choice: each of n choices is its own call

    def call_id(self, c: Choice) -> str:
        return self._call_ids.setdefault(c.index, _new_call_id())

    def choice(self, c: Choice) -> dict:
        body = super().choice(c)
        call = {"id": self.call_id(c), "type": "function"}
        call["function"] = {"name": self.function, "arguments": c.text}
        body["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
        return body

    def delta_choice(self, c: Choice, text: str, records: list[Record], offset: int) -> dict:
        opening = not c.started
        body = super().delta_choice(c, text, records, offset)
        delta = {"role": "assistant"} if opening else {}
        if opening:
            call = {"index": 0, "id": self.call_id(c), "type": "function"}
            call["function"] = {"name": self.function, "arguments": text}
            delta["tool_calls"] = [call]
        elif text:
            delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
        body["delta"] = delta
        return body


class RequiredToolCallsShape(ChatResponseShape):
    """A chat answered with one or more calls (``tool_choice`` "required"): the generated
    text, held to a JSON array of ``{"name", "parameters"}`` (router/http/guides.py
    ``calls_schema``), becomes the message's ``tool_calls``, each with its own id and
    ``parameters`` as its ``arguments``; ``content`` is null and a finish that was "stop" is
    "tool_calls", as vLLM answers. Streamed: each call goes out whole in the chunk where its
    object closes."""

    def __init__(self, model: str, with_logprobs: bool = False):
        super().__init__(model, with_logprobs)
        self._scans: dict[int, _CallScan] = {}  # by choice

    def _scan(self, c: Choice) -> _CallScan:
        scan = self._scans.setdefault(c.index, _CallScan())
        scan.advance(c.text)
        return scan

    def choice(self, c: Choice) -> dict:
        body = super().choice(c)
        calls = self._scan(c).calls
        body["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
        body["finish_reason"] = _calls_finish(c.finish_reason)
        return body

    def delta_choice(self, c: Choice, text: str, records: list[Record], offset: int) -> dict:
        opening = not c.started
        body = super().delta_choice(c, text, records, offset)
        delta = {"role": "assistant"} if opening else {}
        scan = self._scan(c)
        new = scan.calls[scan.sent :]
        scan.sent = len(scan.calls)
        if new:
            delta["tool_calls"] = [
                {"index": scan.sent - len(new) + i, **call} for i, call in enumerate(new)
            ]
        body["delta"] = delta
        body["finish_reason"] = _calls_finish(c.finish_reason)
        return body

    def wants_chunk(self, c: Choice, text: str, records: list) -> bool:
        scan = self._scan(c)
        return not c.started or bool(records or c.finish_reason) or scan.sent < len(scan.calls)


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls_finish(reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" else reason


class _CallScan:
    """The calls of a "required" answer so far: each array element whose object has closed,
    parsed once (the grammar makes the text a JSON array of calls as it grows)."""

    _SKIP = " \t\r\n[,"

    def __init__(self):
        self.calls: list[dict] = []
        self.sent = 0  # calls already streamed
        self._pos = 0
        self._looked = 0  # the text's length at the last look
        self._decoder = json.JSONDecoder()

    def advance(self, text: str) -> None:
        # An object closes only with a '}': without a new one, nothing can parse that did not
        # before (so the stream's per-token looks do not parse the open object again).
        fresh, self._looked = text[self._looked :], len(text)
        if "}" not in fresh:
            return
        while True:
            start = self._pos
            while start < len(text) and text[start] in self._SKIP:
                start += 1
            try:
                obj, end = self._decoder.raw_decode(text, start)
            except json.JSONDecodeError:  # not closed yet, or the array's end
                return
            self._pos = end
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                return  # not a call (the grammar allows none): no more calls to read
            function = {"name": obj["name"], "arguments": json.dumps(obj.get("parameters", {}))}
            self.calls.append({"id": _new_call_id(), "type": "function", "function": function})


class ResponseBuilder:
    """Turns a request's deltas into choices: echo first, then text and logprob records, per
    choice index (sequence i of prompt k is choice k * n + i)."""

    def __init__(
        self,
        shape: ResponseShape,
        token_text: TokenText,
        n: int = 1,
        echoes: list[tuple[str, list[int]]] | None = None,  # each prompt's text and ids
        num_prompts: int = 1,
    ):
        self.shape = shape
        self.token_text = token_text
        self.n = n
        self.choices = [Choice(i) for i in range(n * num_prompts)]
        self.echoes = echoes
        self.prompt_records: dict[int, list[Record]] = {}  # by prompt
        self.usage = None
        self.timings = None

    def add(self, delta) -> dict | None:
        """Take one delta in; returns its stream chunk's choice, or None if it adds nothing."""
        c, k = self.choices[delta.index], delta.index // self.n
        if delta.prompt_logprobs and self.echoes is not None:
            ids = self.echoes[k][1]
            self.prompt_records[k] = self.token_text.records(ids, [None, *delta.prompt_logprobs])
        text, records = delta.text, []
        if self.shape.with_logprobs and delta.logprobs:
            records = self.token_text.records(delta.token_ids, delta.logprobs)
        if self.echoes is not None and not c.echoed:
            c.echoed = True
            text = self.echoes[k][0] + text
            records = self._prompt_records(k) + records
        offset = c.token_offset
        c.token_offset += sum(len(r[0].text) for r in records)
        c.text += text
        c.records += records
        c.finish_reason = delta.finish_reason or c.finish_reason
        if delta.usage is not None:
            self.usage, self.timings = delta.usage, delta.timings
        if not self.shape.wants_chunk(c, text, records):
            return None
        return self.shape.delta_choice(c, text, records, offset)

    def _prompt_records(self, k: int) -> list[Record]:
        if not self.shape.with_logprobs:
            return []
        if k in self.prompt_records:
            return self.prompt_records[k]
        ids = self.echoes[k][1]  # one token: no position has a logprob
        return self.token_text.records(ids, [None] * len(ids))
