"""Terminal tables for `shoal status` and `shoal peers`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:8]}…{peer_id[-6:]}"


def print_status(data: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    peers = data.get("peers", {})
    table.add_row("peer id", data["peer_id"])
    table.add_row("version", data.get("version", "?"))
    table.add_row("uptime", f"{data.get('uptime_s', 0):.0f} s")
    table.add_row("addresses", "\n".join(data.get("addrs", [])) or "(none announced)")
    table.add_row("control API", data.get("control_url", ""))
    if data.get("reachability"):
        r = data["reachability"]
        table.add_row("reachability", f"{r['status']} ({r['reason']})"
                      + (f"\nrelays: {len(r['relay_addrs'])}" if r.get("relay_addrs") else "")
                      + ("\nserving as a relay" if r.get("relaying") else ""))
    table.add_row("roles", ", ".join(data.get("roles", [])))
    table.add_row("peers", f"{peers.get('alive', 0)} alive, {peers.get('suspect', 0)} suspect, "
                           f"{peers.get('dead', 0)} dead; {data.get('connected_peers', 0)} connected")
    if data.get("banned_peers"):
        table.add_row("banned", "\n".join(data["banned_peers"]))
    b = data.get("bytes", {})
    table.add_row("traffic", f"{b.get('sent', 0):,} B sent, {b.get('received', 0):,} B received")
    dropped = data.get("messages", {}).get("dropped", {})
    if dropped:
        table.add_row("dropped", ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items())))
    for key in ("shardcast", "task"):
        if data.get(key):
            section = data[key]
            table.add_row(key, ", ".join(f"{k}: {v}" for k, v in section.items() if not isinstance(v, (dict, list)))
                          if isinstance(section, dict) else str(section))
    console.print(table)


def print_peers(data: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"peers of {_short(data['peer_id'])}")
    for column in ("peer", "state", "address", "hardware", "last seen", "score", "status"):
        table.add_column(column)
    style = {"alive": "green", "suspect": "yellow", "dead": "red"}
    for p in data["peers"]:
        hwinfo = p["hardware"]
        devices = ", ".join(hwinfo["devices"]) or "-"
        table.add_row(_short(p["peer_id"]), f"[{style.get(p['state'], '')}]{p['state']}[/]"
                      + ("" if p["connected"] else " (not connected)"),
                      (p["addrs"][0].split("/p2p/")[0] if p["addrs"] else "-"),
                      f"{devices}; {_gib(hwinfo['memory_bytes'])}; {hwinfo['tflops']:.2f} TFLOP/s",
                      f"{p['last_seen_s']:.1f} s ago", f"{p['score']:.0f}", p.get("status", ""))
    if not data["peers"]:
        console.print("no peers yet")
    else:
        console.print(table)
