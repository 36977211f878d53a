"""Shards over streams: request, header, raw chunks, the receiver verifies and acks.

``/shoal/shard/2`` keeps a stream for the next request: each exchange is request, header, exactly the
header's byte count, ack, and the receiver may send its next request on the same stream (opening a stream
per shard cost the receiving loop about 2 ms a shard). ``/shoal/shard/1``, still served for older peers,
carries one exchange and half-closes after the body. A refusal (busy, seeded, missing) is a header with
that status and no body; on /2 the stream stays open for the next request.

Both sides bound every read and write by an inactivity deadline, and each exchange by
``base_s + nbytes / min_rate_bytes_per_s``. The sender keeps the stream open until the ack
arrives, because yamux drops data the peer has not read when a connection goes down.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import trio

from p2p.api import Stream
from p2p.framing import recv_message, send_message
from protocol.errors import (DecodeError, IntegrityError, OversizeError, RemoteProtocolError, StreamClosed,
                             TransferTimeout)
from protocol.manifest import STATUS_OK, ShardAck, ShardHeader, ShardRequest

from node.shardcast.incoming import Incoming, IncomingShards, UpstreamFailed
from node.shardcast.store import HeldShard, ShardStore

SHARD_PROTOCOL = "/shoal/shard/2"
SHARD_PROTOCOL_V1 = "/shoal/shard/1"
SHARD_PROTOCOLS = (SHARD_PROTOCOL, SHARD_PROTOCOL_V1)
"""In order of preference: what a fetcher offers when it opens a stream."""
CHUNK_BYTES = 1 << 20
WRITE_BATCH_BYTES = 1 << 20
"""Bytes handed to the hashing and writing thread at once (one thread hop each); chosen by measurement."""
CONTROL_MAX_BYTES = 4096
"""Request, header and ack are ~100 bytes; anything near this cap is junk."""
CLEANUP_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Deadlines:
    inactivity_s: float = 10.0
    base_s: float = 5.0
    min_rate_bytes_per_s: float = 250e3

    def overall_s(self, nbytes: int) -> float:
        return self.base_s + nbytes / self.min_rate_bytes_per_s


class Stalled(TransferTimeout):
    """The peer made no progress for a whole inactivity deadline (unlike a merely slow transfer)."""


class Unanswered(StreamClosed):
    """The stream ended or failed before the holder answered the request: on a kept stream, most likely the
    holder closing it as idle just as we asked; the request can go out again on a new stream."""


def keeps_open(stream: Stream) -> bool:
    """Whether ``stream`` runs the protocol that carries several exchanges."""
    return stream.protocol == SHARD_PROTOCOL


async def _step(deadlines: Deadlines, awaitable):
    """One read or write, bounded by the inactivity deadline."""
    try:
        with trio.fail_after(deadlines.inactivity_s):
            return await awaitable
    except trio.TooSlowError:
        raise Stalled(f"no progress for {deadlines.inactivity_s} s") from None


async def abort(stream: Stream) -> None:
    """Reset the stream, bounded and shielded: cleanup must finish even while being cancelled."""
    with trio.move_on_after(CLEANUP_S, shield=True):
        try:
            await stream.reset()
        except StreamClosed:
            pass


async def fetch_shard(stream: Stream, store: ShardStore, *, manifest_id: bytes, index: int, sha256: bytes,
                      nbytes: int, deadlines: Deadlines, fallback: bool = False,
                      incoming: IncomingShards | None = None) -> str:
    """Ask for one shard and store it verified; returns the holder's status ("ok", "busy", "missing").
    With ``incoming``, the body is registered there as it arrives, for our server to pass on (incoming.py).

    Raises IntegrityError, OversizeError or DecodeError when the holder sent something we refuse
    (its fault), TransferTimeout when it went quiet, Unanswered when the stream ended or failed before
    the holder's header, StreamClosed when it died later. On failure the stream is reset. On success a
    /shoal/shard/2 stream stays open for the caller's next request (it closes or resets it); any other
    is closed.
    """
    writer = None
    arriving = None
    nacked = False
    keep = keeps_open(stream)
    try:
        with trio.fail_after(deadlines.overall_s(nbytes)):
            try:
                await _step(deadlines, send_message(stream, ShardRequest(manifest_id=manifest_id, index=index,
                                                                          fallback=fallback)))
                header = await _step(deadlines, recv_message(stream, CONTROL_MAX_BYTES, expect=ShardHeader))
            except StreamClosed as exc:
                raise Unanswered(f"stream failed before the shard header: {exc}") from exc
            if header is None:
                raise Unanswered("stream ended before the shard header")
            if header.manifest_id != manifest_id or header.index != index:
                raise DecodeError(f"asked for shard {index}, got a header for shard {header.index}")
            if header.status != STATUS_OK:
                if not keep:
                    await _step(deadlines, stream.close())
                return header.status
            if header.nbytes != nbytes or header.sha256 != sha256:
                raise IntegrityError(f"header promises {header.nbytes} bytes / another hash; "
                                     f"the manifest says {nbytes} bytes")
            writer = store.shard_writer(sha256, nbytes)
            if incoming is not None:
                arriving = incoming.begin(manifest_id, index, nbytes)
            await _receive_body(stream, writer, nbytes, deadlines, arriving)
            # On /2 bytes past the body would be read as the next header, and refused there.
            if not keep and await _step(deadlines, stream.read(1)):
                raise OversizeError(f"holder sent more than the announced {nbytes} bytes")
            try:
                writer.verify()
            except IntegrityError as exc:
                # Closed, not reset: a reset would discard the nack, and the holder needs it to check its disk.
                await _send_nack(stream, manifest_id, index, str(exc))
                nacked = True
                raise
            if arriving is not None:
                arriving.finish(True)  # verified: whoever we pass it on to gets its last bytes now
            await trio.to_thread.run_sync(writer.commit)
            writer = None
        ack = ShardAck(manifest_id=manifest_id, index=index, ok=True, reason="")
        if keep:
            # The holder reads our next request only after this ack. The shard is ours either way: if the ack
            # cannot go out the stream is reset, and whoever asks on it next is told so (Unanswered).
            acked = False
            with trio.move_on_after(deadlines.inactivity_s):
                try:
                    await send_message(stream, ack)
                    acked = True
                except StreamClosed:
                    pass
            if not acked:
                await abort(stream)
            return STATUS_OK
        # The shard is verified and stored: a lost ack only costs the holder its bookkeeping.
        with trio.move_on_after(deadlines.inactivity_s):
            try:
                await send_message(stream, ack)
                await stream.close()
            except StreamClosed:
                pass
        return STATUS_OK
    except trio.TooSlowError:
        await abort(stream)
        raise TransferTimeout(f"shard {index} slower than its overall deadline") from None
    except BaseException:
        if not nacked:
            await abort(stream)
        raise
    finally:
        if arriving is not None:
            incoming.end(arriving, ok=writer is None)
        if writer is not None:
            writer.abort()


async def _receive_body(stream: Stream, writer, nbytes: int, deadlines: Deadlines,
                        arriving: Incoming | None = None) -> None:
    """Read a shard's bytes on the event loop while a worker thread hashes and writes the batch before.

    hashlib and file writes release the GIL on large buffers, so the thread runs beside the loop
    that decrypts and demultiplexes the stream; the channel holds one batch, bounding memory.
    """
    failure: list[Exception] = []
    send, receive = trio.open_memory_channel[list](1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_write_batches, receive, writer, failure)
        async with send:
            try:
                await _read_batches(stream, send, nbytes, deadlines, failure, arriving)
            except Exception as exc:  # re-raised below as itself, not inside the nursery's exception group
                failure.append(exc)
    if failure:
        raise failure[0]


async def _read_batches(stream: Stream, send: trio.MemorySendChannel[list], nbytes: int,
                        deadlines: Deadlines, failure: list, arriving: Incoming | None) -> None:
    """The chunks as read, handed over uncopied in batches of about WRITE_BATCH_BYTES."""
    received = 0
    batch: list = []
    batched = 0
    # One scope for the whole body, its deadline moved on by each read: a scope per read (as _step) took a
    # tenth of the receiving loop. Handing a batch to the writer is not the peer's doing, so it runs unbounded.
    with trio.CancelScope() as reading:
        while received < nbytes and not failure:
            reading.deadline = trio.current_time() + deadlines.inactivity_s
            chunk = await stream.read(min(CHUNK_BYTES, nbytes - received))
            if not chunk:
                raise IntegrityError(f"shard ended after {received} of {nbytes} bytes")
            batch.append(chunk)
            batched += len(chunk)
            received += len(chunk)
            if arriving is not None:
                arriving.add(chunk)
            if batched >= WRITE_BATCH_BYTES:
                reading.deadline = math.inf
                await send.send(batch)
                batch, batched = [], 0
    if reading.cancelled_caught:
        raise Stalled(f"no progress for {deadlines.inactivity_s} s")
    if batch and not failure:
        await send.send(batch)


async def _write_batches(receive: trio.MemoryReceiveChannel[list], writer, failure: list) -> None:
    # Errors are handed back, not raised, so the caller sees OSError itself rather than an exception group.
    async with receive:
        async for batch in receive:
            if failure:
                continue
            try:
                await trio.to_thread.run_sync(writer.write_all, batch)
            except OSError as exc:
                failure.append(exc)


async def _send_nack(stream: Stream, manifest_id: bytes, index: int, reason: str) -> None:
    with trio.move_on_after(CLEANUP_S):
        try:
            await send_message(stream, ShardAck(manifest_id=manifest_id, index=index, ok=False, reason=reason[:200]))
            await stream.close()
        except StreamClosed:
            pass


class Refused(Exception):
    """An inbound request we refuse; ``reason`` names it in statistics, ``charge`` says whether the peer is to blame."""

    def __init__(self, reason: str, detail: str, *, charge: bool = True):
        super().__init__(detail)
        self.reason = reason
        self.charge = charge


class _Watched:
    """A read-only view of a stream that remembers whether the peer half-closed (EOF) or not."""

    def __init__(self, stream: Stream):
        self._stream = stream
        self.eof = False

    async def read(self, max_bytes: int) -> bytes:
        data = await self._stream.read(max_bytes)
        self.eof = not data
        return data


async def read_control(stream: Stream, deadlines: Deadlines, max_bytes: int, expect: type):
    """The first control message on an inbound stream, or Refused naming what the peer did instead.

    A half-close before a whole request is deliberate (honest peers always send one first), so it is
    charged; a reset is not, since a peer that cancels a query resets its stream.
    """
    watched = _Watched(stream)
    with _judged(watched):
        try:
            with trio.fail_after(deadlines.inactivity_s):
                msg = await recv_message(watched, max_bytes, expect=expect)
        except trio.TooSlowError:
            raise Refused("silent", f"no request within {deadlines.inactivity_s} s") from None
    if msg is None:
        raise Refused("truncated", "stream ended before the request")
    return msg


@contextlib.contextmanager
def _judged(watched: _Watched):
    """A failed read of a request, as the Refused that names what the peer did."""
    try:
        yield
    except OversizeError as exc:
        raise Refused("oversize", str(exc)) from None
    except RemoteProtocolError as exc:
        raise Refused("garbage", str(exc)) from None
    except StreamClosed as exc:
        if watched.eof:
            raise Refused("truncated", str(exc)) from None
        raise Refused("reset", str(exc), charge=False) from None


async def read_request(stream: Stream, deadlines: Deadlines) -> ShardRequest:
    """The requester's ShardRequest; Refused otherwise."""
    return await read_control(stream, deadlines, CONTROL_MAX_BYTES, ShardRequest)


async def read_next(stream: Stream, idle_s: float, max_bytes: int, expect: type):
    """The next message on a kept inbound stream; None once the peer closed it at a message boundary or let it sit
    idle for ``idle_s``. Refused for what no honest peer sends."""
    watched = _Watched(stream)
    with _judged(watched), trio.move_on_after(idle_s):
        return await recv_message(watched, max_bytes, expect=expect)
    return None


async def refuse(stream: Stream, req: ShardRequest, status: str, deadlines: Deadlines) -> bool:
    """Answer with a header carrying ``status`` and no data; then close, or on /shoal/shard/2 keep the stream for
    the next request. Returns whether the stream is still open for one."""
    try:
        with trio.fail_after(deadlines.inactivity_s):
            await send_message(stream, ShardHeader(manifest_id=req.manifest_id, index=req.index, status=status,
                                                   nbytes=0, sha256=b""))
            if keeps_open(stream):
                return True
            await stream.close()
    except (trio.TooSlowError, StreamClosed):
        await abort(stream)
    return False


@dataclass(frozen=True, slots=True)
class SendResult:
    ok: bool
    """The receiver acked the shard as verified."""
    bytes_sent: int
    disk_corrupt: bool
    """What we read from disk did not match its hash: the caller drops the shard."""


def _chunks_of(source: Path | HeldShard, nbytes: int):
    """The shard's bytes in chunks of at most CHUNK_BYTES, read from its file or its pieces in memory."""
    if isinstance(source, HeldShard):
        # Pieces are tensors' bytes, some tiny (a bias): gathered into whole chunks, not a write each.
        chunk = bytearray()
        for piece in source.pieces:
            view = memoryview(piece)
            while view:
                take = min(len(view), CHUNK_BYTES - len(chunk))
                chunk += view[:take]
                view = view[take:]
                if len(chunk) == CHUNK_BYTES:
                    yield bytes(chunk)
                    chunk = bytearray()
        if chunk:
            yield bytes(chunk)
        return
    with open(source, "rb") as f:
        sent = 0
        while sent < nbytes and (chunk := f.read(min(CHUNK_BYTES, nbytes - sent))):
            sent += len(chunk)
            yield chunk


async def send_shard(stream: Stream, req: ShardRequest, *, source: Path | HeldShard | Incoming, sha256: bytes,
                     nbytes: int, deadlines: Deadlines, on_bytes: Callable[[int], None] | None = None) -> SendResult:
    """Serve one shard from ``source`` (its file, its pieces in memory, or the chunks of a transfer still arriving)
    and wait for the receiver's ack; then close, or on /shoal/shard/2 leave the stream open for the receiver's next
    request.

    Raises TransferTimeout, StreamClosed, UpstreamFailed (a shard passed on as it arrived did not verify) or a
    RemoteProtocolError; the stream is reset then.
    """
    sent = 0
    keep = keeps_open(stream)
    try:
        with trio.fail_after(deadlines.overall_s(nbytes)):
            await _step(deadlines, send_message(stream, ShardHeader(manifest_id=req.manifest_id, index=req.index,
                                                                     status=STATUS_OK, nbytes=nbytes, sha256=sha256)))
            if isinstance(source, Incoming):
                # Waiting for bytes still on their way to us is not the receiver's doing: only writes are bounded.
                async for chunk in source.follow():
                    await _step(deadlines, stream.write(chunk))
                    sent += len(chunk)
                    if on_bytes is not None:
                        on_bytes(len(chunk))
            else:
                chunks = _chunks_of(source, nbytes)
                try:
                    for chunk in chunks:
                        await _step(deadlines, stream.write(chunk))
                        sent += len(chunk)
                        if on_bytes is not None:
                            on_bytes(len(chunk))
                finally:
                    chunks.close()  # its file, now rather than when the generator is collected
            if not keep:
                await _step(deadlines, stream.close_write())
            ack = await _step(deadlines, recv_message(stream, CONTROL_MAX_BYTES, expect=ShardAck))
        if ack is None:
            raise StreamClosed("receiver closed without an ack")
        if ack.manifest_id != req.manifest_id or ack.index != req.index:
            raise DecodeError("ack for another shard")
        if not keep:
            with trio.move_on_after(deadlines.inactivity_s):
                try:
                    await stream.close()
                except StreamClosed:
                    pass
        corrupt = sent != nbytes
        if not ack.ok and not corrupt and isinstance(source, Path):
            # Hashing every shard while sending would cost the sender a fifth of its CPU; the store
            # verified it when loading, so only a receiver's complaint makes us look at the disk again.
            corrupt = (await trio.to_thread.run_sync(ShardStore.hash_file, source))[0] != sha256
        return SendResult(ok=ack.ok, bytes_sent=sent, disk_corrupt=corrupt)
    except trio.TooSlowError:
        await abort(stream)
        raise TransferTimeout(f"shard {req.index}: slower than its overall deadline") from None
    except (RemoteProtocolError, StreamClosed, OSError, Stalled, UpstreamFailed):
        await abort(stream)
        raise
