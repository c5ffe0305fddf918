"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client and by plain HTTP:
completions and chat, streaming and not, usage, greedy text equal to the engine's, the SSE
framing, the bad-input table (400 naming the parameter, then still serving), 404, 429, /health.
"""

from __future__ import annotations

import importlib.metadata
import json

import openai
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from router.app import start_router
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.http_utils import get, open_stream, post, sse_events

NEW = 8
MESSAGES = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w5 w9 w40"}]


@pytest.fixture(scope="module")
def openai_tiny(tmp_path_factory):
    """This module's own tiny model (seed 11), which conftest's ``openai_cluster`` serves."""
    return tiny_llama_dir(tmp_path_factory.mktemp("http"), num_heads=4, num_kv_heads=2, seed=11)


@pytest.fixture(scope="module")
def model_path(openai_tiny):
    return openai_tiny[0]


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy text of the single-process engine for a list of prompt ids."""
    engine = LLMEngine.from_model_path(
        model_path, cache=CacheConfig(16, 256), scheduler=SchedulerConfig(), progress=False
    )
    tok = Tokenizer(model_path)

    def greedy(prompt_ids: list[int], new_tokens: int = NEW) -> str:
        [req] = engine.generate(
            [prompt_ids], SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        )
        return tok.decode(req.output_token_ids)

    greedy.tokenizer = tok
    return greedy


GREEDY = {"max_tokens": NEW, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_completion_greedy_text_equals_the_engine(openai_api, served_model, reference):
    out = openai_api.completions.create(model=served_model, prompt="w5 w6 w7", **GREEDY)
    ids = reference.tokenizer.encode("w5 w6 w7")
    assert out.choices[0].text == reference(ids)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == NEW
    assert out.usage.total_tokens == len(ids) + NEW and out.object == "text_completion"


def test_completion_of_token_ids(openai_api, served_model, reference):
    out = openai_api.completions.create(model=served_model, prompt=[7, 8, 9, 10], **GREEDY)
    assert out.choices[0].text == reference([7, 8, 9, 10])


def test_completion_stream_with_usage(openai_api, served_model, reference):
    chunks = list(
        openai_api.completions.create(
            model=served_model,
            prompt="w30 w31",
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference(reference.tokenizer.encode("w30 w31"))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2, "text is streamed"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == NEW
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_text_equals_the_engine(openai_api, served_model, reference):
    out = openai_api.chat.completions.create(model=served_model, messages=MESSAGES, **GREEDY)
    ids = reference.tokenizer.encode_chat(MESSAGES)
    assert out.choices[0].message.content == reference(ids)
    assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == NEW


def test_chat_stream_with_usage(openai_api, served_model, reference):
    chunks = list(
        openai_api.chat.completions.create(
            model=served_model,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(reference.tokenizer.encode_chat(MESSAGES))
    assert chunks[-1].usage.prompt_tokens == len(reference.tokenizer.encode_chat(MESSAGES))
    assert chunks[-1].usage.completion_tokens == NEW


def test_stop_string_gives_finish_reason_stop(openai_api, served_model):
    free = openai_api.completions.create(model=served_model, prompt="w9 w10 w11", **GREEDY)
    stop = free.choices[0].text.split()[3]
    out = openai_api.completions.create(
        model=served_model, prompt="w9 w10 w11", stop=[stop], **GREEDY
    )
    assert out.choices[0].finish_reason == "stop"
    assert free.choices[0].text.startswith(out.choices[0].text) and stop not in out.choices[0].text


def test_seeded_sampling_repeats(openai_api, served_model):
    kw = {
        "model": served_model,
        "prompt": "w9 w10",
        "max_tokens": NEW,
        "temperature": 2.0,
        "top_p": 0.9,
        "seed": 5,
        "extra_body": {"ignore_eos": True, "top_k": 20, "min_tokens": 2},
    }
    assert (
        openai_api.completions.create(**kw).choices[0].text
        == openai_api.completions.create(**kw).choices[0].text
    )


def test_sse_stream_parses_with_a_plain_parser(openai_cluster, served_model):
    body = {
        "model": served_model,
        "prompt": "w5 w6",
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_timings": True,
    }
    conn, resp = open_stream(openai_cluster.http_address, "/v1/completions", body)
    try:
        assert resp.status == 200
        assert resp.getheader("Content-Type").startswith("text/event-stream")
        events = list(sse_events(resp))
    finally:
        conn.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == NEW
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert set(chunks[-1]["timings"]) >= {
        "prefill_queue_s",
        "prefill_s",
        "kv_transfer_s",
        "decode_queue_s",
        "ttft_s",
    }


def test_timings_extension_breaks_down_ttft(openai_api, served_model):
    out = openai_api.completions.create(
        model=served_model, prompt="w5 w6 w7 w8", max_tokens=4, extra_body={"return_timings": True}
    )
    t = out.model_extra["timings"]
    parts = t["prefill_queue_s"] + t["prefill_s"] + t["kv_transfer_s"] + t["decode_queue_s"]
    assert t["prefill_s"] > 0 and t["kv_bytes"] > 0
    assert parts + t["other_s"] == pytest.approx(t["ttft_s"], abs=1e-3) or parts > t["ttft_s"]
    assert t["e2e_s"] >= t["ttft_s"]
    assert (
        "timings"
        not in openai_api.completions.create(
            model=served_model, prompt="w5", max_tokens=2
        ).model_extra
    )


BAD = [
    ({"max_tokens": "abc"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 1000}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": [1]}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": "x"}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"n": 0}, "n"),
    ({"n": "1"}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"return_timings": 1}, "return_timings"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": 1}, "echo"),
    ({"best_of": 0}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [5, 100000]}, "prompt"),
    ({"prompt": ["w5"] * 65}, "prompt"),
    ({"prompt": "w5 " * 200}, "prompt"),
    ({"prompt": "w5 " * 100, "max_tokens": 100}, "max_tokens"),
    ({"prompt": None}, "prompt"),
]
BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "w5"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 2}, "logprobs"),
]


@pytest.mark.parametrize("override,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_completion_parameter_is_400_naming_it(openai_cluster, served_model, override, param):
    body = {"model": served_model, "prompt": "w5 w6", "max_tokens": 4, **override}
    assert_400_naming(openai_cluster, "/v1/completions", body, param)


@pytest.mark.parametrize("override,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_parameter_is_400_naming_it(openai_cluster, served_model, override, param):
    body = {"model": served_model, "messages": MESSAGES, "max_tokens": 4, **override}
    assert_400_naming(openai_cluster, "/v1/chat/completions", body, param)


def assert_400_naming(openai_cluster, path, body, param):
    status, out = post(openai_cluster.http_address, path, body)
    assert status == 400, out
    err = out["error"]
    assert (
        err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"
    )
    # ... and the server keeps serving.
    status, ok = post(
        openai_cluster.http_address, "/v1/completions", {"prompt": "w5", "max_tokens": 2}
    )
    assert status == 200 and ok["choices"][0]["finish_reason"] in ("stop", "length")


def test_malformed_json_is_400(openai_cluster):
    status, out = post(openai_cluster.http_address, "/v1/completions", b"{not json")
    assert status == 400 and out["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404(openai_api):
    with pytest.raises(openai.NotFoundError) as e:
        openai_api.completions.create(model="gpt-17", prompt="w5", max_tokens=2)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"


def test_unknown_route_is_404_in_openai_shape(openai_cluster):
    status, out = get(openai_cluster.http_address, "/v1/nothing")
    assert status == 404 and "message" in out["error"]


def test_models_and_health(openai_api, openai_cluster, served_model):
    assert [m.id for m in openai_api.models.list()] == [served_model]
    healthy = (200, {"status": "ok", "prefill_workers": 1, "decode_workers": 1})
    assert get(openai_cluster.http_address, "/health") == healthy
    # vLLM's names: /ping (GET or POST) is the same probe, /version the server's version.
    assert get(openai_cluster.http_address, "/ping") == healthy
    assert post(openai_cluster.http_address, "/ping", {}) == healthy
    status, body = get(openai_cluster.http_address, "/version")
    assert status == 200 and body["version"] == importlib.metadata.version("pdserve")


def _extra_router(openai_cluster, decode: list[str], **cfg):
    from dataclasses import replace

    rcfg = replace(openai_cluster.router.cfg, **cfg)
    return openai_cluster.run(
        start_router(rcfg, openai_cluster.prefill_addresses, decode, http_port=0)
    )


def test_overloaded_is_429(openai_cluster, served_model):
    servers = _extra_router(
        openai_cluster, openai_cluster.decode_addresses, max_inflight_requests=0
    )
    try:
        with (
            openai.OpenAI(
                base_url=f"http://{servers.http_address}/v1", api_key="x", max_retries=0
            ) as c,
            pytest.raises(openai.RateLimitError),
        ):
            c.completions.create(model=served_model, prompt="w5", max_tokens=2)
    finally:
        openai_cluster.run(servers.stop())


def test_health_is_503_until_every_pool_has_a_ready_worker(openai_cluster):
    servers = _extra_router(openai_cluster, ["127.0.0.1:1"])  # nothing answers there
    try:
        status, body = get(servers.http_address, "/health")
        assert status == 503 and body["decode_workers"] == 0
        assert get(servers.http_address, "/ping")[0] == 503
        openai_cluster.run(servers.router.add_worker("decode", openai_cluster.decode_addresses[0]))
        assert get(servers.http_address, "/health")[0] == 200
    finally:
        openai_cluster.run(servers.stop())


def test_client_leaving_mid_stream_frees_its_blocks(openai_cluster, served_model):
    body = {
        "model": served_model,
        "prompt": "w5 w6",
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
    }
    conn, resp = open_stream(openai_cluster.http_address, "/v1/completions", body)
    assert next(sse_events(resp))
    conn.close()
    assert_all_blocks_free(openai_cluster)
