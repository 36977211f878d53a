"""Start-up checks that find a user's mistake before any service starts: data dir, key, ports."""

from __future__ import annotations

import errno
import getpass
import os
import socket
from pathlib import Path

from node.config import NodeConfig
from protocol.errors import ConfigError


def check_data_dir(data_dir: Path) -> None:
    """The data dir must exist (or be creatable) and be writable by this user."""
    user = getpass.getuser()
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        probe = data_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except PermissionError:
        raise ConfigError(f"data dir {data_dir} is not writable by user {user}; fix its owner "
                          f"(`chown -R {user} {data_dir}`) or choose another with --data-dir") from None
    except FileExistsError:
        raise ConfigError(f"data dir {data_dir} is a file, not a directory; choose another with --data-dir") from None
    except OSError as exc:
        raise ConfigError(f"data dir {data_dir} cannot be used: {exc.strerror}; choose another with --data-dir") from None


def _port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound, or None.

    libp2p listens with SO_REUSEPORT (for TCP hole punching), so a second node on the same port
    would bind too and report ready while the first takes the connections. A probe bound without
    SO_REUSEPORT fails while anyone else listens there.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "is in use by another program (is another node running?)"
            if exc.errno == errno.EADDRNOTAVAIL:
                return "is not an address of this machine"
            if exc.errno == errno.EACCES:
                return "needs privileges to bind (ports below 1024); use a port above 1024"
            return f"cannot be bound ({exc.strerror})"
    return None


def check_ports(cfg: NodeConfig) -> None:
    import multiaddr

    for addr in cfg.listen:
        maddr = multiaddr.Multiaddr(addr)
        host = maddr.value_for_protocol("ip4" if "/ip4/" in addr else "ip6")
        port = int(maddr.value_for_protocol("tcp"))
        if port:
            problem = _port_in_use(host, port)
            if problem:
                raise ConfigError(f"listen address {addr} {problem}; stop that program or pick another "
                                  f"port with --listen /ip4/{host}/tcp/<port>")
    if cfg.control_port:
        problem = _port_in_use(cfg.control_host, cfg.control_port)
        if problem:
            raise ConfigError(f"control port {cfg.control_host}:{cfg.control_port} {problem}; pick another with "
                              f"--control-port (0 takes any free port)")


def check_startup(cfg: NodeConfig) -> None:
    """Everything that can be found out before the node starts, each with one line on how to fix it."""
    from node import identity

    from node.daemon import lock_data_dir

    check_data_dir(cfg.data_dir)
    with lock_data_dir(cfg.data_dir):
        pass  # run_node takes it for good; this only finds a running node before anything is logged
    key = cfg.data_dir / identity.KEY_FILE
    if key.exists():
        try:
            identity.load(key)
        except PermissionError:
            raise ConfigError(f"the node key {key} cannot be read by user {getpass.getuser()}; fix its owner "
                              f"or choose another --data-dir") from None
    check_ports(cfg)
