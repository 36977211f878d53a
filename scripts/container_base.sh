#!/usr/bin/env bash
# Make a local base image for the Dockerfile on a machine that reaches Debian's mirror but no image
# registry: a minimal Debian bookworm (python3.11, venv, GMP) from debootstrap, imported into podman.
#   bash scripts/container_base.sh [IMAGE]      # default localhost/shoal-base:bookworm
# Then: podman build --network host --build-arg BASE=localhost/shoal-base:bookworm \
#           --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t shoal:local .
set -euo pipefail
IMAGE="${1:-localhost/shoal-base:bookworm}"
if podman image exists "$IMAGE"; then
    echo "container_base: $IMAGE exists" >&2
    exit 0
fi
for tool in podman debootstrap; do
    command -v "$tool" >/dev/null 2>&1 || { echo "container_base: needs $tool (apt-get install $tool)" >&2; exit 2; }
done
root="$(mktemp -d /tmp/shoal-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libgmp10 \
    bookworm "$root" http://deb.debian.org/debian >&2
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
echo "deb http://deb.debian.org/debian bookworm main" > "$root/etc/apt/sources.list"
tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$IMAGE" >&2
echo "container_base: made $IMAGE" >&2
