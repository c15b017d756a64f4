"""The runner's pacing and bookkeeping with the pipeline faked (the real one
is in test_batch_e2e.py): shed lines wait and run again, never fail; at most
max_concurrency lines are in flight; a resumed batch runs only the lines
without an outcome; the batch class is the sheddable one by default. With
signed records, a batch whose record does not verify is not run, and a
line whose result does not verify runs again."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from gateway.batch import runner as runner_module
from gateway.batch.records import new_batch, new_file_record
from gateway.batch.runner import BatchRunner
from gateway.priority import batch_priority_class
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
    async def completed() -> dict:
        while (batch := await store.get_batch("alice", BATCH))["status"] != "completed":
            await asyncio.sleep(0.02)
        return batch

    runner.start()
    try:
        return await asyncio.wait_for(completed(), 20)  # not asyncio.timeout: Python 3.10 has none
    finally:
        await runner.stop()


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


KEY = b"k" * 32


def test_a_line_whose_result_does_not_verify_runs_again(tmp_path, monkeypatch):
    pipeline = FakePipeline(sheds=0)
    monkeypatch.setattr(runner_module, "run_completion", pipeline)

    async def main():
        store = DirectoryStore(tmp_path, KEY)
        await _new_batch(store, 4)
        record = await store.get_batch("alice", BATCH)
        await store.put_batch("alice", {**record, "status": "in_progress"})
        for i in (0, 1):
            await store.put_result(BATCH, i, {"custom_id": f"c{i}", "response": {"status_code": 200, "body": {}},
                                              "error": None, "id": "earlier"})
        # Line 1's result altered behind the store's back: it is no result, so the line runs again.
        path = tmp_path / "runs" / BATCH / "results" / "1.json"
        path.write_bytes(path.read_bytes().replace(b'"earlier"', b'"forged"'))
        batch = await _run_to_end(store, _runner(store))
        output = await _lines(store, batch["output_file_id"])
        assert [o["custom_id"] for o in output] == ["c0", "c1", "c2"]  # c3: the fake's refusal, in the errors
        assert output[0]["id"] == "earlier" and output[1]["id"].startswith("batch_req_")

    asyncio.run(main())
    assert pipeline.attempts == {"1": 1, "2": 1, "3": 1}  # line 0 kept its verified result


def test_a_batch_whose_record_does_not_verify_is_not_run(tmp_path, monkeypatch):
    pipeline = FakePipeline(sheds=0)
    monkeypatch.setattr(runner_module, "run_completion", pipeline)

    async def main():
        store = DirectoryStore(tmp_path, KEY)
        await _new_batch(store, 3)
        path = tmp_path / "tenants" / "alice" / "batches" / f"{BATCH}.json"
        path.write_bytes(path.read_bytes().replace(b'"validating"', b'"in_progress"'))
        runner = _runner(store)
        runner.start()
        try:
            async def dropped() -> None:
                while await store.active_batches():
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(dropped(), 10)  # the runner found no record and let the batch go
        finally:
            await runner.stop()

    asyncio.run(main())
    assert pipeline.attempts == {}


def test_the_batch_class_defaults_to_the_sheddable_one():
    classes = PriorityClasses.from_config(None, None)
    assert batch_priority_class(classes, None) == "batch"
    assert batch_priority_class(classes, "standard") == "standard"
    with pytest.raises(ValueError, match="batch.priority_class"):
        batch_priority_class(classes, "nope")


def test_a_drain_lets_lines_in_flight_end_and_starts_no_more(tmp_path, monkeypatch):
    """SIGTERM: the lines running end and keep their results, none starts after,
    and the batch stays unfinished, so whoever resumes it runs only the rest."""
    release = asyncio.Event()
    started: list[str] = []

    async def slow_pipeline(gateway, body, tenant, endpoint):
        started.append(body.prompt)
        await release.wait()
        return {"id": f"cmpl-{body.prompt}", "object": "text_completion"}

    monkeypatch.setattr(runner_module, "run_completion", slow_pipeline)

    async def main():
        store = DirectoryStore(tmp_path)
        await _new_batch(store, 10)
        runner = _runner(store, max_concurrency=3)
        runner.start()
        while len(started) < 3:
            await asyncio.sleep(0.01)
        runner.begin_drain()
        asyncio.get_running_loop().call_later(0.2, release.set)  # the lines in flight end within the grace
        await runner.stop(grace_s=5)
        assert sorted(started) == ["0", "1", "2"]  # none started after the drain began
        assert sorted((await store.results(BATCH)).keys()) == [0, 1, 2]
        assert (await store.get_batch("alice", BATCH))["status"] == "in_progress"
        resumed = []
        monkeypatch.setattr(runner_module, "run_completion",
                            lambda g, body, t, e: resumed.append(body.prompt) or slow_pipeline(g, body, t, e))
        batch = await _run_to_end(store, _runner(store))
        assert sorted(resumed) == [str(i) for i in range(3, 10)]
        output = await _lines(store, batch["output_file_id"])
        assert [o["custom_id"] for o in output] == [f"c{i}" for i in range(10)]
        await store.close()

    asyncio.run(main())


def test_a_drain_past_its_grace_abandons_the_lines_without_results(tmp_path, monkeypatch):
    async def never_ends(gateway, body, tenant, endpoint):
        await asyncio.Event().wait()

    monkeypatch.setattr(runner_module, "run_completion", never_ends)

    async def main():
        store = DirectoryStore(tmp_path)
        await _new_batch(store, 5)
        runner = _runner(store, max_concurrency=2)
        runner.start()
        while (await store.get_batch("alice", BATCH))["status"] != "in_progress":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await asyncio.wait_for(runner.stop(grace_s=0.3), 5)
        assert await store.results(BATCH) == {}
        assert (await store.get_batch("alice", BATCH))["status"] == "in_progress"
        await store.close()

    asyncio.run(main())
