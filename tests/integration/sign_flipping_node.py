"""A Shoal node that trains honestly and publishes -10x its update, validly encoded and signed: the
sign-flipping trainer of the trust tests (``python -m tests.integration.sign_flipping_node start ...``).
Only a test starts it; nothing in Shoal imports it."""

import re
import sys

from node import cli
from node.tasks import compute
from node.tasks.exchange import Exchange
from node.train.compress import encode_blocks

_publish = Exchange._publish_payload
_UPDATE = re.compile(r"/r\d+/u(\d+)$")


async def _flipping_publish(self, data, label):
    found = _UPDATE.search(label)
    if found:
        numel = self._slice_numel(int(found.group(1)))
        data = encode_blocks(-10.0 * compute.decode_slice(data, numel, self.bits), bits=self.bits)
    return await _publish(self, data, label)


Exchange._publish_payload = _flipping_publish

if __name__ == "__main__":
    sys.exit(cli.main())
