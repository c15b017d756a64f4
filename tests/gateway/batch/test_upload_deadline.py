"""An upload that trickles is cut at its deadline (408 naming the file), and
one past the size limit at that limit, without reading the rest."""

from __future__ import annotations

import asyncio

import pytest

from gateway.batch.api import _read_bounded
from gateway.errors import GatewayError


class _TricklingRequest:
    """A request whose body comes `chunks` times `piece`, `gap_s` apart."""

    def __init__(self, piece: bytes, chunks: int, gap_s: float, headers: dict | None = None) -> None:
        self.piece, self.chunks, self.gap_s = piece, chunks, gap_s
        self.headers = headers or {}
        self.sent = 0

    async def stream(self):
        for _ in range(self.chunks):
            await asyncio.sleep(self.gap_s)
            self.sent += 1
            yield self.piece


def test_a_trickling_upload_is_cut_at_its_deadline():
    request = _TricklingRequest(b"x", 1000, 0.01)
    with pytest.raises(GatewayError) as e:
        asyncio.run(_read_bounded(request, limit=1 << 20, deadline_s=0.2))
    assert (e.value.status, e.value.param, e.value.code) == (408, "file", "upload_timeout")
    assert request.sent < 100


def test_an_upload_past_the_limit_is_refused_at_the_limit():
    request = _TricklingRequest(b"y" * 1000, 100, 0.0)
    with pytest.raises(GatewayError) as e:
        asyncio.run(_read_bounded(request, limit=5000))
    assert e.value.status == 400 and request.sent == 6
    declared = _TricklingRequest(b"", 0, 0.0, {"content-length": "999999"})
    with pytest.raises(GatewayError):
        asyncio.run(_read_bounded(declared, limit=5000))


def test_an_upload_inside_both_bounds_is_read_whole():
    request = _TricklingRequest(b"z" * 10, 5, 0.0)
    assert asyncio.run(_read_bounded(request, limit=1000, deadline_s=5)) == b"z" * 50
