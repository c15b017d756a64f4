#!/usr/bin/env python3
"""A Batch API job with the OpenAI SDK, against a Tessera gateway: write a
JSONL file of chat requests, upload it, start a batch, wait for it (with a
deadline), download the output, check that every request came back exactly
once, print a summary, and delete the job's files.

The gateway needs a `batch:` section in its config (docs/batch.md, "Trying
it"): `make run`'s does not have one.

    python examples/batch_job.py --base-url http://127.0.0.1:8000/v1 --lines 20

The API key comes from OPENAI_API_KEY, never from a flag: a command line is
visible to every user of the machine (/proc/*/cmdline). A gateway without a
tenants file takes any key. Exit status 0 when every request came back once
and answered; on failure (a request failed or went missing, the batch did
not complete, the deadline passed) one line on stderr and status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import openai
from example_client import Failure, client_for, first_model, run_main

FINAL = ("completed", "failed", "expired", "cancelled")




def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the gateway's /v1 (default: %(default)s)")
    p.add_argument("--model", default=None, help="the model (default: the first of GET /models)")
    p.add_argument("--lines", type=int, default=10, help="requests in the batch (default 10)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per answer at most (default 8)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the batch; then it is cancelled and the job fails (default 600)")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between looks (default 1)")
    p.add_argument("--keep-files", action="store_true", help="keep the input and output files on the gateway")
    args = p.parse_args(argv)
    if args.lines < 1 or args.max_tokens < 1 or args.timeout <= 0 or args.poll_interval <= 0:
        p.error("--lines and --max-tokens must be at least 1, --timeout and --poll-interval above 0")
    return args


def write_requests(path: Path, model: str, lines: int, max_tokens: int) -> list[str]:
    """The batch's input file: one chat request per line; returns the custom_ids."""
    ids = [f"question-{i}" for i in range(lines)]
    with path.open("w", encoding="utf-8") as f:
        for i, custom_id in enumerate(ids):
            body = {"model": model, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"Give me fact number {i} about the sea."}]}
            f.write(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    return ids


def wait_for(client: openai.OpenAI, batch_id: str, timeout: float, interval: float):
    """The batch once in a final status; past `timeout`, it is cancelled and the job fails."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        batch = client.batches.retrieve(batch_id)
        counts = batch.request_counts
        progress = f"{batch.status} {counts.completed + counts.failed}/{counts.total}" if counts and counts.total \
            else batch.status
        if progress != last:
            print(f"batch {batch_id}: {progress}", flush=True)
            last = progress
        if batch.status in FINAL:
            return batch
        if time.monotonic() >= deadline:
            try:
                client.batches.cancel(batch_id)  # nobody will collect it: stop starting its lines
                what = "cancelled it"
            except openai.OpenAIError:
                what = "could not cancel it"
            raise Failure(f"batch {batch_id} still {progress} after the {timeout:g} s of --timeout; {what}")
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def check_returned(ids: list[str], output: list[dict], errors: list[dict]) -> None:
    """Every custom_id exactly once across the output and error files, and none that was not sent."""
    returned = [line["custom_id"] for line in output + errors]
    missing = sorted(set(ids) - set(returned))
    twice = sorted({i for i in returned if returned.count(i) > 1})
    unknown = sorted(set(returned) - set(ids))
    if missing or twice or unknown:
        raise Failure(f"the output does not hold every request once: missing {missing[:5]}, twice {twice[:5]}, "
                      f"unknown {unknown[:5]}")


def run(args: argparse.Namespace) -> None:
    client = client_for(args.base_url)
    model = args.model or first_model(client)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="batch-job-") as tmp:
        path = Path(tmp) / "requests.jsonl"
        ids = write_requests(path, model, args.lines, args.max_tokens)
        with path.open("rb") as f:
            try:
                uploaded = client.files.create(file=f, purpose="batch")
            except openai.NotFoundError:
                raise Failure("the gateway has no Batch API (POST /files: 404); its config needs a `batch:` "
                              "section (docs/batch.md)") from None
    print(f"uploaded {uploaded.id}: {args.lines} requests, {uploaded.bytes} bytes", flush=True)
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"example": "batch_job"})
    batch = wait_for(client, batch.id, args.timeout, args.poll_interval)
    if batch.status != "completed":
        detail = "; ".join(e.message or "" for e in (batch.errors.data or [])) if batch.errors else ""
        raise Failure(f"batch {batch.id} ended {batch.status}{': ' + detail if detail else ''}")
    output, errors = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    check_returned(ids, output, errors)
    summary = {"batch_id": batch.id, "status": batch.status, "requests": len(ids), "completed": len(output),
               "failed": len(errors), "every_custom_id_once": True,
               "seconds": round(time.monotonic() - started, 1)}
    print("summary: " + json.dumps(summary), flush=True)
    if not args.keep_files:
        for file_id in (uploaded.id, batch.output_file_id, batch.error_file_id):
            if file_id is not None:
                client.files.delete(file_id)
    if errors:
        first = errors[0]["error"] or {}
        raise Failure(f"{len(errors)} of {len(ids)} requests failed, the first ({errors[0]['custom_id']}) with "
                      f"{first.get('code')}: {first.get('message')}")



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # a bad flag: argparse's usage line and status 2
    return run_main("batch_job", run, args)


if __name__ == "__main__":
    sys.exit(main())
