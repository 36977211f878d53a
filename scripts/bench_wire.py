#!/usr/bin/env python3
"""What libp2p adds on the wire: a bulk stream's overhead, a small request-and-answer stream's, and a gossip message's.

Two real hosts on 127.0.0.1 (TCP + Noise + Yamux, gossipsub, as a node runs them). Counts come
from p2p.wire (every byte of the TCP connection) against the streams' payload and the gossip
messages' data. Prints JSON.

    python scripts/bench_wire.py [--bulk-mib 16] [--streams 200] [--messages 200] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from p2p.api import HostConfig  # noqa: E402
from p2p.host import open_host  # noqa: E402
from protocol.keys import Keypair  # noqa: E402

PROTOCOL = "/shoal/bench-wire/1"
TOPIC = "shoal-bench/wire"
MIB = 1 << 20
GOSSIP_GAP_S = 0.02
"""Between gossip messages: one RPC each, as a node's announcements and round messages mostly are."""


async def measure(bulk_mib: int, streams: int, request_bytes: int, messages: int, message_bytes: int) -> dict:
    cfg = HostConfig(listen_addrs=["/ip4/127.0.0.1/tcp/0"])
    async with open_host(Keypair(os.urandom(32)), cfg) as a, open_host(Keypair(os.urandom(32)), cfg) as b:
        async def answer(stream) -> None:
            got = 0
            while data := await stream.read(MIB):
                got += len(data)
            await stream.write(got.to_bytes(8, "big"))
            await stream.close_write()

        b.set_stream_handler(PROTOCOL, answer)
        received = b.subscribe(TOPIC, None)
        a.subscribe(TOPIC, None)
        await a.connect(b.listen_addrs()[0])
        await a.wait_for_topic_peer(TOPIC, b.peer_id)
        await trio.sleep(1.0)  # identify and the gossip hello settle first

        async def one(payload: bytes) -> None:
            stream = await a.open_stream(b.peer_id, PROTOCOL)
            for at in range(0, len(payload), MIB):
                await stream.write(payload[at:at + MIB])
            await stream.close_write()
            while await stream.read(64):
                pass
            await stream.close()

        def snap():
            s = a.statistics()
            return s.wire_bytes_sent, s.bytes_sent

        w0, p0 = snap()
        await one(os.urandom(bulk_mib * MIB))
        w1, p1 = snap()
        for _ in range(streams):
            await one(os.urandom(request_bytes))
        w2, p2 = snap()
        # Gossip: the publisher's bytes per message, and the receiver's (its window updates, its
        # share of the heartbeats' control), both against the message's data.
        b_before = b.statistics().wire_bytes_sent
        for i in range(messages):
            await a.publish(TOPIC, i.to_bytes(4, "big") + os.urandom(message_bytes - 4))
            await received.receive()
            await trio.sleep(GOSSIP_GAP_S)
        w3, b_sent = a.statistics().wire_bytes_sent, b.statistics().wire_bytes_sent - b_before
    return {
        "bulk": {"payload_bytes": p1 - p0, "wire_bytes": w1 - w0,
                 "overhead_ratio": round((w1 - w0) / (p1 - p0) - 1, 5)},
        "small_streams": {"streams": streams, "request_bytes": request_bytes,
                          "wire_bytes_sent_per_stream": round((w2 - w1) / streams, 1),
                          "overhead_bytes_sent_per_stream": round((w2 - w1 - (p2 - p1)) / streams, 1)},
        "gossip": {"messages": messages, "message_bytes": message_bytes,
                   "publisher_wire_bytes_per_message": round((w3 - w2) / messages, 1),
                   "receiver_wire_bytes_per_message": round(b_sent / messages, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk-mib", type=int, default=16)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--request-bytes", type=int, default=100)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--message-bytes", type=int, default=1000, help="a gossip message's data (at least 4)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if min(args.bulk_mib, args.streams, args.request_bytes, args.messages) < 1 or args.message_bytes < 4:
        parser.error("--bulk-mib, --streams, --request-bytes and --messages must be at least 1, --message-bytes at least 4")
    result = trio.run(measure, args.bulk_mib, args.streams, args.request_bytes, args.messages, args.message_bytes)
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
