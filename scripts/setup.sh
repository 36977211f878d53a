#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv in .venv and install Shoal with its test tools.
# CPU torch is pinned by default; for a GPU build set TORCH_SPEC, e.g.
#   TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128" bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV_DIR:-.venv}"
# The torch pin lives in scripts/torch.txt, which the Dockerfile reads too: one policy for both.
TORCH_SPEC="${TORCH_SPEC:-$(cat scripts/torch.txt)}"

if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "shoal: Python 3.11 or newer is needed ($("$PYTHON" --version 2>&1) found); set PYTHON=/path/to/python3.11" >&2
    exit 2
fi
# The NAT tests build routers with nftables (and the NAT benchmark clears their state with conntrack),
# and one router offers NAT-PMP with miniupnpd (the nftables build: a binary and scripts, no service
# that starts on its own): as root, install them from Debian's packages when missing; without root
# those tests skip.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    missing=""
    command -v nft >/dev/null 2>&1 || missing="$missing nftables"
    command -v conntrack >/dev/null 2>&1 || missing="$missing conntrack"
    command -v miniupnpd >/dev/null 2>&1 || [ -x /usr/sbin/miniupnpd ] || missing="$missing miniupnpd-nftables"
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
    # Every node must compute the outer step bit-identically: make sure no dependency swapped the pinned torch.
    case "$TORCH_SPEC" in torch==*)
        want_torch="${TORCH_SPEC#torch==}"; want_torch="${want_torch%% *}"
        got_torch="$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)"
        if [ "$got_torch" != "$want_torch" ]; then
            echo "shoal: torch $got_torch is installed, not the pinned $want_torch; a dependency replaced it" >&2
            exit 2
        fi;;
    esac
    printf '%s' "$want" > "$stamp"
fi

# The browser tests drive Debian's Chromium through chromedriver; as root, install them when missing.
if ! command -v chromedriver >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium and chromium-driver for the browser tests" >&2
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; then
        apt-get update -q >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
            || echo "setup: could not install chromium; the browser tests will skip" >&2
    fi
fi
