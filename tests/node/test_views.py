"""`shoal task show` as tables: the task's head, a row per node with its announced training share, the rounds."""

from rich.console import Console

from node.views import print_status, print_task

A, B = "12D3KooW" + "a" * 44, "12D3KooW" + "b" * 44


def shown(status: dict) -> str:
    console = Console(record=True, width=220, color_system=None)
    print_task(status, console)
    return console.export_text()


def test_task_show_lists_each_node_with_its_training_share():
    text = shown({"id": "ab" * 32, "name": "demo", "initiator": A, "decision": "joined", "phase": "round 3: training",
                  "round": 3, "rounds": 10, "eval_loss": 2.25, "weights_hash": "cd" * 32, "members": [A, B],
                  "train_seconds": 6.0, "round_seconds": 8.0, "bytes": {"sent": 10, "received": 20}, "dropped": {},
                  "peers": [{"peer_id": A, "self": True, "member": True, "round": 2, "eval_loss": 2.25,
                             "train_share": 0.75},
                            {"peer_id": B, "self": False, "member": True, "round": 2, "eval_loss": 2.25,
                             "train_share": None}],
                  "agreement": [{"round": 2, "agreed": True, "peers_agreeing": 2, "members": 2, "eval_loss": 2.25,
                                 "train_s": 2.0, "round_s": 2.5, "weights_hash": "cd" * 8}]})
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    nodes = {c[0].split()[0]: c for c in cells if c and c[0].startswith("12D3KooW")}
    assert nodes[A] == [f"{A} (this node)", "yes", "2", "2.2500", "75%"]
    assert nodes[B] == [B, "yes", "2", "2.2500", "-"]  # not trained yet: no share
    assert "75% of round time training" in text and "2.2500" in text


def test_task_show_of_a_declined_task_has_no_node_table():
    text = shown({"id": "ab" * 32, "name": "demo", "initiator": A, "decision": "declined", "reason": "needs a GPU"})
    assert "declined (needs a GPU)" in text and "training share" not in text


def test_task_show_names_a_banned_forger_and_what_its_aggregate_should_have_been():
    text = shown({"id": "ab" * 32, "name": "demo", "initiator": A, "decision": "joined", "phase": "round 3: training",
                  "round": 3, "rounds": 10, "members": [A], "dropped": {"banned": 4}, "banned": [B],
                  "forgeries": [{"round": 1, "slice": 0, "aggregator": B, "announced": "ee" * 32, "recomputed": "11" * 32,
                                 "found_here": False}]})
    assert "banned: 4" in text and f"round 1 slice 0 by {B}" in text
    assert "its inputs give 1111111111111111 (a peer's proof, recomputed here)" in text


def test_task_show_counts_the_receipts_sealed_and_says_when_some_could_not_be_written():
    base = {"id": "ab" * 32, "name": "demo", "initiator": A, "decision": "joined", "round": 3, "rounds": 10,
            "members": [A], "dropped": {}}
    assert "12 sealed (`shoal ledger abababababab` lists them)" in shown({**base, "receipts": 12})
    assert "2 round(s) not written (see the log)" in shown({**base, "receipts": 12, "receipt_errors": 2})


def test_task_show_says_what_was_screened_out_of_the_applied_aggregates_and_of_its_own():
    base = {"id": "ab" * 32, "name": "demo", "initiator": A, "decision": "joined", "round": 3, "rounds": 10,
            "members": [A], "dropped": {}}
    text = shown({**base, "screened_applied": {"opposed": 6}, "screened": {"opposed": 2}})
    assert "opposed: 6 (slices left out of the applied aggregates, charged alike on every node)" in text
    assert "opposed: 2 left out by this node's aggregations" in text
    assert "screened out" not in shown(base)


def test_task_show_counts_the_training_checks_and_names_what_they_found():
    base = {"id": "ab" * 32, "name": "demo", "initiator": A, "decision": "joined", "round": 3, "rounds": 10,
            "members": [A], "dropped": {}}
    checks = {"enabled": True, "passed": 9, "untrained": 1, "confirmed": 2, "refuted": 0, "unjudged": 1,
              "seconds": 0.8, "findings": [
                  {"round": 1, "producer": B, "gain": -0.1567, "found_by": A, "copy_of": None, "advantage": None},
                  {"round": 2, "producer": B, "gain": 0.29, "found_by": A, "copy_of": A, "advantage": -0.0365}]}
    text = shown({**base, "training_checks": checks})
    assert "passed: 9, untrained: 1, confirmed: 2, refuted: 0, unjudged: 1 (0.8 s)" in text
    assert f"round 1 by {B}: its own batches' loss +0.1567 after it" in text
    assert f"round 2 by {B}: a copy of {A}'s (fits their batches 0.0365 better than its own" in text
    assert "training checks" not in shown({**base, "training_checks": {**checks, "enabled": False, "findings": []}})


def test_status_shows_the_routers_port_mapping():
    console = Console(record=True, width=220, color_system=None)
    mapping = {"status": "mapped",
               "summary": "NAT-PMP on 192.168.1.1: 203.0.113.9:4001 -> port 4001 (renewed every 1800 s)"}
    print_status({"peer_id": A, "reachability": {"status": "public", "reason": "2 of 2 peer(s) dialed back",
                                                 "port_mapping": mapping}}, console)
    text = console.export_text()
    assert "public (2 of 2 peer(s) dialed back)" in text
    assert "port mapping: NAT-PMP on 192.168.1.1: 203.0.113.9:4001 -> port 4001" in text


def test_task_show_names_the_members_a_round_no_longer_waits_for():
    base = {"id": "ab" * 32, "name": "demo", "initiator": A, "decision": "joined", "round": 3, "rounds": 10,
            "members": [A, B], "dropped": {}}
    assert f"{B} (sent nothing in round 1)" in shown({**base, "not_waited": {B: 1}})
    assert "not waited for" not in shown({**base, "not_waited": {}})
