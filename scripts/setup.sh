#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv in .venv and install Shoal with its test tools.
# CPU torch is pinned by default; for a GPU build set TORCH_SPEC, e.g.
#   TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128" bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV_DIR:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "shoal: Python 3.11 or newer is needed ($("$PYTHON" --version 2>&1) found); set PYTHON=/path/to/python3.11" >&2
    exit 2
fi
# The NAT tests build routers with nftables (and the NAT benchmark clears their state with conntrack):
# as root, install them from Debian's packages when missing; without root those tests skip.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    missing=""
    command -v nft >/dev/null 2>&1 || missing="$missing nftables"
    command -v conntrack >/dev/null 2>&1 || missing="$missing conntrack"
    if [ -n "$missing" ]; then
        echo "setup: installing$missing for the netlab NAT tests" >&2
        apt-get install -y -q $missing >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $missing >/dev/null; } \
            || echo "setup: could not install$missing; the netlab NAT tests will skip" >&2
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.shoal-installed"
want="$(cat pyproject.toml; echo "$TORCH_SPEC")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
        echo "shoal: a C compiler is needed to build libp2p's fastecdsa; install build-essential and libgmp-dev" >&2
        exit 2
    fi
    echo "setup: installing $TORCH_SPEC and shoal[test] (first run takes a minute or two)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options such as --index-url
    "$VENV/bin/python" -m pip install -q $TORCH_SPEC
    "$VENV/bin/python" -m pip install -q -e '.[test]'
    printf '%s' "$want" > "$stamp"
fi
