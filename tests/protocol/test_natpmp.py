"""NAT-PMP messages (RFC 6886): the bytes we send, and every answer we refuse."""

import struct

import pytest

from protocol import natpmp
from protocol.errors import DecodeError


def address_answer(*, result: int = 0, epoch: int = 100, ip: bytes = bytes([203, 0, 113, 9]), op: int = 128) -> bytes:
    return struct.pack("!BBHI", 0, op, result, epoch) + ip


def mapping_answer(*, internal: int = 4001, external: int = 4001, lifetime: int = 3600, result: int = 0,
                   op: int = 130, epoch: int = 100) -> bytes:
    return struct.pack("!BBHIHHI", 0, op, result, epoch, internal, external, lifetime)


def test_requests_are_the_rfcs_bytes():
    assert natpmp.external_address_request() == b"\x00\x00"
    assert natpmp.map_request(4001, external_port=4001, lifetime_s=7200) == \
        bytes([0, 2, 0, 0, 0x0F, 0xA1, 0x0F, 0xA1, 0, 0, 0x1C, 0x20])
    assert natpmp.map_request(4001, lifetime_s=0)[1] == natpmp.OP_MAP_TCP  # a deletion
    assert natpmp.map_request(4001, tcp=False)[1] == natpmp.OP_MAP_UDP
    for bad in (dict(internal_port=0), dict(internal_port=70000), dict(internal_port=1, external_port=-1),
                dict(internal_port=1, lifetime_s=2**32)):
        with pytest.raises(ValueError):
            natpmp.map_request(**bad)


def test_answers_parse():
    assert natpmp.parse_external_address(address_answer()) == natpmp.ExternalAddress(epoch_s=100, address="203.0.113.9")
    assert natpmp.parse_mapping(mapping_answer(external=40001, lifetime=1800), internal_port=4001) == \
        natpmp.Mapping(epoch_s=100, internal_port=4001, external_port=40001, lifetime_s=1800)
    # A deletion's answer has no external port.
    assert natpmp.parse_mapping(mapping_answer(external=0, lifetime=0), internal_port=4001).lifetime_s == 0


@pytest.mark.parametrize("code", [1, 2, 3, 4, 5, 77])
def test_a_refusal_says_what_the_router_meant(code):
    with pytest.raises(natpmp.NatPmpRefused) as caught:
        natpmp.parse_mapping(mapping_answer(result=code), internal_port=4001)
    assert caught.value.code == code
    assert ("turned off" in str(caught.value)) == (code == 2)
    assert str(code) in str(caught.value) or code in natpmp.RESULTS


def test_no_public_address_is_a_refusal_not_an_address():
    with pytest.raises(natpmp.NatPmpRefused, match="no public address"):
        natpmp.parse_external_address(address_answer(ip=bytes(4)))


@pytest.mark.parametrize("data, why", [
    (b"", "under its 4-byte header"),
    (b"\x00\x80\x00", "under its 4-byte header"),
    (address_answer()[:11], "not 12"),
    (address_answer() + b"\x00", "not 12"),
    (b"\x02" + address_answer()[1:], "version 2"),
    (address_answer(op=130), "opcode 130, not the answer to opcode 0"),
    (address_answer(op=0), "opcode 0, not the answer"),  # our own request echoed back
])
def test_malformed_address_answers_are_refused(data, why):
    with pytest.raises(DecodeError, match=why):
        natpmp.parse_external_address(data)


@pytest.mark.parametrize("data, why", [
    (mapping_answer()[:15], "not 16"),
    (mapping_answer(op=129), "opcode 129, not the answer to opcode 2"),  # a UDP mapping's answer to our TCP ask
    (mapping_answer(internal=4002), "internal port 4002, not 4001"),  # an answer about another mapping
    (mapping_answer(external=0, lifetime=60), "external port 0"),
])
def test_malformed_mapping_answers_are_refused(data, why):
    with pytest.raises(DecodeError, match=why):
        natpmp.parse_mapping(data, internal_port=4001)


def test_an_epoch_that_lags_our_clock_means_the_router_restarted():
    # 100 s of our time: the router's epoch must advance by at least 7/8 of that, less 2 s of slack.
    assert not natpmp.epoch_went_back(1000, 0.0, 1100, 100.0)
    assert not natpmp.epoch_went_back(1000, 0.0, 1086, 100.0)
    assert natpmp.epoch_went_back(1000, 0.0, 1080, 100.0)
    assert natpmp.epoch_went_back(1000, 0.0, 5, 100.0)  # rebooted: counting from 0 again
