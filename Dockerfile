# Shoal node for rented or home NVIDIA GPUs:
#   docker build -t shoal .
#   docker run --gpus all -p 4001:4001 -v shoal-data:/data shoal \
#       --bootstrap /ip4/<peer ip>/tcp/4001/p2p/<peer id> --announce-addr /ip4/<this host's public ip>/tcp/4001
#   docker exec <container> shoal status
# The control API listens on 127.0.0.1 inside the container only; use `docker exec` to reach it.
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

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
# torch comes with the base image (CUDA build); pip keeps it because it satisfies torch>=2.4.
RUN python -m pip install --upgrade pip && python -m pip install .

RUN useradd --create-home --uid 1000 shoal && mkdir -p /data && chown shoal /data
USER shoal
VOLUME ["/data"]
EXPOSE 4001

HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
    CMD python -c "import json,urllib.request as u; d=json.load(open('/data/node.json')); u.urlopen(d['control_url']+'/status', timeout=4)"

ENTRYPOINT ["shoal", "start", "--data-dir", "/data", "--listen", "/ip4/0.0.0.0/tcp/4001", "--log-json"]
