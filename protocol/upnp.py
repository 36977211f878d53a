"""UPnP Internet Gateway Device port mapping, sans-IO: the search, the device description and SOAP.

A client asks its gateway directly (a unicast M-SEARCH to its UDP port 1900, as UPnP Device
Architecture 1.1 allows; nothing is multicast), reads the LOCATION of the router's description,
finds its WANIPConnection (or WANPPPConnection) service there and calls that service's actions
over SOAP: GetExternalIPAddress, AddPortMapping, GetSpecificPortMappingEntry, DeletePortMapping.

The router is a device on the LAN, not a peer, but its answers are still bounded and checked:
every URL must point back at the gateway's own address over plain http (so an answer cannot send
us to another host), documents are capped in size, and a SOAP fault is raised with its UPnP error
code and description.
"""

from __future__ import annotations

import ipaddress
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from protocol.errors import DecodeError, OversizeError, RemoteProtocolError

SSDP_PORT = 1900
SEARCH_MX_S = 1
SEARCH_TARGET = "urn:schemas-upnp-org:device:InternetGatewayDevice:1"
"""IGD:1; routers that implement IGD:2 answer it too."""
CONNECTION_SERVICES = ("urn:schemas-upnp-org:service:WANIPConnection:",
                       "urn:schemas-upnp-org:service:WANPPPConnection:")
MAX_DOCUMENT_BYTES = 64 * 1024
ERRORS = {
    402: "invalid arguments",
    501: "the action failed on the router",
    606: "not authorized (the router refuses mappings from this host)",
    714: "no such mapping",
    718: "the external port is mapped to another host already",
    724: "the router needs the external and internal ports to be the same",
    725: "the router supports only permanent mappings",
    728: "the router has no mappings left",
    729: "the router refuses this external port",
}


class UpnpFault(RemoteProtocolError):
    """The router answered an action with a SOAP fault."""

    def __init__(self, code: int, description: str):
        self.code = code
        meaning = ERRORS.get(code, description or "no description")
        super().__init__(f"the router refused: UPnP error {code} ({meaning})")


@dataclass(frozen=True, slots=True)
class Service:
    service_type: str
    control_url: str


def search_request(gateway: str) -> bytes:
    return (f"M-SEARCH * HTTP/1.1\r\nHOST: {gateway}:{SSDP_PORT}\r\nMAN: \"ssdp:discover\"\r\nMX: {SEARCH_MX_S}\r\n"
            f"ST: {SEARCH_TARGET}\r\n\r\n").encode()


def _same_host(url: str, gateway: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise DecodeError(f"UPnP URL {url[:120]!r} is not plain http")
    try:
        host = ipaddress.IPv4Address(parts.hostname)
    except ValueError:
        raise DecodeError(f"UPnP URL {url[:120]!r} names no IPv4 address") from None
    if str(host) != gateway:
        raise DecodeError(f"UPnP URL {url[:120]!r} points away from the gateway {gateway}")
    return url


def parse_search_response(data: bytes, gateway: str) -> str:
    """The LOCATION of the gateway's description, from its answer to our M-SEARCH."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise DecodeError("SSDP answer is not ASCII") from None
    lines = text.split("\r\n")
    if not lines[0].startswith("HTTP/1.") or lines[0].split()[1:2] != ["200"]:
        raise DecodeError(f"SSDP answer starts {lines[0][:40]!r}, not 'HTTP/1.1 200'")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    if "location" not in headers:
        raise DecodeError("SSDP answer has no LOCATION")
    return _same_host(headers["location"], gateway)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _parse_xml(body: bytes, what: str) -> ET.Element:
    if len(body) > MAX_DOCUMENT_BYTES:
        raise OversizeError(f"UPnP {what} of {len(body)} bytes, over {MAX_DOCUMENT_BYTES}")
    if b"<!DOCTYPE" in body or b"<!ENTITY" in body:
        raise DecodeError(f"UPnP {what} declares a DTD or entities; refused")
    try:
        return ET.fromstring(body)
    except ET.ParseError as exc:
        raise DecodeError(f"UPnP {what} is not XML: {exc}") from None


def find_connection_service(description: bytes, location: str, gateway: str) -> Service:
    """The WAN connection service that takes port mappings, from the router's device description."""
    root = _parse_xml(description, "device description")
    base = next((e.text.strip() for e in root.iter() if _local(e.tag) == "URLBase" and e.text), location)
    for service in (e for e in root.iter() if _local(e.tag) == "service"):
        fields = {_local(child.tag): (child.text or "").strip() for child in service}
        kind = fields.get("serviceType", "")
        if kind.startswith(CONNECTION_SERVICES) and fields.get("controlURL"):
            return Service(service_type=kind, control_url=_same_host(urljoin(base, fields["controlURL"]), gateway))
    raise DecodeError("the router's description lists no WANIPConnection or WANPPPConnection service")


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def soap_request(service: Service, action: str, args: dict[str, str | int]) -> tuple[dict[str, str], bytes]:
    """Headers and body of one SOAP call."""
    fields = "".join(f"<{k}>{_escape(str(v))}</{k}>" for k, v in args.items())
    body = ('<?xml version="1.0"?>\r\n<s:Envelope xmlns:s="http://schemas.xmlsoap.org/soap/envelope/" '
            's:encodingStyle="http://schemas.xmlsoap.org/soap/encoding/"><s:Body>'
            f'<u:{action} xmlns:u="{service.service_type}">{fields}</u:{action}></s:Body></s:Envelope>\r\n')
    headers = {"Content-Type": 'text/xml; charset="utf-8"', "SOAPAction": f'"{service.service_type}#{action}"'}
    return headers, body.encode()


def parse_soap_response(status: int, body: bytes, action: str) -> dict[str, str]:
    """The action's out-arguments; UpnpFault for a SOAP fault, DecodeError for anything else unexpected."""
    root = _parse_xml(body, f"{action} answer")
    fault = next((e for e in root.iter() if _local(e.tag) == "UPnPError"), None)
    if fault is not None:
        fields = {_local(c.tag): (c.text or "").strip() for c in fault}
        try:
            code = int(fields.get("errorCode", ""))
        except ValueError:
            raise DecodeError(f"UPnP fault to {action} without a numeric errorCode") from None
        raise UpnpFault(code, fields.get("errorDescription", ""))
    reply = next((e for e in root.iter() if _local(e.tag) == f"{action}Response"), None)
    if status != 200 or reply is None:
        raise DecodeError(f"UPnP answer to {action}: HTTP {status} without a {action}Response")
    return {_local(c.tag): (c.text or "").strip() for c in reply}


def external_address(out: dict[str, str]) -> str:
    try:
        address = ipaddress.IPv4Address(out.get("NewExternalIPAddress", ""))
    except ValueError:
        raise DecodeError(f"GetExternalIPAddress gave {out.get('NewExternalIPAddress', '')[:40]!r}") from None
    if address.is_unspecified:
        raise UpnpFault(501, "no external address")
    return str(address)
