"""GET /v1/files and DELETE /v1/files/{id} with the OpenAI SDK, on a real
`Gateway` and its FastAPI app over ASGI (no engine pod: no line runs here),
its store a directory with signed records:

- the tenant's files newest first (or `order=asc`), by pages the SDK walks,
  filtered by `purpose`; another tenant's never appear;
- bad query values are 400s naming the field;
- a delete removes the record and the bytes and frees the quota place; a file
  that a batch not yet in a final status reads is a 409 naming the batch;
  another tenant's or an unknown id is a 404;
- a record altered in the store is not served by any of the routes.

The same routes against a real gateway process: test_batch_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time

import httpx
import openai
import pytest

from gateway.batch.signing import batch_mac_key
from gateway.batch.store import DirectoryStore
from gateway.config import gateway_config_from_dict
from gateway.model import ServedModel
from gateway.openai_api.server import build_app
from gateway.priority import PriorityClasses
from gateway.serving import Gateway
from gateway.tenants import TenantRegistry, hash_api_key
from tessera.internal_secret import InternalSecret
from tests.gateway.conftest import KEYS, MODEL_NAME

SECRET = InternalSecret(b"file-routes-test-secret-0123456789abcdef")
MAX_FILES = 4


@pytest.fixture(scope="module")
def served_model(tiny_llama) -> ServedModel:
    config = gateway_config_from_dict({"model": {"name": MODEL_NAME, "path": str(tiny_llama)},
                                       "pods": {"static": [{"address": "127.0.0.1:1"}]}})
    return ServedModel.load(config.model)


@contextlib.asynccontextmanager
async def files_api(served: ServedModel, root, **batch):
    """The SDK for alice and bob on a gateway's app, and the store behind it."""
    config = gateway_config_from_dict({
        "model": {"name": MODEL_NAME, "path": "unused"}, "pods": {"static": [{"address": "127.0.0.1:1"}]},
        "batch": {"directory": str(root), "max_files_per_tenant": MAX_FILES, **batch}})
    tenants = TenantRegistry.from_dict(
        {"tenants": [{"name": n, "api_key_sha256": [hash_api_key(KEYS[n])]} for n in ("alice", "bob")]}, SECRET)
    gateway = Gateway(config, served, tenants, PriorityClasses.from_config(None, None))
    store = DirectoryStore(root, batch_mac_key(SECRET))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gateway, store)), base_url="http://gw")
    sdks = {n: openai.AsyncOpenAI(base_url="http://gw/v1", api_key=KEYS[n], http_client=http, max_retries=0)
            for n in ("alice", "bob")}
    try:
        yield sdks, store, http
    finally:
        await http.aclose()
        await gateway.close()


def _jsonl(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}}) + "\n"
                   for i in range(n)).encode()


async def _upload(sdk, n: int = 1):
    return await sdk.files.create(file=("in.jsonl", io.BytesIO(_jsonl(n))), purpose="batch")


async def _put(store, tenant: str, n: int, created_at: int, purpose: str) -> str:
    """A file as the runner or an earlier upload left it, at a creation time of the test's choice."""
    file_id = f"file-{n:032x}"
    await store.put_file(tenant, {"id": file_id, "object": "file", "bytes": 1, "created_at": created_at,
                                  "filename": f"{n}.jsonl", "purpose": purpose, "status": "processed",
                                  "status_details": None}, b"x")
    return file_id


def test_files_are_listed_newest_first_by_pages_and_purpose(served_model, tmp_path):
    async def main():
        async with files_api(served_model, tmp_path) as (sdk, store, http):
            purposes = ["batch", "batch_output", "batch", "batch_output"]
            ids = [await _put(store, "alice", n, 1000 + n, purposes[n]) for n in range(4)]
            await _put(store, "bob", 9, 5000, "batch")
            newest_first = ids[::-1]
            page = await sdk["alice"].files.list()
            assert [f.id for f in page.data] == newest_first and not page.has_more
            body = (await http.get("/v1/files", headers={"Authorization": f"Bearer {KEYS['alice']}"})).json()
            assert body["object"] == "list" and (body["first_id"], body["last_id"]) == (ids[3], ids[0])
            assert body["data"][0] == {"id": ids[3], "object": "file", "bytes": 1, "created_at": 1003,
                                       "filename": "3.jsonl", "purpose": "batch_output", "status": "processed",
                                       "status_details": None}  # nothing of the store's own (no tag, no digest)
            # The SDK walks the pages with `after`.
            first = await sdk["alice"].files.list(limit=3)
            assert [f.id for f in first.data] == newest_first[:3] and first.has_more
            assert [f.id async for f in sdk["alice"].files.list(limit=3)] == newest_first
            assert [f.id async for f in sdk["alice"].files.list(limit=1, order="asc")] == ids
            assert [f.id for f in (await sdk["alice"].files.list(purpose="batch_output")).data] == [ids[3], ids[1]]
            assert [f.id for f in (await sdk["alice"].files.list(purpose="batch", order="asc")).data] == \
                [ids[0], ids[2]]
            # Never another tenant's; an id not in the list (deleted since) is an empty page.
            assert [f.id for f in (await sdk["bob"].files.list()).data] == [f"file-{9:032x}"]
            assert (await sdk["bob"].files.list(after=ids[3])).data == []
            assert (await sdk["bob"].files.list(purpose="batch_output")).data == []

    asyncio.run(main())


@pytest.mark.parametrize("query,param", [
    ("purpose=fine-tune", "purpose"), ("purpose=", "purpose"), ("limit=0", "limit"), ("limit=101", "limit"),
    ("limit=abc", "limit"), ("limit=", "limit"), ("after=file-xyz", "after"), ("after=batch_" + "0" * 32, "after"),
    ("order=sideways", "order"), ("order=ASC", "order"),
])
def test_a_bad_list_query_is_a_400_naming_the_field(served_model, tmp_path, query, param):
    async def main():
        async with files_api(served_model, tmp_path) as (_, _store, http):
            r = await http.get(f"/v1/files?{query}", headers={"Authorization": f"Bearer {KEYS['alice']}"})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["param"], error["code"], error["type"]) == (param, "invalid_value", "invalid_request_error")
            assert error["message"].startswith(f"{param}: ")
            if param == "limit":  # the batches' list reads its limit the same way
                r = await http.get(f"/v1/batches?{query}", headers={"Authorization": f"Bearer {KEYS['alice']}"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "limit"

    asyncio.run(main())


def test_a_delete_removes_the_file_unless_a_running_batch_reads_it(served_model, tmp_path):
    async def main():
        async with files_api(served_model, tmp_path) as (sdk, store, http):
            alice, bob = sdk["alice"], sdk["bob"]
            uploaded = await _upload(alice)
            batch = await alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                               completion_window="24h")
            for status in ("validating", "in_progress", "finalizing"):
                await store.put_batch("alice", {**(await store.get_batch("alice", batch.id)), "status": status})
                with pytest.raises(openai.ConflictError) as e:
                    await alice.files.delete(uploaded.id)
                assert e.value.status_code == 409
                assert e.value.body["code"] == "conflict" and e.value.body["param"] == "file_id"
                assert batch.id in e.value.body["message"] and status in e.value.body["message"]
            assert (await alice.files.retrieve(uploaded.id)).id == uploaded.id  # refused: still there
            # Another tenant's id is answered like an unknown one, and the file stays.
            for sdk_, file_id in ((bob, uploaded.id), (alice, "file-" + "0" * 32), (alice, "not-a-file-id")):
                with pytest.raises(openai.NotFoundError) as e:
                    await sdk_.files.delete(file_id)
                assert e.value.body["code"] == "not_found" and e.value.body["param"] == "file_id"
            await store.put_batch("alice", {**(await store.get_batch("alice", batch.id)), "status": "completed"})
            deleted = await alice.files.delete(uploaded.id)
            assert (deleted.id, deleted.object, deleted.deleted) == (uploaded.id, "file", True)
            for call in (alice.files.retrieve, alice.files.content, alice.files.delete):
                with pytest.raises(openai.NotFoundError):
                    await call(uploaded.id)
            assert uploaded.id not in [f.id for f in (await alice.files.list()).data]
            assert not list((tmp_path / "tenants" / "alice" / "files").glob(f"{uploaded.id}.*"))  # bytes too
            # The batch that read it is still there, its input gone.
            assert (await alice.batches.retrieve(batch.id)).input_file_id == uploaded.id

    asyncio.run(main())


def test_a_delete_frees_the_quota_place(served_model, tmp_path):
    async def main():
        async with files_api(served_model, tmp_path) as (sdk, _store, _http):
            files = [await _upload(sdk["alice"]) for _ in range(MAX_FILES)]
            with pytest.raises(openai.BadRequestError) as e:
                await _upload(sdk["alice"])
            assert e.value.body["code"] == "too_many_files"
            await _upload(sdk["bob"])  # a quota per tenant
            await sdk["alice"].files.delete(files[0].id)
            await _upload(sdk["alice"])
            with pytest.raises(openai.BadRequestError):
                await _upload(sdk["alice"])

    asyncio.run(main())


def test_a_record_altered_in_the_store_is_served_by_no_route(served_model, tmp_path):
    async def main():
        async with files_api(served_model, tmp_path) as (sdk, _store, _http):
            alice = sdk["alice"]
            kept, altered = await _upload(alice), await _upload(alice, 2)
            path = tmp_path / "tenants" / "alice" / "files" / f"{altered.id}.json"
            path.write_bytes(path.read_bytes().replace(b'"in.jsonl"', b'"in.jsonx"'))
            for call in (alice.files.retrieve, alice.files.content, alice.files.delete,
                         lambda i: alice.batches.create(input_file_id=i, endpoint="/v1/completions",
                                                        completion_window="24h")):
                with pytest.raises(openai.NotFoundError):
                    await call(altered.id)
            assert [f.id for f in (await alice.files.list()).data] == [kept.id]
            # The bytes swapped under a valid record: the content is not served either.
            (tmp_path / "tenants" / "alice" / "files" / f"{kept.id}.data").write_bytes(_jsonl(3))
            assert (await alice.files.retrieve(kept.id)).id == kept.id
            with pytest.raises(openai.NotFoundError):
                await alice.files.content(kept.id)
            with pytest.raises(openai.NotFoundError) as e:
                await alice.batches.create(input_file_id=kept.id, endpoint="/v1/completions", completion_window="24h")
            assert e.value.body["param"] == "input_file_id"

    asyncio.run(main())


def test_a_tenant_at_its_batch_quota_creates_again_once_a_batch_is_past_its_retention(served_model, tmp_path):
    """No route deletes a batch: retention is what frees a quota place (gateway/batch/retention.py)."""
    from gateway.batch.records import new_batch

    async def main():
        async with files_api(served_model, tmp_path, max_batches_per_tenant=1, retention_s=3600) as (sdk, store, _):
            uploaded = await _upload(sdk["alice"])
            output = await _put(store, "alice", 5, 100, "batch_output")
            ended = {**new_batch("batch_" + "a" * 32, uploaded.id, "/v1/completions", None), "status": "completed",
                     "output_file_id": output}
            await store.put_batch("alice", {**ended, "completed_at": int(time.time()) - 60})  # within retention
            with pytest.raises(openai.BadRequestError, match="too_many_batches|keeps 1 batches"):
                await sdk["alice"].batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                  completion_window="24h")
            await store.put_batch("alice", {**ended, "completed_at": int(time.time()) - 7200})  # past it
            created = await sdk["alice"].batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                        completion_window="24h")
            assert [b.id async for b in sdk["alice"].batches.list()] == [created.id]
            with pytest.raises(openai.NotFoundError):
                await sdk["alice"].files.retrieve(output)  # its output file went with it
            assert (await sdk["alice"].files.retrieve(uploaded.id)).id == uploaded.id  # the input stays

    asyncio.run(main())
