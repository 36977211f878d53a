"""A hostile node for tests: its aggregates announce a result hash their inputs do not give.

Used as a node's argv prefix (scripts/local_swarm.py runs ``prefix + [python, "-m", "node.cli", ...]``):
the node runs here with Exchange.aggregate wrapped; any other command (the control calls) is exec'd as is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import runpy
import sys


def main() -> None:
    argv = sys.argv[1:]
    if argv[1:3] != ["-m", "node.cli"]:
        os.execv(argv[0], argv)
    from node.tasks import exchange

    honest = exchange.Exchange.aggregate

    async def forged(self, job):
        out = await honest(self, job)
        if out is None:
            return None
        return dataclasses.replace(out, result_hash=hashlib.sha256(b"forged" + out.result_hash.encode()).hexdigest())

    exchange.Exchange.aggregate = forged
    sys.argv = ["node.cli", *argv[3:]]
    runpy.run_module("node.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
