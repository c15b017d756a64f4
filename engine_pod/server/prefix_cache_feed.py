"""One StreamLoad subscriber's view of the pod's prefix cache, as the
LoadReport.prefix_cache messages to send it (proto: PrefixCacheKeys)."""

from __future__ import annotations

from engine_pod.core.prefix_cache_keys import Cursor, PrefixCacheKeyLog
from tessera.v1 import engine_pb2 as pb

# Keys in one report: 8 bytes each on the wire, so 512 KiB, well under gRPC's
# 4 MiB default message limit; a larger set or change goes out in several
# reports sent back to back.
MAX_KEYS_PER_REPORT = 65536


class PrefixCacheFeed:
    """Turns the pod's key log into per-report messages for one subscriber.

    The first call sends the whole set with ``reset``; each later call the
    net changes since the previous one; a reader that fell off the log (or a
    cleared cache) gets a reset snapshot again. Each subscriber has its own
    feed, so its own cursor. Runs on the event loop only.
    """

    def __init__(self, max_keys_per_report: int | None = None) -> None:
        self.max_keys = max_keys_per_report or MAX_KEYS_PER_REPORT
        if self.max_keys < 1:
            raise ValueError(f"max_keys_per_report must be >= 1, got {self.max_keys}")
        # The log read so far (None: no engine yet) and the position in it.
        self._log: PrefixCacheKeyLog | None = None
        self._cursor: Cursor | None = None

    def next_messages(self, log: PrefixCacheKeyLog | None) -> list[pb.PrefixCacheKeys]:
        """The messages for the next reports, in order: one, or more for a
        set or change larger than one report (only the first has ``reset``).
        ``log`` None (the engine is not up yet): an empty reset."""
        if log is None:
            self._log = self._cursor = None
            return [pb.PrefixCacheKeys(reset=True)]
        changes = None
        if log is self._log and self._cursor is not None:
            changes = log.changes_since(self._cursor)
        self._log = log
        if changes is None:
            self._cursor, keys = log.snapshot()
            return self._split(True, keys, [])
        self._cursor, stored, removed = changes
        return self._split(False, stored, removed)

    def _split(self, reset: bool, stored: list[int], removed: list[int]) -> list[pb.PrefixCacheKeys]:
        """At most ``max_keys`` keys a message, removed ones first; always at least one message."""
        messages: list[pb.PrefixCacheKeys] = []
        r = s = 0
        while not messages or r < len(removed) or s < len(stored):
            r_end = min(len(removed), r + self.max_keys)
            s_end = min(len(stored), s + self.max_keys - (r_end - r))
            messages.append(pb.PrefixCacheKeys(reset=reset and not messages,
                                               stored=stored[s:s_end], removed=removed[r:r_end]))
            r, s = r_end, s_end
        return messages
