"""The receiving side of PushKVBlocks holds no call open without end: a
sender that stalls is cut at the idle timeout, and one that trickles a
message just inside it is cut at the overall deadline. The servicer runs
in-process on a real store; the limits are shortened for the test."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from engine_pod.server import grpc_service
from engine_pod.server.grpc_service import EngineService
from kv_store.host_tier import HostMemoryTier
from kv_store.inbox_socket import InboxConfig
from kv_store.tiered_store import TieredKVStore
from tessera.v1 import engine_pb2 as pb
from tests.kv_store.blocks import block_hash, genuine_value, make_codec


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted


def _service() -> tuple[EngineService, TieredKVStore]:
    store = TieredKVStore(make_codec(), HostMemoryTier(0), inbox=HostMemoryTier(1 << 24))
    service = EngineService(processor=None, metrics=None, role="decode", max_waiting_requests=1)
    service.engine = SimpleNamespace(core=SimpleNamespace(kv_store=store))
    return service, store


async def _messages(gap_s: float, count: int):
    for i in range(count):
        await asyncio.sleep(gap_s)
        yield pb.PushKVBlocksRequest(transfer_id="t", blocks=[pb.KVBlock(block_hash=block_hash(i),
                                                                         value=genuine_value(i))])


@pytest.mark.parametrize("gap_s, count, limits", [
    (1.0, 3, InboxConfig(idle_timeout_s=0.2, max_transfer_s=30)),   # stalls past the idle timeout
    (0.1, 100, InboxConfig(idle_timeout_s=0.5, max_transfer_s=0.6)),  # trickles inside it, past the overall one
])
def test_a_push_is_cut_at_its_deadlines(monkeypatch, gap_s, count, limits):
    monkeypatch.setattr(grpc_service, "PUSH_LIMITS", limits)
    service, store = _service()
    context = _Context()
    start = time.monotonic()
    with pytest.raises(_Aborted):
        asyncio.run(service.PushKVBlocks(_messages(gap_s, count), context))
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED and "push abandoned" in context.details
    assert time.monotonic() - start < 3
    assert store.stats.inbox_received < count


def test_a_steady_push_inside_both_deadlines_lands_whole(monkeypatch):
    monkeypatch.setattr(grpc_service, "PUSH_LIMITS", InboxConfig(idle_timeout_s=0.5, max_transfer_s=5))
    service, store = _service()
    reply = asyncio.run(service.PushKVBlocks(_messages(0.01, 10), _Context()))
    assert reply.num_blocks == 10 and store.stats.inbox_received == 10
