"""Netlab homes: private hosts behind nftables NAT routers (full cone, port-restricted or symmetric) on a netlab bridge."""

# Standard library only, like netlab.py, which it builds on: the bridge is the lab's "internet",
# each home's router is an ordinary netlab host there, and the private host sits behind it on
# its own veth. Every address is inside the lab's namespaces.
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager

try:
    from scripts import netlab
except ImportError:  # run as `python scripts/netlab_nat.py`
    import netlab  # type: ignore[no-redef]

NAT_KINDS = ("full_cone", "port_restricted", "symmetric")
"""full_cone: endpoint-independent mapping and filtering (RFC 4787 EIM + EIF); port_restricted: EIM with
address-and-port-dependent filtering (Linux conntrack's own, most home routers); symmetric: a fresh random
public port for every connection (endpoint-dependent mapping), filtered like port_restricted."""

LAN_LINK = "lan0"
MAPPING_TIMEOUT_S = 120
"""How long a full-cone mapping stays open to anyone after the private host last sent from that port."""


def nat_unavailable_reason() -> str | None:
    reason = netlab.unavailable_reason()
    if reason is None and shutil.which("nft") is None:
        reason = "netlab NAT needs nft on PATH; install nftables (scripts/setup.sh does when run as root)"
    return reason


def nft_ruleset(kind: str, *, lan_address: str) -> str:
    """The router's whole ruleset: masquerade out of eth0, drop unsolicited inbound without a reset."""
    if kind not in NAT_KINDS:
        raise ValueError(f"NAT kind {kind!r}: choose from {', '.join(NAT_KINDS)}")
    wan = netlab.HOST_LINK
    # Linux keeps the inside port when it is free (one host per home: always), which is what makes
    # the mapping endpoint-independent; `random` draws a new port for every connection instead.
    masquerade = "masquerade random" if kind == "symmetric" else "masquerade"
    full_cone = kind == "full_cone"
    return "\n".join([
        "table ip shoalnat {",
        f"  set mapped {{ type inet_service; flags dynamic,timeout; timeout {MAPPING_TIMEOUT_S}s; }}",
        "  chain pre {",
        "    type nat hook prerouting priority dstnat; policy accept;",
        # A new inbound connection to a port the host has sent from goes to the host: full cone.
        f"    iifname \"{wan}\" tcp dport @mapped dnat to {lan_address}" if full_cone else "",
        "  }",
        "  chain post {",
        "    type nat hook postrouting priority srcnat; policy accept;",
        f"    oifname \"{wan}\" {masquerade}",
        "  }",
        "  chain remember {",
        # After srcnat the header carries the public port: that port is now mapped.
        "    type filter hook postrouting priority srcnat + 10; policy accept;",
        f"    oifname \"{wan}\" meta l4proto tcp update @mapped {{ tcp sport }}" if full_cone else "",
        "  }",
        "  chain forward_filter {",
        "    type filter hook forward priority filter; policy drop;",
        f"    iifname \"{LAN_LINK}\" accept",
        "    ct state established,related accept",
        "    ct status dnat accept",
        "  }",
        "  chain input_filter {",
        # Dropping (not rejecting) matters: a reset would abort the peer's half of a hole punch.
        "    type filter hook input priority filter; policy accept;",
        f"    iifname \"{wan}\" ct state established,related accept",
        f"    iifname \"{wan}\" drop",
        "  }",
        "}",
    ]) + "\n"


class NatLab(netlab.Lab):
    """Public hosts on the bridge plus homes: a router on the bridge and one private host behind it.

    `hosts` lists the public hosts first, then the private ones (named p0, p1, ...), so a Swarm of
    len(hosts) nodes runs one node on each; routers are in `routers` and run no nodes.
    """

    def __init__(self, state: dict) -> None:
        super().__init__(state)
        self.homes: list[dict] = state.get("homes", [])
        self.routers = [h for h in self.hosts if h.name in {home["router"] for home in self.homes}]
        self.hosts = [h for h in self.hosts if h not in self.routers]

    @classmethod
    def create_homes(cls, num_public: int, nat_kinds: list[str], *, rate: str | int | None = None,
                     owner_pid: int | None = None) -> NatLab:
        for kind in nat_kinds:
            nft_ruleset(kind, lan_address="0.0.0.0")  # refuse a bad kind before building anything
        base = netlab.Lab.create(num_public + len(nat_kinds), rate=rate, owner_pid=owner_pid)
        state = base._state
        try:
            octet = int(base.subnet.split(".")[2])
            for k, kind in enumerate(nat_kinds):
                router = state["hosts"][num_public + k]
                lan = f"10.214.{(octet * 8 + k) % 250 + 1}"
                home = {"kind": kind, "router": router["name"], "host": f"p{k}",
                        "router_lan_address": f"{lan}.1", "public_address": router["address"]}
                host = {"name": f"p{k}", "namespace": f"{base.prefix}-p{k}", "address": f"{lan}.2",
                        "bridge_port": ""}
                _build_home(router["namespace"], host["namespace"], home, host["address"])
                state["hosts"].append(host)
                state["rates"][host["name"]] = {"up_bits": None, "down_bits": None}
                state.setdefault("homes", []).append(home)
                base._save()
        except BaseException:
            base.destroy()
            raise
        return cls(state)

    @classmethod
    def attach(cls, prefix: str) -> NatLab:
        lab = netlab.Lab.attach(prefix)
        return cls(lab._state)

    def home_of(self, host: str) -> dict:
        for home in self.homes:
            if home["host"] == host:
                return home
        raise ValueError(f"{host!r} is not a private host; private hosts are {[h['host'] for h in self.homes]}")

    def flush_mappings(self, host: str) -> None:
        """Forget every NAT mapping of a private host's router (conntrack and the full-cone set)."""
        router = self.host(self.home_of(host)["router"]).namespace
        netlab._run(["ip", "netns", "exec", router, "nft", "flush", "set", "ip", "shoalnat", "mapped"])
        # conntrack(8) is optional; without it, entries age out on their own.
        if shutil.which("conntrack"):
            netlab._run(["ip", "netns", "exec", router, "conntrack", "-F"], check=False)

    def host(self, name: str) -> netlab.Host:
        for host in [*self.hosts, *self.routers]:
            if host.name == name:
                return host
        raise ValueError(f"no host {name!r} in lab {self.prefix}")

    def cut(self, host: str) -> None:
        super().cut(self._bridge_side(host))

    def heal(self, host: str) -> None:
        super().heal(self._bridge_side(host))

    def _bridge_side(self, host: str) -> str:
        """Cutting a private host cuts its router off the bridge."""
        return next((home["router"] for home in self.homes if home["host"] == host), host)


def _build_home(router_ns: str, host_ns: str, home: dict, host_address: str) -> None:
    run = netlab._run
    run(["ip", "netns", "add", host_ns])
    run(["ip", "-n", host_ns, "link", "set", "lo", "up"])
    run(["ip", "-n", host_ns, "link", "add", netlab.HOST_LINK, "type", "veth", "peer", "name", LAN_LINK,
         "netns", router_ns])
    run(["ip", "-n", host_ns, "addr", "add", f"{host_address}/24", "dev", netlab.HOST_LINK])
    run(["ip", "-n", router_ns, "addr", "add", f"{home['router_lan_address']}/24", "dev", LAN_LINK])
    run(["ip", "-n", router_ns, "link", "set", LAN_LINK, "up"])
    run(["ip", "-n", host_ns, "link", "set", netlab.HOST_LINK, "up"])
    run(["ip", "-n", host_ns, "route", "add", "default", "via", home["router_lan_address"]])
    run(["ip", "netns", "exec", router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    ruleset = nft_ruleset(home["kind"], lan_address=host_address)
    proc = subprocess.run(["ip", "netns", "exec", router_ns, "nft", "-f", "-"], input=ruleset,
                          capture_output=True, text=True, timeout=netlab.IP_TIMEOUT_S)
    if proc.returncode != 0:
        raise netlab.NetlabError(f"nft refused the {home['kind']} ruleset: {proc.stderr.strip()}")


@contextmanager
def open_nat_lab(num_public: int, nat_kinds: list[str], *, rate: str | int | None = None):
    """A NatLab removed on exit, however the block ends."""
    lab = NatLab.create_homes(num_public, nat_kinds, rate=rate)
    try:
        yield lab
    finally:
        lab.destroy()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netlab_nat.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build public hosts and NAT'd homes, print them, leave them up "
                                   "(remove with netlab.py down --prefix P)")
    up.add_argument("--public", type=int, default=1)
    up.add_argument("--home", action="append", choices=NAT_KINDS, default=[],
                    help="one private host behind a NAT of this kind (repeatable)")
    up.add_argument("--rate")
    up.add_argument("--owner-pid", type=int)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if (reason := nat_unavailable_reason()) is not None:
        print(f"netlab_nat: {reason}", file=sys.stderr)
        return 2
    try:
        lab = NatLab.create_homes(args.public, args.home, rate=args.rate, owner_pid=args.owner_pid or os.getppid())
    except (ValueError, netlab.NetlabError) as exc:
        print(f"netlab_nat: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"prefix": lab.prefix, "public": {h.name: h.address for h in lab.hosts if not h.bridge_port == ""},
                      "homes": lab.homes, "private": {h.name: h.address for h in lab.hosts if h.bridge_port == ""}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
