"""A netlab home router that offers port mapping: miniupnpd (Debian's miniupnpd-nftables) in the router's namespace.

miniupnpd refuses to forward ports while its outside address is a private one, as every lab
address is, unless a STUN check says the router sits behind no filtering NAT. So the first public
host also runs a small STUN responder (RFC 5389 Binding, XOR-MAPPED-ADDRESS only) that answers
with the address each request came from: on the lab's bridge that is the router's own outside
address, which is what a router with a public address would learn. It offers NAT-PMP, UPnP IGD
or both; with UPnP on, miniupnpd also multicasts its SSDP notices, which stay on the home's own
link. The router's mappings live in their own nftables table.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

try:
    from scripts import netlab
except ImportError:  # run as `python scripts/netlab_portmap.py`
    import netlab  # type: ignore[no-redef]

STUN_PORT = 3478
READY_TIMEOUT_S = 20.0
_stun_running: set[str] = set()
"""Prefixes of labs whose first public host already runs the STUN responder."""

STUN_RESPONDER = """import socket, struct, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", int(sys.argv[1])))
COOKIE = 0x2112A442
while True:
    data, (ip, port) = sock.recvfrom(2048)
    if len(data) < 20 or data[:2] != b"\\x00\\x01":  # a Binding request only
        continue
    addr = struct.pack("!HHBBHI", 0x0020, 8, 0, 1, port ^ (COOKIE >> 16),
                       struct.unpack("!I", socket.inet_aton(ip))[0] ^ COOKIE)
    sock.sendto(struct.pack("!HH", 0x0101, len(addr)) + data[4:20] + addr, (ip, port))
"""

# miniupnpd adds its rules to the *_miniupnpd chains; the base chains only hook them in. The home's
# own NAT table (netlab_nat) still drops other inbound traffic and accepts what was DNATed.
RULESET = """table inet miniupnpd {
  chain forward { type filter hook forward priority filter; policy accept; jump forward_miniupnpd; }
  chain forward_miniupnpd { }
  chain prerouting { type nat hook prerouting priority dstnat; policy accept; jump prerouting_miniupnpd; }
  chain prerouting_miniupnpd { }
  chain postrouting { type nat hook postrouting priority srcnat; policy accept; jump postrouting_miniupnpd; }
  chain postrouting_miniupnpd { }
}
"""


def miniupnpd() -> str | None:
    """Its path: Debian puts it in /usr/sbin, which a non-login PATH may lack."""
    return shutil.which("miniupnpd") or shutil.which("miniupnpd", path="/usr/sbin:/usr/local/sbin")


def unavailable_reason() -> str | None:
    if miniupnpd() is None:
        return ("a NAT-PMP router needs miniupnpd on PATH; install Debian's miniupnpd-nftables "
                "(scripts/setup.sh does when run as root)")
    return None


PROTOCOLS = ("nat-pmp", "upnp")


def config(*, lan_subnet: str, stun_host: str, protocols: tuple[str, ...] = ("nat-pmp",)) -> str:
    unknown = set(protocols) - set(PROTOCOLS)
    if unknown or not protocols:
        raise ValueError(f"protocols {protocols!r}: choose from {PROTOCOLS}")
    return "\n".join([
        f"ext_ifname={netlab.HOST_LINK}",
        "listening_ip=lan0",
        f"enable_natpmp={'yes' if 'nat-pmp' in protocols else 'no'}",
        f"enable_upnp={'yes' if 'upnp' in protocols else 'no'}",
        "ext_perform_stun=yes",
        f"ext_stun_host={stun_host}",
        f"ext_stun_port={STUN_PORT}",
        "secure_mode=yes",
        "system_uptime=yes",
        "upnp_table_name=miniupnpd",
        "upnp_nat_table_name=miniupnpd",
        "upnp_forward_chain=forward_miniupnpd",
        "upnp_nat_chain=prerouting_miniupnpd",
        "upnp_nat_postrouting_chain=postrouting_miniupnpd",
        "uuid=8d3c8a52-6f1e-4c55-9a0e-5b0e2f6c1d01",
        f"allow 1024-65535 {lan_subnet} 1024-65535",
        "deny 0-65535 0.0.0.0/0 0-65535",
    ]) + "\n"


def offer_port_mapping(lab, host: str, work_dir: Path, protocols: tuple[str, ...] = ("nat-pmp",)) -> Path:
    """Run miniupnpd on the router of private host `host` (a netlab_nat.NatLab home); return its log file.

    Its config, pid file and log go in work_dir. It stops with the lab: every process in a lab
    namespace does.
    """
    reason = unavailable_reason()
    if reason:
        raise netlab.NetlabError(reason)
    home = lab.home_of(host)
    router = lab.host(home["router"])
    stun = lab.hosts[0]  # the first public host
    if lab.prefix not in _stun_running:
        lab.exec(stun.name, [sys.executable, "-c", STUN_RESPONDER, str(STUN_PORT)])
        _stun_running.add(lab.prefix)
    proc = subprocess.run(["ip", "netns", "exec", router.namespace, "nft", "-f", "-"], input=RULESET,
                          capture_output=True, text=True, timeout=netlab.IP_TIMEOUT_S)
    if proc.returncode != 0:
        raise netlab.NetlabError(f"nft refused miniupnpd's tables on {router.name}: {proc.stderr.strip()}")
    work_dir.mkdir(parents=True, exist_ok=True)
    base = work_dir / f"miniupnpd-{router.name}"
    conf = base.with_suffix(".conf")
    conf.write_text(config(lan_subnet=home["router_lan_address"].rsplit(".", 1)[0] + ".0/24", stun_host=stun.address,
                           protocols=protocols))
    log = base.with_suffix(".log")
    with log.open("w") as out:
        lab.exec(router.name, [miniupnpd(), "-f", str(conf), "-d", "-P", str(base.with_suffix(".pid"))],
                 stdout=out, stderr=out)
    deadline = time.monotonic() + READY_TIMEOUT_S
    ready = "Listening for NAT-PMP" if "nat-pmp" in protocols else "HTTP listening on port"
    while ready not in log.read_text():
        if time.monotonic() > deadline or "Port forwarding is impossible" in log.read_text():
            raise netlab.NetlabError(f"miniupnpd on {router.name} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    if "Port forwarding is now enabled" not in log.read_text():
        raise netlab.NetlabError(f"miniupnpd on {router.name} will not forward ports: {log.read_text()[-2000:]}")
    return log


def mappings(lab, host: str) -> str:
    """The router's current port-mapping rules for `host`, as nft lists them."""
    router = lab.host(lab.home_of(host)["router"])
    return netlab._run(["ip", "netns", "exec", router.namespace, "nft", "list", "chain", "inet", "miniupnpd",
                        "prerouting_miniupnpd"])
