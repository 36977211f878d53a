"""runner.side_by_side: a state published while the trainer evaluates, and a trainer crash that still reads as one."""

from __future__ import annotations

import pytest
import trio

from node.tasks.runner import side_by_side
from node.train.client import TrainerCrashed


async def test_calls_run_at_once_and_return_in_order(autojump_clock):
    started = []

    async def call(name: str, delay: float) -> str:
        started.append((name, trio.current_time()))
        await trio.sleep(delay)
        return name

    t0 = trio.current_time()
    assert await side_by_side(lambda: call("eval", 1.0), lambda: call("state", 0.5)) == ["eval", "state"]
    assert trio.current_time() - t0 == pytest.approx(1.0)  # the autojump clock: side by side, not one after another
    assert {name for name, _ in started} == {"eval", "state"}


async def test_a_failure_comes_out_as_itself_after_the_other_call_finished(autojump_clock):
    finished = []

    async def crashes() -> None:
        await trio.sleep(0.1)
        raise TrainerCrashed("trainer child exited with code -9")

    async def publishes() -> str:
        await trio.sleep(1.0)
        finished.append("state")
        return "mid"

    with pytest.raises(TrainerCrashed):  # not an ExceptionGroup: _work restarts the trainer on it
        await side_by_side(crashes, publishes)
    assert finished == ["state"]
