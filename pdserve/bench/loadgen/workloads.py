"""Benchmark workloads: synthetic chat turns and long documents, or requests from a JSONL file.

Everything is generated offline from a seeded generator. The *seed* fixes a workload's shape
(which requests are documents, their lengths, max_tokens, the words of each document) so two
systems see the same load; the *nonce* opens every prompt with a line of its own, so no prompt
of one run shares a prefix with a prompt of another run (a prefix cache would flatter the
second run) nor with another prompt of the same run.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WORKLOADS = ("chat", "longdoc", "mixed")
MULTITURN = "multiturn"  # conversations: pdserve/bench/loadgen/multiturn.py
MIXED_LONGDOC_FRACTION = 0.2
DOC_WORDS = (700, 1000)  # inclusive range of words in a synthetic document
DOC_MAX_TOKENS = (32, 64)
CHAT_MAX_TOKENS = (64, 200)


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    "river city market garden engine council harbor school bridge forest village library "
    "museum station factory farmer teacher student doctor pilot sailor miner writer painter "
    "season winter summer morning evening storm road mountain valley island coast castle "
    "tower window letter report budget plan project team company customer product price "
    "history science music language family friend neighbor child parent government law "
    "railway canal mill bakery orchard harvest festival journey border province region "
    "network signal machine system method result question answer problem solution idea"
)
_VERBS = _words(
    "built opened closed visited measured described changed improved planned repaired "
    "studied collected delivered followed crossed reached supported explained shared "
    "protected replaced carried painted written counted noticed welcomed recorded moved"
)
_ADJECTIVES = _words(
    "old new small large quiet busy narrow wide early late careful simple modern ancient "
    "local public private northern southern eastern western bright dark heavy light warm "
    "cold steady rapid gentle strong famous common rare useful"
)
_FILLERS = _words(
    "the the the a a of of in on at by with from near after before during under over "
    "and and but while because although since then also often rarely soon still"
)
_TOPICS = (
    "photosynthesis",
    "the water cycle",
    "compound interest",
    "a bicycle gear",
    "tides",
    "the immune system",
    "a rainbow",
    "recursion",
    "an electric motor",
    "volcanoes",
    "supply and demand",
    "a sourdough starter",
    "public key encryption",
    "the seasons",
    "a steam engine",
    "jet streams",
    "bird migration",
    "a hash table",
    "the printing press",
    "coral reefs",
    "a lighthouse",
    "inflation",
    "a vaccine",
    "plate tectonics",
)
_CHAT_TEMPLATES = (
    "Can you explain how {t} works in simple terms?",
    "What are three interesting facts about {t}?",
    "Write a short poem about {t}.",
    "Why is {t} important? Keep it brief.",
    "Give me a one-paragraph overview of {t}.",
    "What is a common misconception about {t}?",
    "Describe {t} to a ten-year-old.",
    "List a few pros and cons of learning about {t}.",
)
_DOC_QUESTIONS = (
    "Summarize the document above in one sentence.",
    "What is the main topic of the document above? Answer briefly.",
    "Give a short title for the document above.",
    "Name two places mentioned in the document above.",
)


@dataclass
class BenchRequest:
    """One request of a workload: a chat (``messages``) or a completion (``prompt``)."""

    max_tokens: int
    messages: list[dict] | None = None
    prompt: str | None = None
    kind: str = "chat"  # "chat" | "longdoc" | "file"
    words: int = 0  # words in the prompt text, for reports

    def text(self) -> str:
        """The prompt as plain text (for /v1/completions)."""
        if self.prompt is not None:
            return self.prompt
        return "\n\n".join(m["content"] for m in self.messages or [])

    def as_messages(self) -> list[dict]:
        if self.messages is not None:
            return self.messages
        return [{"role": "user", "content": self.prompt or ""}]


@dataclass
class Workload:
    name: str
    nonce: str
    requests: list[BenchRequest] = field(default_factory=list)
    # multiturn: the conversations (their turns' requests depend on the server's answers)
    conversations: list | None = None

    @property
    def num_requests(self) -> int:
        if self.conversations is not None:
            return sum(len(c.questions) for c in self.conversations)
        return len(self.requests)


def new_nonce() -> str:
    return secrets.token_hex(4)


def _sentence(rng: np.random.Generator) -> str:
    n = int(rng.integers(8, 17))
    pools = (_FILLERS, _ADJECTIVES, _NOUNS, _VERBS, _FILLERS, _NOUNS)
    words = [pools[i % len(pools)][int(rng.integers(len(pools[i % len(pools)])))] for i in range(n)]
    return " ".join(words).capitalize() + "."


def synth_document(rng: np.random.Generator, num_words: int) -> str:
    """Plausible-looking English-ish paragraphs of exactly ``num_words`` words."""
    words: list[str] = []
    paragraphs: list[str] = []
    sentences: list[str] = []
    while len(words) < num_words:
        sentence = _sentence(rng).split()[: num_words - len(words)]
        if not sentence[-1].endswith("."):
            sentence[-1] += "."
        words += sentence
        sentences.append(" ".join(sentence))
        if len(sentences) >= int(rng.integers(4, 8)):
            paragraphs.append(" ".join(sentences))
            sentences = []
    if sentences:
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def _preamble(nonce: str, index: int) -> str:
    return f"Session {nonce}-{index}."


def chat_request(rng: np.random.Generator, nonce: str, index: int) -> BenchRequest:
    template = _CHAT_TEMPLATES[int(rng.integers(len(_CHAT_TEMPLATES)))]
    question = template.format(t=_TOPICS[int(rng.integers(len(_TOPICS)))])
    content = f"{_preamble(nonce, index)} {question}"
    max_tokens = int(rng.integers(CHAT_MAX_TOKENS[0], CHAT_MAX_TOKENS[1] + 1))
    messages = [{"role": "user", "content": content}]
    return BenchRequest(max_tokens, messages, kind="chat", words=len(content.split()))


def longdoc_request(rng: np.random.Generator, nonce: str, index: int) -> BenchRequest:
    num_words = int(rng.integers(DOC_WORDS[0], DOC_WORDS[1] + 1))
    doc = synth_document(rng, num_words)
    question = _DOC_QUESTIONS[int(rng.integers(len(_DOC_QUESTIONS)))]
    max_tokens = int(rng.integers(DOC_MAX_TOKENS[0], DOC_MAX_TOKENS[1] + 1))
    content = f"{_preamble(nonce, index)}\n\n{doc}\n\n{question}"
    messages = [{"role": "user", "content": content}]
    return BenchRequest(max_tokens, messages, kind="longdoc", words=num_words)


def make_workload(
    name: str, num_requests: int, seed: int = 0, nonce: str | None = None
) -> Workload:
    """``chat``, ``longdoc`` or ``mixed`` (a fifth long documents, in seeded positions)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)} or a FILE")
    nonce = new_nonce() if nonce is None else nonce
    if name == "mixed":
        order = np.random.default_rng([seed, 0]).permutation(num_requests)
        docs = set(order[: round(num_requests * MIXED_LONGDOC_FRACTION)].tolist())
    else:
        docs = set(range(num_requests)) if name == "longdoc" else set()
    requests = []
    for i in range(num_requests):
        rng = np.random.default_rng([seed, 1, i])  # per request: same shape whatever N is
        make = longdoc_request if i in docs else chat_request
        requests.append(make(rng, nonce, i))
    return Workload(name, nonce, requests)


def load_jsonl(
    path: str | Path,
    num_requests: int | None = None,
    nonce: str | None = None,
    default_max_tokens: int = 128,
) -> Workload:
    """One request per line: {"prompt": str | "messages": [...], "max_tokens": int}.

    File prompts are used verbatim (a nonce is recorded but not added): the file is the load.
    """
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{path}:{lineno}: give exactly one of 'prompt' or 'messages'")
        max_tokens = int(row.get("max_tokens", default_max_tokens))
        req = BenchRequest(max_tokens, row.get("messages"), row.get("prompt"), kind="file")
        req.words = len(req.text().split())
        requests.append(req)
    if num_requests is not None:
        if not requests:
            raise ValueError(f"{path}: no requests")
        requests = [requests[i % len(requests)] for i in range(num_requests)]
    return Workload(str(path), nonce or "", requests)


def get_workload(spec: str, num_requests: int, seed: int = 0, nonce: str | None = None) -> Workload:
    """A named workload, or a JSONL file (cycled to ``num_requests``); ``multiturn`` is made
    by pdserve/bench/loadgen/multiturn.py (its requests depend on the server's answers)."""
    if spec in WORKLOADS:
        return make_workload(spec, num_requests, seed, nonce)
    if Path(spec).is_file():
        return load_jsonl(spec, num_requests, nonce)
    known = ", ".join((*WORKLOADS, MULTITURN))
    raise ValueError(f"unknown workload {spec!r}: not one of {known} nor a file")


def warmup_requests(count: int, nonce: str) -> list[BenchRequest]:
    """Short chat requests with prompts of their own (never those of the timed run)."""
    rng = np.random.default_rng(list(nonce.encode()) or [0])
    out = [chat_request(rng, f"warmup-{nonce}", i) for i in range(count)]
    for req in out:
        req.max_tokens = 16
    return out
