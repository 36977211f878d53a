#!/usr/bin/env python3
"""Churn without stalls: node processes train the demo task while a random one is SIGKILLed and restarted.

A short quiet task (the same spec, a few rounds) gives the quiet round time; then the chaos task,
sized to --minutes of such rounds, runs while every 10-15 s (a seeded draw) one node is SIGKILLed,
its checkpoint is loaded from its data dir, and it is restarted on that dir. Kills stop after
--minutes or a few rounds before the task's last; the rest runs quiet to the end.
The JSON report: rounds that failed, the slowest round over the quiet one, whether every node's
weights hashes agree, checkpoints that did not load, and the kills and rounds behind them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.local_swarm import READY_TIMEOUT_S, Swarm, netlab_interrupts  # noqa: E402
from protocol.spec_toml import spec_from_dict  # noqa: E402
from scripts.swarm_task import TaskRun, spec_fields, use_local_corpus  # noqa: E402

DEMO_TASK = ROOT / "examples" / "tiny-task.toml"
ENV = {"SHOAL_HARDWARE_BENCHMARK": "false"}
"""The nodes' default heartbeats (2 s, quiet after 5 s), as in the demo; no start-up benchmark."""
KILL_EVERY_S = (10.0, 15.0)
QUIET_ROUNDS = 4
"""Rounds of the quiet task run first; its median round time is the quiet round time."""
TAIL_ROUNDS = 3
"""Rounds left without kills at the end, so every node finishes from a quiet swarm."""
REJOIN_WAIT_S = 60.0
"""A restarted node gets this long to be back in a round before the next kill is drawn anyway."""
POLL_S = 0.3
FAILED_LINE = re.compile(r"task (\w+) round (\d+) failed: (.*); keeping the weights")
PHASES_PER_ROUND = 3
"""Collecting, gathering and voting may each wait out the round deadline: the most a round can take."""
STARTUP_S = 120.0
"""Dataset check, trainer start and the listen window before a task's first round."""


def log(msg: str, started: float) -> None:
    print(f"{time.monotonic() - started:7.1f} s  {msg}", file=sys.stderr, flush=True)


def checkpoint_state(directory: Path, spec) -> str:
    """"ok", "absent" (never written) or "corrupt" (written, but it does not load and verify)."""
    from node.tasks.task_files import load_checkpoint
    if not (directory / "meta.json").exists() and not (directory / "weights.safetensors").exists():
        return "absent"
    return "ok" if load_checkpoint(directory, spec) is not None else "corrupt"


class Chaos:
    def __init__(self, args: argparse.Namespace, fields: dict, work_dir: Path):
        self.args, self.fields, self.work_dir = args, fields, work_dir
        self.spec = spec_from_dict(fields, created_ms=1)
        self.rng = random.Random(args.seed)
        self.swarm = Swarm(args.nodes, work_dir, env=ENV)
        self.run: TaskRun | None = None
        self.kills: list[dict] = []
        self.checkpoints_checked: list[dict] = []
        self.started = time.monotonic()
        self.chaos_started_round: int | None = None
        self.chaos_ended_round: int | None = None
        self.quiet: dict = {}

    # -- following the task --------------------------------------------------------------------

    def rounds_of(self, node) -> int:
        return self.run.mine(node).get("round") or 0

    def swarm_round(self) -> int:
        return max((self.rounds_of(n) for n in self.run.live_nodes()), default=0)

    def in_round(self, node) -> bool:
        phase = self.run.mine(node).get("phase", "")
        return phase.startswith("round ") or phase == "finished"

    def wait(self, predicate, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            self.swarm.update()
            if predicate():
                return True
            now_round = self.swarm_round()
            if now_round != last:
                cells = [f"{n.index}:{self.rounds_of(n)} {self.run.mine(n).get('phase', '-')}"
                         for n in self.swarm.nodes]
                log(f"round {now_round}: " + " | ".join(cells), self.started)
                last = now_round
            if self.run.stopped():
                return False
            time.sleep(POLL_S)
        return False

    # -- the run -------------------------------------------------------------------------------

    def go(self) -> dict:
        args = self.args
        self.swarm.start(watch_interval_s=POLL_S)
        if not self.wait_all_see_all():
            raise RuntimeError(f"the nodes did not all see each other within {READY_TIMEOUT_S:.0f} s")
        self.quiet = self.quiet_run()
        quiet_s = self.quiet["round_seconds"]
        rounds = args.rounds or args.tail_rounds + max(2, math.ceil(60.0 * args.minutes / quiet_s))
        self.fields = {**self.fields, "rounds": rounds}
        self.spec = spec_from_dict(self.fields, created_ms=1)
        self.run = TaskRun(self.swarm, self.fields)
        self.swarm.task_id = self.run.publish()
        log(f"published the chaos task {self.swarm.task_id[:16]}: {rounds} rounds", self.started)
        # The kills start once every node trains the task: a kill before it joined tests start-up, not churn.
        if not self.wait(lambda: all(self.in_round(n) for n in self.swarm.nodes), STARTUP_S):
            raise RuntimeError(f"the chaos task did not start on every node: {self.run.stopped() or 'timed out'}")
        self.chaos_started_round = self.swarm_round()
        self.chaos(time.monotonic() + 60.0 * args.minutes)
        self.chaos_ended_round = self.swarm_round()
        log(f"chaos over after {len(self.kills)} kill(s); the task runs to its end", self.started)
        done = self.wait(self.run.done, (rounds - self.chaos_ended_round + 1) * PHASES_PER_ROUND
                         * self.spec.round_deadline_s + STARTUP_S)
        self.run.collect()
        return {"finished": done, "stopped": self.run.stopped()}

    def quiet_run(self) -> dict:
        """The same task, a few rounds without kills: the round time every chaos round is held to."""
        args = self.args
        self.run = TaskRun(self.swarm, {**self.fields, "name": f"{self.fields.get('name', 'task')}-quiet",
                                        "rounds": args.quiet_rounds})
        self.swarm.task_id = self.run.publish()
        log(f"published the quiet task {self.swarm.task_id[:16]}: {args.quiet_rounds} rounds", self.started)
        if not self.wait(self.run.done, args.quiet_rounds * PHASES_PER_ROUND * self.spec.round_deadline_s + STARTUP_S):
            raise RuntimeError(f"the quiet task did not finish: {self.run.stopped() or 'timed out'}")
        self.run.collect()
        # Cancelled, so a node restarted during the chaos does not resume it (and start its trainer) too.
        self.swarm.nodes[0].call("/task/cancel", {"id": self.run.task_id, "reason": "the quiet rounds are timed"})
        gaps = [g["seconds"] for g in self.gaps(self.close_times())]
        if not gaps:
            raise RuntimeError("the quiet task closed too few rounds to time one")
        failed = self.failed_rounds(self.run.task_id)
        quiet = {"task": self.run.task_id, "rounds_seconds": gaps, "round_seconds": round(statistics.median(gaps), 2),
                 "rounds_failed": len(failed)}
        log(f"quiet round: {quiet['round_seconds']:.2f} s (rounds {gaps}); {len(failed)} failed", self.started)
        return quiet

    def wait_all_see_all(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self.swarm.update()
            if self.swarm.all_see_all():
                return True
            time.sleep(POLL_S)
        return False

    def chaos(self, until: float) -> None:
        args = self.args
        next_kill = time.monotonic() + self.rng.uniform(*KILL_EVERY_S)
        max_kills = math.ceil(60.0 * args.minutes / KILL_EVERY_S[0]) + 1
        last_round = self.spec.rounds - args.tail_rounds
        while len(self.kills) < max_kills:
            # One node down at a time: the next kill waits for the last victim to be back in a round.
            back = (lambda: True) if not self.kills else (lambda: self.in_round(self.swarm.nodes[self.kills[-1]["node"]]))
            if not self.wait(lambda: (time.monotonic() >= next_kill and back()) or self.swarm_round() >= last_round,
                             max(0.0, until - time.monotonic())):
                break
            if time.monotonic() >= until or self.swarm_round() >= last_round or self.run.stopped():
                break
            self.kill_one()
            next_kill = self.kills[-1]["killed_at_s"] + self.started + self.rng.uniform(*KILL_EVERY_S)

    def kill_one(self) -> None:
        node = self.rng.choice(self.swarm.nodes)
        at_round = self.rounds_of(node)
        phase = self.run.mine(node).get("phase", "")
        killed_at = time.monotonic()
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=10)
        # Whatever the kill interrupted (a checkpoint half written, too) must still load.
        ckpt = checkpoint_state(node.data_dir / "tasks" / self.run.task_id, self.spec)
        self.checkpoints_checked.append({"node": node.index, "when": "after kill", "state": ckpt})
        log(f"SIGKILL node {node.index} in round {at_round} ({phase}); checkpoint {ckpt}", self.started)
        self.swarm.restart_node(node.index)
        ready_s = time.monotonic() - killed_at
        back = self.wait(lambda: self.in_round(node) and self.rounds_of(node) >= self.swarm_round() - 1,
                         REJOIN_WAIT_S)
        back_s = time.monotonic() - killed_at
        log(f"node {node.index} ready after {ready_s:.1f} s, back in round {self.rounds_of(node)} after "
            f"{back_s:.1f} s" + ("" if back else " (not back in time)"), self.started)
        self.kills.append({"node": node.index, "round": at_round, "phase": phase,
                           "killed_at_s": round(killed_at - self.started, 2), "checkpoint": ckpt,
                           "ready_s": round(ready_s, 2), "back_s": round(back_s, 2) if back else None})

    def stop(self) -> None:
        self.swarm.stop()

    # -- the report ----------------------------------------------------------------------------

    @staticmethod
    def gaps(closed: dict[int, float]) -> list[dict]:
        """Each round's seconds: from the first close of the round before to its own first close."""
        return [{"round": r, "seconds": round(closed[r] - closed[r - 1], 2)} for r in sorted(closed) if r - 1 in closed]

    def report(self, outcome: dict) -> dict:
        task_report = self.run.report()
        rows = task_report["task"]["rounds"]
        per_round = self.gaps(self.close_times())
        quiet_s = self.quiet["round_seconds"]
        worst = max(per_round, key=lambda p: p["seconds"], default=None)
        failed = self.failed_rounds(self.run.task_id)
        final_hashes = {n.index: (n.status.get("task") or {}).get("weights_hash") for n in self.swarm.nodes}
        hashes_agree = all(r["hashes_agree"] for r in rows) and len(set(final_hashes.values())) == 1 \
            and None not in final_hashes.values()
        for node in self.swarm.nodes:
            state = checkpoint_state(node.data_dir / "tasks" / self.run.task_id, self.spec)
            self.checkpoints_checked.append({"node": node.index, "when": "at the end", "state": state})
        members = {r["round"]: r["members"] for r in rows}
        return {
            "rounds_failed": len(failed),
            "worst_round_over_quiet": round(worst["seconds"] / quiet_s, 2) if worst else None,
            "hashes_agree": hashes_agree,
            "corrupt_checkpoints": sum(1 for c in self.checkpoints_checked if c["state"] == "corrupt"),
            "finished": outcome["finished"], "stopped": outcome["stopped"],
            "seed": self.args.seed, "nodes": self.args.nodes, "minutes": self.args.minutes,
            "kills": self.kills, "num_kills": len(self.kills),
            "rounds": self.spec.rounds, "chaos_rounds": [self.chaos_started_round, self.chaos_ended_round],
            "quiet_round_seconds": quiet_s, "quiet": self.quiet,
            "worst_round": worst,
            "rounds_over_twice_quiet": [p for p in per_round if p["seconds"] > 2 * quiet_s],
            "round_seconds": per_round,
            "failed_rounds": failed,
            "rounds_resynced": sorted({row["round"] for status in self.run.final.values()
                                       for row in (status.get("task") or {}).get("agreement", [])
                                       if row.get("agreed") is False}),
            "min_members_per_round": members,
            "final_weights_hash": final_hashes,
            "checkpoints": self.checkpoints_checked,
            "seconds": round(time.monotonic() - self.started, 1),
            "work_dir": str(self.work_dir),
        }

    def close_times(self) -> dict[int, float]:
        """Per round, the earliest wall time any node closed it (each node's own clock: one machine)."""
        out: dict[int, float] = {}
        for status in self.run.final.values():
            for row in (status.get("task") or {}).get("agreement", []):
                t = row.get("closed_at")
                if t is not None and not row.get("caught_up"):
                    out[row["round"]] = min(out.get(row["round"], math.inf), t)
        return out

    def failed_rounds(self, task_id: str) -> list[dict]:
        """Rounds of the task some node closed without an aggregate (it kept θ_r), from the nodes' logs."""
        failed: dict[int, list] = {}
        for node in self.swarm.nodes:
            text = node.log_path.read_text(errors="replace") if node.log_path and node.log_path.exists() else ""
            for m in FAILED_LINE.finditer(text):
                if m.group(1) == task_id[:12]:
                    failed.setdefault(int(m.group(2)), []).append({"node": node.index, "reason": m.group(3)})
        for peer, status in self.run.final.items():  # and what the nodes' rows say
            for row in (status.get("task") or {}).get("agreement", []):
                if row.get("failed") and not any(f.get("peer") == peer for f in failed.get(row["round"], [])):
                    failed.setdefault(row["round"], []).append({"peer": peer, "reason": "row marked failed"})
        return [{"round": r, "on": failed[r]} for r in sorted(failed)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=4.0, help="minutes of kills after the quiet rounds")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="seeds which node is killed and when")
    parser.add_argument("--task", type=Path, default=DEMO_TASK, help="task spec TOML (default: the demo's)")
    parser.add_argument("--rounds", type=int, help="the chaos task's rounds (default: --minutes over the quiet "
                                                   "round time, plus --tail-rounds)")
    parser.add_argument("--quiet-rounds", type=int, default=QUIET_ROUNDS, help="rounds of the quiet task run first")
    parser.add_argument("--tail-rounds", type=int, default=TAIL_ROUNDS, help="rounds left without kills at the end")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep node data dirs and logs")
    parser.add_argument("--work-dir", type=Path, help="node data and logs go here and stay (default: a temporary "
                        "folder, removed after a run that met every target unless --keep)")
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 60:
        parser.error("--minutes must be above 0 and at most 60")
    if not 2 <= args.nodes <= 16:
        parser.error("--nodes must be between 2 and 16")
    if args.quiet_rounds < 2:
        parser.error("--quiet-rounds must be at least 2 (the quiet time is measured between rounds)")

    from protocol.errors import ShoalError
    try:
        fields = spec_fields(args.task)
        note = use_local_corpus(fields)
    except ShoalError as exc:
        print(f"chaos_swarm: {exc}", file=sys.stderr)
        return 2
    if note:
        print(f"chaos_swarm: {note}", file=sys.stderr)
    if fields.get("min_members", 1) > args.nodes - 1:
        print(f"chaos_swarm: the task's min_members {fields['min_members']} needs more than {args.nodes} nodes "
              "when one is down", file=sys.stderr)
        return 2
    if args.work_dir:
        if args.work_dir.exists() and not args.work_dir.is_dir():
            parser.error(f"--work-dir {args.work_dir} is a file, not a folder")
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="shoal-chaos-"))
    chaos = Chaos(args, fields, work_dir)
    report: dict = {}
    try:
        with netlab_interrupts():  # SIGTERM (a test's timeout, say) still stops every node we started
            outcome = chaos.go()
            chaos.stop()
            report = chaos.report(outcome)
    except KeyboardInterrupt:
        print("interrupted; stopping the nodes", file=sys.stderr)
    except (RuntimeError, ShoalError) as exc:
        print(f"chaos_swarm: {exc}", file=sys.stderr)
    finally:
        chaos.stop()
    if not report:
        print(f"node data and logs kept in {work_dir}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    met = (report["rounds_failed"] == 0 and report["hashes_agree"] and report["corrupt_checkpoints"] == 0
           and report["finished"])
    fast = report["worst_round_over_quiet"] is not None and report["worst_round_over_quiet"] <= 2.0
    print(f"chaos_swarm: {report['num_kills']} kills, {len(report['round_seconds'])} rounds; rounds failed "
          f"{report['rounds_failed']}, hashes agree {report['hashes_agree']}, corrupt checkpoints "
          f"{report['corrupt_checkpoints']}, worst round {report['worst_round_over_quiet']}x quiet "
          f"({report['quiet_round_seconds']} s)", file=sys.stderr)
    if args.work_dir:
        print(f"node data and logs are in {work_dir}", file=sys.stderr)
    elif met and fast and not args.keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    else:
        print(f"node data and logs kept in {work_dir}", file=sys.stderr)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
