"""The OpenAI parameters real clients use, through the official ``openai`` client against a
disaggregated cluster: penalties and logit_bias, logprobs, echo, /tokenize (n, batches, stop
strings and streaming: test_http_openai_n.py). Fixtures ``openai_*``: tests/conftest.py."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from tests.http_utils import post

NEW = 8
GREEDY = {"max_tokens": NEW, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def engine(openai_tiny):
    return LLMEngine.from_model_path(
        openai_tiny[0], cache=CacheConfig(16, 256), scheduler=SchedulerConfig(), progress=False
    )


@pytest.fixture(scope="module")
def tok(openai_tiny):
    return Tokenizer(openai_tiny[0])


def engine_text(engine, tok, prompt_ids, **sampling) -> str:
    [req] = engine.generate(
        [prompt_ids], SamplingParams(max_tokens=NEW, ignore_eos=True, **sampling)
    )
    return tok.decode(req.output_token_ids)


# ---- penalties and logit_bias -----------------------------------------------------------


def test_logit_bias_forces_a_token(openai_api, served_model):
    out = openai_api.completions.create(
        model=served_model, prompt="w5 w6", logit_bias={"50": 100}, **GREEDY
    )
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
def test_penalties_match_the_engine(openai_api, served_model, engine, tok, kw):
    """A bias makes w50 repeat; each penalty breaks the repeats as the engine's sampler does."""
    body = {**GREEDY, **kw}
    out = openai_api.completions.create(
        model=served_model, prompt="w5 w6 w5", logit_bias={"50": 8}, **body
    )
    sampling = {k: v for k, v in {**kw, **kw.get("extra_body", {})}.items() if "penalty" in k}
    ids, bias = tok.encode("w5 w6 w5"), ((50, 8.0),)
    want = engine_text(engine, tok, ids, logit_bias=bias, **sampling)
    assert out.choices[0].text == want
    assert want != engine_text(engine, tok, ids, logit_bias=bias), "the penalty changed nothing"


def test_chat_takes_penalties_streaming(openai_api, served_model):
    chunks = openai_api.chat.completions.create(
        model=served_model,
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
def test_bad_parameter_is_400_naming_it(openai_cluster, served_model, override, param):
    body = {"model": served_model, "prompt": "w5 w6", "max_tokens": 4, **override}
    status, out = post(openai_cluster.http_address, "/v1/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == param and param in out["error"]["message"]


# ---- /tokenize and /detokenize ----------------------------------------------------------


def test_tokenize_prompt_and_chat_as_vllm(openai_cluster, served_model, tok):
    status, out = post(
        openai_cluster.http_address, "/tokenize", {"model": served_model, "prompt": "w5 w6"}
    )
    assert status == 200
    assert out == {"count": 2, "max_model_len": 128, "tokens": [5, 6], "token_strs": None}
    messages = [{"role": "user", "content": "w5 w6"}]
    status, out = post(openai_cluster.http_address, "/tokenize", {"messages": messages})
    assert status == 200 and out["tokens"] == tok.encode_chat(messages)
    body = {"messages": messages, "add_generation_prompt": False, "return_token_strs": True}
    status, out = post(openai_cluster.http_address, "/tokenize", body)
    assert out["count"] < len(tok.encode_chat(messages)) and out["token_strs"][-1] == "w6"


def test_tokenizer_info_names_the_special_tokens(openai_cluster, tok):
    from tests.http_utils import get

    status, out = get(openai_cluster.http_address, "/tokenizer_info")
    assert status == 200 and out["eos_token"] == "</s>" and out["bos_token"] == "<s>"
    assert out["chat_template"] == tok.chat_template and out["model_max_length"] == 128


def test_detokenize_round_trips(openai_cluster):
    status, out = post(openai_cluster.http_address, "/detokenize", {"tokens": [5, 6, 2]})
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
def test_tokenize_bad_input_is_400(openai_cluster, path, body, param):
    status, out = post(openai_cluster.http_address, path, body)
    assert status == 400 and out["error"]["param"] == param, out


def test_tokenize_over_grpc(openai_cluster, tok):
    import grpc

    from protos import pdserve_pb2 as pb
    from protos import pdserve_pb2_grpc as pb_grpc

    messages = [pb.ChatMessage(role="user", content="w7")]
    with grpc.insecure_channel(openai_cluster.address) as ch:
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


def test_completion_logprobs_equal_transformers(openai_api, served_model, openai_tiny, tok):
    prompt = tok.encode("w5 w6 w7 w8")
    out = openai_api.completions.create(model=served_model, prompt=prompt, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    ids = [tok.encode(t, add_special_tokens=False)[0] for t in lp.tokens]
    # The word-level test tokenizer decodes a lone token without its separating space.
    assert len(ids) == NEW and " ".join(lp.tokens) == out.choices[0].text.strip()
    ref = hf_logprobs(openai_tiny[1], prompt + ids)
    for t, token in enumerate(ids):
        row = ref[len(prompt) - 1 + t]
        assert lp.token_logprobs[t] == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(3)
        assert list(lp.top_logprobs[t].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
        assert max(lp.top_logprobs[t].values()) == lp.token_logprobs[t]  # greedy
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_echo_returns_prompt_logprobs_equal_transformers(
    openai_api, served_model, openai_tiny, tok
):
    prompt = "w9 w10 w11 w12 w13"
    out = openai_api.completions.create(
        model=served_model, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    choice, ids = out.choices[0], tok.encode(prompt)
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.tokens[: len(ids)] == prompt.split()
    ref = hf_logprobs(openai_tiny[1], ids)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)


def test_echo_without_logprobs_streams_the_prompt_first(openai_api, served_model):
    chunks = list(
        openai_api.completions.create(
            model=served_model, prompt="w5 w6", echo=True, stream=True, **GREEDY
        )
    )
    assert chunks[0].choices[0].text.startswith("w5 w6")
    assert all(c.choices[0].logprobs is None for c in chunks)


def test_streamed_completion_logprobs_match_the_whole_response(openai_api, served_model):
    kw = {"model": served_model, "prompt": "w20 w21", "logprobs": 2, "echo": True, **GREEDY}
    whole = openai_api.completions.create(**kw).choices[0].logprobs
    chunks = list(openai_api.completions.create(stream=True, **kw))
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert streamed == whole.token_logprobs and offsets == whole.text_offset


def test_chat_logprobs_streaming_and_not(openai_api, served_model, openai_tiny, tok):
    messages = [{"role": "user", "content": "w30 w31"}]
    kw = {
        "model": served_model,
        "messages": messages,
        "logprobs": True,
        "top_logprobs": 2,
        **GREEDY,
    }
    whole = openai_api.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == NEW and len(whole[0].top_logprobs) == 2
    ids = [tok.encode(e.token, add_special_tokens=False)[0] for e in whole]
    prompt = tok.encode_chat(messages)
    ref = hf_logprobs(openai_tiny[1], prompt + ids)
    for t, e in enumerate(whole):
        assert e.logprob == pytest.approx(ref[len(prompt) - 1 + t, ids[t]].item(), abs=1e-4)
        assert e.bytes == list(e.token.encode()) and e.top_logprobs[0].logprob == e.logprob
    chunks = list(openai_api.chat.completions.create(stream=True, **kw))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == [e.logprob for e in whole]
    plain = openai_api.chat.completions.create(model=served_model, messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None
