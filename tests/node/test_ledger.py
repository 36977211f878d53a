"""The ledger file and `shoal ledger`: receipts appended as rounds close, read back signed, and what a
crash, a damaged file or a full disk leave behind."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from node.cli import app
from node.ledger_cli import ledger
from node.tasks import ledger as ledger_mod
from node.tasks.ledger import FILE, Ledger, read
from protocol.envelope import seal
from protocol.keys import Keypair
from protocol.receipts import Credit, digest
from protocol.spec_toml import load_spec_toml
from protocol.task import task_id

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-task.toml"
KEY = Keypair.from_label("ledger-node")
WEIGHTS = ["%064x" % i for i in range(1, 10)]
CREDITS = (Credit("12D3KooWProducerA", 64, 2), Credit("12D3KooWProducerB", 32, 1))

if "ledger" not in {c.name for c in app.registered_commands}:
    app.command("ledger")(ledger)


def task_dir(data_dir: Path) -> tuple[Path, str]:
    spec = load_spec_toml(EXAMPLE.read_text(), created_ms=1)
    tid = task_id(spec)
    d = data_dir / "tasks" / tid
    d.mkdir(parents=True)
    (d / "spec.sealed").write_bytes(seal(spec, KEY))
    return d, tid


def test_receipts_appended_round_by_round_read_back_signed_and_counted_across_restarts(tmp_path):
    d, tid = task_dir(tmp_path)
    first = Ledger(d, KEY, tid, num_slices=2)
    assert [r.producer for r in first.record(0, WEIGHTS[0], CREDITS)] == [c.producer for c in CREDITS]
    first.record(1, WEIGHTS[1], CREDITS[:1])
    again = Ledger(d, KEY, tid, num_slices=2)
    again.open()
    assert again.count == 3
    again.record(2, WEIGHTS[2], CREDITS)
    found = read(d, tid)
    assert [(s.message.round, s.message.producer) for s in found.receipts] == [
        (0, "12D3KooWProducerA"), (0, "12D3KooWProducerB"), (1, "12D3KooWProducerA"),
        (2, "12D3KooWProducerA"), (2, "12D3KooWProducerB")]
    assert {s.signer for s in found.receipts} == {KEY.peer_id} and (found.invalid, found.torn) == (0, False)


def test_a_write_cut_short_by_a_crash_is_cut_off_at_the_next_start(tmp_path):
    d, tid = task_dir(tmp_path)
    Ledger(d, KEY, tid, 2).record(0, WEIGHTS[0], CREDITS)
    whole = (d / FILE).read_bytes()
    (d / FILE).write_bytes(whole + whole[:30])  # the crash: half a frame
    later = Ledger(d, KEY, tid, 2)
    later.record(1, WEIGHTS[1], CREDITS)
    found = read(d, tid)
    assert [s.message.round for s in found.receipts] == [0, 0, 1, 1] and not found.torn


def test_a_damaged_ledger_is_kept_aside_and_its_readable_part_goes_on(tmp_path):
    d, tid = task_dir(tmp_path)
    Ledger(d, KEY, tid, 2).record(0, WEIGHTS[0], CREDITS)
    good = (d / FILE).read_bytes()
    damaged = good + b"\xff\xff\xff\xff" + good
    (d / FILE).write_bytes(damaged)
    Ledger(d, KEY, tid, 2).record(1, WEIGHTS[1], CREDITS[:1])
    assert (d / (FILE + ".damaged")).read_bytes() == damaged
    assert [s.message.round for s in read(d, tid).receipts] == [0, 0, 1]


def test_a_full_disk_loses_no_receipt_already_written_and_the_next_round_is_written(tmp_path, monkeypatch):
    d, tid = task_dir(tmp_path)
    led = Ledger(d, KEY, tid, 2)
    led.record(0, WEIGHTS[0], CREDITS)
    before = (d / FILE).read_bytes()
    real_fsync = ledger_mod.os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ledger_mod.os, "fsync", full)
    assert led.record(1, WEIGHTS[1], CREDITS) == [] and led.errors == 1
    assert (d / FILE).read_bytes() == before, "a failed write is undone"
    monkeypatch.setattr(ledger_mod.os, "fsync", real_fsync)
    led.record(2, WEIGHTS[2], CREDITS)
    assert [s.message.round for s in read(d, tid).receipts] == [0, 0, 2, 2] and led.count == 4


def test_shoal_ledger_lists_tasks_sums_per_producer_and_prints_a_digest_of_the_chosen_rounds(tmp_path):
    d, tid = task_dir(tmp_path)
    led = Ledger(d, KEY, tid, 2)
    for r in range(4):
        led.record(r, WEIGHTS[r], CREDITS if r != 2 else CREDITS[:1])
    runner = CliRunner()
    listed = runner.invoke(app, ["ledger", "--data-dir", str(tmp_path)])
    assert listed.exit_code == 0 and tid[:12] in listed.output and "rounds 0..3  7 receipt(s), 2 producer(s)" in listed.output
    shown = runner.invoke(app, ["ledger", tid[:8], "--data-dir", str(tmp_path), "--json"])
    data = json.loads(shown.output)
    a, b = data["producers"]
    assert (a["producer"], a["rounds"], a["samples"], a["share"]) == ("12D3KooWProducerA", 4, 256, 1.0)
    assert (b["producer"], b["rounds"], b["samples"], b["share"]) == ("12D3KooWProducerB", 3, 96, 0.5)
    assert data["signers"] == [KEY.peer_id]
    assert data["digest"] == digest(s.message for s in read(d, tid).receipts)
    # --from/--to pick rounds, so two nodes that joined at different rounds compare the rounds both hold.
    part = json.loads(runner.invoke(app, ["ledger", tid[:8], "--data-dir", str(tmp_path), "--json",
                                          "--from", "1", "--to", "2"]).output)
    assert (part["first_round"], part["last_round"], part["receipts"]) == (1, 2, 3)
    per_round = runner.invoke(app, ["ledger", tid[:8], "--data-dir", str(tmp_path), "--rounds"])
    assert per_round.exit_code == 0 and per_round.output.count("12D3KooWProducerA") == 4


@pytest.mark.parametrize("args, says", [(["ledger", "zz"], "no single task"),
                                        (["ledger", "0000ffff"], "no single task"),
                                        (["ledger", "--from", "-1"], "greater than or equal to 0")])
def test_shoal_ledger_says_what_is_wrong_without_a_traceback(tmp_path, args, says):
    task_dir(tmp_path)
    out = CliRunner().invoke(app, [*args, "--data-dir", str(tmp_path)])
    assert out.exit_code == 2 and says in out.output and "Traceback" not in out.output
