#!/usr/bin/env bash
# Build the image with podman on a machine that reaches PyPI and Debian's mirror but no image registry:
# a local base (scripts/container_base.sh), the host's CA certificates (a TLS-inspecting proxy) and its
# local wheel directory (the CPU torch wheel) mounted into the build's RUN steps. Prints the image name.
#   bash scripts/container_build.sh [IMAGE]          # default shoal:local
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${1:-shoal:local}"
BASE_IMAGE="localhost/shoal-base:bookworm"
bash scripts/container_base.sh "$BASE_IMAGE"
# This machine's kernel runs cgroups v1+v2 (hybrid) and denies raising rlimits: runc copes, crun does not.
conf="$(mktemp)"
trap 'rm -f "$conf"' EXIT
printf '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\n' > "$conf"
runtime=()
command -v runc >/dev/null 2>&1 && runtime=(--runtime runc)
mounts=(-v /etc/ssl/certs:/etc/ssl/certs:ro)
wheels="${WHEEL_DIR:-/opt/wheels}"
[ -d "$wheels" ] && mounts+=(-v "$wheels:$wheels:ro")
CONTAINERS_CONF="$conf" podman "${runtime[@]}" build --network host "${mounts[@]}" \
    --build-arg BASE="$BASE_IMAGE" --build-arg TORCH_INDEX= --build-arg TORCH_FIND_LINKS="$wheels" \
    -t "$IMAGE" . >&2
echo "$IMAGE"
