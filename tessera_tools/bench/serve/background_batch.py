"""A batch job through the Batch API (/v1/files, /v1/batches) that runs while
`tessera bench serve --background-batch` measures interactive requests: its
lines, its start, and at the end how much it got done and how fast.

The batch is cancelled when the interactive run ends (lines in flight
finish); its output file says which lines completed and their token counts.
Its throughput is those tokens over the time from the batch's creation to
its final status, both on this client's clock.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from tessera_tools.bench.serve.client import ENDPOINT_PATHS, ServeClient, Target
from tessera_tools.bench.serve.dataset import ServeRequest

FINAL_STATUSES = ("completed", "failed", "cancelled", "expired")
POLL_INTERVAL_S = 0.25


@dataclass(frozen=True)
class BatchFigures:
    """What one background batch did while it ran."""

    status: str
    lines_completed: int
    lines_failed: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    """Creation to final status (the cancel's lines in flight included)."""

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict:
        return {"status": self.status, "lines_completed": self.lines_completed, "lines_failed": self.lines_failed,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "seconds": round(self.seconds, 3), "output_tokens_per_s": round(self.output_tokens_per_s, 2),
                "total_tokens_per_s": round(self.total_tokens_per_s, 2)}


def batch_input(target: Target, requests: list[ServeRequest], max_tokens: int) -> bytes:
    """The JSONL input file: one line per request, shaped as the interactive
    ones are, but not streamed (the Batch API refuses `stream`)."""
    lines = []
    for i, request in enumerate(requests):
        body = target.body(request, max_tokens)
        body.pop("stream")
        body.pop("stream_options")
        lines.append(json.dumps({"custom_id": f"bg-{i}", "method": "POST",
                                 "url": "/v1" + ENDPOINT_PATHS[target.endpoint], "body": body}))
    return ("\n".join(lines) + "\n").encode()


def _answer(status: int, body: bytes, what: str) -> dict:
    if status != 200:
        raise RuntimeError(f"{what}: HTTP {status}: {body[:300].decode(errors='replace')}")
    return json.loads(body)


class BackgroundBatch:
    """One batch: `start()` uploads and creates it and waits until it runs;
    `stop()` cancels it, waits for its end and counts what it did."""

    def __init__(self, client: ServeClient, content: bytes, deadline_s: float = 600.0) -> None:
        self.client = client
        self.content = content
        self.deadline_s = deadline_s
        self.batch_id: str | None = None
        self._created_at = 0.0

    async def start(self) -> None:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", self.content, filename="background.jsonl", content_type="application/jsonl")
        uploaded = _answer(*await self.client.call("POST", "/files", data=form), "upload the batch input")
        endpoint = json.loads(self.content.split(b"\n", 1)[0])["url"]
        self._created_at = time.perf_counter()
        created = _answer(*await self.client.call("POST", "/batches", json={
            "input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h"}), "create the batch")
        self.batch_id = created["id"]
        await self._wait(lambda b: b["status"] != "validating", "start")

    async def stop(self) -> BatchFigures:
        if self.batch_id is None:
            raise RuntimeError("the background batch was never started")
        _answer(*await self.client.call("POST", f"/batches/{self.batch_id}/cancel"), "cancel the batch")
        batch = await self._wait(lambda b: b["status"] in FINAL_STATUSES, "end")
        seconds = time.perf_counter() - self._created_at
        lines = await self._output_lines(batch.get("output_file_id"))
        usage = [line["response"]["body"].get("usage") or {} for line in lines]
        counts = batch.get("request_counts") or {}
        return BatchFigures(batch["status"], counts.get("completed", 0), counts.get("failed", 0),
                            sum(u.get("prompt_tokens", 0) for u in usage),
                            sum(u.get("completion_tokens", 0) for u in usage), seconds)

    async def _wait(self, done, what: str) -> dict:
        deadline = time.monotonic() + self.deadline_s
        while True:
            batch = _answer(*await self.client.call("GET", f"/batches/{self.batch_id}"), "read the batch")
            if done(batch):
                return batch
            if batch["status"] in FINAL_STATUSES:
                raise RuntimeError(f"batch {self.batch_id} ended {batch['status']} before its {what}: "
                                   f"{json.dumps(batch.get('errors'))[:300]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {self.batch_id}: no {what} after {self.deadline_s:g} s "
                                   f"(status {batch['status']})")
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _output_lines(self, file_id: str | None) -> list[dict]:
        """The output file's successful lines (none when no line completed)."""
        if not file_id:
            return []
        status, body = await self.client.call("GET", f"/files/{file_id}/content")
        if status != 200:
            raise RuntimeError(f"read the batch output: HTTP {status}: {body[:300].decode(errors='replace')}")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        return [line for line in lines if line.get("response") and line["response"].get("status_code") == 200]
