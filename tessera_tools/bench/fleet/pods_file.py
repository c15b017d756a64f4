"""The gateways' pods file (gateway config `pods.file`): the bench's stand-in
for a pool Service's EndpointSlices. A pod is listed once it is ready and
unlisted as soon as it starts terminating; the gateways poll the file and
make their pods exactly what it lists.

Written elsewhere and renamed into place, so a gateway never reads half a
file. The gateways notice a change by the file's (mtime, size): two writes
of the same size within one tick of the file system's clock would look
alike, so a write that would leave the stamp unchanged is repeated until
it differs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml

# How long to wait before rewriting a file whose stamp did not change.
STAMP_RETRY_S = 0.005
STAMP_RETRIES = 400


def file_stamp(path: Path) -> tuple[int, int]:
    """What the gateways' FileWatcher compares: (mtime in ns, size)."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size


class PodsFile:
    """The pools' addresses by role (gateway/pods/discovery.py members_from_file), as the gateways read
    them: one mixed pool, or a prefill and a decode pool. Every role given is written, empty or not."""

    def __init__(self, path: Path, roles: tuple[str, ...] = ("mixed",)) -> None:
        self.path = Path(path)
        self.members: dict[str, list[str]] = {role: [] for role in roles}
        self._stamp: tuple[int, int] | None = None
        self._write()

    def add(self, address: str, role: str = "mixed") -> None:
        if address not in self.members[role]:
            self.members[role].append(address)
            self._write()

    def remove(self, address: str, role: str = "mixed") -> None:
        if address in self.members[role]:
            self.members[role].remove(address)
            self._write()

    def set(self, addresses: list[str], role: str = "mixed") -> None:
        self.members[role] = list(addresses)
        self._write()

    def _write(self) -> None:
        text = yaml.safe_dump({role: sorted(addresses) for role, addresses in self.members.items()})
        tmp = self.path.with_name(self.path.name + ".tmp")
        for _ in range(STAMP_RETRIES):
            tmp.write_text(text)
            os.replace(tmp, self.path)
            stamp = file_stamp(self.path)
            if stamp != self._stamp:
                self._stamp = stamp
                return
            time.sleep(STAMP_RETRY_S)
        raise RuntimeError(f"{self.path}: its modification time does not change; the gateways would miss a write")
