"""Membership messages: the signed node announcement that doubles as the heartbeat."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.codec import message

MAX_ADDRS = 16
MAX_ROLES = 8
MAX_DEVICES = 64
KNOWN_ROLES = frozenset({"trainer", "validator", "initiator"})


@message(tag=2)
@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareSummary:
    devices: tuple[str, ...]
    memory_bytes: int
    tflops: float

    def __post_init__(self) -> None:
        if len(self.devices) > MAX_DEVICES or any(len(d) > 128 for d in self.devices):
            raise ValueError("too many or too long device names")
        if self.memory_bytes < 0 or not 0.0 <= self.tflops < 1e6:
            raise ValueError("memory_bytes and tflops must be non-negative and plausible")


@message(tag=3)
@dataclass(frozen=True, slots=True, kw_only=True)
class Announce:
    """Who a node is and how to reach it; re-sent every heartbeat with a larger ``seq``."""

    peer_id: str
    seq: int
    addrs: tuple[str, ...]
    version: str
    roles: tuple[str, ...]
    hardware: HardwareSummary
    control: str = ""
    """Free-form status line (e.g. current task and round) for operators' tables."""

    def __post_init__(self) -> None:
        if not 0 <= self.seq < 2**63:
            raise ValueError("seq must fit in a signed 64-bit integer")
        if len(self.addrs) > MAX_ADDRS or any(len(a) > 256 for a in self.addrs):
            raise ValueError("too many or too long addresses")
        if len(self.roles) > MAX_ROLES or not set(self.roles) <= KNOWN_ROLES:
            raise ValueError(f"roles must be among {sorted(KNOWN_ROLES)}")
        if len(self.version) > 64 or len(self.control) > 256 or len(self.peer_id) > 128:
            raise ValueError("version, control or peer_id too long")
