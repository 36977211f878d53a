#!/usr/bin/env python3
"""What libp2p adds on the wire: a bulk stream's overhead, and a small request-and-answer stream's.

Two real hosts on 127.0.0.1 (TCP + Noise + Yamux, as a node runs them). Counts come from
p2p.wire (every byte of the TCP connection) against the streams' payload. Prints JSON.

    python scripts/bench_wire.py [--bulk-mib 16] [--streams 200] [--json-out FILE]
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
MIB = 1 << 20


async def measure(bulk_mib: int, streams: int, request_bytes: int) -> dict:
    cfg = HostConfig(listen_addrs=["/ip4/127.0.0.1/tcp/0"])
    async with open_host(Keypair(os.urandom(32)), cfg) as a, open_host(Keypair(os.urandom(32)), cfg) as b:
        async def answer(stream) -> None:
            got = 0
            while data := await stream.read(MIB):
                got += len(data)
            await stream.write(got.to_bytes(8, "big"))
            await stream.close_write()

        b.set_stream_handler(PROTOCOL, answer)
        await a.connect(b.listen_addrs()[0])
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
    return {
        "bulk": {"payload_bytes": p1 - p0, "wire_bytes": w1 - w0,
                 "overhead_ratio": round((w1 - w0) / (p1 - p0) - 1, 5)},
        "small_streams": {"streams": streams, "request_bytes": request_bytes,
                          "wire_bytes_sent_per_stream": round((w2 - w1) / streams, 1),
                          "overhead_bytes_sent_per_stream": round((w2 - w1 - (p2 - p1)) / streams, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk-mib", type=int, default=16)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--request-bytes", type=int, default=100)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if args.bulk_mib < 1 or args.streams < 1 or args.request_bytes < 1:
        parser.error("--bulk-mib, --streams and --request-bytes must be at least 1")
    result = trio.run(measure, args.bulk_mib, args.streams, args.request_bytes)
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
