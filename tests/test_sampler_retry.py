"""A batched sampling pass that fails after it drew its noise: each row is sampled again alone
(engine/sampler.py ``sample_isolated``), and the rows that survive get exactly the tokens and
logprobs of a run in which nothing failed, over several steps (penalty state included).

Seeded rows build their generator from (seed, position) at every draw, so no pass can advance
it; unseeded rows draw from torch's default generator, which the failed pass did advance and
which is put back before the rows are sampled alone."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sampler import Sampler

VOCAB = 512
STEPS = 6
FAIL_AT = 2  # the bad request's sampling fails when it has this many output tokens
BAD = "bad"
SEEDED = {
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=3, logprobs=2),
    "seeded-penalized": SamplingParams(
        temperature=1.0, top_k=20, seed=11, presence_penalty=0.5, frequency_penalty=0.3
    ),
    "greedy-logprobs": SamplingParams(temperature=0.0, logprobs=3),
    # A bias is added in place to the step's logits (engine/sampler.py): the failed pass's
    # must be taken back, or the rows sampled alone have it twice (their logprobs show it).
    "greedy-dense-bias": SamplingParams(
        temperature=0.0, logprobs=2, logit_bias=tuple((t, t % 5 - 2.0) for t in range(VOCAB))
    ),
    "seeded-sparse-bias": SamplingParams(
        temperature=0.8, seed=5, logprobs=1, logit_bias=((3, 2.0), (7, -1.0))
    ),
}
UNSEEDED = {
    "unseeded": SamplingParams(temperature=1.0, logprobs=1),
    "unseeded-top-k": SamplingParams(temperature=0.8, top_k=30, repetition_penalty=1.2),
}
# Greedy, so that it draws no noise itself: the run without it draws the same from the
# default generator until its failure.
BAD_SAMPLING = SamplingParams(temperature=0.0)


def _key(rid: str) -> int:
    return sum(ord(c) * 31**i for i, c in enumerate(rid)) % 2**31


def prompt_of(rid: str) -> list[int]:
    """A request's prompt, the same in every run (its repetition penalty reads it)."""
    return [1, 2, _key(rid) % VOCAB]


def step_logits(step: int, request_ids: list[str]) -> torch.Tensor:
    """The model's logits at ``step``: one row per request, the same row for a request in
    every run (keyed by its name), so runs differ only in what the sampler does."""
    rows = []
    for rid in request_ids:
        gen = torch.Generator().manual_seed(step * 7919 + _key(rid))
        rows.append(torch.randn(VOCAB, generator=gen) * 3)
    return torch.stack(rows)


def fail_after(sampler: Sampler, method: str) -> None:
    """``sampler.<method>`` runs, then raises for a batch holding the bad request at its
    FAIL_AT-th token: in the batch (after every row's noise is drawn) and alone."""
    original = getattr(sampler, method)

    def wrapped(logits, requests, *rest):
        out = original(logits, requests, *rest)
        if any(r.request_id == BAD and len(r.output_token_ids) == FAIL_AT for r in requests):
            raise RuntimeError(f"injected after {method}")
        return out

    setattr(sampler, method, wrapped)


def run_steps(sampler: Sampler, params: dict[str, SamplingParams]):
    """STEPS steps of the batch, as the engine runs them: every unfailed request samples one
    token per step, a failed one leaves the batch. Returns ({id: Request}, {id: error})."""
    reqs = {rid: Request(rid, prompt_of(rid), p) for rid, p in params.items()}
    errors: dict[str, BaseException] = {}
    torch.manual_seed(1234)  # the default generator, as a fresh process would have it
    for step in range(STEPS):
        batch = [r for rid, r in reqs.items() if rid not in errors]
        logits = step_logits(step, [r.request_id for r in batch])
        tokens, failed = sampler.sample_isolated(logits, batch)
        for i, (req, token) in enumerate(zip(batch, tokens)):
            if i in failed:
                errors[req.request_id] = failed[i]
            else:
                req.output_token_ids.append(token)
    return reqs, errors


def with_bad_in_the_middle(params: dict[str, SamplingParams]) -> dict[str, SamplingParams]:
    items = list(params.items())
    return dict([*items[:1], (BAD, BAD_SAMPLING), *items[1:]])


def assert_survivors_exact(params: dict[str, SamplingParams], method: str) -> None:
    undisturbed, no_errors = run_steps(Sampler(), params)
    assert no_errors == {}
    sampler = Sampler()
    fail_after(sampler, method)
    reqs, errors = run_steps(sampler, with_bad_in_the_middle(params))
    assert list(errors) == [BAD] and f"injected after {method}" in str(errors[BAD])
    assert len(reqs[BAD].output_token_ids) == FAIL_AT
    for rid in params:
        got, want = reqs[rid], undisturbed[rid]
        assert got.output_token_ids == want.output_token_ids, rid
        assert got.output_logprobs == want.output_logprobs, rid
        assert len(got.output_token_ids) == STEPS


@pytest.mark.parametrize("method", ["_draw", "_record_logprobs"])
def test_seeded_rows_keep_their_tokens_when_the_batch_fails_after_drawing(method):
    """Holds without restoring anything (each seeded draw builds its own generator); kept as
    the guard of that property, since a generator kept per request would break it."""
    assert_survivors_exact(SEEDED, method)


@pytest.mark.parametrize("method", ["_draw", "_record_logprobs"])
def test_unseeded_rows_draw_as_undisturbed_when_the_batch_fails_after_drawing(method):
    """Fails without putting the default generator back: the rows sampled alone would draw
    the noise after the failed pass's."""
    assert_survivors_exact({**UNSEEDED, **SEEDED}, method)


def test_a_batch_without_unseeded_rows_copies_no_generator_state(monkeypatch):
    """The copy of the default generator's state is taken only when a row draws from it."""
    copies = []
    real = torch.get_rng_state
    monkeypatch.setattr(torch, "get_rng_state", lambda: copies.append(1) or real())
    run_steps(Sampler(), SEEDED)
    assert copies == []
    run_steps(Sampler(), UNSEEDED)
    assert len(copies) == STEPS
