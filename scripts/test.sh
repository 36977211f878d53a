#!/usr/bin/env bash
# Set up the virtualenv if needed, then run the whole test suite (slow multi-process tests included).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the fast tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
