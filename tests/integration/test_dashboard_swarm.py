"""The demo swarm (3 node processes, examples/tiny-task.toml) seen from outside: the dashboard in headless
Chromium, /metrics scraped while rounds close, and every --log-json line of the nodes and their trainers."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from node.control import ControlClient, read_token
from scripts.local_swarm import TASK_ENV, Swarm
from scripts.swarm_task import TaskRun, spec_fields, use_local_corpus
from tests.browser import chromium

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-task.toml"
SCREENSHOT_DIR = os.environ.get("DASHBOARD_SCREENSHOT_DIR", "")
"""Where the test also copies its two screenshots (the README's image comes from there); they stay in tmp too."""


def wait_for(predicate, timeout_s: float, what: str, swarm: Swarm):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        swarm.update()
        time.sleep(0.3)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    fields = spec_fields(EXAMPLE)
    use_local_corpus(fields)
    swarm = Swarm(3, tmp_path_factory.mktemp("swarm"), extra_args=["--log-json"], env=TASK_ENV)
    try:
        swarm.start()
        wait_for(swarm.all_see_all, 60, "the 3 nodes see each other", swarm)
        run = TaskRun(swarm, fields)
        run.publish()
        yield swarm, run
    finally:
        swarm.stop()


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([-+0-9.e]+)$", text, re.M)
    return None if m is None else float(m.group(1))


def test_dashboard_shows_every_peer_and_a_growing_loss_curve(demo, tmp_path):
    swarm, run = demo
    node = swarm.nodes[0]
    url = f"{node.control_url}/?token={read_token(node.data_dir)}"
    others = {n.peer_id for n in swarm.nodes[1:]}
    with chromium(tmp_path / "profile") as drv:
        drv.get(url)

        def seen() -> dict:
            return drv.execute_script("""
              const svg = document.querySelector('svg.curve');
              const shares = {};
              for (const tr of document.querySelectorAll('table.nodes tbody tr'))
                shares[tr.querySelector('td[title]').title] = tr.querySelector('td.share').textContent;
              return {peers: [...document.querySelectorAll('#peers tbody td[title]')].map((td) => td.title),
                      points: svg ? Number(svg.dataset.points) : 0, live: document.getElementById('live').className,
                      shares, facts: document.getElementById('node-facts').textContent};
            """)

        first = wait_for(lambda: (lambda s: s if set(s["peers"]) == others and s["points"] >= 1 else None)(seen()),
                         240, "the dashboard lists both peers and a first closed round", swarm)
        shot1 = tmp_path / "dashboard-1.png"
        drv.save_screenshot(str(shot1))
        later = wait_for(lambda: (lambda s: s if s["points"] >= first["points"] + 2 else None)(seen()),
                         240, "two more rounds close on the dashboard", swarm)
        shot2 = tmp_path / "dashboard-2.png"
        drv.save_screenshot(str(shot2))
    assert first["live"] == "ok" and set(later["peers"]) == others
    assert "reachability" in later["facts"] and "on the wire" in later["facts"], later["facts"]
    # Each member's training share, as it announced it with its weights: a percentage for all three.
    assert set(later["shares"]) == others | {node.peer_id}, later["shares"]
    assert all(re.fullmatch(r"\d{1,3}%", v) and 0 < int(v[:-1]) <= 100 for v in later["shares"].values()), later
    assert later["points"] > first["points"]
    assert shot1.stat().st_size > 10_000 and shot2.stat().st_size > 10_000
    if SCREENSHOT_DIR:
        for shot in (shot1, shot2):
            shutil.copy(shot, Path(SCREENSHOT_DIR) / shot.name)


def test_metrics_move_during_the_task_and_every_log_line_is_json(demo):
    swarm, run = demo
    node = swarm.nodes[0]
    client = ControlClient(token=read_token(node.data_dir), url=node.control_url)
    before = wait_for(lambda: (lambda t: t if metric(t, "shoal_task_round") is not None else None)(
        client.text("/metrics")), 240, "node 0 reports a task round in /metrics", swarm)
    r0 = metric(before, "shoal_task_round")
    # Two rounds on: a whole round's training lies between the scrapes, whenever the first one fell.
    after = wait_for(lambda: (lambda t: t if metric(t, "shoal_task_round") >= r0 + 2 else None)(
        client.text("/metrics")), 240, "the round moves in /metrics", swarm)
    assert metric(after, "shoal_task_train_seconds_total") > (metric(before, "shoal_task_train_seconds_total") or 0)
    assert metric(after, "shoal_task_eval_loss") is not None
    for name in ("shoal_task_inner_steps_per_second", "shoal_task_training_share", "process_resident_memory_bytes",
                 "process_cpu_seconds_total", "shoal_build_info"):
        assert metric(after, name) is not None, name
    assert 'shoal_task_rounds_total{outcome="agreed"' in after
    shares = re.findall(r'^shoal_task_peer_training_share{peer="([^"]+)",task="[^"]+"} ([0-9.e+-]+)$', after, re.M)
    assert {p for p, _ in shares} == {n.peer_id[-10:] for n in swarm.nodes}, shares
    assert all(0 < float(v) <= 1 for _, v in shares), shares
    wait_for(lambda: run.done() or run.stopped(), 300, "the task finishes", swarm)
    assert not run.stopped(), run.stopped()
    swarm.stop()
    loggers, fields = set(), set()
    for n in swarm.nodes:
        lines = n.log_path.read_text().splitlines()
        assert lines
        for line in lines:
            entry = json.loads(line)  # every line, the trainer child's included
            assert isinstance(entry, dict) and "msg" in entry and "level" in entry, line
            loggers.add(entry["logger"])
            fields.update(k for k in ("task", "round", "peer", "step", "loss") if k in entry)
    assert "shoal.trainer" in loggers and "shoal.tasks" in loggers, loggers
    assert fields == {"task", "round", "peer", "step", "loss"}, fields
