"""The ``multiturn`` workload: chat conversations of several turns, each turn's prompt the whole
history (every earlier question and the server's own answers), a think time between turns, many
conversations interleaved.

Conversations start on a seeded Poisson schedule at ``rate / turns`` a second, so requests
arrive at about ``rate`` overall; within a conversation a turn leaves ``think`` seconds
(exponential, seeded) after the previous answer ended: closed loop inside a conversation, open
loop across them, as chat users are. What the questions are and how long each answer may be
is fixed by the seed; the answers are the server's, so two servers see the same questions and
each its own history.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.loadgen.workloads import (
    _TOPICS,
    MULTITURN,
    BenchRequest,
    Workload,
    _preamble,
    new_nonce,
    synth_document,
)
from pdserve.metrics import RequestRecord

TURNS = 6  # turns per conversation
THINK_S = 2.0  # mean think time between an answer and the next question
OPENING_WORDS = (60, 200)  # the first turn: a short text to talk about, then follow-ups
TURN_MAX_TOKENS = (48, 96)
_FOLLOW_UPS = (
    "Can you say more about the second point?",
    "Summarize that in one sentence.",
    "What would a skeptic say?",
    "Give an example.",
    "How does that relate to {t}?",
    "Rewrite your last answer for a child.",
    "What is the most surprising part?",
    "List two open questions.",
)


@dataclass
class Conversation:
    """One user's questions (answers come from the server) and each turn's max_tokens."""

    questions: list[str]
    max_tokens: list[int]
    think_s: list[float]  # before turns 1.. (len = turns - 1)
    answers: list[str] = field(default_factory=list)

    def request(self, turn: int) -> BenchRequest:
        """Turn ``turn``'s request: the history so far, then the new question."""
        messages = []
        for q, a in zip(self.questions[:turn], self.answers[:turn]):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": self.questions[turn]})
        words = sum(len(m["content"].split()) for m in messages)
        return BenchRequest(self.max_tokens[turn], messages, kind=f"turn{turn + 1}", words=words)


def multiturn_workload(
    num_requests: int, seed: int, nonce: str | None, turns: int = TURNS, think_s: float = THINK_S
) -> Workload:
    nonce = new_nonce() if nonce is None else nonce
    conversations = make_conversations(num_requests, seed, nonce, turns, think_s)
    return Workload(MULTITURN, nonce, conversations=conversations)


def make_conversations(
    num_requests: int, seed: int, nonce: str, turns: int = TURNS, think_s: float = THINK_S
) -> list[Conversation]:
    """Enough conversations of ``turns`` turns for ``num_requests`` requests (the last may be
    shorter)."""
    out = []
    for c in range(-(-num_requests // turns)):
        rng = np.random.default_rng([seed, 2, c])
        n = min(turns, num_requests - c * turns)
        words = int(rng.integers(OPENING_WORDS[0], OPENING_WORDS[1] + 1))
        opening = f"{_preamble(nonce, c)}\n\n{synth_document(rng, words)}\n\nWhat is this about?"
        topic = _TOPICS[int(rng.integers(len(_TOPICS)))]
        follow = [_FOLLOW_UPS[int(rng.integers(len(_FOLLOW_UPS)))] for _ in range(n - 1)]
        questions = [opening] + [q.format(t=topic) for q in follow]
        lo, hi = TURN_MAX_TOKENS
        max_tokens = [int(rng.integers(lo, hi + 1)) for _ in range(n)]
        think = rng.exponential(think_s, n - 1).tolist() if think_s > 0 else [0.0] * (n - 1)
        out.append(Conversation(questions, max_tokens, think))
    return out


async def run_conversations(conversations, starts, send, on_done=None):
    """Run every conversation, each from its offset in ``starts`` (seconds; a Poisson
    schedule at rate / turns); ``send(BenchRequest) -> (RequestRecord, answer text)``.
    Returns (records in send order, duration)."""
    records: list[tuple[float, RequestRecord]] = []
    start = time.perf_counter()

    async def converse(offset: float, conv: Conversation) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        for turn in range(len(conv.questions)):
            if turn:
                await asyncio.sleep(conv.think_s[turn - 1])
            record, answer = await send(conv.request(turn))
            records.append((record.send_time, record))
            if on_done is not None:
                on_done()
            if not record.success:
                return  # the user gives up: later turns would need this answer
            conv.answers.append(answer)

    await asyncio.gather(*(converse(float(o), c) for o, c in zip(starts, conversations)))
    duration = time.perf_counter() - start
    return [r for _, r in sorted(records, key=lambda x: x[0])], duration
