"""Property-based requests generated from the gateway's OpenAPI document
(schemathesis): whatever the body, the gateway answers 2xx or 4xx in
OpenAI's error shape, never a 5xx, never a crash or a hang.

The fuzzing gateway (tests/gateway/conftest.py) caps the context at 48
tokens, so a valid generated request stays cheap on the real engine pods
behind it.
"""

from __future__ import annotations

import json

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import KEYS, MODEL_NAME

EXAMPLES = 500


def test_no_generated_request_gets_a_server_error(fuzz_gateway):
    doc = httpx.get(fuzz_gateway.base_url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    seen: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of([op.as_strategy() for op in operations]), served_model=st.integers(0, 4))
    def check(case, served_model):
        # Mostly the served model: a random name only exercises the 404 path.
        if served_model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL_NAME
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEYS['fuzz']}"}
        response = case.call(base_url=fuzz_gateway.base_url, timeout=60)
        seen.append(response.status_code)
        assert response.status_code < 500, \
            f"{case.method} {case.path} {case.body!r} -> {response.status_code}: {response.text[:500]}"
        if response.status_code >= 400:
            error = json.loads(response.text)["error"]
            assert error["message"] and error["type"]
        assert fuzz_gateway.proc.poll() is None, "the gateway died"

    check()
    assert len(seen) >= EXAMPLES
    # The generator reached both sides: valid requests served, invalid ones refused.
    assert any(200 <= s < 300 for s in seen) and any(400 <= s < 500 for s in seen)
