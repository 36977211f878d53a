"""Writes cancelled by their caller's deadline leave the connection's encryption intact."""

from __future__ import annotations

import random

import pytest
import trio
from libp2p.io.exceptions import ConnectionClosedError

from p2p import frames
from p2p.host import open_host
from p2p_harness import connect, fresh_keypair, make_config


async def test_writers_cancelled_mid_frame_do_not_break_the_connection():
    """Eight streams at a time push 256 KiB writes into a slow reader and give up after 10–300 ms:
    before frames were written whole, each run of this lost the connection ("Failed authentication
    of message" at the reader, a Noise nonce spent on a frame that never left)."""
    rng = random.Random(7)
    async with open_host(fresh_keypair(), make_config()) as a, open_host(fresh_keypair(), make_config()) as b:

        async def sink(stream):
            try:
                while await stream.read(65536):
                    await trio.sleep(0.002)
            except Exception:
                pass

        async def echo(stream):
            await stream.write(await stream.read(100))
            await stream.close()

        b.set_stream_handler("/test/sink", sink)
        b.set_stream_handler("/test/echo", echo)
        await connect(a, b)
        gone: list[str] = []

        async def watch():
            async for peer in a.disconnections():
                gone.append(peer)

        async def writer():
            stream = await a.open_stream(b.peer_id, "/test/sink")
            with trio.move_on_after(rng.uniform(0.01, 0.3)):
                for _ in range(64):
                    await stream.write(b"x" * 262144)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for _ in range(10):
                async with trio.open_nursery() as writers:
                    for _ in range(8):
                        writers.start_soon(writer)
            with trio.fail_after(5):
                stream = await a.open_stream(b.peer_id, "/test/echo")
                await stream.write(b"ping")
                assert await stream.read(100) == b"ping"
            await trio.sleep(0.2)  # a torn frame is noticed by the reader's next frame
            nursery.cancel_scope.cancel()
        assert gone == [], "the connection was lost to a cancelled write"


class _Session:
    def __init__(self, write_s: float):
        self.write_s, self.written, self.closed = write_s, [], False

    async def write(self, data: bytes) -> None:
        await trio.sleep(self.write_s)
        self.written.append(data)

    async def close(self) -> None:
        self.closed = True

    def get_remote_peer(self) -> str:
        return "peer"


async def test_a_cancelled_caller_still_writes_the_whole_frame_then_sees_its_cancellation(autojump_clock):
    session = _Session(write_s=1.0)
    write = frames._whole(session, session.write)
    with trio.move_on_after(0.1) as scope:
        await write(b"frame")
    assert scope.cancelled_caught and session.written == [b"frame"] and not session.closed


async def test_a_frame_the_peer_never_takes_closes_the_connection(autojump_clock):
    session = _Session(write_s=frames.WRITE_STALL_S * 10)
    write = frames._whole(session, session.write)
    start = trio.current_time()
    with pytest.raises(ConnectionClosedError):
        await write(b"frame")
    assert session.closed and trio.current_time() - start == pytest.approx(frames.WRITE_STALL_S)
