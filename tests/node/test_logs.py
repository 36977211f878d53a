"""Log lines: JSON objects with fields, stray stderr text wrapped, routine libp2p redial errors kept quiet."""

import json
import logging
import subprocess
import sys

from node.logs import JsonFormatter, QuietLibp2p, json_line, log_fields


def record(name: str, level: int, msg: str, *args, **extra) -> logging.LogRecord:
    rec = logging.LogRecord(name, level, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_json_formatter_gives_fields_from_extra_context_and_text():
    fmt = JsonFormatter()
    peer = "12D3KooWS3MzVjosU3vcX1kvg88QFytg1adFx2NMZ4ANmiCrWh1M"
    entry = json.loads(fmt.format(record("shoal.tasks", logging.INFO, "round %d closed by %s", 4, peer)))
    assert entry["round"] == 4 and entry["peer"] == peer and entry["level"] == "info"
    with log_fields(task="9b0313e46b9b"):
        entry = json.loads(fmt.format(record("shoal.tasks", logging.INFO, "eval", loss=1.5)))
    assert entry["task"] == "9b0313e46b9b" and entry["loss"] == 1.5
    assert "task" not in json.loads(fmt.format(record("x", logging.INFO, "after")))


def test_stray_lines_become_json_and_trainer_lines_carry_step_and_loss():
    entry = json.loads(json_line("[trainer 77] train id=3 step 10/50 loss 2.3456\n", logger="shoal.trainer", pid=1))
    assert entry["pid"] == 77 and entry["step"] == 10 and entry["loss"] == 2.3456 and entry["logger"] == "shoal.trainer"
    assert json.loads(json_line("UserWarning: something\n", logger="n", pid=1))["level"] == "warning"
    assert json_line("   \n", logger="n", pid=1) is None
    already = '{"ts": 1, "level": "info", "msg": "x"}'
    assert json_line(already + "\n", logger="n", pid=1) == already


def test_routine_redial_errors_are_debug_and_real_errors_stay():
    quiet = QuietLibp2p()
    redial = record("libp2p.transport.tcp.tcp", logging.ERROR,
                    "Failed to open TCP stream: all attempts to connect to 127.0.0.1:33619 failed")
    assert quiet.filter(redial) is False and redial.levelname == "DEBUG"
    other = record("libp2p.pubsub", logging.ERROR, "something else broke")
    assert quiet.filter(other) is True and other.levelname == "ERROR"


def test_a_json_process_turns_everything_on_stderr_into_json_lines():
    code = ("import logging, os, sys, warnings\n"
            "from node.logs import setup_logging\n"
            "setup_logging('info', json_lines=True)\n"
            "logging.getLogger('shoal.node').info('ready in round 2')\n"
            "warnings.warn('a library warning')\n"
            "print('plain print to stderr', file=sys.stderr)\n"
            "os.write(2, b'native write\\n')\n"
            "raise SystemExit(0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    lines = done.stderr.decode().splitlines()
    entries = [json.loads(line) for line in lines]
    assert [e["msg"] for e in entries if "native" in e["msg"] or "plain" in e["msg"]] == ["plain print to stderr",
                                                                                           "native write"]
    assert any(e.get("round") == 2 for e in entries) and any("a library warning" in e["msg"] for e in entries)
