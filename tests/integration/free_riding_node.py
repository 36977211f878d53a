"""A Shoal node that trains nothing worth having: every slice of every update it publishes is zeros, with
its full sample count claimed, and otherwise it follows the protocol (``python -m
tests.integration.free_riding_node start ...``). Only a test starts it; nothing in Shoal imports it."""

import re
import sys

import torch

from node import cli
from node.tasks.exchange import Exchange
from node.train.compress import encode_blocks

_publish = Exchange._publish_payload
_UPDATE = re.compile(r"/r\d+/u(\d+)$")


async def _free_riding_publish(self, data, label):
    found = _UPDATE.search(label)
    if found:
        data = encode_blocks(torch.zeros(self._slice_numel(int(found.group(1)))), bits=self.bits)
    return await _publish(self, data, label)


Exchange._publish_payload = _free_riding_publish

if __name__ == "__main__":
    sys.exit(cli.main())
