"""The OpenAI parameters real clients use, part two: n > 1, a batch of prompts, the gRPC
client's parameters, stop strings, and what streaming holds against the whole response (the
first part: test_http_openai_params.py). Fixtures ``openai_*``: tests/conftest.py."""

from __future__ import annotations

import openai
import pytest

from tests.http_utils import post

NEW = 8
GREEDY = {"max_tokens": NEW, "temperature": 0, "extra_body": {"ignore_eos": True}}

# ---- n > 1 ------------------------------------------------------------------------------

SAMPLED = {"max_tokens": NEW, "temperature": 1.0, "extra_body": {"ignore_eos": True}}


def texts(out) -> list[str]:
    assert [c.index for c in out.choices] == list(range(len(out.choices)))
    return [c.text for c in out.choices]


def test_n_seeded_sequences_differ_and_repeat(openai_api, served_model):
    kw = {"model": served_model, "prompt": "w5 w6", "n": 4, "seed": 3, **SAMPLED}
    first = openai_api.completions.create(**kw)
    assert len(set(texts(first))) > 1 and first.usage.completion_tokens == 4 * NEW
    assert texts(openai_api.completions.create(**kw)) == texts(first)


def test_sequence_i_is_the_single_request_seeded_seed_plus_i(openai_api, served_model):
    many = texts(
        openai_api.completions.create(model=served_model, prompt="w9", n=3, seed=10, **SAMPLED)
    )
    for i in range(3):
        one = openai_api.completions.create(model=served_model, prompt="w9", seed=10 + i, **SAMPLED)
        assert one.choices[0].text == many[i]


def test_n_greedy_equals_the_single_greedy_output(openai_api, served_model):
    one = (
        openai_api.completions.create(model=served_model, prompt="w7 w8", **GREEDY).choices[0].text
    )
    assert (
        texts(openai_api.completions.create(model=served_model, prompt="w7 w8", n=4, **GREEDY))
        == [one] * 4
    )


def test_n_streams_each_choice_under_its_index(openai_api, served_model):
    messages = [{"role": "user", "content": "w40 w41"}]
    kw = {
        "model": served_model,
        "messages": messages,
        "n": 3,
        "seed": 4,
        "logprobs": True,
        **SAMPLED,
    }
    whole = openai_api.chat.completions.create(**kw)
    chunks = list(openai_api.chat.completions.create(stream=True, **kw))
    streamed, lps = ["", "", ""], [[], [], []]
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
            lps[ch.index] += [e.logprob for e in (ch.logprobs.content if ch.logprobs else [])]
    assert streamed == [c.message.content for c in whole.choices]
    assert lps == [[e.logprob for e in c.logprobs.content] for c in whole.choices]
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 3


def test_n_prefilled_on_the_decode_worker_matches(openai_cluster, served_model):
    """The colocated path (no transfer) forks after its own prefill: same sequences."""
    from dataclasses import replace

    from router.app import start_router

    cfg = replace(openai_cluster.router.cfg, local_prefill_max_tokens=1000)
    servers = openai_cluster.run(
        start_router(
            cfg, openai_cluster.prefill_addresses, openai_cluster.decode_addresses, http_port=0
        )
    )
    kw = {"model": served_model, "prompt": "w11 w12 w13", "n": 3, "seed": 8, **SAMPLED}
    try:
        with openai.OpenAI(
            base_url=f"http://{servers.http_address}/v1", api_key="x", max_retries=0
        ) as local:
            colocated = texts(local.completions.create(**kw))
    finally:
        openai_cluster.run(servers.stop())
    with openai.OpenAI(base_url=f"http://{openai_cluster.http_address}/v1", api_key="x") as c:
        assert colocated == texts(c.completions.create(**kw))


@pytest.mark.parametrize(
    "override,param",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"best_of": 0}, "best_of"),
    ],
)
def test_bad_n_is_400(openai_cluster, served_model, override, param):
    body = {"model": served_model, "prompt": "w5", "max_tokens": 2, **override}
    status, out = post(openai_cluster.http_address, "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == param, out


# ---- a batch of prompts -----------------------------------------------------------------


def test_a_batch_of_prompts_gives_choice_k_n_plus_i(openai_api, served_model):
    prompts = ["w5 w6", "w7 w8 w9", "w20"]
    kw = {"model": served_model, "n": 2, "seed": 6, **SAMPLED}
    out = openai_api.completions.create(prompt=prompts, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    for k, p in enumerate(prompts):
        alone = openai_api.completions.create(prompt=p, **kw)
        assert [c.text for c in out.choices[2 * k : 2 * k + 2]] == texts(alone)
    assert out.usage.completion_tokens == 6 * NEW and out.usage.prompt_tokens == 2 + 3 + 1
    chunks = list(openai_api.completions.create(prompt=prompts, stream=True, **kw))
    streamed = [""] * 6
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == [c.text for c in out.choices]


def test_a_batch_scores_each_prompt_with_echo(openai_api, served_model):
    """What lm-eval's local-completions sends with batch_size > 1."""
    prompts = [[5, 6, 7], [9, 10]]
    out = openai_api.completions.create(
        model=served_model, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    for k, c in enumerate(out.choices):
        one = openai_api.completions.create(
            model=served_model,
            prompt=prompts[k],
            echo=True,
            logprobs=1,
            max_tokens=1,
            temperature=0,
        )
        assert c.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs
        assert len(c.logprobs.token_logprobs) == len(prompts[k]) + 1


def test_grpc_client_takes_the_new_parameters(openai_cluster):
    from pdserve.client import Client

    with Client(openai_cluster.address) as c:
        out = c.generate(
            token_ids=[5, 6, 7],
            max_tokens=4,
            temperature=1.0,
            seed=2,
            n=3,
            logprobs=2,
            prompt_logprobs=1,
            presence_penalty=0.5,
            logit_bias={9: 1.0},
            ignore_eos=True,
        )
        assert len(out.sequences) == 3 and out.usage.completion_tokens == 12
        assert all(len(s.logprobs) == 4 == len(s.token_ids) for s in out.sequences)
        assert all(len(lp.top) == 2 for s in out.sequences for lp in s.logprobs)
        assert len(out.prompt_logprobs) == 2 and out.finish_reason == "length"


def test_a_stop_string_ends_tokens_and_logprobs_at_its_token(openai_api, served_model):
    free = openai_api.completions.create(model=served_model, prompt="w9 w10 w11", **GREEDY).choices[
        0
    ]
    words = free.text.split()
    out = openai_api.completions.create(
        model=served_model, prompt="w9 w10 w11", stop=[words[3]], logprobs=0, **GREEDY
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and words[3] not in choice.text
    assert choice.logprobs.tokens == words[:4]  # up to the token that completed the stop
    assert out.usage.completion_tokens == 4


@pytest.mark.parametrize(
    "kw",
    [
        {"logit_bias": {"50": 8}, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.5}},
        {"logit_bias": {"50": 8}, "presence_penalty": 1.0, "frequency_penalty": 0.5},
        {"n": 2, "best_of": 2, "seed": 1, "temperature": 1.0},
        {"logprobs": 3, "echo": True},
    ],
    ids=["repetition+bias", "presence+frequency", "n+best_of", "logprobs+echo"],
)
def test_each_parameter_streams_what_the_whole_response_holds(openai_api, served_model, kw):
    body = {"model": served_model, "prompt": "w5 w6 w5", **GREEDY, **kw}
    whole = openai_api.completions.create(**body)
    streamed = [""] * len(whole.choices)
    for chunk in openai_api.completions.create(stream=True, **body):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert streamed == [c.text for c in whole.choices]


def test_prompt_logprobs_too_big_for_one_message_are_400(openai_cluster, served_model, monkeypatch):
    import router.core

    monkeypatch.setattr(router.core, "MAX_PROMPT_LOGPROB_ENTRIES", 10)
    body = {
        "model": served_model,
        "prompt": "w5 w6 w7 w8",
        "echo": True,
        "logprobs": 2,
        "max_tokens": 1,
    }
    status, out = post(openai_cluster.http_address, "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == "logprobs", out
    body["logprobs"] = 1  # 4 x 2 entries fit
    assert post(openai_cluster.http_address, "/v1/completions", body)[0] == 200
