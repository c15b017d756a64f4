"""Every problem of an uploaded batch file is a 400 naming its line and field."""

from __future__ import annotations

import json

import pytest

from gateway.batch.input_file import parse_input
from gateway.errors import GatewayError


def _line(custom_id="a", url="/v1/completions", **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "tiny", "prompt": "hi"}, **extra})


def test_a_good_file_keeps_its_order():
    lines = parse_input(f"{_line('x')}\n\n{_line('y')}\n".encode(), max_lines=10)
    assert [(li.index, li.custom_id) for li in lines] == [(0, "x"), (1, "y")]


@pytest.mark.parametrize("content, where, param", [
    (f"{_line('a')}\n{{not json\n", "line 2: not valid JSON", "file"),
    ("[1, 2]\n", "line 1: must be a JSON object", "file"),
    (f"{_line('a')}\n{_line('a')}\n", "line 2: custom_id 'a' is used by an earlier line", "custom_id"),
    (_line(url="/v1/embeddings"), "line 1: url '/v1/embeddings' is not supported", "url"),
    (_line().replace('"POST"', '"GET"'), "line 1: method must be", "method"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": []}), "line 1: body", "body"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "line 1: custom_id", "custom_id"),
    ("\n\n", "file: holds no requests", "file"),
    (b"\xff\xfe".decode("latin-1"), "line 1: not valid JSON", "file"),
])
def test_bad_lines_name_the_line_and_field(content, where, param):
    with pytest.raises(GatewayError) as e:
        parse_input(content.encode(), max_lines=10)
    assert e.value.status == 400 and where in e.value.message and e.value.param == param


def test_not_utf8_and_too_many_lines():
    with pytest.raises(GatewayError, match="not UTF-8"):
        parse_input(b"\xff\n", max_lines=10)
    with pytest.raises(GatewayError, match="more than 2 requests"):
        parse_input("\n".join(_line(str(i)) for i in range(3)).encode(), max_lines=2)


def test_the_batch_endpoint_binds_every_line():
    with pytest.raises(GatewayError, match="line 1: url '/v1/completions'"):
        parse_input(_line().encode(), max_lines=10, endpoint="/v1/chat/completions")
