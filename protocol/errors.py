"""The one exception tree of Shoal.

    ShoalError
    ├── ConfigError               a user's mistake in config, flags or files; the message says how to fix it
    ├── LocalProtocolError        our own code asked for something the protocol forbids (a bug here)
    ├── LocalStoreError           our own disk returned bytes that fail their hash; charged to no peer
    ├── RemoteProtocolError       a peer sent something we refuse; costs that peer score, never crashes us
    │   ├── DecodeError           malformed bytes, unknown version or tag, wrong field types
    │   ├── OversizeError         a frame or buffer larger than its cap, refused before allocation
    │   ├── SignatureError        a signature that does not verify, or a signer that does not match its claim
    │   └── IntegrityError        content whose size or hash does not match what was promised
    ├── TransportError            the network failed us (raised by p2p/, never by protocol/)
    │   ├── PeerUnreachable       could not dial or open a stream to a peer
    │   ├── StreamClosed          the stream ended (EOF or reset) before the exchange finished
    │   └── TransferTimeout       a peer stopped sending or answering within its deadline
    └── TaskRejected              a task spec that this node will not run; the message says why

ConfigError is also a ValueError, LocalStoreError an OSError and TransferTimeout a TimeoutError,
so callers that only know the builtin kinds still catch them.
"""


class ShoalError(Exception):
    """Base of every error Shoal raises on purpose."""


class ConfigError(ShoalError, ValueError):
    """A wrong config value, flag or file: one line naming the key and the fix."""


class LocalProtocolError(ShoalError):
    """Our side broke the protocol's rules: a bug in this node, not the peer's fault."""


class LocalStoreError(ShoalError, OSError):
    """A file in our own store failed its hash when read back: a local disk fault, never a peer's."""


class RemoteProtocolError(ShoalError):
    """A peer broke the protocol's rules; the message is dropped and the peer penalized."""


class DecodeError(RemoteProtocolError):
    """Bytes that do not decode into a known message."""


class OversizeError(RemoteProtocolError):
    """A frame, message or payload larger than its cap."""


class SignatureError(RemoteProtocolError):
    """A signature that does not verify, or a key that is not the claimed signer's."""


class IntegrityError(RemoteProtocolError):
    """Content whose size or hash differs from what a manifest or header promised."""


class TransportError(ShoalError):
    """The network layer failed: unreachable peer, closed stream, timeout."""


class PeerUnreachable(TransportError):
    """A dial or stream open to a peer failed."""


class StreamClosed(TransportError):
    """The stream ended before the exchange was complete."""


class TransferTimeout(TransportError, TimeoutError):
    """A peer went quiet past an inactivity or size-based deadline."""


class TaskRejected(ShoalError):
    """A task this node declines to run; str() is the reason shown to operators."""
