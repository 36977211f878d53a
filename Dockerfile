# Shoal node for rented or home NVIDIA GPUs (CUDA torch wheels bundle their CUDA runtime):
#   docker build -t shoal .
#   docker run --gpus all -p 4001:4001 -p 9464:9464 -v shoal-data:/data shoal \
#       --bootstrap /ip4/<peer ip>/tcp/4001/p2p/<peer id> --announce-addr /ip4/<this host's public ip>/tcp/4001
#   docker exec <container> shoal status
# A CPU-only image: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Built here (no registry, no download.pytorch.org): bash scripts/container_build.sh
# Another base (one made locally, for a machine with no registry): --build-arg BASE=<image with python3.11>
# The control API stays on 127.0.0.1 and the data dir's Unix socket (`docker exec ... shoal status` uses it);
# /metrics alone is also served on 0.0.0.0:9464 and needs the token in /data/control.token.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
# libp2p pulls in fastecdsa, which builds from source against GMP and the Python headers: compilers and
# headers live in this stage only.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential libgmp-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scripts/torch.txt ./scripts/torch.txt
# The same torch pin as scripts/setup.sh (scripts/torch.txt); the index picks the CUDA or CPU build, and
# TORCH_FIND_LINKS a directory of wheels mounted into the build (`-v /opt/wheels:/opt/wheels:ro`).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_FIND_LINKS=
RUN python3 -m venv /opt/shoal \
    && /opt/shoal/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/shoal/bin/pip install --no-cache-dir "$(cat scripts/torch.txt)" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} \
        ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"}
COPY protocol ./protocol
COPY p2p ./p2p
COPY node ./node
RUN /opt/shoal/bin/pip install --no-cache-dir . \
    && /opt/shoal/bin/python -c "import node.dashboard, libp2p, torch; node.dashboard.page()" \
    && /opt/shoal/bin/python -c "import sys, torch; want = open('scripts/torch.txt').read().split('==')[1].strip(); \
v = torch.__version__.split('+')[0]; sys.exit(0 if v == want else f'torch {v} was installed, not the pinned {want}')"

FROM ${BASE}
# Runtime libraries only (GMP for fastecdsa); no compiler, no headers.
RUN apt-get update && apt-get install -y --no-install-recommends libgmp10 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/shoal /opt/shoal
ENV PATH=/opt/shoal/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SHOAL_DATA_DIR=/data \
    SHOAL_METRICS_LISTEN=0.0.0.0:9464
RUN useradd --create-home --uid 1000 shoal && mkdir -p /data && chown shoal /data
USER shoal
VOLUME ["/data"]
EXPOSE 4001 9464

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s CMD shoal status --json --data-dir /data > /dev/null

ENTRYPOINT ["shoal", "start", "--data-dir", "/data", "--listen", "/ip4/0.0.0.0/tcp/4001", "--log-json"]
