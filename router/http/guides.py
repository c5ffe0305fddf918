"""Structured output at the HTTP edge: the request's one guide, from whichever spelling a client
uses, as (kind, spec) for the wire's ``SamplingParams.guide`` (kinds: engine/guided.py).

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM's ``guided_json`` (a schema, as an object or its text), ``guided_regex``,
  ``guided_choice`` (a list of strings) and ``guided_grammar`` (EBNF);
- vLLM's newer ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ...}``.

And a chat's tool calls (the response carries them as tool calls,
router/http/openai_responses.py): ``tools`` with ``tool_choice`` naming one function, whose
``parameters`` schema guides the output (the arguments); or ``tool_choice`` "required", which
holds the output to a JSON array of one or more ``{"name", "parameters"}`` calls among the
tools, as vLLM does. "none" leaves tools out; "auto" needs a model-specific tool-call parser,
which pdserve does not have (vLLM refuses it too unless started with one): a 400.

More than one is a 400 naming the second; a spec that does not compile is refused by the
workers as they admit the request (engine/guided.py), a 400 naming it.
"""

from __future__ import annotations

import json

from engine.errors import InvalidRequestError

Guide = tuple[str, str]


def forced_tool(req) -> dict | None:
    """The function a chat request's ``tool_choice`` names (its ``tools`` entry's
    ``function``), None when it names none; InvalidRequestError for what is not served."""
    tools, choice = _tools_and_choice(req)
    if tools is None or choice == "required":
        return None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if name not in functions:
        raise InvalidRequestError("tool_choice", f"must name one of the tools, got {name!r}")
    return functions[name]


def required_tools(req) -> list[dict] | None:
    """The functions a chat request with ``tool_choice`` "required" may call (each ``tools``
    entry's ``function``), None when it is not "required"."""
    tools, choice = _tools_and_choice(req)
    if tools is None or choice != "required":
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools", "function names must be unique")
    return [t["function"] for t in tools]


def _tools_and_choice(req) -> tuple[list | None, object]:
    """The request's tools and tool_choice when it asks for a tool call, (None, None) when it
    asks for none; InvalidRequestError for tools that are not functions and for "auto"."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if not tools or choice == "none":
        if isinstance(choice, dict) or choice == "required":
            raise InvalidRequestError("tool_choice", "asks for a tool call, but tools is empty")
        return None, None
    if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
        raise InvalidRequestError("tools", "each must be {type: function, function: {name}}")
    if choice in (None, "auto"):
        raise InvalidRequestError(
            "tool_choice",
            "'auto' needs a tool-call parser, which this server does not have: name the "
            "function ({type: function, function: {name}}) or ask for 'required'",
        )
    return tools, choice


def calls_schema(functions: list[dict]) -> dict:
    """The JSON schema of a "required" answer: an array of one or more calls, each
    ``{"name": <one function>, "parameters": <its parameters>}`` (vLLM's). Each parameters
    schema's ``$defs`` move to the top, where its ``#/$defs/...`` references point."""
    defs: dict = {}
    calls = []
    for function in functions:
        params = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict) or not isinstance(params.get("$defs", {}), dict):
            raise InvalidRequestError("tools", "a function's parameters must be a JSON schema")
        params = dict(params)
        for key, value in params.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise InvalidRequestError("tools", f"two different $defs named {key!r}")
        name = {"type": "string", "enum": [function["name"]]}
        properties = {"name": name, "parameters": params}
        calls.append({"properties": properties, "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    return {**schema, "$defs": defs} if defs else schema


def _is_function_tool(tool) -> bool:
    return (
        isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


def request_guide(req) -> Guide | None:
    """The guide ``req`` (a completions or chat request) asks for, or None."""
    found: list[tuple[str, Guide]] = []
    tool, required = forced_tool(req), required_tools(req)
    if tool is not None:
        params = tool.get("parameters") or {"type": "object"}
        found.append(("tool_choice", _spec("tools", "json", params)))
    elif required is not None:
        found.append(("tool_choice", ("json", json.dumps(calls_schema(required)))))
    if req.response_format is not None:
        guide = _response_format(req.response_format)
        if guide is not None:
            found.append(("response_format", guide))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", _spec(f"guided_{kind}", kind, value)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    if len(found) > 1:
        raise InvalidRequestError(found[1][0], f"only one structured output, and {found[0][0]}")
    return found[0][1] if found else None


def _response_format(value) -> Guide | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format", "json_schema.schema must be an object")
        return ("json", json.dumps(schema))
    raise InvalidRequestError(
        "response_format", "type must be 'text', 'json_object' or 'json_schema'"
    )


def _spec(param: str, kind: str, value) -> Guide:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise InvalidRequestError(param, "must be a JSON schema") from None
        if not isinstance(value, dict):
            raise InvalidRequestError(param, "must be a JSON schema (an object)")
        return ("json", json.dumps(value))
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise InvalidRequestError(param, "must be a non-empty list of strings")
        return ("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(param, "must be a non-empty string")
    return (kind, value)


def _structured_outputs(value) -> Guide:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs", "must be an object")
    if value.get("json_object") is True:
        return ("json_object", "")
    kinds = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    if len(kinds) != 1:
        raise InvalidRequestError(
            "structured_outputs", "must name one of json, regex, choice, grammar or json_object"
        )
    return _spec("structured_outputs", kinds[0], value[kinds[0]])
