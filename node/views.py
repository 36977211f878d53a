"""Terminal tables for `shoal status`, `shoal peers`, `shoal task list` and `shoal task show`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:8]}…{peer_id[-6:]}"


def hardware_line(report: dict) -> str:
    """One line from a `shoal hw --json` report: devices, cores, memory, best measured TFLOP/s."""
    cpu, ram = report.get("cpu", {}), report.get("ram", {})
    gpus = [f"{g['name']} ({_gib(g['memory_total_bytes'])})" for g in report.get("gpus", [])]
    best = [b for b in report.get("benchmarks", []) if not b.get("error")]
    rate = max(best, key=lambda b: b["tflops"], default=None)
    parts = [", ".join(gpus) or "no GPU", f"{cpu.get('usable_cores', '?')} of {cpu.get('logical_cores', '?')} cores",
             f"{_gib(ram.get('total_bytes', 0))} RAM"]
    if rate is not None:
        sure = f" ±{rate['spread'] * 100:.0f}%" if rate.get("spread") is not None else ""
        parts.append(f"{rate['tflops']:.3g} TFLOP/s{sure} ({rate['device']} {rate['dtype']})")
    else:
        parts.append("not benchmarked")
    return "; ".join(parts)


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
                      + ("\nserving as a relay" if r.get("relaying") else "")
                      + (f"\nport mapping: {r['port_mapping'].get('summary')}" if r.get("port_mapping") else ""))
    table.add_row("roles", ", ".join(data.get("roles", [])))
    if data.get("hardware"):
        table.add_row("hardware", hardware_line(data["hardware"]))
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
                      f"{devices}; {_gib(hwinfo['memory_bytes'])}; "
                      + (f"{hwinfo['tflops']:.3g} TFLOP/s" if hwinfo["tflops"] > 0 else "TFLOP/s not measured"),
                      f"{p['last_seen_s']:.1f} s ago", f"{p['score']:.0f}", p.get("status", ""))
    if not data["peers"]:
        console.print("no peers yet")
    else:
        console.print(table)


def _loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def print_task_list(data: dict, console: Console | None = None) -> None:
    console = console or Console()
    if not data["tasks"]:
        console.print("no tasks")
        return
    table = Table()
    for column in ("task", "name", "decision", "phase", "round", "members", "eval loss"):
        table.add_column(column, no_wrap=column != "phase")
    for t in data["tasks"]:
        table.add_row(t["id"][:16], t["name"], t["decision"], t.get("phase", "") or t.get("reason", ""),
                      f"{t.get('round', '-')}/{t.get('rounds', '-')}", str(len(t.get("members", []))),
                      _loss(t.get("eval_loss")))
    console.print(table)


def _flatten(prefix: str, value, out: list[tuple[str, str]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out.append((prefix, str(value)))


def print_task(t: dict, console: Console | None = None) -> None:
    """`shoal task show`: the task's state, its members, one row per closed round, and its spec."""
    console = console or Console()
    head = Table(show_header=False, box=None, title=f"task {t['id'][:16]}", title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("name", t["name"])
    head.add_row("initiator", t["initiator"])
    head.add_row("decision", t["decision"] + (f" ({t['reason']})" if t.get("reason") else ""))
    if t["decision"] == "joined":
        head.add_row("phase", t.get("phase", "") + (f" ({t['detail']})" if t.get("detail") else ""))
        head.add_row("round", f"{t.get('round', '-')} of {t.get('rounds', '-')}")
        head.add_row("eval loss", _loss(t.get("eval_loss")))
        head.add_row("weights", str(t.get("weights_hash") or "-"))
        b = t.get("bytes", {})
        head.add_row("task bytes", f"{b.get('sent', 0):,} sent, {b.get('received', 0):,} received")
        train_s, round_s = t.get("train_seconds", 0.0), t.get("round_seconds", 0.0)
        share = f" ({100 * train_s / round_s:.0f}% of round time training)" if round_s else ""
        head.add_row("time", f"{train_s:.1f} s training, {round_s:.1f} s in rounds{share}")
        dropped = t.get("dropped", {})
        head.add_row("rejected", ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items())) or "none")
        screened, applied = t.get("screened") or {}, t.get("screened_applied") or {}
        parts = [", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + note for counts, note in (
            (applied, " (slices left out of the applied aggregates, charged alike on every node)"),
            (screened, " left out by this node's aggregations")) if counts]
        if parts:
            head.add_row("screened out", "; ".join(parts))
        checks = t.get("training_checks") or {}
        if checks.get("enabled"):
            head.add_row("training checks", ", ".join(f"{k}: {checks.get(k, 0)}" for k in (
                "passed", "untrained", "confirmed", "refuted", "unjudged")) + f" ({checks.get('seconds', 0):.1f} s)")
        for f in checks.get("findings", [])[-5:]:
            if f.get("copy_of"):
                head.add_row("copied update", f"round {f['round']} by {f['producer']}: a copy of {f['copy_of']}'s "
                             f"(fits their batches {-f['advantage']:.4f} better than its own; "
                             f"found by {f['found_by']})")
            else:
                head.add_row("untrained update", f"round {f['round']} by {f['producer']}: its own batches' loss "
                             f"{-f['gain']:+.4f} after it (found by {f['found_by']})")
        errors = t.get("receipt_errors", 0)
        head.add_row("receipts", f"{t.get('receipts', 0)} sealed (`shoal ledger {t['id'][:12]}` lists them)"
                     + (f"; {errors} round(s) not written (see the log)" if errors else ""))
        if t.get("banned"):
            head.add_row("banned", "\n".join(t["banned"]))
        if t.get("not_waited"):
            head.add_row("not waited for", "\n".join(f"{p} (sent nothing in round {r})"
                                                      for p, r in t["not_waited"].items()))
        for f in t.get("forgeries", []):
            head.add_row("forged aggregate", f"round {f['round']} slice {f['slice']} by {f['aggregator']}: announced "
                         f"{f['announced'][:16]}, its inputs give {f['recomputed'][:16]}"
                         + ("" if f.get("found_here") else " (a peer's proof, recomputed here)"))
        head.add_row("members", "\n".join(t.get("members", [])) or "-")
    console.print(head)
    peers = t.get("peers", [])
    if peers:
        table = Table(title="nodes (as each last announced itself)", title_justify="left")
        for column in ("peer", "member", "round", "eval loss", "training share"):
            table.add_column(column)
        for p in peers:
            share = "-" if p.get("train_share") is None else f"{100 * p['train_share']:.0f}%"
            table.add_row(p["peer_id"] + (" (this node)" if p.get("self") else ""), "yes" if p.get("member") else "no",
                          str("-" if p.get("round") is None else p["round"]), _loss(p.get("eval_loss")), share)
        console.print(table)
    rounds = t.get("agreement", [])
    if rounds:
        table = Table(title="rounds", title_justify="left")
        for column in ("round", "agreed", "peers agreeing", "members", "eval loss", "train s", "round s", "weights"):
            table.add_column(column)
        for a in rounds:
            agreed = "caught up" if a.get("caught_up") else "[green]yes[/]" if a.get("agreed") else "[red]no[/]"
            table.add_row(str(a["round"]), agreed, str(a.get("peers_agreeing") or "-"), str(a.get("members", "-")),
                          _loss(a.get("eval_loss")), f"{a.get('train_s', 0):.1f}", f"{a.get('round_s', 0):.1f}",
                          a.get("weights_hash", ""))
        console.print(table)
    if t.get("spec"):
        spec = Table(title="spec", title_justify="left", show_header=False)
        spec.add_column(style="bold")
        spec.add_column()
        rows: list[tuple[str, str]] = []
        _flatten("", t["spec"], rows)
        for k, v in rows:
            spec.add_row(k, v)
        console.print(spec)
