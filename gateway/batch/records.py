"""A batch's record and the OpenAI Batch object shown to clients.

The record is the Batch object itself (what the store keeps and the runner
updates); a cancel asked for but not yet seen by the runner shows as
"cancelling", from the store's cancel mark, so the API never races the runner
over one field."""

from __future__ import annotations

import time

COMPLETION_WINDOW_S = 24 * 3600
_ACTIVE = ("validating", "in_progress", "finalizing")


def new_batch(batch_id: str, input_file_id: str, endpoint: str, metadata: dict | None) -> dict:
    now = int(time.time())
    return {
        "id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
        "completion_window": "24h", "status": "validating", "output_file_id": None, "error_file_id": None,
        "created_at": now, "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None,
        "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
    }


def visible_status(record: dict, cancel_requested: bool) -> str:
    if cancel_requested and record["status"] in _ACTIVE:
        return "cancelling"
    return record["status"]


def batch_json(record: dict, cancel_requested: bool = False) -> dict:
    """The Batch object of a record."""
    status = visible_status(record, cancel_requested or record.get("cancelling_at") is not None)
    return {**record, "status": status}


def new_file_record(file_id: str, filename: str, size: int, purpose: str) -> dict:
    """OpenAI's File object."""
    return {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
            "purpose": purpose, "status": "processed", "status_details": None}
