#!/usr/bin/env python3
"""Print hashes of the outer step's results (int8 decode, weighted mean, Nesterov) for fixed inputs under this torch.

Run it under two torch builds and compare the JSON: equal hashes mean nodes on either build reach the same
θ_{r+1} bit for bit. Inputs come from sha256, not from torch's RNG, so they are the same whatever the build.
    python scripts/compare_outer.py                      # this environment's torch
    /other/venv/bin/python scripts/compare_outer.py      # another build (PYTHONPATH set to the checkout)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from node.train.compress import decode_int8, encode_int8  # noqa: E402
from node.train.diloco import OuterNesterov, weighted_mean_by_peer, weights_hash  # noqa: E402

SHAPES = {"a.weight": (257, 33), "b.weight": (1024,), "c.bias": (7, 5, 3)}


def values(label: str, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    raw = b"".join(hashlib.sha256(f"{label}/{i}".encode()).digest() for i in range((4 * n + 31) // 32))
    ints = torch.frombuffer(bytearray(raw[: 4 * n]), dtype=torch.int32).to(torch.float64)
    return (ints / 2**31 * scale).to(torch.float32).reshape(shape)


def main() -> int:
    theta = {k: values(f"theta/{k}", s, 0.5) for k, s in SHAPES.items()}
    outer = OuterNesterov(lr=0.7, momentum=0.9)
    out = {"torch": torch.__version__, "rounds": []}
    for r in range(3):
        updates = {}
        for p, peer in enumerate(("peer-a", "peer-b", "peer-c")):
            delta = {k: values(f"delta/{r}/{peer}/{k}", s, 0.01) for k, s in SHAPES.items()}
            decoded = {k: decode_int8(encode_int8(t.reshape(-1)), t.numel()).reshape(t.shape) for k, t in delta.items()}
            updates[peer] = (decoded, float(100 + 37 * p))
        mean = weighted_mean_by_peer(updates)
        payloads = {k: encode_int8(mean[k].reshape(-1)) for k in sorted(mean)}
        payload = b"".join(payloads.values())
        applied = {k: decode_int8(payloads[k], mean[k].numel()).reshape(mean[k].shape) for k in payloads}
        theta = outer.step(theta, applied)
        out["rounds"].append({"int8_aggregate_sha256": hashlib.sha256(payload).hexdigest()[:16],
                              "mean": weights_hash(mean)[:16], "weights": weights_hash(theta)[:16],
                              "momentum": weights_hash(outer.state_dict())[:16]})
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
