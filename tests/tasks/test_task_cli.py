"""`shoal task` against a running node's control API (one node over the fake network, served on loopback)."""

from __future__ import annotations

from pathlib import Path

import trio
from typer.testing import CliRunner

from node.task_cli import task_app
from tests.tasks.conftest import Swarm

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-task.toml"


async def test_publish_list_show(network, tmp_path):
    cli = CliRunner()
    async with trio.open_nursery() as nursery:
        node = await Swarm(nursery, tmp_path, network).add("a", join=False)
        url = ["--url", node.control_url, "--data-dir", str(node.config.data_dir)]
        out = await trio.to_thread.run_sync(lambda: cli.invoke(task_app, ["publish", str(EXAMPLE), *url]))
        assert out.exit_code == 0 and "topk" not in out.output, out.output
        tid = out.stdout.strip().splitlines()[0]
        assert len(tid) == 64
        out = await trio.to_thread.run_sync(lambda: cli.invoke(task_app, ["list", *url]))
        assert tid[:16] in out.stdout and "declined" in out.stdout
        out = await trio.to_thread.run_sync(lambda: cli.invoke(task_app, ["show", tid[:8], *url, "--json"]))
        assert out.exit_code == 0 and '"tiny-lm-3-nodes"' in out.stdout
        out = await trio.to_thread.run_sync(lambda: cli.invoke(task_app, ["show", tid[:8], *url]))
        assert out.exit_code == 0 and "tiny-lm-3-nodes" in out.stdout and "model.n_layer" in out.stdout
        # A valid spec that measured badly is published, with a note saying why and what to change.
        topk = tmp_path / "topk.toml"
        topk.write_text(EXAMPLE.read_text().replace('compression = "int4"  ', 'compression = "topk"  ', 1))
        out = await trio.to_thread.run_sync(lambda: cli.invoke(task_app, ["publish", str(topk), *url]))
        assert out.exit_code == 0 and len(out.stdout.strip()) == 64, out.output
        assert "note: compression = \"topk\" with outer_momentum = 0.9" in out.stderr and "(1.5, 0.0)" in out.stderr
        bad = tmp_path / "bad.toml"
        bad.write_text(EXAMPLE.read_text().replace("rounds = 10", "rounds = -1"))
        out = await trio.to_thread.run_sync(lambda: cli.invoke(task_app, ["publish", str(bad), *url]))
        assert out.exit_code == 2 and "rounds" in out.output and "Traceback" not in out.output
        nursery.cancel_scope.cancel()
