#!/usr/bin/env bash
# Set up the virtualenv if needed, then run the demo: a local swarm of node processes on this machine.
# Extra arguments go to scripts/local_swarm.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- --nodes 4 --duration 25
fi
exec .venv/bin/python scripts/local_swarm.py "$@"
