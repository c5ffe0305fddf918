"""Structured output at the HTTP edge: the request's one guide, from whichever spelling a client
uses, as (kind, spec) for the wire's ``SamplingParams.guide`` (kinds: engine/guided.py).

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM's ``guided_json`` (a schema, as an object or its text), ``guided_regex``,
  ``guided_choice`` (a list of strings) and ``guided_grammar`` (EBNF);
- vLLM's newer ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ...}``.

And a chat's forced tool call: ``tools`` with ``tool_choice`` naming one function, whose
``parameters`` schema guides the output (the arguments; the response carries them as a tool
call, router/http/openai_responses.py). ``tool_choice`` "none" leaves tools out; "auto" and
"required" need a model-specific tool-call parser, which pdserve does not have (vLLM refuses
"auto" too unless started with one): a 400.

More than one is a 400 naming the second; a spec that does not compile is refused by the
workers as they admit the request (engine/guided.py), a 400 naming it.
"""

from __future__ import annotations

import json

from engine.errors import InvalidRequestError

Guide = tuple[str, str]


def forced_tool(req) -> dict | None:
    """The function a chat request's ``tool_choice`` names (its ``tools`` entry's
    ``function``), None when it asks for no tool call; InvalidRequestError for what is not
    served."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if not tools or choice == "none":
        if isinstance(choice, dict):
            raise InvalidRequestError("tool_choice", "names a function, but tools is empty")
        return None
    if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
        raise InvalidRequestError("tools", "each must be {type: function, function: {name}}")
    if choice in (None, "auto", "required"):
        raise InvalidRequestError(
            "tool_choice",
            f"{choice or 'auto'!r} needs a tool-call parser, which this server does not have: "
            "name the function ({type: function, function: {name}})",
        )
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if name not in functions:
        raise InvalidRequestError("tool_choice", f"must name one of the tools, got {name!r}")
    return functions[name]


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
    tool = forced_tool(req)
    if tool is not None:
        params = tool.get("parameters") or {"type": "object"}
        found.append(("tool_choice", _spec("tools", "json", params)))
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
