"""The batch runner: a background task per gateway that claims runnable
batches (a lease in the store) and runs their lines through the same
pipeline as interactive requests, at the batch priority class.

Pacing: at most `batch.max_concurrency` lines in flight per gateway; a line
the gateway sheds or queues out (429, 503) waits `retry_interval_s` and is
tried again, never failed: batches fill capacity that interactive traffic
leaves idle. Each line's outcome is stored as it ends, so a restart (or
another replica taking over an expired lease) runs only the lines without
one: none lost, none twice in the output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from pydantic import ValidationError

from gateway.batch.input_file import BatchLine, parse_input
from gateway.batch.records import new_file_record
from gateway.batch.store import FINAL_STATUSES, BatchStore
from gateway.config import BatchConfig
from gateway.errors import GatewayError, bad_request, internal
from gateway.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai_api.server import run_chat_completion, run_completion
from gateway.priority import batch_priority_class
from gateway.serving import Gateway
from gateway.tenants import Tenant

logger = logging.getLogger(__name__)
# Refusals that say "not now" rather than "never": the line waits and is tried again.
_RETRY_STATUSES = (429, 503)
# The metrics' endpoint label of batch lines.
ENDPOINT_LABEL = "batch"


class BatchRunner:
    def __init__(self, gateway: Gateway, store: BatchStore, config: BatchConfig) -> None:
        self.gateway = gateway
        self.store = store
        self.config = config
        self.priority_class = batch_priority_class(gateway.classes, config.priority_class)
        # This runner's name in the leases: unique per process start.
        self.owner = uuid.uuid4().hex
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._running: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        # Set when the gateway is asked to stop: no batch is claimed and no line started after it.
        self.draining = False
        self._drain_started = 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    def begin_drain(self) -> None:
        """Start no more lines (the gateway is stopping); those in flight go on."""
        if not self.draining:
            self.draining = True
            self._drain_started = time.monotonic()
            if self._task is not None:
                self._task.cancel()

    async def stop(self, grace_s: float = 0.0) -> None:
        """Drain, then stop: lines in flight get until `grace_s` after the drain
        began to end and store their results; any still running then are
        abandoned without one (whoever resumes the batch runs them again), and
        the leases are given up. A drained batch keeps its status: it is not
        finished, only paused until a runner claims it again."""
        self.begin_drain()
        runs = list(self._running.values())
        left = self._drain_started + grace_s - time.monotonic()
        if runs and left > 0:
            await asyncio.wait(runs, timeout=left)
        tasks = [t for t in (self._task, *self._running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            try:
                for tenant, batch_id in await self.store.active_batches():
                    if batch_id not in self._running and await self.store.claim(batch_id, self.owner,
                                                                                 self.config.lease_s):
                        task = asyncio.create_task(self._run_claimed(tenant, batch_id))
                        self._running[batch_id] = task
                        task.add_done_callback(lambda _, b=batch_id: self._running.pop(b, None))
            except Exception:
                logger.exception("batch runner: cannot read the store; trying again")
            await asyncio.sleep(self.config.poll_interval_s)

    async def _run_claimed(self, tenant_name: str, batch_id: str) -> None:
        lost = asyncio.Event()
        renewer = asyncio.create_task(self._renew(batch_id, lost))
        try:
            await BatchRun(self, tenant_name, batch_id, lost).run()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s: the run failed; another runner will resume it", batch_id)
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.store.release(batch_id, self.owner), timeout=5)

    async def _renew(self, batch_id: str, lost: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                ok = await asyncio.wait_for(self.store.claim(batch_id, self.owner, self.config.lease_s),
                                            timeout=self.config.lease_s / 3)
            except Exception:
                ok = False
            if not ok:
                logger.warning("batch %s: lease lost; starting no more of its lines", batch_id)
                lost.set()
                return


class BatchRun:
    """One claimed batch run to its end, or until its lease is lost."""

    def __init__(self, runner: BatchRunner, tenant_name: str, batch_id: str, lost: asyncio.Event) -> None:
        self.runner = runner
        self.store = runner.store
        self.tenant_name = tenant_name
        self.batch_id = batch_id
        self.lost = lost

    async def update(self, **changes) -> dict:
        """The record re-read and changed in these fields only (a cancel's cancelling_at stays)."""
        record = await self.store.get_batch(self.tenant_name, self.batch_id)
        if record is None:
            # Deleted, or altered by a writer without the key (store.py: it no longer verifies): the
            # run stops here; the next runner to claim the batch finds no record and drops it.
            raise LookupError(f"batch {self.batch_id}: its record is gone or does not verify")
        record.update(changes)
        await self.store.put_batch(self.tenant_name, record)
        if record["status"] in FINAL_STATUSES:
            await self.store.set_inactive(self.tenant_name, self.batch_id)
        return record

    async def run(self) -> None:
        record = await self.store.get_batch(self.tenant_name, self.batch_id)
        if record is None or record["status"] in FINAL_STATUSES:
            await self.store.set_inactive(self.tenant_name, self.batch_id)
            return
        tenant = self._tenant()
        content = await self.store.file_content(self.tenant_name, record["input_file_id"])
        try:
            if tenant is None:
                raise internal("the batch's API key is no longer configured")
            if content is None:
                raise internal("the batch's input file is gone")
            lines = await asyncio.to_thread(parse_input, content, self.runner.config.max_lines_per_file,
                                            record["endpoint"])
        except GatewayError as e:
            await self.update(status="failed", failed_at=int(time.time()),
                              errors={"object": "list", "data": [{"code": e.code, "message": e.message,
                                                                  "param": e.param, "line": None}]})
            return
        if record["status"] == "validating":
            record = await self.update(status="in_progress", in_progress_at=int(time.time()),
                                       request_counts={"total": len(lines), "completed": 0, "failed": 0})
        done = await self.store.results(self.batch_id)
        pending = [line for line in lines if line.index not in done]
        counts = _counts(done, len(lines))
        in_flight: set[asyncio.Task] = set()
        stopped = None  # why no more lines start: "cancelled", "expired", or None
        try:
            for line in pending:
                stopped = await self._why_stop(record)
                if stopped or self._paused():
                    break
                await self.runner._slots.acquire()
                if self._paused():  # the drain began while this line waited for a slot
                    self.runner._slots.release()
                    break
                task = asyncio.create_task(self._run_line(tenant, line, record["expires_at"], counts))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            # Lines in flight finish, a cancel or not: their results count.
            while in_flight:
                await asyncio.wait(set(in_flight), timeout=self.runner.config.poll_interval_s)
                if self.lost.is_set() or time.time() > record["expires_at"]:
                    break
        finally:
            for task in list(in_flight):
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
        if self._paused():
            return  # not finished: the lines without a result run when a runner claims the batch again
        stopped = stopped or await self._why_stop(record)
        await self._finish(lines, stopped)

    def _paused(self) -> bool:
        """The lease is lost or the gateway drains: start no line, finish nothing."""
        return self.lost.is_set() or self.runner.draining

    async def _why_stop(self, record: dict) -> str | None:
        if await self.store.cancel_requested(self.batch_id):
            return "cancelled"
        if time.time() > record["expires_at"]:
            return "expired"
        return None

    def _tenant(self) -> Tenant | None:
        return next((t for t in self.runner.gateway.tenants.tenants if t.name == self.tenant_name), None)

    async def _run_line(self, tenant: Tenant, line: BatchLine, expires_at: float, counts: dict) -> None:
        try:
            result = await self._attempt_until_answered(tenant, line, expires_at)
            if result is None:
                return  # expired or lease lost: no outcome, the line stays pending
            await self.store.put_result(self.batch_id, line.index, result)
            counts["completed" if result["response"] and result["response"]["status_code"] == 200
                   else "failed"] += 1
            if (counts["completed"] + counts["failed"]) % 10 == 0:
                await self.update(request_counts=dict(counts))
        finally:
            self.runner._slots.release()

    async def _attempt_until_answered(self, tenant: Tenant, line: BatchLine, expires_at: float) -> dict | None:
        while time.time() < expires_at and not self.lost.is_set():
            try:
                body = await self._execute(tenant, line)
                return _output_line(line, 200, body)
            except GatewayError as e:
                if e.status in _RETRY_STATUSES:
                    await asyncio.sleep(max(self.runner.config.retry_interval_s, e.retry_after or 0))
                    continue
                return _output_line(line, e.status, e.to_openai())
        return None

    async def _execute(self, tenant: Tenant, line: BatchLine) -> dict:
        body = {**line.body, "priority_class": self.runner.priority_class}
        try:
            if line.url == "/v1/chat/completions":
                request = ChatCompletionRequest.model_validate(body)
                return await run_chat_completion(self.runner.gateway, request, tenant, ENDPOINT_LABEL)
            request = CompletionRequest.model_validate(body)
            return await run_completion(self.runner.gateway, request, tenant, ENDPOINT_LABEL)
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ())) or "body"
            raise bad_request(f"body.{where}: {first.get('msg')}", "invalid_value", where) from None

    async def _finish(self, lines: list[BatchLine], stopped: str | None) -> None:
        """Output and error files (in input order), then the final status."""
        now = int(time.time())
        if stopped == "cancelled":
            record = await self.store.get_batch(self.tenant_name, self.batch_id)
            await self.update(cancelling_at=record.get("cancelling_at") or now)
        else:
            await self.update(status="finalizing", finalizing_at=now)
        results = await self.store.results(self.batch_id)
        output, errors = [], []
        for line in lines:
            result = results.get(line.index)
            if result is None:
                if stopped == "expired":
                    errors.append(_error_line(line, "batch_expired", "the batch expired before this request ran"))
                continue
            (output if result["response"]["status_code"] == 200 else errors).append(result)
        output_id = await self._save_output("output", output)
        error_id = await self._save_output("errors", errors)
        final = {"cancelled": "cancelled", "expired": "expired"}.get(stopped, "completed")
        await self.update(status=final, output_file_id=output_id, error_file_id=error_id,
                          request_counts=_counts(results, len(lines)), **{f"{final}_at": int(time.time())})

    async def _save_output(self, kind: str, items: list[dict]) -> str | None:
        if not items:
            return None
        content = "".join(json.dumps(item, separators=(",", ":")) + "\n" for item in items).encode()
        record = new_file_record(f"file-{uuid.uuid4().hex}", f"{self.batch_id}_{kind}.jsonl", len(content),
                                 "batch_output")
        await self.store.put_file(self.tenant_name, record, content)
        return record["id"]


def _counts(results: dict[int, dict], total: int) -> dict:
    completed = sum(1 for r in results.values() if r["response"] and r["response"]["status_code"] == 200)
    return {"total": total, "completed": completed, "failed": len(results) - completed}


def _output_line(line: BatchLine, status: int, body: dict) -> dict:
    """OpenAI's output line: the answer's body, or an error's status and OpenAI error body."""
    ok = status == 200
    error = None if ok else {"code": body["error"].get("code"), "message": body["error"].get("message")}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": body.get("id", "") if ok else "", "body": body},
            "error": error}


def _error_line(line: BatchLine, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}
