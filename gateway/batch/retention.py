"""How long a finished batch is kept: `batch.retention_s` after it ended, then
it goes with its output and error files (the input file is the tenant's, kept
until it is deleted). Without it a tenant that reached
`batch.max_batches_per_tenant` could never create another batch: the Batch API
has no route that deletes one.

Expired batches are removed when their tenant next lists or creates batches
or files, the moments their quota and listings are read: no sweep of every
tenant's records, and a tenant never sees a batch past its retention.
"""

from __future__ import annotations

import time

from gateway.batch.store import FINAL_STATUSES, BatchStore

# The times a batch may have ended at (records.py): the latest that is set.
_END_FIELDS = ("completed_at", "failed_at", "expired_at", "cancelled_at")


def ended_at(record: dict) -> int | None:
    """When the batch reached its final status (None: it has not)."""
    if record.get("status") not in FINAL_STATUSES:
        return None
    times = [record[f] for f in _END_FIELDS if isinstance(record.get(f), int)]
    return max(times) if times else record.get("created_at")


async def remove_expired(store: BatchStore, tenant: str, retention_s: float, now: float | None = None) -> list[dict]:
    """Remove the tenant's batches that ended more than `retention_s` ago (and
    their output and error files); the tenant's other batches, newest first."""
    now = time.time() if now is None else now
    kept = []
    for record in await store.list_batches(tenant):
        end = ended_at(record)
        if end is None or end + retention_s > now:
            kept.append(record)
            continue
        for file_id in (record.get("output_file_id"), record.get("error_file_id")):
            if file_id:
                await store.delete_file(tenant, file_id)
        await store.delete_batch(tenant, record["id"])
    return kept
