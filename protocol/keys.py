"""Ed25519 keys, libp2p-compatible peer ids, and signatures (no I/O: seeds come from the caller)."""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from protocol.errors import DecodeError, SignatureError

SEED_BYTES = 32
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64

# libp2p's PublicKey protobuf: field 1 (KeyType) = 1 (Ed25519), field 2 (Data) = 32 bytes.
_PROTOBUF_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
# Multihash "identity" code 0x00, length 36: small keys are inlined in the peer id.
_MULTIHASH_PREFIX = bytes([0x00, 0x24])
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    n = 0
    for c in text:
        if c not in _B58_INDEX:
            raise DecodeError(f"invalid base58 character {c!r}")
        n = n * 58 + _B58_INDEX[c]
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\0" * pad + body


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id ("12D3KooW...") of an Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise DecodeError(f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, not {len(public_key)}")
    return b58encode(_MULTIHASH_PREFIX + _PROTOBUF_PREFIX + public_key)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Inverse of peer_id_from_public_key; DecodeError for ids that do not inline an Ed25519 key."""
    raw = b58decode(peer_id)
    prefix = _MULTIHASH_PREFIX + _PROTOBUF_PREFIX
    if len(raw) != len(prefix) + PUBLIC_KEY_BYTES or not raw.startswith(prefix):
        raise DecodeError(f"{peer_id!r} is not an Ed25519 peer id")
    return raw[len(prefix):]


class Keypair:
    """A node's signing key. The seed is its only secret; the same seed gives the libp2p identity."""

    __slots__ = ("seed", "public_key", "peer_id", "_private")

    def __init__(self, seed: bytes):
        if len(seed) != SEED_BYTES:
            raise ValueError(f"an Ed25519 seed has {SEED_BYTES} bytes, not {len(seed)}")
        self.seed = bytes(seed)
        self._private = Ed25519PrivateKey.from_private_bytes(self.seed)
        self.public_key = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.peer_id = peer_id_from_public_key(self.public_key)

    @classmethod
    def from_label(cls, label: str) -> "Keypair":
        """A deterministic key for tests and simulations (never for real nodes)."""
        return cls(hashlib.sha256(b"shoal-test-key/" + label.encode()).digest())

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def __repr__(self) -> str:
        return f"Keypair({self.peer_id})"


def verify(public_key: bytes, signature: bytes, data: bytes) -> None:
    """Raise SignatureError unless ``signature`` is ``public_key``'s signature of ``data``."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        raise SignatureError("malformed key or signature")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        raise SignatureError("signature does not verify") from None
