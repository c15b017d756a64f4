"""How a request FastAPI cannot validate is named in the 400: the field, not where it came from."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError

from gateway.openai_api.server import _validation_message


@pytest.mark.parametrize("loc, where, param", [
    (("body", "messages", 0, "content"), "messages.0.content", "messages"),
    (("query", "limit"), "limit", "limit"),
    (("path", "batch_id"), "batch_id", "batch_id"),
    (("body", "body"), "body", "body"),  # a field named like the source is still a field
])
def test_the_message_and_param_name_the_field(loc, where, param):
    message, named = _validation_message(RequestValidationError([{"loc": loc, "msg": "bad value", "type": "x"}]))
    assert (message, named) == (f"{where}: bad value", param)


def test_a_body_that_is_not_an_object_is_named_as_such():
    message, named = _validation_message(RequestValidationError([{"loc": ("body",), "msg": "x", "type": "x"}]))
    assert named is None and "JSON object" in message
