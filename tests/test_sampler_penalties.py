"""Logit bias and penalties against a straightforward per-token reference (vLLM's semantics),
on random logits; and the sampler's logprobs against log-softmax."""

from __future__ import annotations

import random

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.request import Request, SamplingParams
from engine.sampler import Sampler, logprob_entries

VOCAB = 50


def reference_penalties(row: torch.Tensor, req: Request) -> torch.Tensor:
    """One row the plain way: bias, then repetition on every token seen in prompt or output
    (divide positive logits, multiply negative), then frequency x count and presence."""
    sp = req.sampling
    x = row.clone()
    for token, bias in sp.logit_bias:
        x[token] += bias
    for token in set(req.prompt_token_ids) | set(req.output_token_ids):
        x[token] = (
            x[token] / sp.repetition_penalty if x[token] > 0 else x[token] * sp.repetition_penalty
        )
    for token in set(req.output_token_ids):
        count = req.output_token_ids.count(token)
        x[token] -= sp.frequency_penalty * count + sp.presence_penalty
    return x


def random_request(rng: random.Random, i: int) -> Request:
    neutral = rng.random() < 0.25  # some rows of the batch ask for nothing
    sp = SamplingParams(
        max_tokens=64,
        presence_penalty=0.0 if neutral else rng.uniform(-2, 2),
        frequency_penalty=0.0 if neutral else rng.uniform(-2, 2),
        repetition_penalty=1.0 if neutral else rng.uniform(0.5, 2.0),
        logit_bias=()
        if neutral
        else tuple((rng.randrange(VOCAB), rng.uniform(-5, 5)) for _ in range(2)),
    )
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    outputs = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
    return Request(f"r{i}", prompt, sp, output_token_ids=outputs)


@pytest.mark.parametrize("seed", range(5))
def test_penalties_equal_the_reference_loop_on_random_logits(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    reqs = [random_request(rng, i) for i in range(8)]
    sampler = Sampler()
    for _ in range(3):  # the counts follow outputs that grow between steps
        logits = torch.randn(len(reqs), VOCAB) * 3
        got = sampler.penalties.apply(logits, reqs)
        want = torch.stack([reference_penalties(logits[i], r) for i, r in enumerate(reqs)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for r in reqs:
            r.output_token_ids.extend(rng.randrange(VOCAB) for _ in range(rng.randrange(3)))


def test_neutral_requests_leave_logits_untouched():
    logits = torch.randn(2, VOCAB)
    reqs = [Request("a", [1, 2], SamplingParams()), Request("b", [3], SamplingParams())]
    assert Sampler().penalties.apply(logits, reqs) is logits


def test_logit_bias_steers_greedy_and_penalties_stop_repeats():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5.0
    sampler = Sampler()
    biased = Request("b", [1], SamplingParams(logit_bias=((9, 100.0),)))
    assert sampler.sample(logits, [biased]) == [9]
    banned = Request("p", [7], SamplingParams(repetition_penalty=2.0, presence_penalty=2.0))
    banned.output_token_ids = [7, 7]
    logits[0, 8] = 2.0  # 5 / 2 - 2 < 2: the repeated token loses
    assert sampler.sample(logits, [banned]) == [8]


def test_released_request_history_is_rebuilt():
    sampler = Sampler()
    req = Request("x", [3], SamplingParams(frequency_penalty=1.0), output_token_ids=[4])
    sampler.penalties.apply(torch.zeros(1, VOCAB), [req])
    sampler.release("x")
    req2 = Request("x", [3], SamplingParams(frequency_penalty=1.0), output_token_ids=[5, 5])
    out = sampler.penalties.apply(torch.zeros(1, VOCAB), [req2])
    assert out[0, 4] == 0 and out[0, 5] == -2


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logit_bias", ((3, 101.0),)),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
    ],
)
def test_out_of_range_parameter_is_named(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_logprobs_are_log_softmax_after_temperature():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4
    temps = [0.0, 0.7, 1.5]
    entries = logprob_entries(logits, temps, [4, 5, 6], [0, 3, 5])
    for j, (t, entry) in enumerate(zip(temps, entries)):
        ref = torch.log_softmax(logits[j] / (t or 1.0), dim=-1)
        assert entry.logprob == pytest.approx(ref[4 + j].item(), abs=1e-5)
        want = ref.topk([0, 3, 5][j])
        assert [i for i, _ in entry.top] == want.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(want.values.tolist(), abs=1e-5)


def test_sampler_records_the_sampled_tokens_logprob():
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    reqs = [
        Request("g", [1], SamplingParams(logprobs=2)),
        Request("s", [1], SamplingParams(temperature=0.8, seed=3, logprobs=0)),
    ]
    tokens = Sampler().sample(logits, reqs)
    assert tokens[0] == int(logits[0].argmax())
    for j, r in enumerate(reqs):
        [entry] = r.output_logprobs
        ref = torch.log_softmax(logits[j] / (r.sampling.temperature or 1.0), dim=-1)
        assert entry.logprob == pytest.approx(ref[tokens[j]].item(), abs=1e-5)
    assert (
        reqs[0].output_logprobs[0].top[0][0] == tokens[0] and reqs[1].output_logprobs[0].top == ()
    )


def test_in_place_apply_changes_only_the_rows_that_ask_and_copies_nothing():
    """The engine's pass (``apply_``) adds a vocabulary-sized bias to its own row in place: a
    biased request costs a step its own row, not a copy of the batch."""
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    dense = tuple((t, 1.5) for t in range(VOCAB))
    reqs = [
        Request("plain", [1], SamplingParams()),
        Request("dense", [1], SamplingParams(logit_bias=dense)),
        Request("sparse", [1], SamplingParams(logit_bias=((4, -2.0),))),
    ]
    assert Sampler().penalties.apply_(logits, reqs) is logits
    assert torch.equal(logits[0], before[0])
    assert torch.equal(logits[1], before[1] + 1.5)
    want = before[2].clone()
    want[4] -= 2.0
    assert torch.equal(logits[2], want)
