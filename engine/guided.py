"""Structured output (guided decoding): a request's tokens held to a JSON schema, any JSON
object, a regular expression, one of a list of strings, or an EBNF grammar, with xgrammar
(vLLM's and SGLang's default backend): each step, a guided row's logits keep only the tokens
its grammar allows next (a bitmask, about 0.25 ms a row at a 49k vocabulary).

A request's grammar state is derived from its tokens, not carried: before each mask its
matcher takes the output tokens it has not seen (``_sync``). So the first token, drawn on the
prefill worker under the same grammar, reaches the decode worker as a plain token and is
replayed there; a fork of n > 1, a stream migrated to another worker and a sampling pass run
again after a failure all rebuild the same state from the same tokens, and nothing about the
grammar crosses the wire but the request's spec.

Specs are compiled once per worker (xgrammar's compiler caches by spec), first as a worker
admits the request (``check``), so a malformed schema, regex or grammar, or one no token of
the vocabulary can begin, is refused then: gRPC INVALID_ARGUMENT naming the parameter, which
the router passes on as the request's own (a 400), never a failure inside a step. The router
itself loads no xgrammar (it imports torch) and checks only a spec's shape.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from engine.request import Request
    from engine.tokenizer import Tokenizer

log = logging.getLogger("pdserve.engine")

# Compiled grammars kept per process (xgrammar's cache, least recently used out): bounded, as
# every new schema a client sends is one more entry.
GUIDE_CACHE_BYTES = 64 << 20
# kind -> what its spec is: json (a JSON schema, as text), json_object (any JSON object; spec
# empty), regex, choice (a JSON list of strings), grammar (EBNF, GBNF as llama.cpp's).
GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def check_guide(kind: str, spec: str) -> None:
    """The spec's own shape (its grammar is checked by compiling it: ``GuideCompiler``)."""
    if kind not in GUIDE_KINDS:
        raise InvalidRequestError("guide", f"kind must be one of {GUIDE_KINDS}, got {kind!r}")
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError:
            choices = None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise InvalidRequestError("guided_choice", "must be a non-empty list of strings")


def _choice_grammar(spec: str) -> str:
    alternatives = " | ".join(json.dumps(c) for c in json.loads(spec))
    return f"root ::= {alternatives}"


class GuideCompiler:
    """Compiled grammars of one tokenizer and vocabulary, cached by (kind, spec)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=1, cache_limit_bytes=GUIDE_CACHE_BYTES
        )
        self._lock = threading.Lock()  # one compile at a time (RPC threads, the engine's)

    def compile(self, kind: str, spec: str):
        check_guide(kind, spec)
        param = _param(kind)
        try:
            with self._lock:
                if kind == "json":
                    return self._compiler.compile_json_schema(spec)
                if kind == "json_object":
                    return self._compiler.compile_builtin_json_grammar()
                if kind == "regex":
                    return self._compiler.compile_regex(spec)
                if kind == "choice":
                    return self._compiler.compile_grammar(_choice_grammar(spec))
                return self._compiler.compile_grammar(spec)
        except Exception as e:  # noqa: BLE001 - whatever xgrammar raises for the spec's own fault
            raise InvalidRequestError(param, f"does not compile: {_reason(e)}") from None

    def check_startable(self, kind: str, spec: str) -> None:
        """Compiles, and some token of the vocabulary can begin an output it allows (a regex
        of characters no token holds cannot): else InvalidRequestError naming the spec."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(kind, spec))
        bitmask = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise InvalidRequestError(
                _param(kind), "no token of this model's vocabulary can begin an output it allows"
            )


def _param(kind: str) -> str:
    """The HTTP parameter a kind of guide most often comes as, for its 400."""
    return {"json": "guided_json", "json_object": "response_format"}.get(kind, f"guided_{kind}")


def _reason(error: Exception) -> str:
    """xgrammar's message without its log prefix ("[21:00:43] /project/cpp/x.cc:94: ")."""
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(error).strip())
    return text.splitlines()[0][:300] if text else type(error).__name__


class _Matcher:
    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0  # output tokens accepted so far
        self.dead_end = False  # no token continued it: it took a stop token (see mask_)

    @property
    def done(self) -> bool:
        """Only stop tokens may come: its grammar is complete and its stop token taken
        (ignore_eos runs on), or it met a dead end."""
        return self.dead_end or self.matcher.is_terminated()


class GuidedDecoding:
    """The sampler's side: masks guided rows, keeps one matcher per guided request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self._args = (tokenizer, vocab_size, tuple(stop_token_ids))
        self._compiler: GuideCompiler | None = None  # built at the first guided request
        self._matchers: dict[str, _Matcher] = {}

    def mask_(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """In place: each guided row keeps only the tokens its grammar allows next."""
        rows = [i for i, r in enumerate(requests) if r.sampling.guide is not None]
        if not rows:
            return
        import torch
        import xgrammar as xgr

        matchers = [self._synced(requests[i]) for i in rows]
        live = [(i, m) for i, m in zip(rows, matchers) if not m.done]
        stops_only = [i for i, m in zip(rows, matchers) if m.done]
        if live:
            bitmask = xgr.allocate_token_bitmask(len(live), self._compiled().info.vocab_size)
            for j, (_, m) in enumerate(live):
                m.matcher.fill_next_token_bitmask(bitmask, j)
            # A grammar no token of this vocabulary continues (a dead end) ends the output.
            dead = (bitmask == 0).all(dim=1)
            stops_only += [i for (i, _), d in zip(live, dead.tolist()) if d]
            index = torch.tensor([i for i, _ in live], device=logits.device)
            guided = logits[index]
            vocab = guided.shape[-1]
            xgr.apply_token_bitmask_inplace(guided, bitmask.to(logits.device), vocab_size=vocab)
            logits[index] = guided
        if stops_only:  # done (its stop token taken under ignore_eos), or a dead end
            self._stops_only_(logits, stops_only)

    def _stops_only_(self, logits: torch.Tensor, rows: list[int]) -> None:
        import torch

        stops = torch.tensor(self._args[2], device=logits.device)
        for i in rows:
            kept = logits[i, stops].clone()
            kept[kept == float("-inf")] = 0.0  # a masked stop token is the way out
            logits[i] = float("-inf")
            logits[i, stops] = kept

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def check(self, kind: str, spec: str) -> None:
        """``GuideCompiler.check_startable`` on this engine's vocabulary (compiles are cached:
        the step that masks with it does not compile again)."""
        self._compiled().check_startable(kind, spec)

    def _compiled(self) -> GuideCompiler:
        if self._compiler is None:
            self._compiler = GuideCompiler(*self._args)
        return self._compiler

    def _synced(self, req: Request) -> _Matcher:
        """``req``'s matcher, having taken every output token it had not seen."""
        import xgrammar as xgr

        m = self._matchers.get(req.request_id)
        if m is None or m.consumed > len(req.output_token_ids):  # new, or its tokens went back
            kind, spec = req.sampling.guide
            grammar = self._compiled().compile(kind, spec)
            m = self._matchers[req.request_id] = _Matcher(xgr.GrammarMatcher(grammar))
        stops = self._args[2]
        for token in req.output_token_ids[m.consumed :]:
            if m.done:
                break  # past its end only stop tokens come: nothing to check
            if not m.matcher.accept_token(token):
                if token not in stops:
                    raise InvalidRequestError("guide", f"token {token} breaks its grammar")
                m.dead_end = True  # the stop token mask_ gave a dead end
        m.consumed = len(req.output_token_ids)
        return m
