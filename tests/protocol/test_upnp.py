"""UPnP IGD messages: the search, the router's description and SOAP, and every answer we refuse."""

import pytest

from protocol import upnp
from protocol.errors import DecodeError, OversizeError

GW = "192.168.1.1"


def search_answer(location: str = f"http://{GW}:5000/rootDesc.xml", status: str = "200 OK") -> bytes:
    return (f"HTTP/1.1 {status}\r\nCACHE-CONTROL: max-age=120\r\nST: {upnp.SEARCH_TARGET}\r\n"
            f"Location: {location}\r\nSERVER: Linux UPnP/1.1 MiniUPnPd/2.3.1\r\n\r\n").encode()


def description(services: str, url_base: str = "") -> bytes:
    base = f"<URLBase>{url_base}</URLBase>" if url_base else ""
    return (f'<?xml version="1.0"?><root xmlns="urn:schemas-upnp-org:device-1-0">{base}<device><deviceList>'
            f"<device><serviceList>{services}</serviceList></device></deviceList></device></root>").encode()


def service(kind: str, control: str) -> str:
    return f"<service><serviceType>{kind}</serviceType><controlURL>{control}</controlURL></service>"


WANIP2 = "urn:schemas-upnp-org:service:WANIPConnection:2"


def test_the_search_asks_the_gateway_for_an_internet_gateway_device():
    text = upnp.search_request(GW).decode()
    assert text.startswith("M-SEARCH * HTTP/1.1\r\n") and text.endswith("\r\n\r\n")
    assert f"HOST: {GW}:1900" in text and f"ST: {upnp.SEARCH_TARGET}" in text and 'MAN: "ssdp:discover"' in text


def test_the_search_answer_gives_the_description_url():
    assert upnp.parse_search_response(search_answer(), GW) == f"http://{GW}:5000/rootDesc.xml"


@pytest.mark.parametrize("data, why", [
    (search_answer(location="http://10.9.9.9:5000/rootDesc.xml"), "points away from the gateway"),
    (search_answer(location=f"https://{GW}/d.xml"), "not plain http"),
    (search_answer(location="http://router.local/d.xml"), "names no IPv4 address"),
    (search_answer(status="404 Not Found"), "not 'HTTP/1.1 200'"),
    (b"NOTIFY * HTTP/1.1\r\nLOCATION: x\r\n\r\n", "not 'HTTP/1.1 200'"),
    (b"HTTP/1.1 200 OK\r\nST: x\r\n\r\n", "no LOCATION"),
    ("HTTP/1.1 200 OK\r\nLOCATION: http://192.168.1.1/\u00e9\r\n\r\n".encode(), "not ASCII"),
])
def test_search_answers_that_would_send_us_elsewhere_are_refused(data, why):
    with pytest.raises(DecodeError, match=why):
        upnp.parse_search_response(data, GW)


def test_the_wan_connection_service_is_found_in_nested_devices():
    doc = description(service("urn:schemas-upnp-org:service:Layer3Forwarding:1", "/ctl/L3F")
                      + service(WANIP2, "/ctl/IPConn"))
    found = upnp.find_connection_service(doc, f"http://{GW}:5000/rootDesc.xml", GW)
    assert found == upnp.Service(service_type=WANIP2, control_url=f"http://{GW}:5000/ctl/IPConn")
    ppp = description(service("urn:schemas-upnp-org:service:WANPPPConnection:1", "ctl/PPP"), url_base=f"http://{GW}:80/")
    assert upnp.find_connection_service(ppp, f"http://{GW}:5000/d.xml", GW).control_url == f"http://{GW}:80/ctl/PPP"


@pytest.mark.parametrize("doc, error, why", [
    (description(service(WANIP2, "http://10.9.9.9/ctl")), DecodeError, "points away from the gateway"),
    (description(service(WANIP2, "/ctl"), url_base="http://10.9.9.9/"), DecodeError, "points away"),
    (description(service("urn:schemas-upnp-org:service:Layer3Forwarding:1", "/x")), DecodeError, "no WANIPConnection"),
    (b"<root><unclosed></root>", DecodeError, "not XML"),
    (b'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY a "aaaa">]><root>&a;</root>', DecodeError, "DTD or entities"),
    (b"<root>" + b" " * upnp.MAX_DOCUMENT_BYTES + b"</root>", OversizeError, "over 65536"),
])
def test_descriptions_that_are_malformed_or_point_elsewhere_are_refused(doc, error, why):
    with pytest.raises(error, match=why):
        upnp.find_connection_service(doc, f"http://{GW}:5000/rootDesc.xml", GW)


def test_a_soap_call_names_its_action_and_escapes_its_arguments():
    headers, body = upnp.soap_request(upnp.Service(WANIP2, f"http://{GW}/ctl"), "AddPortMapping",
                                      {"NewExternalPort": 4001, "NewPortMappingDescription": "a<b&c"})
    assert headers["SOAPAction"] == f'"{WANIP2}#AddPortMapping"'
    text = body.decode()
    assert f'<u:AddPortMapping xmlns:u="{WANIP2}"><NewExternalPort>4001</NewExternalPort>' in text
    assert "<NewPortMappingDescription>a&lt;b&amp;c</NewPortMappingDescription>" in text


def envelope(inner: str) -> bytes:
    return (f'<?xml version="1.0"?><s:Envelope xmlns:s="http://schemas.xmlsoap.org/soap/envelope/">'
            f"<s:Body>{inner}</s:Body></s:Envelope>").encode()


def test_soap_answers_give_their_out_arguments():
    body = envelope(f'<u:GetExternalIPAddressResponse xmlns:u="{WANIP2}">'
                    "<NewExternalIPAddress>203.0.113.9</NewExternalIPAddress></u:GetExternalIPAddressResponse>")
    out = upnp.parse_soap_response(200, body, "GetExternalIPAddress")
    assert upnp.external_address(out) == "203.0.113.9"


def test_a_soap_fault_says_what_the_router_meant():
    fault = envelope('<s:Fault><faultcode>s:Client</faultcode><faultstring>UPnPError</faultstring><detail>'
                     '<UPnPError xmlns="urn:schemas-upnp-org:control-1-0"><errorCode>718</errorCode>'
                     "<errorDescription>ConflictInMappingEntry</errorDescription></UPnPError></detail></s:Fault>")
    with pytest.raises(upnp.UpnpFault, match=r"UPnP error 718 \(the external port is mapped to another host") as caught:
        upnp.parse_soap_response(500, fault, "AddPortMapping")
    assert caught.value.code == 718


@pytest.mark.parametrize("status, body, why", [
    (200, envelope('<u:SomethingElseResponse xmlns:u="x"/>'), "without a AddPortMappingResponse"),
    (500, envelope("<nothing/>"), "HTTP 500"),
    (500, envelope("<UPnPError><errorCode>x</errorCode></UPnPError>"), "without a numeric errorCode"),
])
def test_unexpected_soap_answers_are_refused(status, body, why):
    with pytest.raises(DecodeError, match=why):
        upnp.parse_soap_response(status, body, "AddPortMapping")


@pytest.mark.parametrize("value", ["", "not-an-ip", "::1"])
def test_a_bad_external_address_is_refused(value):
    with pytest.raises(DecodeError, match="GetExternalIPAddress gave"):
        upnp.external_address({"NewExternalIPAddress": value})


def test_no_external_address_yet_is_a_refusal():
    with pytest.raises(upnp.UpnpFault):
        upnp.external_address({"NewExternalIPAddress": "0.0.0.0"})
