"""Guided-decoding fields of the REST API, checked at the gateway before any
engine time: the constraint is parsed with xgrammar (cached per constraint),
so a malformed schema, regex or grammar is a 400 naming the field.

REST accepts OpenAI's ``response_format`` and vLLM's ``structured_outputs``
and older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``; one constraint per request.
"""

from __future__ import annotations

import re
from typing import Any

from engine_pod.structured_output.backend_xgrammar import validate
from engine_pod.structured_output.params import StructuredOutputsParams
from gateway.errors import bad_request

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def checked(make, param: str) -> StructuredOutputsParams:
    """Build and parse a constraint; 400 with ``param`` on any problem."""
    try:
        params = make()
        validate(params)
    except RecursionError:
        raise bad_request(f"{param}: nested too deeply", "invalid_structured_output", param.split(".")[0]) from None
    except (ValueError, TypeError) as e:
        # The engine names its own field ("structured_outputs.json: ..."):
        # name the client's instead.
        found = re.match(r"structured_outputs(\.\w+)?: ", str(e))
        where = param + (found.group(1) or "" if found and param.endswith("structured_outputs") else "")
        detail = str(e)[found.end():] if found else str(e)
        raise bad_request(f"{where}: {detail}", "invalid_structured_output", param.split(".")[0]) from None
    return params


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


def from_rest_body(body) -> StructuredOutputsParams | None:
    """The one constraint of a REST request body, or None."""
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED_FIELDS)
             if getattr(body, name, None) is not None]
    if isinstance(body.response_format, dict) and body.response_format.get("type") == "text":
        given.remove("response_format")  # plain text constrains nothing
    if len(given) > 1:
        raise bad_request(f"give one output constraint, got {' and '.join(given)}",
                          "invalid_structured_output", given[1])
    if not given:
        return _from_response_format(body.response_format) if body.response_format is not None else None
    name = given[0]
    if name == "response_format":
        return _from_response_format(body.response_format)
    if name == "structured_outputs":
        return checked(lambda: StructuredOutputsParams.from_dict(body.structured_outputs), name)
    return checked(lambda: StructuredOutputsParams(**{_GUIDED_FIELDS[name]: getattr(body, name)}), name)
