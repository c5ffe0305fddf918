"""The OpenAI parameters real clients use, through the official ``openai`` client against a
disaggregated cluster: penalties and logit_bias, logprobs, echo, n, /tokenize."""

from __future__ import annotations

import openai
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from tests.cluster_utils import http_cluster, openai_client
from tests.conftest import tiny_llama_dir
from tests.http_utils import post

NEW = 8
GREEDY = {"max_tokens": NEW, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("params"), num_heads=4, num_kv_heads=2, seed=5)


@pytest.fixture(scope="module")
def cluster(tiny):
    with http_cluster(tiny[0]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with openai_client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def model(cluster):
    return cluster.router.cfg.model_name


@pytest.fixture(scope="module")
def engine(tiny):
    return LLMEngine.from_model_path(
        tiny[0], cache=CacheConfig(16, 256), scheduler=SchedulerConfig(), progress=False
    )


@pytest.fixture(scope="module")
def tok(tiny):
    return Tokenizer(tiny[0])


def engine_text(engine, tok, prompt_ids, **sampling) -> str:
    [req] = engine.generate(
        [prompt_ids], SamplingParams(max_tokens=NEW, ignore_eos=True, **sampling)
    )
    return tok.decode(req.output_token_ids)


# ---- penalties and logit_bias -----------------------------------------------------------


def test_logit_bias_forces_a_token(client, model):
    out = client.completions.create(model=model, prompt="w5 w6", logit_bias={"50": 100}, **GREEDY)
    assert out.choices[0].text.split() == ["w50"] * NEW


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.2},
        {"extra_body": {"ignore_eos": True, "repetition_penalty": 1.8}},
    ],
    ids=["presence", "frequency", "repetition"],
)
def test_penalties_match_the_engine(client, model, engine, tok, kw):
    """A bias makes w50 repeat; each penalty breaks the repeats as the engine's sampler does."""
    body = {**GREEDY, **kw}
    out = client.completions.create(model=model, prompt="w5 w6 w5", logit_bias={"50": 8}, **body)
    sampling = {k: v for k, v in {**kw, **kw.get("extra_body", {})}.items() if "penalty" in k}
    ids, bias = tok.encode("w5 w6 w5"), ((50, 8.0),)
    want = engine_text(engine, tok, ids, logit_bias=bias, **sampling)
    assert out.choices[0].text == want
    assert want != engine_text(engine, tok, ids, logit_bias=bias), "the penalty changed nothing"


def test_chat_takes_penalties_streaming(client, model):
    chunks = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "w5 w6"}],
        frequency_penalty=2.0,
        presence_penalty=2.0,
        stream=True,
        **GREEDY,
    )
    words = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).split()
    assert len(set(words)) > 1  # special tokens decode to nothing


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 3}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
]


@pytest.mark.parametrize("override,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_parameter_is_400_naming_it(cluster, model, override, param):
    body = {"model": model, "prompt": "w5 w6", "max_tokens": 4, **override}
    status, out = post(cluster.http_address, "/v1/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == param and param in out["error"]["message"]


# ---- /tokenize and /detokenize ----------------------------------------------------------


def test_tokenize_prompt_and_chat_as_vllm(cluster, model, tok):
    status, out = post(cluster.http_address, "/tokenize", {"model": model, "prompt": "w5 w6"})
    assert status == 200
    assert out == {"count": 2, "max_model_len": 128, "tokens": [5, 6], "token_strs": None}
    messages = [{"role": "user", "content": "w5 w6"}]
    status, out = post(cluster.http_address, "/tokenize", {"messages": messages})
    assert status == 200 and out["tokens"] == tok.encode_chat(messages)
    body = {"messages": messages, "add_generation_prompt": False, "return_token_strs": True}
    status, out = post(cluster.http_address, "/tokenize", body)
    assert out["count"] < len(tok.encode_chat(messages)) and out["token_strs"][-1] == "w6"


def test_tokenizer_info_names_the_special_tokens(cluster, tok):
    from tests.http_utils import get

    status, out = get(cluster.http_address, "/tokenizer_info")
    assert status == 200 and out["eos_token"] == "</s>" and out["bos_token"] == "<s>"
    assert out["chat_template"] == tok.chat_template and out["model_max_length"] == 128


def test_detokenize_round_trips(cluster):
    status, out = post(cluster.http_address, "/detokenize", {"tokens": [5, 6, 2]})
    assert status == 200 and out == {"prompt": "w5 w6 </s>"}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "w5", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [100000]}, "tokens"),
        ("/detokenize", {"tokens": "w5"}, "tokens"),
    ],
)
def test_tokenize_bad_input_is_400(cluster, path, body, param):
    status, out = post(cluster.http_address, path, body)
    assert status == 400 and out["error"]["param"] == param, out


def test_tokenize_over_grpc(cluster, tok):
    import grpc

    from protos import pdserve_pb2 as pb
    from protos import pdserve_pb2_grpc as pb_grpc

    messages = [pb.ChatMessage(role="user", content="w7")]
    with grpc.insecure_channel(cluster.address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        out = stub.Tokenize(pb.TokenizeRequest(prompt="w5 w6 w7"))
        assert list(out.tokens) == [5, 6, 7] and out.count == 3 and out.max_model_len == 128
        chat = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=messages)))
        assert list(chat.tokens) == tok.encode_chat([{"role": "user", "content": "w7"}])
        assert stub.Detokenize(pb.DetokenizeRequest(tokens=[5, 6])).prompt == "w5 w6"
        with pytest.raises(grpc.RpcError) as e:
            stub.Detokenize(pb.DetokenizeRequest(tokens=[10**6]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- logprobs and echo ------------------------------------------------------------------


def hf_logprobs(hf_model, ids):
    import torch

    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completion_logprobs_equal_transformers(client, model, tiny, tok):
    prompt = tok.encode("w5 w6 w7 w8")
    out = client.completions.create(model=model, prompt=prompt, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    ids = [tok.encode(t, add_special_tokens=False)[0] for t in lp.tokens]
    # The word-level test tokenizer decodes a lone token without its separating space.
    assert len(ids) == NEW and " ".join(lp.tokens) == out.choices[0].text.strip()
    ref = hf_logprobs(tiny[1], prompt + ids)
    for t, token in enumerate(ids):
        row = ref[len(prompt) - 1 + t]
        assert lp.token_logprobs[t] == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(3)
        assert list(lp.top_logprobs[t].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
        assert max(lp.top_logprobs[t].values()) == lp.token_logprobs[t]  # greedy
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_echo_returns_prompt_logprobs_equal_transformers(client, model, tiny, tok):
    prompt = "w9 w10 w11 w12 w13"
    out = client.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    choice, ids = out.choices[0], tok.encode(prompt)
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.tokens[: len(ids)] == prompt.split()
    ref = hf_logprobs(tiny[1], ids)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)


def test_echo_without_logprobs_streams_the_prompt_first(client, model):
    chunks = list(
        client.completions.create(model=model, prompt="w5 w6", echo=True, stream=True, **GREEDY)
    )
    assert chunks[0].choices[0].text.startswith("w5 w6")
    assert all(c.choices[0].logprobs is None for c in chunks)


def test_streamed_completion_logprobs_match_the_whole_response(client, model):
    kw = {"model": model, "prompt": "w20 w21", "logprobs": 2, "echo": True, **GREEDY}
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert streamed == whole.token_logprobs and offsets == whole.text_offset


def test_chat_logprobs_streaming_and_not(client, model, tiny, tok):
    messages = [{"role": "user", "content": "w30 w31"}]
    kw = {"model": model, "messages": messages, "logprobs": True, "top_logprobs": 2, **GREEDY}
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == NEW and len(whole[0].top_logprobs) == 2
    ids = [tok.encode(e.token, add_special_tokens=False)[0] for e in whole]
    prompt = tok.encode_chat(messages)
    ref = hf_logprobs(tiny[1], prompt + ids)
    for t, e in enumerate(whole):
        assert e.logprob == pytest.approx(ref[len(prompt) - 1 + t, ids[t]].item(), abs=1e-4)
        assert e.bytes == list(e.token.encode()) and e.top_logprobs[0].logprob == e.logprob
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == [e.logprob for e in whole]
    plain = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None


# ---- n > 1 ------------------------------------------------------------------------------

SAMPLED = {"max_tokens": NEW, "temperature": 1.0, "extra_body": {"ignore_eos": True}}


def texts(out) -> list[str]:
    assert [c.index for c in out.choices] == list(range(len(out.choices)))
    return [c.text for c in out.choices]


def test_n_seeded_sequences_differ_and_repeat(client, model):
    kw = {"model": model, "prompt": "w5 w6", "n": 4, "seed": 3, **SAMPLED}
    first = client.completions.create(**kw)
    assert len(set(texts(first))) > 1 and first.usage.completion_tokens == 4 * NEW
    assert texts(client.completions.create(**kw)) == texts(first)


def test_sequence_i_is_the_single_request_seeded_seed_plus_i(client, model):
    many = texts(client.completions.create(model=model, prompt="w9", n=3, seed=10, **SAMPLED))
    for i in range(3):
        one = client.completions.create(model=model, prompt="w9", seed=10 + i, **SAMPLED)
        assert one.choices[0].text == many[i]


def test_n_greedy_equals_the_single_greedy_output(client, model):
    one = client.completions.create(model=model, prompt="w7 w8", **GREEDY).choices[0].text
    assert texts(client.completions.create(model=model, prompt="w7 w8", n=4, **GREEDY)) == [one] * 4


def test_n_streams_each_choice_under_its_index(client, model):
    messages = [{"role": "user", "content": "w40 w41"}]
    kw = {"model": model, "messages": messages, "n": 3, "seed": 4, "logprobs": True, **SAMPLED}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed, lps = ["", "", ""], [[], [], []]
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
            lps[ch.index] += [e.logprob for e in (ch.logprobs.content if ch.logprobs else [])]
    assert streamed == [c.message.content for c in whole.choices]
    assert lps == [[e.logprob for e in c.logprobs.content] for c in whole.choices]
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 3


def test_n_prefilled_on_the_decode_worker_matches(cluster, model):
    """The colocated path (no transfer) forks after its own prefill: same sequences."""
    from dataclasses import replace

    from router.app import start_router

    cfg = replace(cluster.router.cfg, local_prefill_max_tokens=1000)
    servers = cluster.run(
        start_router(cfg, cluster.prefill_addresses, cluster.decode_addresses, http_port=0)
    )
    kw = {"model": model, "prompt": "w11 w12 w13", "n": 3, "seed": 8, **SAMPLED}
    try:
        with openai.OpenAI(
            base_url=f"http://{servers.http_address}/v1", api_key="x", max_retries=0
        ) as local:
            colocated = texts(local.completions.create(**kw))
    finally:
        cluster.run(servers.stop())
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="x") as c:
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
def test_bad_n_is_400(cluster, model, override, param):
    body = {"model": model, "prompt": "w5", "max_tokens": 2, **override}
    status, out = post(cluster.http_address, "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == param, out


# ---- a batch of prompts -----------------------------------------------------------------


def test_a_batch_of_prompts_gives_choice_k_n_plus_i(client, model):
    prompts = ["w5 w6", "w7 w8 w9", "w20"]
    kw = {"model": model, "n": 2, "seed": 6, **SAMPLED}
    out = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    for k, p in enumerate(prompts):
        alone = client.completions.create(prompt=p, **kw)
        assert [c.text for c in out.choices[2 * k : 2 * k + 2]] == texts(alone)
    assert out.usage.completion_tokens == 6 * NEW and out.usage.prompt_tokens == 2 + 3 + 1
    chunks = list(client.completions.create(prompt=prompts, stream=True, **kw))
    streamed = [""] * 6
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == [c.text for c in out.choices]


def test_a_batch_scores_each_prompt_with_echo(client, model):
    """What lm-eval's local-completions sends with batch_size > 1."""
    prompts = [[5, 6, 7], [9, 10]]
    out = client.completions.create(
        model=model, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    for k, c in enumerate(out.choices):
        one = client.completions.create(
            model=model, prompt=prompts[k], echo=True, logprobs=1, max_tokens=1, temperature=0
        )
        assert c.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs
        assert len(c.logprobs.token_logprobs) == len(prompts[k]) + 1


def test_grpc_client_takes_the_new_parameters(cluster):
    from pdserve.client import Client

    with Client(cluster.address) as c:
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


def test_a_stop_string_ends_tokens_and_logprobs_at_its_token(client, model):
    free = client.completions.create(model=model, prompt="w9 w10 w11", **GREEDY).choices[0]
    words = free.text.split()
    out = client.completions.create(
        model=model, prompt="w9 w10 w11", stop=[words[3]], logprobs=0, **GREEDY
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
def test_each_parameter_streams_what_the_whole_response_holds(client, model, kw):
    body = {"model": model, "prompt": "w5 w6 w5", **GREEDY, **kw}
    whole = client.completions.create(**body)
    streamed = [""] * len(whole.choices)
    for chunk in client.completions.create(stream=True, **body):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert streamed == [c.text for c in whole.choices]


def test_prompt_logprobs_too_big_for_one_message_are_400(cluster, model, monkeypatch):
    import router.core

    monkeypatch.setattr(router.core, "MAX_PROMPT_LOGPROB_ENTRIES", 10)
    body = {"model": model, "prompt": "w5 w6 w7 w8", "echo": True, "logprobs": 2, "max_tokens": 1}
    status, out = post(cluster.http_address, "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == "logprobs", out
    body["logprobs"] = 1  # 4 x 2 entries fit
    assert post(cluster.http_address, "/v1/completions", body)[0] == 200
