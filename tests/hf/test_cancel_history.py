"""`shoal task cancel`: only the initiator's signed cancel ends a task, on every node and across a restart;
the per-round history survives restarts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from node import control
from node.tasks import history
from protocol.envelope import seal
from protocol.task import SPECS_TOPIC, TaskCancel, task_id
from tests.tasks.conftest import Swarm, network, runner, tiny_spec, wait_until  # noqa: F401 (network is a fixture)

pytestmark = [pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def phase(node, tid):
    r = runner(node, tid)
    return r.phase if r is not None else None


def training(node, tid) -> bool:
    """The task runs rounds here (past round 0: a state it trains from), whatever phase it is in right now."""
    r = runner(node, tid)
    return r is not None and r.state is not None and r.state.round >= 1 and r.phase.startswith("round")


async def test_only_the_initiators_cancel_ends_the_task_everywhere(network, tmp_path):
    spec = tiny_spec(rounds=200, min_members=2, inner_steps=4)
    tid = task_id(spec)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, tmp_path, network)
        a, b = [await swarm.add(n) for n in "ab"]
        await swarm.connected()
        await a.tasks.publish(spec)
        await wait_until(lambda: all(training(n, tid) for n in (a, b)), timeout_s=90)

        # b is not the initiator: its own node refuses to sign for it, and a forged gossip is refused by a.
        with pytest.raises(Exception, match="only the initiator"):
            await trio.to_thread.run_sync(lambda: control.call(b.control_url + "/task/cancel", token=b.control_token, body={"id": tid[:8]}))
        await b.host.publish(SPECS_TOPIC, seal(TaskCancel(task_id=tid, reason="mine now"), b.keypair))
        await wait_until(lambda: a.tasks.cancels.refused[b.keypair.peer_id] >= 1, timeout_s=10)
        assert training(a, tid) and a.tasks.tasks[tid].decision == "joined"

        answer = await trio.to_thread.run_sync(lambda: control.call(
            a.control_url + "/task/cancel", token=a.control_token, body={"id": tid[:8], "reason": "enough"}))
        assert answer["decision"] == "cancelled"
        await wait_until(lambda: all(n.tasks.tasks[tid].decision == "cancelled" for n in (a, b)), timeout_s=10)
        assert phase(b, tid) == "cancelled" and runner(b, tid).detail == "enough"
        assert (tmp_path / "b" / "tasks" / tid / "cancel.sealed").is_file()
        swarm.scopes["b"].cancel()
        nursery.cancel_scope.cancel()

    # Restarted, b does not resume the cancelled task.
    async with trio.open_nursery() as nursery:
        b2 = await Swarm(nursery, tmp_path, network).add("b")
        await wait_until(lambda: tid in b2.tasks.tasks, timeout_s=10)
        assert b2.tasks.tasks[tid].decision == "declined" and "cancelled" in b2.tasks.tasks[tid].reason
        nursery.cancel_scope.cancel()


def test_history_round_trips_and_survives_a_damaged_file(tmp_path):
    rows = [{"round": 0, "eval_loss": 3.0, "members": 3}, {"round": 1, "eval_loss": 2.0, "members": 3}]
    history.record(tmp_path, rows + [{"round": 1, "eval_loss": 1.5, "members": 2}])
    assert history.load(tmp_path) == [rows[0], {"round": 1, "eval_loss": 1.5, "members": 2}]
    (tmp_path / history.FILE).write_text("{not json")
    assert history.load(tmp_path) == []


async def test_watch_follows_a_task_to_its_end_and_cancel_speaks_one_line(network, tmp_path):
    from typer.testing import CliRunner

    from node.task_cli import task_app
    cli = CliRunner()
    spec = tiny_spec(rounds=200, min_members=1, inner_steps=2)
    tid = task_id(spec)
    async with trio.open_nursery() as nursery:
        node = await Swarm(nursery, tmp_path, network).add("a")
        url = ["--data-dir", str(node.config.data_dir), "--url", node.control_url]
        await node.tasks.publish(spec)
        await wait_until(lambda: training(node, tid), timeout_s=90)
        watching = []

        async def watch():
            # A process of its own: typer's CliRunner swaps sys.stdout, so two invocations at once would mix.
            done = await trio.run_process([sys.executable, "-m", "node.cli", "task", "watch", tid[:8], "--json", *url],
                                          capture_stdout=True, capture_stderr=True, check=False,
                                          env={**os.environ, "PYTHONPATH": str(ROOT)})
            watching.append(done)
        nursery.start_soon(watch)
        await trio.sleep(3.0)
        out = await trio.to_thread.run_sync(lambda: cli.invoke(task_app, ["cancel", tid[:8], "--reason", "done", *url]))
        assert out.exit_code == 0 and f"cancelled {tid}" in out.stdout, out.output
        await wait_until(lambda: watching, timeout_s=30)
        lines = watching[0].stdout.decode().strip().splitlines()
        assert watching[0].returncode == 0 and '"cancelled"' in lines[-1] and '"round' in lines[0], \
            (lines, watching[0].stderr[-500:])
        out = await trio.to_thread.run_sync(lambda: cli.invoke(task_app, ["cancel", "zzzz", *url]))
        assert out.exit_code == 2 and "no single task" in out.output and "Traceback" not in out.output
        nursery.cancel_scope.cancel()
