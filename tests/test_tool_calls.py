"""Tool calls at the HTTP edge (router/http/guides.py, router/http/openai_responses.py): a
chat's ``tool_choice`` naming one function is guided by its parameters schema; "required" by
vLLM's schema of an array of one or more calls among the tools; the answers are OpenAI tool
calls, whole and streamed. Through the cluster: tests/test_structured_output.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.errors import InvalidRequestError

GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")
GUIDE_FIELDS += ("guided_grammar", "structured_outputs")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _chat(**fields):
    """A chat request that asks for no guide but what ``fields`` give."""
    empty = dict.fromkeys((*GUIDE_FIELDS, "tools", "tool_choice"))
    return SimpleNamespace(**{**empty, **fields})


def test_a_forced_tool_call_is_guided_by_its_parameters_and_other_choices_are_refused():
    from router.http.guides import request_guide

    assert request_guide(_chat(tools=TOOLS, tool_choice=FORCED)) == ("json", json.dumps(WEATHER))
    assert request_guide(_chat(tools=TOOLS, tool_choice="none")) is None
    assert request_guide(_chat(tool_choice="auto")) is None  # no tools: nothing asked
    for choice in (None, "auto", {"type": "function", "function": {"name": "x"}}):
        with pytest.raises(InvalidRequestError) as err:
            request_guide(_chat(tools=TOOLS, tool_choice=choice))
        assert err.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as err:
        request_guide(_chat(tools=[{"type": "retrieval"}], tool_choice=FORCED))
    assert err.value.param == "tools"
    with pytest.raises(InvalidRequestError) as err:  # a tool call and a response_format
        request_guide(_chat(tools=TOOLS, tool_choice=FORCED, guided_regex="a"))
    assert err.value.param == "guided_regex"


TIME = {"type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "$defs": {}}
TIME["$defs"]["Zone"] = {"type": "string", "enum": ["UTC", "CET"]}
TWO_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]


def _tool(name: str, parameters) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_required_holds_the_output_to_an_array_of_calls_among_the_tools():
    """vLLM's schema for tool_choice "required": one or more {name, parameters}, each name
    one function's with that function's parameters; a $defs moves to the top, where its
    references point."""
    from router.http.guides import request_guide

    kind, spec = request_guide(_chat(tools=TWO_TOOLS, tool_choice="required"))
    schema = json.loads(spec)
    assert kind == "json" and schema["type"] == "array" and schema["minItems"] == 1
    weather, time_ = schema["items"]["anyOf"]
    assert weather["properties"] == {
        "name": {"type": "string", "enum": ["get_weather"]},
        "parameters": WEATHER,
    }
    assert time_["properties"]["parameters"] == {"type": "object", "properties": TIME["properties"]}
    assert schema["$defs"] == TIME["$defs"] and weather["required"] == ["name", "parameters"]
    for fields, param in (
        ({"tools": [*TOOLS, *TOOLS], "tool_choice": "required"}, "tools"),  # one name twice
        ({"tools": [_tool("f", "not a schema")], "tool_choice": "required"}, "tools"),
        ({"tools": [_tool("f", {"$defs": []})], "tool_choice": "required"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # nothing to call
    ):
        with pytest.raises(InvalidRequestError) as err:
            request_guide(_chat(**fields))
        assert err.value.param == param


CALLS_TEXT = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"zone": "UTC"}}]'


def _deltas(pieces: list[str], finish: str):
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        yield SimpleNamespace(
            index=0,
            prompt_logprobs=None,
            text=piece,
            token_ids=[],
            logprobs=None,
            finish_reason=finish if last else None,
            usage=None,
            timings=None,
        )


def test_required_calls_are_answered_as_tool_calls_whole_and_streamed():
    """Whole: every call in the array, each its own id, parameters as arguments, content null,
    "stop" told as "tool_calls". Streamed: each call once, whole, in the chunk where its object
    closes; a call cut by max_tokens is left out."""
    from router.http.openai_responses import RequiredToolCallsShape, ResponseBuilder

    pieces = [CALLS_TEXT[i : i + 7] for i in range(0, len(CALLS_TEXT), 7)]
    builder = ResponseBuilder(RequiredToolCallsShape("m"), token_text=None)
    chunks = [c for c in map(builder.add, _deltas(pieces, "stop")) if c is not None]
    [whole] = builder.shape.whole(builder.choices)["choices"]
    calls = whole["message"]["tool_calls"]
    assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert len({c["id"] for c in calls}) == 2
    streamed = [tc for chunk in chunks for tc in chunk["delta"].get("tool_calls", [])]
    assert streamed == [{"index": i, **call} for i, call in enumerate(calls)]
    assert chunks[0]["delta"]["role"] == "assistant" and chunks[-1]["finish_reason"] == "tool_calls"
    assert all("content" not in chunk["delta"] for chunk in chunks)
    cut = ResponseBuilder(RequiredToolCallsShape("m"), token_text=None)
    for delta in _deltas([CALLS_TEXT[:80]], "length"):
        cut.add(delta)
    [whole] = cut.shape.whole(cut.choices)["choices"]
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    assert whole["finish_reason"] == "length"


def test_each_of_n_forced_calls_has_its_own_id_whole_and_streamed():
    from router.http.openai_responses import ResponseBuilder, ToolCallShape

    builder = ResponseBuilder(ToolCallShape("m", "get_weather"), token_text=None, n=2)
    chunks = []
    for index in (0, 1, 0, 1):
        delta = next(_deltas(['{"city": "Rome"}'], None))
        delta.index = index
        chunks.append(builder.add(delta))
    whole = builder.shape.whole(builder.choices)["choices"]
    ids = [c["message"]["tool_calls"][0]["id"] for c in whole]
    assert len(set(ids)) == 2
    opened = [c["delta"]["tool_calls"][0]["id"] for c in chunks[:2]]
    assert opened == ids
