"""A one-writer, many-reader broadcast channel over shared memory.

Why this and not a pipe per rank or ``broadcast_object_list``: each step's
message is pickled once and copied once into a ring of slots in a shared
mapping, whatever the number of readers; a pipe per rank writes (and the
kernel copies) it once per rank, and a gloo broadcast would put the engine
process into the workers' process group and pay a TCP round per rank. Messages
larger than a slot stream through the ring chunk by chunk.

Synchronisation is two counting semaphores per reader: ``ready`` (chunks
written that the reader has not taken) and ``free`` (slots the reader has
released; the writer takes one from every reader before reusing a slot).
Semaphore operations are also the memory barriers that publish the slot's
bytes. A waiting side sleeps in the kernel, not in a spin loop, so idle
workers leave the CPU to the engine process on a small machine, and wakes as
soon as the other side posts. Every wait is bounded and calls ``check_alive``
between rounds, so a dead peer turns into an error, never a hang.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from multiprocessing.synchronize import Semaphore

# Per slot: payload bytes in this slot, and 1 when it ends the message.
_SLOT_HEADER = struct.Struct("<QQ")
# Seconds between liveness checks while waiting.
POLL_SECONDS = 0.5


def _no_check() -> None:
    pass


@dataclass
class ChannelSpec:
    """What a reader process needs to attach (picklable at spawn time)."""

    path: str
    num_slots: int
    slot_bytes: int
    ready: list[Semaphore]
    free: list[Semaphore]

    @property
    def stride(self) -> int:
        return _SLOT_HEADER.size + self.slot_bytes

    def map(self) -> mmap.mmap:
        with open(self.path, "r+b") as f:
            return mmap.mmap(f.fileno(), self.num_slots * self.stride)


def _shm_directory() -> str | None:
    # tmpfs: pages never reach a disk. Falls back to the temp dir elsewhere.
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class BroadcastWriter:
    def __init__(self, ctx: BaseContext, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20) -> None:
        fd, path = tempfile.mkstemp(prefix="tessera-broadcast-", dir=_shm_directory())
        os.close(fd)
        self.spec = ChannelSpec(
            path, num_slots, slot_bytes,
            ready=[ctx.Semaphore(0) for _ in range(num_readers)],
            free=[ctx.Semaphore(num_slots) for _ in range(num_readers)],
        )
        with open(path, "r+b") as f:
            f.truncate(num_slots * self.spec.stride)
        self._mm = self.spec.map()
        self._slot = 0
        self._unlinked = False

    def reader_spec(self) -> ChannelSpec:
        return self.spec

    def write(self, obj: object, check_alive: Callable[[], None] = _no_check) -> int:
        """Broadcast ``obj``; returns the pickled size in bytes."""
        data = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        size, spec = len(data), self.spec
        start = 0
        while True:
            piece = data[start : start + spec.slot_bytes]
            start += len(piece)
            last = start >= size
            for free in spec.free:
                while not free.acquire(timeout=POLL_SECONDS):
                    check_alive()
            offset = self._slot * spec.stride
            _SLOT_HEADER.pack_into(self._mm, offset, len(piece), int(last))
            body = offset + _SLOT_HEADER.size
            self._mm[body : body + len(piece)] = piece
            for ready in spec.ready:
                ready.release()
            self._slot = (self._slot + 1) % spec.num_slots
            if last:
                return size

    def unlink(self) -> None:
        """Remove the file name once every reader has mapped it: the mapping
        lives on, and nothing is left on disk even if this process is killed."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.spec.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        if not self._mm.closed:
            self._mm.close()


class BroadcastReader:
    def __init__(self, spec: ChannelSpec, index: int) -> None:
        self.spec = spec
        self._ready = spec.ready[index]
        self._free = spec.free[index]
        self._mm = spec.map()
        self._slot = 0

    def read(self, check_alive: Callable[[], None] = _no_check) -> object:
        spec, parts = self.spec, []
        while True:
            while not self._ready.acquire(timeout=POLL_SECONDS):
                check_alive()
            offset = self._slot * spec.stride
            size, last = _SLOT_HEADER.unpack_from(self._mm, offset)
            body = offset + _SLOT_HEADER.size
            parts.append(self._mm[body : body + size])  # a copy: the slot is released next
            self._free.release()
            self._slot = (self._slot + 1) % spec.num_slots
            if last:
                return pickle.loads(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.close()
