"""Poll a node's control API and print one JSON line per poll (used by the swarm launcher, also inside netlab hosts)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from node.control import ControlClient, read_token
from protocol.errors import ShoalError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="control API base URL, e.g. http://127.0.0.1:7070")
    parser.add_argument("--data-dir", required=True, type=Path, help="the node's data dir (its control token)")
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--paths", default="/peers", help="comma-separated endpoints to fetch each poll")
    parser.add_argument("--max-s", type=float, default=24 * 3600.0, help="stop after this long")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.max_s
    paths = [p for p in args.paths.split(",") if p]
    client = None
    while time.monotonic() < deadline:
        line: dict = {"t": time.time()}
        for path in paths:
            try:
                client = client or ControlClient(token=read_token(args.data_dir), url=args.url.rstrip("/"))
                line[path.strip("/")] = client.call(path, timeout_s=5)
            except ShoalError as exc:
                line["error"] = str(exc)
        try:
            print(json.dumps(line), flush=True)
        except BrokenPipeError:
            return 0
        time.sleep(args.interval_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
