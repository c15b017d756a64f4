"""A batch input file checked line by line: nothing in it is trusted. Each
line is a JSON object {custom_id, method: "POST", url, body}; custom_ids are
unique; every url is one this gateway serves in batches. A problem is a 400
naming the line (1-based, as an editor shows it) and the field."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.errors import GatewayError, bad_request

# The endpoints a batch may run, and their names in the metrics.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
_MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch."""

    index: int
    """Its position in the input file (0-based): the output keeps this order."""
    custom_id: str
    """The client's name for it, echoed in its output line."""
    url: str
    """The endpoint it runs on (one of BATCH_ENDPOINTS)."""
    body: dict
    """The endpoint's request body, checked by the endpoint's own model when the line runs."""


def _line_error(number: int, message: str, param: str) -> GatewayError:
    return bad_request(f"line {number}: {message}", "invalid_batch_input", param)


def parse_input(content: bytes, max_lines: int, endpoint: str | None = None) -> list[BatchLine]:
    """The file's lines, or a GatewayError (400) for its first problem.
    `endpoint`: the batch's, which every line's url must equal (None: any of BATCH_ENDPOINTS)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"file: not UTF-8 text (byte {e.start})", "invalid_batch_input", "file") from None
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue  # a trailing newline, a blank line: nothing to run
        if len(lines) >= max_lines:
            raise bad_request(f"file: more than {max_lines} requests (batch.max_lines_per_file)",
                              "too_many_lines", "file")
        try:
            item = json.loads(raw)
        except (json.JSONDecodeError, RecursionError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deep"
            raise _line_error(number, f"not valid JSON: {msg}", "file") from None
        if not isinstance(item, dict):
            raise _line_error(number, "must be a JSON object", "file")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > _MAX_CUSTOM_ID_CHARS:
            raise _line_error(number, f"custom_id must be a string of 1 to {_MAX_CUSTOM_ID_CHARS} characters",
                              "custom_id")
        if custom_id in seen:
            raise _line_error(number, f"custom_id {custom_id[:64]!r} is used by an earlier line; each must be "
                                      "unique", "custom_id")
        seen.add(custom_id)
        if item.get("method") != "POST":
            raise _line_error(number, "method must be \"POST\"", "method")
        url = item.get("url")
        allowed = (endpoint,) if endpoint else BATCH_ENDPOINTS
        if url not in allowed:
            shown = url[:64] if isinstance(url, str) else url
            raise _line_error(number, f"url {shown!r} is not supported here; use {' or '.join(allowed)}", "url")
        body = item.get("body")
        if not isinstance(body, dict):
            raise _line_error(number, "body must be a JSON object", "body")
        if body.get("stream"):
            raise _line_error(number, "body.stream: batch requests cannot stream", "body")
        unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
        if unknown:
            raise _line_error(number, f"unknown field(s) {[u[:64] for u in unknown[:5]]}", "file")
        lines.append(BatchLine(len(lines), custom_id, url, body))
    if not lines:
        raise bad_request("file: holds no requests", "invalid_batch_input", "file")
    return lines
