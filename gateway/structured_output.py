"""Guided-decoding fields of the REST API, checked at the gateway before any
engine time with light libraries (gateway/constraint_check.py): a malformed
schema or a certainly malformed regex is a 400 naming the field. What only
the grammar compiler can judge the engine pod refuses at submit, before any
token; `engine_refusal` turns that into the same 400, so either way the
client's field is named and nothing has been streamed.

REST accepts OpenAI's ``response_format`` and vLLM's ``structured_outputs``
and older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``; one constraint per request.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.constraint_check import check
from gateway.errors import EngineRefused, GatewayError, bad_request
from gateway.request import SamplingOptions
from gateway.tool_calls import ToolCallPlan
from tessera.structured_output import StructuredOutputsParams

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
# How the shared params and the engine name the constraint's fields.
_OWN_FIELD = re.compile(r"structured_outputs(\.\w+)?: ")


def _bad_constraint(message: str, param: str) -> GatewayError:
    """400 naming the client's field `param` for a message that names ours
    ("structured_outputs.json: ...")."""
    found = _OWN_FIELD.match(message)
    where = param + ((found.group(1) or "") if found and param.endswith("structured_outputs") else "")
    detail = message[found.end():] if found else message
    return bad_request(f"{where}: {detail}", "invalid_structured_output", param.split(".")[0])


def checked(make, param: str) -> StructuredOutputsParams:
    """Build and check a constraint; 400 with ``param`` on any problem."""
    try:
        params = make()
        check(params)
    except RecursionError:
        raise bad_request(f"{param}: nested too deeply", "invalid_structured_output", param.split(".")[0]) from None
    except (ValueError, TypeError) as e:
        raise _bad_constraint(str(e), param) from None
    return params


def engine_refusal(error: EngineRefused, param: str | None) -> GatewayError:
    """An engine pod's refusal as the client sees it: one of the constraint
    (the grammar compiler's verdict) names the field the client sent it in."""
    if param is not None and _OWN_FIELD.match(error.details):
        return _bad_constraint(error.details, param)
    return error


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or "type" not in value:
        raise bad_request("response_format: must be an object with a type (text, json_object or json_schema)",
                          "invalid_value", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return checked(lambda: StructuredOutputsParams(json_object=True), "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format.json_schema: must be an object with a schema",
                              "invalid_value", "response_format")
        return checked(lambda: StructuredOutputsParams(json=spec["schema"]), "response_format")
    raise bad_request(f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
                      "invalid_value", "response_format")


def from_rest_body(body) -> tuple[StructuredOutputsParams | None, str | None]:
    """The one constraint of a REST request body and the field it came in, or (None, None)."""
    name = _constraint_field(body)
    if name is None:
        return None, None
    if name == "response_format":
        params = _from_response_format(body.response_format)
    elif name == "structured_outputs":
        params = checked(lambda: StructuredOutputsParams.from_dict(body.structured_outputs), name)
    else:
        params = checked(lambda: StructuredOutputsParams(**{_GUIDED_FIELDS[name]: getattr(body, name)}), name)
    return params, (name if params is not None else None)


def _constraint_field(body) -> str | None:
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED_FIELDS)
             if getattr(body, name, None) is not None]
    if isinstance(body.response_format, dict) and body.response_format.get("type") == "text":
        given.remove("response_format")  # plain text constrains nothing
    if len(given) > 1:
        raise bad_request(f"give one output constraint, got {' and '.join(given)}",
                          "invalid_structured_output", given[1])
    if given:
        return given[0]
    # Only a text response_format: still checked (its type may be wrong).
    return "response_format" if body.response_format is not None else None


def constrain_to_tool_calls(options: SamplingOptions, plan: ToolCallPlan | None) -> None:
    """tool_choice "required" or a named function: the output is decoded
    under the calls' schema (gateway/tool_calls/guided.py), which leaves no
    room for another constraint (400 naming tool_choice). An engine pod's
    refusal of the schema names the tools it came from."""
    if plan is None or plan.constraint is None:
        return
    if options.structured_outputs is not None:
        raise bad_request(f"tool_choice: {_choice_text(plan)} constrains the output to tool calls; it cannot be "
                          f"combined with {options.structured_outputs_param}", "invalid_value", "tool_choice")
    options.structured_outputs = plan.constraint
    options.structured_outputs_param = _tool_schema_param(plan)


def _choice_text(plan: ToolCallPlan) -> str:
    request = plan.request
    return f"the named function {request.named!r}" if request.choice == "named" else f"{request.choice!r}"


def _tool_schema_param(plan: ToolCallPlan) -> str:
    """Where the constraint's schema came from: the named function's
    parameters, or (required) every tool's."""
    request = plan.request
    if request.choice != "named":
        return "tools"
    index = [tool.name for tool in request.tools].index(request.named)
    return f"tools[{index}].function.parameters"
