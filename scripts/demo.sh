#!/usr/bin/env bash
# Set up the virtualenv if needed, then run the demo: three node processes on this machine train
# examples/tiny-task.toml together (DiLoCo rounds over SHARDCAST, a few minutes on a laptop CPU),
# with live progress, then print the JSON report (eval loss per round, every node's weights hash).
# Extra arguments go to scripts/local_swarm.py instead, e.g. `scripts/demo.sh --nodes 4 --duration 25`
# for the membership-only demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- --nodes 3 --task examples/tiny-task.toml
fi
exec .venv/bin/python scripts/local_swarm.py "$@"
