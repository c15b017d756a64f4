"""The Batch API's routes: /v1/files and /v1/batches, in OpenAI's shapes.

Every file and batch belongs to the tenant that made it: another tenant's id
is answered exactly like an unknown one (404), so nobody learns what exists.
A file that a batch still running reads cannot be deleted (409).
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import time
import uuid
from typing import Annotated

import grpc
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from gateway.batch.input_file import BATCH_ENDPOINTS, parse_input
from gateway.batch.retention import remove_expired
from gateway.batch.records import batch_json, new_batch, new_file_record, visible_status
from gateway.batch.store import BATCH_ID_RE, FILE_ID_RE, FINAL_STATUSES, BatchStore
from gateway.errors import GatewayError, bad_request
from gateway.openai_api.checks import authenticated_route, endpoint_label
from gateway.openai_api.protocol import ErrorResponse, error_responses
from gateway.serving import Gateway

# The multipart form's own bytes (boundaries, headers, the purpose field) beside the file's.
_FORM_OVERHEAD_BYTES = 64 << 10
_MAX_FILENAME_CHARS = 255
_MAX_METADATA_KEYS = 16
_MAX_METADATA_KEY_CHARS = 64
_MAX_METADATA_VALUE_CHARS = 512
_MAX_LIST_LIMIT = 100
_DEFAULT_LIST_LIMIT = 20
# What GET /v1/files may filter on: the purposes this API gives files.
_FILE_PURPOSES = ("batch", "batch_output")
_LIST_ORDERS = ("asc", "desc")
# An upload that has not arrived whole by then is refused: a client trickling
# bytes holds no connection (nor its buffered part of the file) for ever.
UPLOAD_DEADLINE_S = 300.0


def not_found(what: str, ident: str, param: str) -> GatewayError:
    """An unknown id, or another tenant's: one answer for both."""
    return GatewayError(404, grpc.StatusCode.NOT_FOUND, "invalid_request_error", f"No such {what}: {ident[:64]!r}",
                        "not_found", param)


def conflict(message: str, param: str | None) -> GatewayError:
    """The request is well formed but the resource's state refuses it (a file a running batch reads)."""
    return GatewayError(409, grpc.StatusCode.FAILED_PRECONDITION, "invalid_request_error", message, "conflict", param)


def _with_conflict(*statuses: int) -> dict:
    """`error_responses` and a 409, which only the Batch API answers."""
    return {**error_responses(*statuses),
            409: {"model": ErrorResponse, "description": "A file that a batch not yet in a final status uses as its "
                                                         "input; the message names the batch"}}


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(max_length=64)
    endpoint: str = Field(max_length=64)
    completion_window: str = Field(max_length=16)
    metadata: dict[str, str] | None = None


def _upload_route(gateway: Gateway) -> type[APIRoute]:
    """The upload authenticates first like every /v1 route, but its body is a
    multipart form, not JSON: it is read by the handler, within its size limit,
    never whole before the check (as the JSON routes' Unicode check would)."""

    class UploadRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                request.state.tenant = gateway.authenticate(request.headers.get("authorization"),
                                                            endpoint_label(request))
                return await handler(request)

            return route

    return UploadRoute


async def _read_bounded(request: Request, limit: int, deadline_s: float = UPLOAD_DEADLINE_S) -> bytes:
    """The request's body, refused past ``limit`` bytes or ``deadline_s`` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), deadline_s)
    except TimeoutError:
        raise GatewayError(408, grpc.StatusCode.DEADLINE_EXCEEDED, "invalid_request_error",
                           f"file: the upload did not arrive within {deadline_s:.0f} s", "upload_timeout",
                           "file") from None
    return b"".join(chunks)


def _too_large(limit: int) -> GatewayError:
    return bad_request(f"file: larger than the {limit - _FORM_OVERHEAD_BYTES} bytes allowed (batch.max_file_bytes)",
                       "file_too_large", "file")


def _parse_form(content_type: str, body: bytes) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """The form's text fields and its `file` (name, bytes), with the stdlib's MIME parser."""
    if not content_type.startswith("multipart/form-data"):
        raise bad_request("the body must be multipart/form-data with `file` and `purpose`", "invalid_value", None)
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    fields: dict[str, str] = {}
    upload = None
    for part in message.iter_parts() if message.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        data = part.get_payload(decode=True) or b""
        if name == "file":
            upload = (str(part.get_filename() or "upload.jsonl")[:_MAX_FILENAME_CHARS], data)
        elif isinstance(name, str) and len(fields) < 8:
            fields[name] = data.decode("utf-8", "replace")[:256]
    return fields, upload


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > _MAX_METADATA_KEYS:
        raise bad_request(f"metadata: at most {_MAX_METADATA_KEYS} keys", "invalid_value", "metadata")
    for key, value in metadata.items():
        if len(key) > _MAX_METADATA_KEY_CHARS or len(value) > _MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"metadata: keys up to {_MAX_METADATA_KEY_CHARS} characters, values up to "
                              f"{_MAX_METADATA_VALUE_CHARS}", "invalid_value", "metadata")


def _json(record: dict) -> Response:
    return Response(json.dumps(record), media_type="application/json")


def _list_limit(raw: str | None) -> int:
    """A list's `limit` query parameter: 1 to 100, default 20. Read here, not by FastAPI, so that a
    value that is not a number is a 400 naming `limit` like one out of range."""
    if raw is None:
        return _DEFAULT_LIST_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_LIST_LIMIT:
        raise bad_request(f"limit: must be an integer in [1, {_MAX_LIST_LIMIT}]", "invalid_value", "limit")
    return limit


def _page(records: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list object: the `limit` records after the one whose id is `after` (an id not in
    the list: an empty page, as for an id deleted since the previous page)."""
    if after is not None:
        ids = [r["id"] for r in records]
        records = records[ids.index(after) + 1:] if after in ids else []
    data = records[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(records) > limit}


def _check_file_list_query(purpose: str | None, after: str | None, order: str) -> None:
    if purpose is not None and purpose not in _FILE_PURPOSES:
        raise bad_request(f"purpose: {purpose[:64]!r} is not a purpose of this API's files; use "
                          f"{' or '.join(_FILE_PURPOSES)}", "invalid_value", "purpose")
    if after is not None and not FILE_ID_RE.match(after):
        raise bad_request("after: not a file id (the last_id of the previous page)", "invalid_value", "after")
    if order not in _LIST_ORDERS:
        raise bad_request(f"order: {order[:16]!r} is not supported; use asc or desc", "invalid_value", "order")


def batch_router(gateway: Gateway, store: BatchStore) -> APIRouter:
    config = gateway.config.batch
    v1 = APIRouter(route_class=authenticated_route(gateway))
    upload = APIRouter(route_class=_upload_route(gateway))

    async def own_file(request: Request, file_id: str) -> dict:
        record = await store.get_file(request.state.tenant.name, file_id) if FILE_ID_RE.match(file_id) else None
        if record is None:
            raise not_found("file", file_id, "file_id")
        return record

    async def own_batch(request: Request, batch_id: str) -> dict:
        record = await store.get_batch(request.state.tenant.name, batch_id) if BATCH_ID_RE.match(batch_id) \
            else None
        if record is None:
            raise not_found("batch", batch_id, "batch_id")
        return record

    @upload.post("/v1/files", responses=error_responses(400, 401, 500))
    async def create_file(request: Request):
        """Upload a batch input file (multipart: `file`, `purpose` = "batch"); its lines are checked now."""
        tenant = request.state.tenant.name
        body = await _read_bounded(request, config.max_file_bytes + _FORM_OVERHEAD_BYTES)
        # Parsing and checking a large file takes a while: off the event loop, which serves interactive requests.
        fields, uploaded = await asyncio.to_thread(_parse_form, request.headers.get("content-type", ""), body)
        if fields.get("purpose") != "batch":
            raise bad_request(f"purpose: {fields.get('purpose', '')[:64]!r} is not supported; use \"batch\"",
                              "invalid_value", "purpose")
        if uploaded is None:
            raise bad_request("file: missing (send it as the form's `file` part)", "invalid_value", "file")
        filename, content = uploaded
        if len(content) > config.max_file_bytes:
            raise _too_large(config.max_file_bytes + _FORM_OVERHEAD_BYTES)
        await asyncio.to_thread(parse_input, content, config.max_lines_per_file)
        await remove_expired(store, tenant, config.retention_s)  # their output files free quota places
        if await store.count_files(tenant) >= config.max_files_per_tenant:
            raise bad_request(f"file: this API key keeps {config.max_files_per_tenant} files already "
                              "(batch.max_files_per_tenant)", "too_many_files", "file")
        record = new_file_record(f"file-{uuid.uuid4().hex}", filename, len(content), "batch")
        await store.put_file(tenant, record, content)
        return _json(record)

    @v1.get("/v1/files", responses=error_responses(400, 401, 500))
    async def list_files(request: Request, purpose: str | None = None,
                         limit: Annotated[str | None, Query(description="1 to 100 (default 20)")] = None,
                         after: str | None = None, order: str = "desc"):
        """The API key's files, newest first (`order=asc`: oldest first), `purpose` alone if given."""
        page_size = _list_limit(limit)
        _check_file_list_query(purpose, after, order)
        await remove_expired(store, request.state.tenant.name, config.retention_s)
        records = await store.list_files(request.state.tenant.name)  # newest first
        if order == "asc":
            records.reverse()
        if purpose is not None:
            records = [r for r in records if r["purpose"] == purpose]
        return _json(_page(records, after, page_size))

    @v1.get("/v1/files/{file_id}", responses=error_responses(400, 401, 404, 500))
    async def retrieve_file(file_id: str, request: Request):
        return _json(await own_file(request, file_id))

    @v1.delete("/v1/files/{file_id}", responses=_with_conflict(400, 401, 404, 500))
    async def delete_file(file_id: str, request: Request):
        """Delete the file's record and bytes (its quota place is free again); refused (409) while a batch
        that is not in a final status uses it as its input."""
        tenant = request.state.tenant.name
        await own_file(request, file_id)
        # A batch created between this check and the delete finds its input gone and ends failed.
        user = next((b for b in await store.list_batches(tenant)
                     if b["input_file_id"] == file_id and b["status"] not in FINAL_STATUSES), None)
        if user is not None:
            raise conflict(f"file_id: batch {user['id']} ({user['status']}) uses this file as its input; cancel the "
                           "batch or wait until it ends", "file_id")
        if not await store.delete_file(tenant, file_id):
            raise not_found("file", file_id, "file_id")  # deleted meanwhile by another request
        return _json({"id": file_id, "object": "file", "deleted": True})

    @v1.get("/v1/files/{file_id}/content", responses=error_responses(400, 401, 404, 500))
    async def file_content(file_id: str, request: Request):
        await own_file(request, file_id)
        content = await store.file_content(request.state.tenant.name, file_id)
        if content is None:
            raise not_found("file", file_id, "file_id")
        return Response(content, media_type="application/jsonl")

    @v1.post("/v1/batches", responses=error_responses(400, 401, 404, 500))
    async def create_batch(body: CreateBatchRequest, request: Request):
        tenant = request.state.tenant.name
        if body.endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"endpoint: {body.endpoint!r} is not supported; use {' or '.join(BATCH_ENDPOINTS)}",
                              "invalid_value", "endpoint")
        if body.completion_window != "24h":
            raise bad_request("completion_window: only \"24h\" is supported", "invalid_value", "completion_window")
        _check_metadata(body.metadata)
        record = await store.get_file(tenant, body.input_file_id) if FILE_ID_RE.match(body.input_file_id) else None
        if record is None:
            raise not_found("file", body.input_file_id, "input_file_id")
        if record["purpose"] != "batch":
            raise bad_request("input_file_id: the file's purpose is not \"batch\"", "invalid_value", "input_file_id")
        content = await store.file_content(tenant, body.input_file_id)
        if content is None:  # deleted meanwhile, or its bytes do not verify (store.py)
            raise not_found("file", body.input_file_id, "input_file_id")
        # Every line on the batch's endpoint.
        await asyncio.to_thread(parse_input, content, config.max_lines_per_file, body.endpoint)
        if len(await remove_expired(store, tenant, config.retention_s)) >= config.max_batches_per_tenant:
            raise bad_request(f"this API key keeps {config.max_batches_per_tenant} batches already "
                              "(batch.max_batches_per_tenant)", "too_many_batches", None)
        batch = new_batch(f"batch_{uuid.uuid4().hex}", body.input_file_id, body.endpoint, body.metadata)
        await store.put_batch(tenant, batch)
        return _json(batch_json(batch))

    @v1.get("/v1/batches/{batch_id}", responses=error_responses(400, 401, 404, 500))
    async def retrieve_batch(batch_id: str, request: Request):
        record = await own_batch(request, batch_id)
        return _json(batch_json(record, await store.cancel_requested(batch_id)))

    @v1.get("/v1/batches", responses=error_responses(400, 401, 500))
    async def list_batches(request: Request,
                           limit: Annotated[str | None, Query(description="1 to 100 (default 20)")] = None,
                           after: str | None = None):
        page_size = _list_limit(limit)
        records = await remove_expired(store, request.state.tenant.name, config.retention_s)
        return _json(_page([batch_json(r) for r in records], after, page_size))

    @v1.post("/v1/batches/{batch_id}/cancel", responses=error_responses(400, 401, 404, 500))
    async def cancel_batch(batch_id: str, request: Request):
        """Stop starting the batch's lines; those in flight finish (cancelling, then cancelled)."""
        record = await own_batch(request, batch_id)
        if visible_status(record, False) in ("validating", "in_progress", "finalizing"):
            await store.request_cancel(batch_id)
            record = {**record, "cancelling_at": record.get("cancelling_at") or int(time.time())}
            await store.put_batch(request.state.tenant.name, record)
        return _json(batch_json(record, await store.cancel_requested(batch_id)))

    router = APIRouter()
    router.include_router(upload)
    router.include_router(v1)
    return router
