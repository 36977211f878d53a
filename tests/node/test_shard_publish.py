"""`shard publish` through the control API: content comes by upload; a named path only under publish_dir."""

import hashlib
import os

import pytest
import trio

from node.control import TOKEN_FILE, ControlClient, client_for
from node.uploads import upload_and_publish
from protocol.errors import ShoalError
from tests.node.conftest import fast_config
from tests.node.test_control_api import start_with_shardcast


async def test_publish_reads_no_path_in_the_data_dir_and_takes_uploads(network, tmp_path):
    outside = tmp_path / "shared"
    outside.mkdir()
    (outside / "weights.bin").write_bytes(b"w" * 5000)
    # publish_dir is the parent of the data dir: the data dir inside it must still be refused.
    config = fast_config(tmp_path / "shared" / "node", mdns=False, publish_dir=str(outside))
    async with trio.open_nursery() as nursery:
        a = await start_with_shardcast(nursery, config)
        client = ControlClient(token=a.control_token, url=a.control_url)
        for target in (config.data_dir / "node.key", config.data_dir / TOKEN_FILE, tmp_path / "elsewhere"):
            with pytest.raises(ShoalError, match="not under publish_dir|not an existing file"):
                await trio.to_thread.run_sync(lambda: client.call("/shard/publish", body={"path": str(target)}))
        link = outside / "key-link"
        link.symlink_to(config.data_dir / "node.key")
        with pytest.raises(ShoalError, match="not under publish_dir"):
            await trio.to_thread.run_sync(lambda: client.call("/shard/publish", body={"path": str(link)}))
        assert a.shardcast.store.manifest_ids() == []
        answer = await trio.to_thread.run_sync(lambda: client.call("/shard/publish",
                                                                   body={"path": str(outside / "weights.bin")}))
        assert answer["bytes"] == 5000

        src = tmp_path / "model.safetensors"
        src.write_bytes(os.urandom(9 * 2**20 + 17))  # three chunks
        sock_client = client_for(config.data_dir)
        assert sock_client.socket_path is not None
        answer = await trio.to_thread.run_sync(lambda: upload_and_publish(sock_client, src))
        assert answer["bytes"] == src.stat().st_size and answer["label"] == "model.safetensors"
        mid = bytes.fromhex(answer["manifest_id"])
        assert mid in a.shardcast.store.manifest_ids()
        assert list((config.data_dir / "uploads").iterdir()) == []

        begun = await trio.to_thread.run_sync(lambda: client.call("/shard/upload", body={"name": "x", "bytes": 3}))
        await trio.to_thread.run_sync(lambda: client.call(
            "/shard/upload", body={"upload_id": begun["upload_id"], "offset": 0, "data": "YWJj"}))
        with pytest.raises(ShoalError, match="do not match the sha256"):
            await trio.to_thread.run_sync(lambda: client.call(
                "/shard/publish", body={"upload_id": begun["upload_id"], "sha256": hashlib.sha256(b"abd").hexdigest()}))
        nursery.cancel_scope.cancel()
