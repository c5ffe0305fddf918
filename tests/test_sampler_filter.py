"""The sampler's top-k / top-p cut: the fast paths (a plain softmax for rows with neither, the
k-th largest as the cut for top-k alone) give the distribution the full sort gives, row by
row, in a batch that mixes every kind of row. And min-p (vLLM's): cut first, from the
probabilities themselves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.request import SamplingParams
from engine.sampler import Sampler, _cut_by_rank_and_mass

VOCAB = 1000


def _request(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return SimpleNamespace(
        sampling=SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    )


def _sorted_reference(logits, requests):
    """Every row through the full sort, as the sampler did for every row before."""
    temps = torch.tensor([r.sampling.temperature for r in requests]).unsqueeze(1)
    ks = torch.tensor([r.sampling.top_k or VOCAB for r in requests])
    ps = torch.tensor([r.sampling.top_p for r in requests])
    return _cut_by_rank_and_mass(logits / temps, ks, ps).softmax(dim=-1)


ROWS = [
    _request(),  # OpenAI's defaults: no cut
    _request(temperature=0.7, top_k=40),
    _request(top_p=0.9),
    _request(temperature=1.3, top_k=50, top_p=0.8),
    _request(top_k=VOCAB),  # k = vocab: no cut
    _request(top_k=1),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_kind_of_row_gets_the_distribution_of_the_full_sort(seed):
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    got = Sampler._filtered_probs(logits.clone(), ROWS)
    want = _sorted_reference(logits, ROWS)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    kept = (got > 0).sum(dim=-1).tolist()
    assert kept[1] == 40 and kept[5] == 1 and kept[0] == kept[4] == VOCAB
    assert 1 <= kept[3] <= 50 and 1 <= kept[2] < VOCAB


def test_the_caller_s_logits_are_not_changed():
    logits = torch.randn(len(ROWS), VOCAB)
    before = logits.clone()
    Sampler._filtered_probs(logits, ROWS)
    assert torch.equal(logits, before)


MIN_P_ROWS = [
    _request(min_p=0.05),
    _request(),  # beside rows without one: untouched
    _request(temperature=0.5, min_p=0.2),
    _request(min_p=0.1, top_p=0.9),  # min-p first, then top-p over what is left
    _request(min_p=1.0),  # only the top token
]


def _min_p_reference(logits, requests):
    """From the probabilities, as vLLM's min-p processor: p < min_p * max p is cut; then the
    full sort for top-k / top-p."""
    temps = torch.tensor([r.sampling.temperature for r in requests]).unsqueeze(1)
    scaled = logits / temps
    probs = scaled.softmax(dim=-1)
    min_p = torch.tensor([r.sampling.min_p for r in requests]).unsqueeze(1)
    cut = probs < min_p * probs.max(dim=-1, keepdim=True).values
    scaled = scaled.masked_fill(cut, float("-inf"))
    ks = torch.tensor([r.sampling.top_k or VOCAB for r in requests])
    ps = torch.tensor([r.sampling.top_p for r in requests])
    return _cut_by_rank_and_mass(scaled, ks, ps).softmax(dim=-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_p_cuts_what_falls_under_its_share_of_the_top_probability(seed):
    logits = torch.randn(len(MIN_P_ROWS), VOCAB, generator=torch.Generator().manual_seed(seed))
    logits *= 3
    got = Sampler._filtered_probs(logits.clone(), MIN_P_ROWS)
    torch.testing.assert_close(got, _min_p_reference(logits, MIN_P_ROWS), atol=1e-6, rtol=1e-5)
    kept = (got > 0).sum(dim=-1).tolist()
    assert kept[1] == VOCAB and kept[4] == 1
    assert 1 < kept[0] < VOCAB and kept[2] < kept[0]  # a lower temperature sharpens: fewer
    assert int(got[4].argmax()) == int(logits[4].argmax())


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_min_p_outside_0_to_1_is_refused_by_name(bad):
    with pytest.raises(InvalidRequestError, match="min_p"):
        SamplingParams(min_p=bad)
