"""The sending half of the direct P/D channel: a prefill pod streams each
producing request's KV blocks straight to the decode pod the gateway picked
(the Engine service's PushKVBlocks), instead of through Redis.

A push first asks the decode pod for its inbox socket (``OpenKVInbox``) and,
given a ticket, streams the blocks there (kv_store/inbox_socket.py: plain
frames, several times gRPC's throughput); a pod without one takes them over
the ``PushKVBlocks`` stream instead.

One transfer per request, on a thread of its own: the engine step only
queues the blocks it filled (``send``), so the push of a long prompt's first
chunks overlaps the compute of its later ones, and signing (the MAC every
shared value carries) happens here, off the step. ``finish`` closes the
stream and hands back a future the request's final response waits on, so a
decode pod is never sent to read blocks still on the wire.

A push that fails or is cut short (the decode pod gone, a deadline, a
refusal) is not retried there: the transfer's blocks go to the fallback
(Redis, synchronously) and the result says so. Whatever a decode pod took
before the failure is still sound: each value is verified when read.
"""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from kv_store.inbox_socket import InboxUnreachable, push_blocks
from tessera.internal_channel import InternalClient
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# A block queued for the wire: (block hash, encoded value, MAC not yet set).
_Block = tuple[bytes, bytes]
_END = None


@dataclass(frozen=True)
class TransferResult:
    """How one request's blocks reached (or failed to reach) its decode pod."""

    channel: str
    """"direct" (the decode pod took every block), "redis" (the push failed;
    the blocks went to Redis instead) or "none" (neither worked)."""
    num_blocks: int
    """Blocks the transfer carried."""
    num_bytes: int
    """Bytes of signed values sent on the channel that delivered them."""
    seconds: float
    """From the first block queued to the last one delivered."""
    error: str | None = None
    """Why the direct push failed (None: it did not)."""
    data_path: str = "grpc"
    """How a direct push travelled: "socket" (the decode pod's inbox socket) or "grpc" (PushKVBlocks)."""


@dataclass(frozen=True)
class DirectSenderConfig:
    """How the direct channel pushes."""

    timeout_s: float = 60.0
    """Deadline of one push, from its first block to the decode pod's reply."""
    max_message_bytes: int = 8 << 20
    """Blocks are batched into messages of at most this many bytes (at least one block each)."""
    max_channels: int = 64
    """Channels to decode pods kept open at most (least recently used closed first)."""


class _Transfer:
    def __init__(self, transfer_id: str, target: str) -> None:
        self.transfer_id = transfer_id
        self.target = target
        self.data_path = "grpc"  # "socket" once the decode pod's inbox socket took the blocks
        self.queue: queue.Queue[_Block | None] = queue.Queue()
        # Every block queued, kept until the decode pod answers: the fallback
        # takes them all, whatever part of the queue the push consumed.
        self.blocks: list[_Block] = []
        self.finished = threading.Event()  # no block comes after this
        self.start = time.perf_counter()
        self.result: Future[TransferResult] = Future()


class DirectSender:
    def __init__(self, sign: Callable[[bytes], bytes], fallback: Callable[[list[tuple[bytes, bytes]]], bool] | None,
                 client: Callable[[], InternalClient], config: DirectSenderConfig = DirectSenderConfig()) -> None:
        """``sign``: the codec's (an encoded value -> its signed copy);
        ``fallback``: puts signed values into Redis now, True when they landed
        (None: no fallback); ``client``: how to dial pods, made on the first push."""
        self._sign = sign
        self._fallback = fallback
        self._make_client = client
        self._client: InternalClient | None = None
        self._ssl_context: ssl.SSLContext | None = None
        self.config = config
        self._transfers: dict[str, _Transfer] = {}
        self._channels: OrderedDict[str, grpc.Channel] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def send(self, transfer_id: str, target: str, block_hash: bytes, value: bytes) -> None:
        """Queue one encoded block of a transfer (started by its first block)."""
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                transfer = self._transfers[transfer_id] = _Transfer(transfer_id, target)
                threading.Thread(target=self._run, args=(transfer,), name=f"kv-push-{transfer_id[:24]}",
                                 daemon=True).start()
            transfer.blocks.append((block_hash, value))
        transfer.queue.put((block_hash, value))

    def finish(self, transfer_id: str) -> Future[TransferResult]:
        """End a transfer: its result once every queued block is delivered
        (at once for a transfer that queued none)."""
        with self._lock:
            transfer = self._transfers.pop(transfer_id, None)
        if transfer is None:
            done: Future[TransferResult] = Future()
            done.set_result(TransferResult("direct", 0, 0, 0.0))
            return done
        transfer.finished.set()
        transfer.queue.put(_END)
        return transfer.result

    def cancel(self, transfer_id: str) -> None:
        """Drop a transfer whose request ended without output (aborted): its
        push ends at once, nothing falls back."""
        with self._lock:
            transfer = self._transfers.pop(transfer_id, None)
        if transfer is not None:
            transfer.result.cancel()
            transfer.finished.set()
            transfer.queue.put(_END)

    def close(self) -> None:
        with self._lock:
            transfers, self._transfers = list(self._transfers.values()), {}
            channels, self._channels = list(self._channels.values()), OrderedDict()
        for transfer in transfers:
            transfer.result.cancel()
            transfer.finished.set()
            transfer.queue.put(_END)
        for channel in channels:
            channel.close()

    # -- the transfer's thread ----------------------------------------------
    def _run(self, transfer: _Transfer) -> None:
        error = None
        try:
            stub = pb_grpc.EngineStub(self._channel(transfer.target))  # type: ignore[no-untyped-call]  # generated
            taken = self._push(stub, transfer)
            if taken != len(transfer.blocks):
                error = f"the decode pod took {taken} of {len(transfer.blocks)} blocks"
        except grpc.RpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except Exception as e:  # no secret to dial with, a bad address, a refused socket: fall back, never crash
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            # Blocks still come until the request's last step: the fallback takes them all.
            transfer.finished.wait(self.config.timeout_s)
        if not transfer.result.cancelled():
            transfer.result.set_result(self._outcome(transfer, error))

    def _push(self, stub: pb_grpc.EngineStub, transfer: _Transfer) -> int:
        """Blocks the decode pod took: over its inbox socket when it has one, else the gRPC stream."""
        start = time.monotonic()
        opened = self._open_inbox(stub, transfer)
        if opened.port:
            host = transfer.target.rsplit(":", 1)[0].strip("[]")
            tls, server_name = self._socket_tls()
            try:
                taken = push_blocks(host, opened.port, opened.ticket, self._signed_blocks(transfer),
                                    self.config.timeout_s - (time.monotonic() - start), tls, server_name)
                transfer.data_path = "socket"
                return taken
            except InboxUnreachable as e:  # nothing sent yet (a policy drops the port?): gRPC carries it
                logger.warning("kv transfer %s: %s; pushing over gRPC", transfer.transfer_id, e)
        return int(stub.PushKVBlocks(self._messages(transfer), timeout=self.config.timeout_s).num_blocks)

    def _open_inbox(self, stub: pb_grpc.EngineStub, transfer: _Transfer) -> pb.OpenKVInboxReply:
        try:
            reply: pb.OpenKVInboxReply = stub.OpenKVInbox(pb.OpenKVInboxRequest(transfer_id=transfer.transfer_id),
                                                          timeout=self.config.timeout_s)
            return reply
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return pb.OpenKVInboxReply(port=0)  # a pod of an older release: gRPC only

    def _signed_blocks(self, transfer: _Transfer) -> Iterator[tuple[bytes, bytes]]:
        """The transfer's blocks, signed, as they are queued, until ``finish``."""
        while (item := transfer.queue.get()) is not _END:
            yield item[0], self._sign(item[1])

    def _socket_tls(self) -> tuple[ssl.SSLContext | None, str | None]:
        """The socket's TLS and the name the peer's certificate must carry: the pod's
        own certificate, as on its gRPC channels ((None, None): plaintext)."""
        with self._lock:
            tls = self._client.tls if self._client is not None else None
            if tls is None:
                return None, None
            if self._ssl_context is None:
                self._ssl_context = tls.ssl_context()
            return self._ssl_context, tls.server_name

    def _messages(self, transfer: _Transfer) -> Iterator[pb.PushKVBlocksRequest]:
        """The transfer's blocks as they are queued, signed and batched (what
        is queued already, up to max_message_bytes), until ``finish``."""
        while True:
            item = transfer.queue.get()  # wait for the next block
            if item is _END:
                return
            batch, size, ended = [], 0, False
            while True:
                batch.append(pb.KVBlock(block_hash=item[0], value=self._sign(item[1])))
                size += len(item[1])
                if size >= self.config.max_message_bytes:
                    break
                try:
                    item = transfer.queue.get_nowait()
                except queue.Empty:
                    break
                if item is _END:
                    ended = True
                    break
            yield pb.PushKVBlocksRequest(transfer_id=transfer.transfer_id, blocks=batch)
            if ended:
                return

    def _outcome(self, transfer: _Transfer, error: str | None) -> TransferResult:
        with self._lock:
            blocks = list(transfer.blocks)
        num_bytes = sum(len(v) for _, v in blocks)
        elapsed = time.perf_counter() - transfer.start
        if error is None:
            return TransferResult("direct", len(blocks), num_bytes, elapsed, data_path=transfer.data_path)
        logger.warning("kv transfer %s to %s failed (%s); %s", transfer.transfer_id, transfer.target, error,
                       "falling back to Redis" if self._fallback else "no fallback: the decode pod recomputes")
        landed = self._fallback is not None and self._fallback([(h, self._sign(v)) for h, v in blocks])
        return TransferResult("redis" if landed else "none", len(blocks), num_bytes if landed else 0,
                              time.perf_counter() - transfer.start, error)

    def _channel(self, target: str) -> grpc.Channel:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            channel = self._channels.get(target)
            if channel is None:
                limit = self.config.max_message_bytes + (1 << 20)
                channel = self._channels[target] = self._client.channel(
                    target, options=[("grpc.max_send_message_length", limit)])
                self._close_idle_channels()
            self._channels.move_to_end(target)
            return channel

    def _close_idle_channels(self) -> None:
        """Keep at most max_channels: decode pods come and go (new addresses),
        and a channel to one long gone would otherwise stay open for ever.
        The least recently used go first, never one a transfer is using."""
        busy = {t.target for t in self._transfers.values()}
        for target in [t for t in self._channels if t not in busy][: len(self._channels) - self.config.max_channels]:
            self._channels.pop(target).close()
