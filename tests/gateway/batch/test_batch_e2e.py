"""The Batch API end to end with the OpenAI SDK: a real gateway (or two, one
after the other) in front of the tiny model's engine pods, files and batches
in a directory or a real redis-server."""

from __future__ import annotations

import io
import json
import signal
import time

import httpx
import openai
import pytest

from tests.gateway.batch.conftest import start_batch_gateway as _gateway
from tests.gateway.observe import metric_sum
from tests.gateway.conftest import MODEL_NAME, client


def _jsonl(n: int, url: str = "/v1/completions", prefix: str = "req") -> bytes:
    lines = []
    for i in range(n):
        if url == "/v1/completions":
            body = {"model": MODEL_NAME, "prompt": f"count {i}:", "max_tokens": 2, "temperature": 0}
        else:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2}
        lines.append(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def _upload(c: openai.OpenAI, content: bytes, purpose: str = "batch"):
    return c.files.create(file=("input.jsonl", io.BytesIO(content)), purpose=purpose)


def _wait(c: openai.OpenAI, batch_id: str, until, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = c.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id}: still {batch.status} {batch.request_counts} after {timeout}s")


def _done(batch) -> bool:
    return batch.status in ("completed", "failed", "cancelled", "expired")


def _output(c: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in c.files.content(file_id).text.splitlines() if line]


def test_a_batch_of_200_lines_completes_in_order(batch_gateway):
    c = client(batch_gateway)
    uploaded = _upload(c, _jsonl(200))
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                             metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    batch = _wait(c, batch.id, _done)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (200, 200, 0)
    assert batch.error_file_id is None and batch.completed_at is not None
    output = _output(c, batch.output_file_id)
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(200)]  # the input's order
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "text_completion"
        assert o["response"]["body"]["usage"]["completion_tokens"] <= 2
    assert c.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in c.batches.list(limit=100).data]
    # The lines ran through the interactive pipeline, in the sheddable "batch" class.
    ran = metric_sum(batch_gateway.metrics_url, "tessera_gateway_requests_total", tenant="alice",
                     priority_class="batch", endpoint="batch", outcome="ok")
    assert ran >= 200


def test_chat_lines_and_a_line_the_engine_refuses(batch_gateway):
    c = client(batch_gateway)
    bad = json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}})
    uploaded = _upload(c, _jsonl(3, "/v1/chat/completions") + bad.encode() + b"\n")
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = _wait(c, batch.id, _done, timeout=60)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    assert [o["response"]["body"]["object"] for o in _output(c, batch.output_file_id)] == ["chat.completion"] * 3
    [error] = _output(c, batch.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 404
    assert error["error"]["code"] == "model_not_found"


def test_cancel_stops_new_lines(batch_gateway):
    c = client(batch_gateway)
    uploaded = _upload(c, _jsonl(400, prefix="cancel"))
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    _wait(c, batch.id, lambda b: b.status == "in_progress", timeout=30)
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    batch = _wait(c, batch.id, _done, timeout=60)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    done = batch.request_counts.completed + batch.request_counts.failed
    assert done < 400
    output = _output(c, batch.output_file_id) if batch.output_file_id else []
    assert len(output) == done and len({o["custom_id"] for o in output}) == done


def test_another_tenant_gets_404_for_the_batch_and_its_files(batch_gateway):
    alice, bob = client(batch_gateway, "alice"), client(batch_gateway, "bob")
    uploaded = _upload(alice, _jsonl(2))
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    batch = _wait(alice, batch.id, _done, timeout=60)
    for call in (lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.files.retrieve(uploaded.id), lambda: bob.files.content(uploaded.id),
                 lambda: bob.files.content(batch.output_file_id),
                 lambda: bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "not_found"
    assert batch.id not in [b.id for b in bob.batches.list().data]
    # ... and an unknown id gets the very same answer.
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve("batch_" + "0" * 32)


def test_every_batch_route_needs_an_api_key(batch_gateway):
    """No key, or a wrong one: 401 on every route, before the body is read."""
    uploaded = _upload(client(batch_gateway), _jsonl(1))
    for key in ("", "sk-not-a-tenant"):
        stranger = openai.OpenAI(base_url=batch_gateway.base_url + "/v1", api_key=key or "x", max_retries=0,
                                 default_headers={} if key else {"Authorization": ""})
        calls = (lambda c: _upload(c, _jsonl(1)), lambda c: c.files.retrieve(uploaded.id),
                 lambda c: c.files.content(uploaded.id), lambda c: c.files.list(),
                 lambda c: c.files.delete(uploaded.id), lambda c: c.batches.list(),
                 lambda c: c.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                            completion_window="24h"))
        for call in calls:
            with pytest.raises(openai.AuthenticationError):
                call(stranger)


def _bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


def test_bad_input_is_a_400_naming_the_field_or_line(batch_gateway):
    c = client(batch_gateway)
    assert _bad_request(lambda: _upload(c, _jsonl(1), purpose="fine-tune"))["param"] == "purpose"
    too_large = _bad_request(lambda: _upload(c, b"x" * 300_000))
    assert too_large["code"] == "file_too_large" and too_large["param"] == "file"
    malformed = _bad_request(lambda: _upload(c, _jsonl(2) + b"{oops\n"))
    assert malformed["message"].startswith("line 3: not valid JSON") and malformed["code"] == "invalid_batch_input"
    duplicate = _bad_request(lambda: _upload(c, _jsonl(2) + _jsonl(1)))
    assert duplicate["message"].startswith("line 3: custom_id 'req-0'") and duplicate["param"] == "custom_id"
    url = _bad_request(lambda: _upload(c, _jsonl(1).replace(b"/v1/completions", b"/v1/embeddings")))
    assert url["message"].startswith("line 1: url") and url["param"] == "url"
    with pytest.raises(openai.NotFoundError) as e:
        c.batches.create(input_file_id="file-" + "0" * 32, endpoint="/v1/completions", completion_window="24h")
    assert e.value.body["param"] == "input_file_id"
    uploaded = _upload(c, _jsonl(1))
    mismatch = _bad_request(lambda: c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                     completion_window="24h"))
    assert mismatch["message"].startswith("line 1: url")
    window = _bad_request(lambda: c.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                   completion_window="1h"))
    assert window["param"] == "completion_window"


@pytest.mark.parametrize("kind", ["redis", "directory"])
def test_a_gateway_restart_loses_no_line_and_duplicates_none(tiny_llama, engine_pods, tmp_path, request, kind):
    """The first gateway is killed (SIGKILL: no goodbye, its lease simply expires)
    mid-batch; a second one on the same store resumes the batch."""
    where = ({"redis_url": request.getfixturevalue("redis_server").url} if kind == "redis"
             else {"directory": str(tmp_path / "store")})
    store = {**where, "max_concurrency": 2}
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    first = _gateway(tiny_llama, engine_pods, first_dir, store)
    try:
        c = client(first)
        uploaded = _upload(c, _jsonl(120, prefix="restart"))
        batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        _wait(c, batch.id, lambda b: b.request_counts.completed >= 20, timeout=120)
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.terminate()
    second = _gateway(tiny_llama, engine_pods, second_dir, store)
    try:
        c = client(second)
        midway = c.batches.retrieve(batch.id)
        assert midway.status == "in_progress" and midway.request_counts.completed < 120
        batch = _wait(c, batch.id, _done)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (120, 0)
        ids = [o["custom_id"] for o in _output(c, batch.output_file_id)]
        assert ids == [f"restart-{i}" for i in range(120)]  # each exactly once, in order
    finally:
        second.terminate()


def test_the_openapi_document_has_the_batch_routes(batch_gateway):
    paths = httpx.get(batch_gateway.base_url + "/openapi.json").json()["paths"]
    for path in ("/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
                 "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel"):
        assert path in paths
    assert "404" in paths["/v1/batches/{batch_id}"]["get"]["responses"]
    assert {"get", "post"} <= set(paths["/v1/files"])
    assert {"404", "409"} <= set(paths["/v1/files/{file_id}"]["delete"]["responses"])
    assert {p["name"] for p in paths["/v1/files"]["get"]["parameters"]} == {"purpose", "limit", "after", "order"}


def test_files_listed_and_deleted_and_their_records_signed(batch_gateway):
    """The gateway signs with the key of its internal secret: a record altered in its
    store is no longer served (the store's own tests: test_batch_signing.py)."""
    c = client(batch_gateway, "docs-a")  # a tenant no other test here uploads as: its list is this test's
    first, second = _upload(c, _jsonl(1)), _upload(c, _jsonl(2))
    assert {f.id for f in c.files.list().data} == {first.id, second.id}
    assert [f.id for f in client(batch_gateway, "docs-b").files.list().data] == []
    record = batch_gateway.store_dir / "tenants" / "docs-a" / "files" / f"{first.id}.json"
    assert record.read_bytes().startswith(b"hmac-sha256:")
    record.write_bytes(record.read_bytes().replace(b'"input.jsonl"', b'"other.jsonl"'))
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(first.id)
    assert [f.id for f in c.files.list().data] == [second.id]
    assert c.files.delete(second.id).deleted
    assert c.files.list().data == []
