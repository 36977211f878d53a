"""A raw libp2p peer for hostile-input testing (the wire fuzzer, the hostile suites): any bytes, any layer.

It is a bare py-libp2p host (Noise + Yamux, like a real peer), plus a hand-made connection that
stops after the Noise handshake or after muxer negotiation, so every layer can be fed garbage.
"""

from __future__ import annotations

import os

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.pb import rpc_pb2
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID, Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID, Yamux
from libp2p.transport.tcp.tcp import TCP
from libp2p.transport.upgrader import TransportUpgrader

MESHSUB = "/meshsub/1.1.0"
IDENTIFY_PUSH = "/ipfs/id/push/1.0.0"


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def multistream_line(text: str) -> bytes:
    body = text.encode() + b"\n"
    return varint(len(body)) + body


def rpc_bytes(**fields) -> bytes:
    """A well-formed protobuf pubsub RPC whose contents may be nonsense."""
    rpc = rpc_pb2.RPC()
    for msg in fields.get("publish", ()):
        rpc.publish.append(rpc_pb2.Message(**msg))
    for topic in fields.get("subscribe", ()):
        rpc.subscriptions.append(rpc_pb2.RPC.SubOpts(subscribe=True, topicid=topic))
    if "graft" in fields:
        rpc.control.graft.extend(rpc_pb2.ControlGraft(topicID=t) for t in fields["graft"])
    if "ihave" in fields:
        rpc.control.ihave.append(rpc_pb2.ControlIHave(topicID=fields["ihave"][0], messageIDs=fields["ihave"][1]))
    body = rpc.SerializeToString()
    return varint(len(body)) + body


def garbage(n: int = 300) -> bytes:
    return os.urandom(n)


class HostilePeer:
    """A raw py-libp2p host aimed at one victim address (a /p2p/ multiaddr)."""

    def __init__(self, target: str, *, seed: bytes | None = None):
        """``seed``: a Shoal identity's key seed, so the peer can send messages sealed by that identity."""
        self.target = target
        self.info = info_from_p2p_addr(multiaddr.Multiaddr(target))
        self.key_pair = create_new_key_pair(seed)
        self.peer_id = str(ID.from_pubkey(self.key_pair.public_key))
        self.host = new_host(key_pair=self.key_pair, sec_opt=self._sec_opt(),
                             muxer_opt={TProtocol(YAMUX_ID): Yamux},
                             connection_config=ConnectionConfig(max_connections_per_peer=1, dial_timeout=5.0))

    def _sec_opt(self):
        return {NOISE_ID: NoiseTransport(self.key_pair, noise_privkey=x25519_key_pair().private_key)}

    async def connect(self) -> None:
        with trio.fail_after(10):
            await self.host.connect(self.info)

    async def send(self, protocol: str, payload: bytes, *, read_reply: bool = False) -> None:
        """Open ``protocol``, write ``payload`` and close; failures of a hostile send are expected."""
        try:
            with trio.move_on_after(5):
                stream = await self.host.new_stream(self.info.peer_id, [TProtocol(protocol)])
                await stream.write(payload)
                if read_reply:
                    await stream.read(4096)
                await stream.close()
        except Exception:
            pass  # the victim reset the stream or dropped us: that is its right

    async def send_after_noise(self, payload: bytes, *, negotiate_yamux: bool) -> None:
        """A fresh TCP connection: Noise handshake, then (optionally yamux negotiation and) garbage."""
        address = multiaddr.Multiaddr(self.target.rsplit("/p2p/", 1)[0])
        upgrader = TransportUpgrader(self._sec_opt(), {TProtocol(YAMUX_ID): Yamux})
        try:
            with trio.move_on_after(5):
                raw = await TCP().dial(address)
                secure = await upgrader.upgrade_security(raw, True, self.info.peer_id)
                if negotiate_yamux:
                    await secure.write(multistream_line("/multistream/1.0.0") + multistream_line(YAMUX_ID))
                    await secure.read(64)
                await secure.write(payload)
                await secure.read(64)
                await secure.close()
        except Exception:
            pass


PUBSUB_SIGNING_PREFIX = b"libp2p-pubsub:"


class RawPeerSession:
    """Streams of one HostilePeer kept open for many frames (the fuzzer's fast path)."""

    def __init__(self, peer: HostilePeer):
        self.peer = peer
        self._seqno = 0

    def gossip_frame(self, topic: str, data: bytes) -> bytes:
        """An RPC frame carrying one message validly signed by this peer, so it reaches the node's validators."""
        self._seqno += 1
        msg = rpc_pb2.Message(data=data, topicIDs=[topic], from_id=self.peer.host.get_id().to_bytes(),
                              seqno=self._seqno.to_bytes(8, "big"))
        msg.signature = self.peer.key_pair.private_key.sign(PUBSUB_SIGNING_PREFIX + msg.SerializeToString())
        rpc = rpc_pb2.RPC()
        rpc.publish.append(msg)
        body = rpc.SerializeToString()
        return varint(len(body)) + body

    async def open(self, protocol: str):
        """A raw libp2p stream; exceptions are the caller's to expect."""
        return await self.peer.host.new_stream(self.peer.info.peer_id, [TProtocol(protocol)])
