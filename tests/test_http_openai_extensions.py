"""What a vLLM user sends beyond OpenAI's basics, through the official ``openai`` client and
gRPC against a disaggregated cluster: ``min_p``, ``include_stop_str_in_output``,
``skip_special_tokens`` and ``add_generation_prompt`` (served), GET /v1/models/{id}; and every known parameter pdserve
does not implement (beam search, chat templates of the request's own, ...) refused with a 400
naming it when it asks for anything, so that no client takes free text for what it asked.
Fixtures ``openai_*``: tests/conftest.py."""

from __future__ import annotations

import grpc
import openai
import pytest

from engine.tokenizer import Tokenizer
from pdserve.client import Client
from router.http.openai_requests import CHAT_NEUTRAL_VALUES, NEUTRAL_VALUES
from tests.http_utils import get, post

NEW = 8
GREEDY = {"max_tokens": NEW, "temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]


def test_min_p_1_samples_the_greedy_text(openai_api, served_model):
    """At min_p 1 only the top token is left, so sampling at temperature 1 is greedy; a cut
    that did nothing would sample other tokens from a random model's flat distribution."""
    greedy = openai_api.completions.create(model=served_model, prompt="w5 w6", **GREEDY)

    def sampled(min_p: float) -> list[str]:
        extra = {"ignore_eos": True, "min_p": min_p}
        kw = {"max_tokens": NEW, "temperature": 1.0, "n": 3, "extra_body": extra}
        out = openai_api.completions.create(model=served_model, prompt="w5 w6", **kw)
        return [c.text for c in out.choices]

    assert sampled(1.0) == [greedy.choices[0].text] * 3
    assert any(text != greedy.choices[0].text for text in sampled(0.0))


def test_min_p_over_grpc_matches_http_and_is_range_checked(openai_cluster, openai_api):
    greedy = openai_api.completions.create(model=None, prompt="w5 w6", **GREEDY)
    with Client(openai_cluster.address) as client:
        out = client.generate("w5 w6", max_tokens=NEW, temperature=1.0, min_p=1.0, ignore_eos=True)
        assert out.text == greedy.choices[0].text
        with pytest.raises(grpc.RpcError) as err:
            client.generate("w5 w6", max_tokens=NEW, temperature=1.0, min_p=1.5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "min_p" in err.value.details()


@pytest.mark.parametrize("bad", [1.5, -0.2, "0.5"])
def test_min_p_out_of_range_or_not_a_number_is_a_400_naming_it(openai_cluster, bad):
    body = {"prompt": "w5", "max_tokens": 2, "min_p": bad}
    status, out = post(openai_cluster.http_address, "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == "min_p", out


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_the_text(
    openai_api, served_model, stream
):
    greedy = openai_api.completions.create(model=served_model, prompt="w5 w6", **GREEDY)
    words = greedy.choices[0].text.split(" ")
    stop = " " + words[3]  # a word the greedy text has, far enough in to leave text before it
    before = greedy.choices[0].text.split(stop)[0]
    for keep, want in ((False, before), (True, before + stop)):
        out = openai_api.completions.create(
            model=served_model,
            prompt="w5 w6",
            stop=[" nothing-like-it", stop],
            stream=stream,
            **{**GREEDY, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": keep}},
        )
        chunks = list(out) if stream else [out]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == want, (keep, text, want)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_shows_them_in_the_text(
    openai_api, served_model, openai_tiny, stream
):
    """A bias makes every token the tiny model's EOS (</s>, id 2; ``ignore_eos`` runs on):
    the text is empty by default, and the tokenizer's text of them with skip_special_tokens
    false."""
    shown = Tokenizer(openai_tiny[0]).decode([2, 2, 2], skip_special_tokens=False)
    assert shown.count("</s>") == 3
    texts = {}
    for skip in (True, False):
        extra = {"ignore_eos": True, "skip_special_tokens": skip}
        out = openai_api.completions.create(
            model=served_model,
            prompt="w5 w6",
            logit_bias={"2": 100},
            stream=stream,
            **{**GREEDY, "max_tokens": 3, "extra_body": extra},
        )
        chunks = list(out) if stream else [out]
        texts[skip] = "".join(c.choices[0].text for c in chunks if c.choices)
    assert texts == {True: "", False: shown}, texts


def test_add_generation_prompt_false_leaves_the_assistant_opening_out(openai_cluster):
    address = openai_cluster.http_address
    for add in (True, False):
        _, tokenized = post(
            address, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": add}
        )
        body = {"messages": MESSAGES, "max_tokens": 2, "add_generation_prompt": add}
        status, out = post(address, "/v1/chat/completions", body)
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == tokenized["count"], (add, out, tokenized)
    _, with_opening = post(address, "/tokenize", {"messages": MESSAGES})
    assert with_opening["count"] > tokenized["count"]  # the two differ: the test can tell


def test_a_model_is_retrieved_by_name_and_an_unknown_one_is_a_404(openai_api, served_model):
    card = openai_api.models.retrieve(served_model)
    assert card.id == served_model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        openai_api.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found"


def test_a_model_id_with_a_slash_reaches_the_lookup(openai_cluster):
    """Hugging Face names ("org/model") are served names too: the route takes the slash."""
    name = openai_cluster.router.cfg.model_name
    status, out = get(openai_cluster.http_address, f"/v1/models/org/{name}")
    assert status == 404 and out["error"]["code"] == "model_not_found", out
    assert f"org/{name}" in out["error"]["message"]


# A value that asks for something, per parameter pdserve does not implement.
ASKING = {
    "suffix": "tail",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": {"name": "f"},
    "use_beam_search": True,
    "length_penalty": 0.5,
    "bad_words": ["w9"],
    "prompt_logprobs": 1,
    "truncate_prompt_tokens": 4,
    "priority": 1,
}
CHAT_ASKING = {
    "echo": True,
    "continue_final_message": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "documents": [{"text": "a"}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
}


def test_every_unimplemented_parameter_is_listed():
    assert set(ASKING) == set(NEUTRAL_VALUES) and set(CHAT_ASKING) == set(CHAT_NEUTRAL_VALUES)


@pytest.mark.parametrize(
    "path,param,value",
    [("/v1/completions", k, v) for k, v in ASKING.items()]
    + [("/v1/chat/completions", k, v) for k, v in {**ASKING, **CHAT_ASKING}.items()]
    + [("/v1/completions", "priority", True), ("/v1/completions", "length_penalty", True)],
)
def test_an_unimplemented_parameter_that_asks_for_something_is_a_400_naming_it(
    openai_cluster, path, param, value
):
    base = {"prompt": "w5"} if path == "/v1/completions" else {"messages": MESSAGES}
    status, out = post(openai_cluster.http_address, path, {**base, "max_tokens": 2, param: value})
    assert status == 400, out
    assert out["error"]["param"] == param and "not supported" in out["error"]["message"], out


def test_the_neutral_values_are_served(openai_cluster):
    """What clients send by default (the openai SDK's tool_choice "auto", vLLM's
    skip_special_tokens true, ...) asks for nothing and is served."""
    neutral = {k: v[0] for k, v in {**NEUTRAL_VALUES, **CHAT_NEUTRAL_VALUES}.items() if v}
    neutral |= {"length_penalty": 1, "tool_choice": "auto", "stream": True}
    neutral["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
    body = {"messages": MESSAGES, "max_tokens": 2, **neutral}
    status, _ = post(openai_cluster.http_address, "/v1/chat/completions", body)
    assert status == 200
    body["stream_options"]["continuous_usage_stats"] = True
    status, out = post(openai_cluster.http_address, "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "stream_options.continuous_usage_stats"
