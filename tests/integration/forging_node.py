"""A Shoal node whose every aggregate is -10x what its inputs give, stored, hashed and signed as an honest
aggregate would be, and which ignores every check of aggregates: the malicious aggregator of the trust
tests (``python -m tests.integration.forging_node start ...``). Only a test starts it; nothing in Shoal
imports it."""

import re
import sys

from node import cli
from node.tasks import compute
from node.tasks.exchange import Exchange
from node.train.compress import encode_int8
from protocol.audit import Audit

_publish = Exchange._publish_payload
_AGGREGATE = re.compile(r"/r\d+/a(\d+)$")


async def _forging_publish(self, data, label):
    found = _AGGREGATE.search(label)
    if found:
        numel = self._slice_numel(int(found.group(1)))
        data[:] = encode_int8(-10.0 * compute.decode_slice(data, numel, 8))
    return await _publish(self, data, label)


Exchange._publish_payload = _forging_publish
Audit.judge = lambda self, aggregate, accuser=None: []  # it never bans anyone, least of all the honest

if __name__ == "__main__":
    sys.exit(cli.main())
