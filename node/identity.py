"""The node's persistent identity: an Ed25519 seed in the data dir, readable by its owner only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from protocol.errors import ConfigError
from protocol.keys import SEED_BYTES, Keypair

KEY_FILE = "node.key"


def load_or_create(data_dir: Path) -> Keypair:
    """Load the node key, creating it (mode 0600) on first start."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load(path)
    seed = os.urandom(SEED_BYTES)
    with os.fdopen(fd, "wb") as f:
        f.write(seed)
        f.flush()
        os.fsync(f.fileno())
    return Keypair(seed)


def load(path: Path) -> Keypair:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the node key {path} is readable by other users (mode {stat.S_IMODE(mode):o}); "
                          f"run `chmod 600 {path}` and start again")
    seed = path.read_bytes()
    if len(seed) != SEED_BYTES:
        raise ConfigError(f"the node key {path} is damaged ({len(seed)} bytes, expected {SEED_BYTES}); "
                          f"restore it from a backup, or move it away to start with a new identity (a new peer id)")
    return Keypair(seed)
