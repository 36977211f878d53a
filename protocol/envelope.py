"""Signed envelopes: a message, the signer's public key, and an Ed25519 signature over both.

Every gossip message and every manifest travels sealed, so that it can be relayed, stored and
checked later by anyone, independent of the libp2p connection it arrived on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, decode, encode, message
from protocol.errors import DecodeError
from protocol.keys import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Keypair, peer_id_from_public_key, verify

_DOMAIN = b"shoal/envelope/v1\0"
M = TypeVar("M")


@message(tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    signer: bytes
    payload: bytes
    signature: bytes

    def __post_init__(self) -> None:
        if len(self.signer) != PUBLIC_KEY_BYTES:
            raise ValueError("signer must be a 32-byte Ed25519 public key")
        if len(self.signature) != SIGNATURE_BYTES:
            raise ValueError("signature must be 64 bytes")


@dataclass(frozen=True, slots=True)
class Signed:
    """A verified message and who signed it."""

    signer: str
    message: Any
    payload: bytes


def seal(msg: Any, key: Keypair) -> bytes:
    """Encode ``msg`` and wrap it in an envelope signed by ``key``."""
    payload = encode(msg)
    return encode(Envelope(signer=key.public_key, payload=payload, signature=key.sign(_DOMAIN + payload)))


def open_sealed(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                expect: type[M] | tuple[type, ...] | None = None) -> Signed:
    """Decode and verify an envelope; raises DecodeError, OversizeError or SignatureError."""
    env = decode(data, max_bytes=max_bytes, expect=Envelope)
    verify(env.signer, env.signature, _DOMAIN + env.payload)
    inner = decode(env.payload, max_bytes=max_bytes, expect=expect)
    if isinstance(inner, Envelope):
        raise DecodeError("nested envelopes are not allowed")
    return Signed(signer=peer_id_from_public_key(env.signer), message=inner, payload=env.payload)
