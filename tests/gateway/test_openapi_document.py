"""The OpenAPI document tells the truth: every status the API returns, in
OpenAI's error shape, and the constraints the gateway enforces, so a
schema-driven client or fuzzer agrees with the server about what is valid."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import KEYS, MODEL_NAME

GENERATION = ("/v1/completions", "/v1/chat/completions")
BODIES = {"/v1/completions": ("CompletionRequest", {"prompt": "hi"}),
          "/v1/chat/completions": ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi"}]})}


@pytest.fixture(scope="module")
def doc(platform) -> dict:
    return httpx.get(platform.base_url + "/openapi.json").json()


def test_every_status_is_documented_with_the_openai_error_schema(doc):
    for path in GENERATION:
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "429", "500", "503"}
        for status in set(responses) - {"200"}:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(doc["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401", "500"}
    error = doc["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    # Validation errors are 400 here, never FastAPI's 422.
    assert "422" not in str(doc) and "HTTPValidationError" not in doc["components"]["schemas"]


def _properties(doc, name: str) -> dict:
    return doc["components"]["schemas"][name]["properties"]


def test_the_prompt_and_stop_constraints_are_stated(doc):
    prompt = _properties(doc, "CompletionRequest")["prompt"]["anyOf"]
    text, ids, texts, id_lists = prompt
    assert text == {"type": "string", "minLength": 1}
    assert ids["minItems"] == 1
    assert texts["minItems"] == texts["maxItems"] == 1 and texts["items"]["minLength"] == 1
    assert id_lists["minItems"] == id_lists["maxItems"] == 1 and id_lists["items"]["minItems"] == 1
    stop = _properties(doc, "CompletionRequest")["stop"]
    assert stop["anyOf"][0] == {"type": "string", "minLength": 1}
    assert _properties(doc, "CompletionRequest")["echo"]["enum"] == [False]


def _ranges(doc, name: str):
    """(field, minimum, maximum) of every integer field with documented bounds."""
    for field, schema in _properties(doc, name).items():
        for option in schema.get("anyOf", [schema]):
            if option.get("type") == "integer" and "minimum" in option:
                yield field, option["minimum"], option.get("maximum")


@pytest.mark.parametrize("path", GENERATION)
def test_the_server_refuses_just_outside_every_documented_integer_range(platform, doc, path):
    name, base = BODIES[path]
    checked = []
    for field, low, high in _ranges(doc, name):
        for value in (low - 1, None if high is None else high + 1):
            if value is None:
                continue
            r = httpx.post(platform.base_url + path, json={"model": MODEL_NAME, **base, field: value},
                           headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
            checked.append(field)
    assert {"n", "seed", "max_tokens", "top_k", "min_tokens"} <= set(checked)


def test_a_long_stop_string_is_accepted(platform):
    # 16 is the most stop strings, not their length (the document once said maxLength 16).
    r = httpx.post(platform.base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "stop": "x" * 40},
                   headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert r.status_code == 200, r.text
