# Shoal node for rented or home NVIDIA GPUs:
#   docker build -t shoal .
#   docker run --gpus all -p 4001:4001 -v shoal-data:/data shoal \
#       --bootstrap /ip4/<peer ip>/tcp/4001/p2p/<peer id> --announce-addr /ip4/<this host's public ip>/tcp/4001
#   docker exec <container> shoal status
# The control API listens on 127.0.0.1 inside the container only; use `docker exec` to reach it.
# torch follows scripts/setup.sh: one pinned version for every node (the outer step must be bit-identical
# across members; a task can also pin requirements.torch_version), here its CUDA build. The CUDA libraries
# come inside the torch wheel's dependencies; the host's driver comes in with --gpus.
FROM python:3.11-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_SPEC="torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/cu128"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SHOAL_DATA_DIR=/data

# libp2p pulls in fastecdsa, which builds from source against GMP.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential libgmp-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/shoal
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY p2p ./p2p
COPY node ./node
COPY scripts ./scripts
# torch first, pinned; pip then keeps it because it satisfies torch>=2.4 (transformers and peft allow it).
RUN python -m pip install --upgrade pip && python -m pip install $TORCH_SPEC && python -m pip install . \
    && python -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '${TORCH_VERSION}' else f'torch {v} was installed, not the pinned ${TORCH_VERSION}')"

RUN useradd --create-home --uid 1000 shoal && mkdir -p /data && chown shoal /data
USER shoal
VOLUME ["/data"]
EXPOSE 4001

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
    CMD python -c "import json,urllib.request as u; d=json.load(open('/data/node.json')); u.urlopen(d['control_url']+'/status', timeout=4)"

ENTRYPOINT ["shoal", "start", "--data-dir", "/data", "--listen", "/ip4/0.0.0.0/tcp/4001", "--log-json"]
