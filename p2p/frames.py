"""Whole frames: a write that its caller's timeout cancels must not tear the connection's encryption.

py-libp2p's Noise session encrypts a frame (spending the next nonce) and only then writes it to the
socket. A cancellation between the two, or in the middle of the socket write, leaves the peer with a
missing or partial frame; every later frame then fails authentication ("Failed authentication of
message") and the connection dies with every stream on it. Any stream write under a deadline can be
that cancellation: a shard upload that gives up, a hello past its timeout, a stream closed in a
bounded cleanup. On a loaded 2-core machine it happened a few times per task, and each time both
peers saw the other go away.

Once Yamux holds its connection write lock and hands a frame to the secure session, the frame is
written whole: the write runs shielded and the caller's cancellation lands right after it. A peer
that stops reading cannot pin the writer forever: a frame that cannot be written in WRITE_STALL_S
closes the connection (it may be half written, so it can never be used again).
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from libp2p.io.exceptions import ConnectionClosedError

log = logging.getLogger(__name__)

WRITE_STALL_S = 30.0
"""A frame is at most a Yamux window (256 KiB), 0.4 s on a 5 Mbit/s link: a frame this late means
the peer stopped reading, or the link is cut and membership has not dropped the connection yet."""
CLOSE_S = 2.0


def write_whole_frames(raw_host: Any) -> None:
    """Make every secure session ``raw_host`` upgrades to (dialled or accepted) write frames whole."""
    upgrader = raw_host.get_network().upgrader
    upgrade_security = upgrader.upgrade_security

    async def upgrade(raw_conn: Any, is_initiator: bool, peer_id: Any = None) -> Any:
        secured = await upgrade_security(raw_conn, is_initiator, peer_id)
        secured.write = _whole(secured, secured.write)
        return secured

    upgrader.upgrade_security = upgrade


def _whole(secured: Any, write: Any):
    async def write_whole(data: bytes) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(WRITE_STALL_S) as stalled:
                await write(data)
            if stalled.cancelled_caught:
                log.info("a frame to %s took over %.0f s to write; closing the connection",
                         _peer(secured), WRITE_STALL_S)
                with trio.move_on_after(CLOSE_S):
                    try:
                        await secured.close()
                    except Exception:
                        pass
                raise ConnectionClosedError(f"write stalled for {WRITE_STALL_S} s", transport="tcp")
        await trio.lowlevel.checkpoint()  # the caller's cancellation, if any, lands here

    return write_whole


def _peer(secured: Any) -> str:
    try:
        return str(secured.get_remote_peer())
    except Exception:
        return "a peer"
