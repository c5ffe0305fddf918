"""Structured output (engine/guided.py, router/http/guides.py): every spelling clients use maps
to one guide; the sampler holds a row to its grammar from the tokens alone, so another
worker's sampler (the decode worker after the prefill worker's first token) goes on from the
same tokens; a token that breaks a grammar fails its request alone. Through a disaggregated
cluster of the embedded model (slow): JSON schema, JSON object, regex and choice outputs that
parse and match, token-exact against the single-process engine, streamed with n > 1, over
HTTP (the openai client) and gRPC, and tool calls (named and "required"; their unit tests
are in tests/test_tool_calls.py); a spec that does not compile is refused as the workers
admit the request (the router loads no xgrammar: it imports torch), a 400 naming it."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import grpc
import openai
import pytest
import torch

from engine.errors import InvalidRequestError
from engine.guided import GuidedDecoding
from engine.request import Request, SamplingParams
from engine.sampler import Sampler
from tests.conftest import needs_embedded
from tests.test_tool_calls import FORCED, TOOLS, TWO_TOOLS

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"


def _request(**fields):
    names = ("response_format", "guided_json", "guided_regex", "guided_choice")
    names += ("guided_grammar", "structured_outputs")
    return SimpleNamespace(**{n: fields.get(n) for n in names})


@pytest.mark.parametrize(
    "fields,want",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", "")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            ("json", json.dumps(SCHEMA)),
        ),
        ({"guided_json": SCHEMA}, ("json", json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, ("json", json.dumps(SCHEMA))),
        ({"guided_regex": PHONE}, ("regex", PHONE)),
        ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
        ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
        ({"structured_outputs": {"regex": PHONE}}, ("regex", PHONE)),
        ({"structured_outputs": {"json_object": True}}, ("json_object", "")),
    ],
)
def test_every_spelling_maps_to_one_guide(fields, want):
    from router.http.guides import request_guide

    assert request_guide(_request(**fields)) == want


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"guided_json": "not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),  # the second named
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_a_malformed_or_second_guide_is_refused_by_name(fields, param):
    from router.http.guides import request_guide

    with pytest.raises(InvalidRequestError) as err:
        request_guide(_request(**fields))
    assert err.value.param == param


def test_an_unknown_guide_kind_is_refused():
    with pytest.raises(InvalidRequestError, match="guide"):
        SamplingParams(guide=("yaml", ""))


@pytest.fixture(scope="module")
def tokenizer():
    from engine.model_files import resolve_model_dir
    from engine.tokenizer import Tokenizer

    return Tokenizer(resolve_model_dir("embedded"))


def _guided(tokenizer) -> GuidedDecoding:
    return GuidedDecoding(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])


def _run(sampler, req, tokenizer, steps, seed):
    """``steps`` tokens from random logits, appended as the engine's update does."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        token = sampler.sample(torch.randn(1, tokenizer.vocab_size, generator=gen) * 5, [req])[0]
        req.output_token_ids.append(token)
        if token == tokenizer.eos_token_id:
            break


@needs_embedded
@pytest.mark.parametrize("seed", [0, 1])
def test_random_logits_held_to_a_regex_and_another_sampler_goes_on_from_the_tokens(tokenizer, seed):
    """The first sampler draws a few tokens (a prefill worker's), a second one with its own
    matchers (a decode worker's) goes on from them: the text matches the regex."""
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=seed, guide=("regex", PHONE))
    req = Request("r", [1, 2, 3], params, eos_token_ids=(tokenizer.eos_token_id,))
    _run(Sampler(_guided(tokenizer)), req, tokenizer, 2, seed)
    _run(Sampler(_guided(tokenizer)), req, tokenizer, 30, seed + 100)
    assert req.output_token_ids[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(req.output_token_ids)
    assert re.fullmatch(PHONE, text), text


@needs_embedded
def test_a_token_that_breaks_its_grammar_fails_its_request_alone(tokenizer):
    sampler = Sampler(_guided(tokenizer))
    eos = (tokenizer.eos_token_id,)
    choice = SamplingParams(max_tokens=4, guide=("choice", '["yes", "no"]'))
    bad = Request("bad", [1], choice, eos_token_ids=eos)
    bad.output_token_ids.append(tokenizer.encode("maybe", add_special_tokens=False)[0])
    good = Request("good", [1], choice, eos_token_ids=eos)
    plain = Request("plain", [1], SamplingParams(max_tokens=4), eos_token_ids=eos)
    logits = torch.randn(3, tokenizer.vocab_size)
    tokens, errors = sampler.sample_isolated(logits.clone(), [bad, good, plain])
    assert list(errors) == [0] and "grammar" in str(errors[0])
    start = tokenizer.decode([tokens[1]])
    assert start and ("yes".startswith(start) or "no".startswith(start)), start
    assert tokens[2] == int(logits[2].argmax())  # the unguided row is untouched


def test_a_dead_end_ends_the_output_and_the_router_refuses_a_spec_no_token_can_begin(tmp_path):
    """A word-level vocabulary ("w5", "w6", ...): regex "w5x" begins with w5, then no token
    continues it, so the row may take only its stop token, and past it (ignore_eos) stop
    tokens again, without an error; "x" no token can begin is refused before it runs."""
    from engine.guided import GuideCompiler
    from engine.tokenizer import Tokenizer
    from tests.conftest import tiny_llama_dir

    tok = Tokenizer(tiny_llama_dir(tmp_path, vocab=64)[0])
    eos = tok.eos_token_id
    sampler = Sampler(GuidedDecoding(tok, 64, [eos]))
    params = SamplingParams(max_tokens=8, ignore_eos=True, guide=("regex", "w5x"))
    req = Request("r", [3], params, eos_token_ids=(eos,))
    for _ in range(3):
        req.output_token_ids.append(sampler.sample(torch.randn(1, 64), [req])[0])
    assert req.output_token_ids == [tok.encode("w5", add_special_tokens=False)[0], eos, eos]
    with pytest.raises(InvalidRequestError, match="begin") as err:
        GuideCompiler(tok, 64, [eos]).check_startable("regex", "x")
    assert err.value.param == "guided_regex"


# ---- end to end on the embedded model ----------------------------------------------------
MESSAGES = [{"role": "user", "content": "Give me a person as JSON with name and age."}]


@pytest.fixture(scope="module")
def cluster():
    from pdserve.cluster.local import ClusterSpec, LocalCluster
    from tests.cluster_utils import assert_all_blocks_free

    with LocalCluster(ClusterSpec(model="embedded", num_blocks=256, http_port=0)) as c:
        yield c
        assert_all_blocks_free(c)


@pytest.fixture(scope="module")
def api(cluster):
    from tests.cluster_utils import openai_client

    with openai_client(cluster) as c:
        yield c


@pytest.mark.slow
@needs_embedded
def test_a_json_schema_output_parses_and_matches_the_engine_token_for_token(api, make_engine):
    engine = make_engine("embedded", num_blocks=128)
    prompt = engine.tokenizer.encode_chat(MESSAGES)
    guide = ("json", json.dumps(SCHEMA))
    [ref] = engine.generate([prompt], SamplingParams(max_tokens=60, guide=guide))
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    out = api.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        response_format=response_format,
        logprobs=True,
    )
    text = out.choices[0].message.content
    assert text == ref.output_text and out.choices[0].finish_reason == "stop"
    person = json.loads(text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person
    assert [lp.token for lp in out.choices[0].logprobs.content]  # served with logprobs too


@pytest.mark.slow
@needs_embedded
def test_regex_choice_and_streamed_json_objects_with_n_2(api):
    phone = api.completions.create(
        model="smollm2",
        prompt="Phone number:",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": PHONE},
    )
    assert re.fullmatch(PHONE, phone.choices[0].text), phone.choices[0].text
    answer = api.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert answer.choices[0].message.content in ("yes", "no")
    stream = api.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        max_tokens=120,
        temperature=1.0,
        seed=3,
        n=2,
        stream=True,
        response_format={"type": "json_object"},
    )
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(texts) == [0, 1]
    for i, text in texts.items():
        if finish[i] == "stop":  # a sampled object may run past max_tokens: then it is cut
            assert isinstance(json.loads(text), dict), text


@pytest.mark.slow
@needs_embedded
def test_grpc_takes_the_guide_and_a_spec_that_does_not_compile_is_refused(cluster, api):
    from pdserve.client import Client

    with Client(cluster.address) as client:
        out = client.generate(
            "Phone number:", max_tokens=20, guide={"kind": "regex", "spec": PHONE}
        )
        assert re.fullmatch(PHONE, out.text), out.text
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x", max_tokens=2, guide={"kind": "regex", "spec": "[a-"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for body, param in (
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_json": {"type": "objet"}}, "guided_json"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            api.completions.create(model="smollm2", prompt="x", max_tokens=2, extra_body=body)
        assert bad.value.body["param"] == param and "compile" in bad.value.body["message"]
    ok = api.completions.create(model="smollm2", prompt="Hi", max_tokens=3, temperature=0)
    assert ok.choices[0].text  # still serving


@pytest.mark.slow
@needs_embedded
def test_a_forced_tool_call_answers_with_its_arguments_whole_and_streamed(api):
    """As LangChain's ``with_structured_output`` asks: the call's arguments follow the
    function's parameters; content is null; streamed, the pieces add up to the same."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"model": "smollm2", "messages": question, "tools": TOOLS, "tool_choice": FORCED}
    kw["max_tokens"] = 40
    whole = api.chat.completions.create(**kw, temperature=0)
    message = whole.choices[0].message
    assert message.content is None and whole.choices[0].finish_reason == "stop"
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    pieces, names, ids = [], set(), set()
    for chunk in api.chat.completions.create(**kw, temperature=0, stream=True):
        for c in chunk.choices:
            assert c.delta.content is None
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                if tc.function.name:
                    names.add(tc.function.name)
                if tc.id:
                    ids.add(tc.id)
                pieces.append(tc.function.arguments or "")
    assert names == {"get_weather"} and len(ids) == 1
    assert "".join(pieces) == call.function.arguments
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(**{**kw, "tool_choice": "auto"})
    assert err.value.body["param"] == "tool_choice"


@pytest.mark.slow
@needs_embedded
def test_required_tool_calls_through_the_cluster_whole_and_streamed(api):
    """tool_choice "required" through the openai client: one or more calls among the tools,
    each with arguments its function's parameters take; streamed, the same calls."""
    question = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    kw = {"model": "smollm2", "messages": question, "tools": TWO_TOOLS, "tool_choice": "required"}
    kw.update(max_tokens=80, temperature=0)
    whole = api.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.message.content is None and choice.finish_reason == "tool_calls", choice
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls), calls
    for name, arguments in calls:
        allowed = {"get_weather": {"city"}, "get_time": {"zone"}}[name]
        assert set(arguments) <= allowed, arguments
    streamed = []
    for chunk in api.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            assert c.delta.content is None
            for tc in c.delta.tool_calls or []:
                assert tc.index == len(streamed) and tc.id
                streamed.append((tc.function.name, json.loads(tc.function.arguments)))
    assert streamed == calls
