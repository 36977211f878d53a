"""One libp2p notifee that calls plain functions on connection events (py-libp2p wants every method)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from libp2p.abc import INotifee


class ConnectionEvents(INotifee):
    """Calls ``on_connected(conn)`` / ``on_disconnected(conn)``; the swarm has forgotten a closed one by then."""

    def __init__(self, *, on_connected: Callable[[Any], None] | None = None,
                 on_disconnected: Callable[[Any], None] | None = None):
        self._on_connected, self._on_disconnected = on_connected, on_disconnected

    async def opened_stream(self, network: Any, stream: Any) -> None: ...
    async def closed_stream(self, network: Any, stream: Any) -> None: ...

    async def connected(self, network: Any, conn: Any) -> None:
        if self._on_connected is not None:
            self._on_connected(conn)

    async def disconnected(self, network: Any, conn: Any) -> None:
        if self._on_disconnected is not None:
            self._on_disconnected(conn)

    async def listen(self, network: Any, multiaddr: Any) -> None: ...
    async def listen_close(self, network: Any, multiaddr: Any) -> None: ...
