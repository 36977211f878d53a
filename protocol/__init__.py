"""Shoal's sans-IO protocol: wire messages, codec, signatures, manifests and state machines."""

PROTOCOL_VERSION = 1
