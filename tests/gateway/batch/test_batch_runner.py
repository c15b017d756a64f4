"""The runner's pacing and bookkeeping with the pipeline faked (the real one
is in test_batch_e2e.py): shed lines wait and run again, never fail; at most
max_concurrency lines are in flight; a resumed batch runs only the lines
without an outcome; the batch class is the sheddable one by default."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from gateway.batch import runner as runner_module
from gateway.batch.records import new_batch, new_file_record
from gateway.batch.runner import BatchRunner, batch_priority_class
from gateway.batch.store import DirectoryStore
from gateway.config import BatchConfig
from gateway.errors import bad_request, rate_limited
from gateway.priority import PriorityClasses

FILE = "file-" + "f" * 32
BATCH = "batch_" + "b" * 32


def _content(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "tiny", "prompt": str(i)}}) + "\n" for i in range(n)).encode()


class FakePipeline:
    """run_completion's stand-in: sheds each line's first `sheds` attempts, refuses prompt "3"."""

    def __init__(self, sheds: int = 1) -> None:
        self.sheds = sheds
        self.attempts: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.classes: set[str] = set()

    async def __call__(self, gateway, body, tenant, endpoint):
        self.classes.add(body.priority_class)
        n = self.attempts[body.prompt] = self.attempts.get(body.prompt, 0) + 1
        if n <= self.sheds:
            raise rate_limited("shed under load", "shed", 0.01)
        if body.prompt == "3":
            raise bad_request("prompt: refused", "invalid_value", "prompt")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return {"id": f"cmpl-{body.prompt}", "object": "text_completion"}


def _runner(store, **config) -> BatchRunner:
    gateway = SimpleNamespace(classes=PriorityClasses.from_config(None, None),
                              tenants=SimpleNamespace(tenants=[SimpleNamespace(name="alice")]))
    return BatchRunner(gateway, store, BatchConfig(directory="unused", lease_s=5, poll_interval_s=0.02,
                                                   retry_interval_s=0.01, **config))


async def _run_to_end(store, runner) -> dict:
    runner.start()
    try:
        async with asyncio.timeout(20):
            while (batch := await store.get_batch("alice", BATCH))["status"] != "completed":
                await asyncio.sleep(0.02)
    finally:
        await runner.stop()
    return batch


async def _lines(store, file_id: str) -> list[dict]:
    return [json.loads(line) for line in (await store.file_content("alice", file_id)).splitlines()]


async def _new_batch(store, n: int) -> None:
    await store.put_file("alice", new_file_record(FILE, "in.jsonl", 0, "batch"), _content(n))
    await store.put_batch("alice", new_batch(BATCH, FILE, "/v1/completions", None))


def test_shed_lines_are_retried_and_concurrency_is_bounded(tmp_path, monkeypatch):
    pipeline = FakePipeline(sheds=2)
    monkeypatch.setattr(runner_module, "run_completion", pipeline)

    async def main():
        store = DirectoryStore(tmp_path)
        await _new_batch(store, 30)
        batch = await _run_to_end(store, _runner(store, max_concurrency=3))
        assert batch["request_counts"] == {"total": 30, "completed": 29, "failed": 1}
        output = await _lines(store, batch["output_file_id"])
        assert [o["custom_id"] for o in output] == [f"c{i}" for i in range(30) if i != 3]
        [error] = await _lines(store, batch["error_file_id"])
        assert error["custom_id"] == "c3" and error["response"]["status_code"] == 400
        assert error["error"]["code"] == "invalid_value"

    asyncio.run(main())
    assert all(n == 3 for p, n in pipeline.attempts.items() if p != "3")  # shed twice, then ran
    assert pipeline.max_in_flight <= 3
    assert pipeline.classes == {"batch"}


def test_a_resumed_batch_runs_only_the_lines_without_an_outcome(tmp_path, monkeypatch):
    pipeline = FakePipeline(sheds=0)
    monkeypatch.setattr(runner_module, "run_completion", pipeline)

    async def main():
        store = DirectoryStore(tmp_path)
        await _new_batch(store, 10)
        record = await store.get_batch("alice", BATCH)
        await store.put_batch("alice", {**record, "status": "in_progress"})
        for i in (0, 5, 9):  # a dead runner's work
            await store.put_result(BATCH, i, {"custom_id": f"c{i}", "response": {"status_code": 200, "body": {}},
                                              "error": None, "id": "earlier"})
        batch = await _run_to_end(store, _runner(store))
        output = await _lines(store, batch["output_file_id"])
        assert [o["custom_id"] for o in output] == [f"c{i}" for i in range(10) if i != 3]
        assert [o["id"] for o in output if o["custom_id"] in ("c0", "c5", "c9")] == ["earlier"] * 3

    asyncio.run(main())
    assert sorted(pipeline.attempts) == sorted(str(i) for i in range(10) if i not in (0, 5, 9))


def test_the_batch_class_defaults_to_the_sheddable_one():
    classes = PriorityClasses.from_config(None, None)
    assert batch_priority_class(classes, None) == "batch"
    assert batch_priority_class(classes, "standard") == "standard"
    with pytest.raises(ValueError, match="batch.priority_class"):
        batch_priority_class(classes, "nope")
