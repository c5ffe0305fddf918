"""Logprobs of generated and prompt positions equal transformers' log-softmax of the same
logits (within 1e-4), through the engine's chunked prefill and decode; requests that ask for
none get none."""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from tests.conftest import tiny_llama_dir

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("lp"), num_heads=4, num_kv_heads=2, seed=3)


@torch.inference_mode()
def hf_logprobs(hf_model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), vocab]: row p is the distribution of token p + 1."""
    logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def assert_entry(entry, ref_row: torch.Tensor, token: int, k: int) -> None:
    assert entry.logprob == pytest.approx(ref_row[token].item(), abs=TOL)
    top = ref_row.topk(k)
    assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=TOL)
    assert [t for t, _ in entry.top] == top.indices.tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_prompt_and_output_logprobs_equal_transformers(tiny, make_engine, temperature):
    path, hf_model = tiny
    engine = make_engine(path, block_size=16, prefill_chunk_size=16)  # 3 chunks of prompt
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(
        max_tokens=6,
        ignore_eos=True,
        temperature=temperature,
        seed=1,
        logprobs=3,
        prompt_logprobs=2,
    )
    [req] = engine.generate([prompt], sp)
    ref = hf_logprobs(hf_model, prompt + req.output_token_ids, temperature or 1.0)
    assert len(req.prompt_logprobs) == len(prompt) - 1
    for p, entry in enumerate(req.prompt_logprobs):
        assert_entry(entry, ref[p], prompt[p + 1], 2)
    assert len(req.output_logprobs) == len(req.output_token_ids)
    for t, (token, entry) in enumerate(zip(req.output_token_ids, req.output_logprobs)):
        assert_entry(entry, ref[len(prompt) - 1 + t], token, 3)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny, make_engine):
    path, hf_model = tiny
    engine = make_engine(path, block_size=16)
    prompt = list(range(3, 40))
    engine.generate([prompt], SamplingParams(max_tokens=2))  # its full blocks are now cached
    [req] = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert req.num_cached_tokens == 0 and len(req.prompt_logprobs) == len(prompt) - 1
    ref = hf_logprobs(hf_model, prompt)
    assert req.prompt_logprobs[5].logprob == pytest.approx(ref[5, prompt[6]].item(), abs=TOL)


def test_requests_that_do_not_ask_get_no_logprobs(tiny, make_engine):
    engine = make_engine(tiny[0])
    [req] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert req.output_logprobs == [] and req.prompt_logprobs is None


def test_only_requests_that_ask_pay_for_prompt_logprobs(tiny, make_engine):
    """The LM head sees one row per sampling sequence, plus the prompt positions of the
    requests that asked for prompt logprobs (and no others)."""
    engine = make_engine(tiny[0])
    rows = []
    head = engine.runner.model.compute_logits

    def counting(hidden):
        rows.append(hidden.shape[0])
        return head(hidden)

    engine.runner.model.compute_logits = counting
    prompt = list(range(3, 30))
    engine.generate([prompt], SamplingParams(max_tokens=2))
    assert rows == [1, 1]
    rows.clear()
    engine.add_request(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))
    engine.add_request(list(range(40, 60)), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    # Prefill step: the asked prompt positions, then both last rows; decode step: both rows.
    assert rows == [len(prompt) - 1, 2, 2]
