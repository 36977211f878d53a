"""/metrics rendering: bounded id labels, process_* and shoal_build_info, training figures from task status."""

from types import SimpleNamespace

from node.metrics import MAX_LABEL_VALUES, bound, render, task_samples


def test_peer_labels_are_short_and_capped_with_the_rest_summed():
    samples = [("shoal_shard_peer_bytes_total", "counter", "h", {"peer": f"12D3KooW{i:040d}", "direction": "served"},
                float(i)) for i in range(100)]
    out = bound(samples)
    peers = {s[3]["peer"] for s in out}
    assert len(peers) == MAX_LABEL_VALUES and "other" in peers
    assert all(len(p) <= 10 for p in peers)
    assert sum(s[4] for s in out) == sum(range(100))
    biggest = max(out, key=lambda s: s[4] if s[3]["peer"] != "other" else -1)
    assert biggest[4] == 99.0


def test_render_has_process_and_build_info():
    text = render(lambda: [("shoal_x", "gauge", "x", {}, 1.0)]).decode()
    assert "process_resident_memory_bytes" in text and "shoal_build_info{" in text and "shoal_x 1.0" in text


def test_task_samples_from_the_task_service_status():
    status = {"id": "ab" * 32, "decision": "joined", "round": 3, "members": ["a", "b", "c"], "eval_loss": 2.5,
              "train_seconds": 9.0, "bytes": {"sent": 10, "received": 20}, "dropped": {"late_weights": 2},
              "agreement": [{"round": 0, "agreed": True, "train_s": 4.0, "round_s": 5.0},
                            {"round": 1, "agreed": False, "train_s": 4.0, "round_s": 5.0},
                            {"round": 2, "agreed": True, "caught_up": True, "train_s": 0.0, "round_s": 1.0}],
              "peers": [{"peer_id": "12D3KooW" + "a" * 44, "train_share": 0.9},
                        {"peer_id": "12D3KooW" + "b" * 44, "train_share": None}],
              "screened": {"empty": 1}, "screened_applied": {"empty": 3, "opposed": 2}, "not_waited": {"x": 1},
              "training_checks": {"enabled": True, "passed": 7, "untrained": 1, "confirmed": 0, "refuted": 2,
                                  "unjudged": 0, "seconds": 1.5, "findings": []}}
    known = SimpleNamespace(spec=SimpleNamespace(inner_steps=50))
    service = SimpleNamespace(tasks={status["id"]: known}, summary=lambda tid, k: status)
    got = {(s[0], tuple(sorted(s[3].items()))): s[4] for s in bound(task_samples(SimpleNamespace(tasks=service)))}
    task = ("task", "ab" * 6)
    assert got[("shoal_task_round", (task,))] == 3
    assert got[("shoal_task_inner_steps_per_second", (task,))] == 100 / 8.0
    assert got[("shoal_task_training_share", (task,))] == 8.0 / 11.0
    assert got[("shoal_task_rounds_total", (("outcome", "dissent"), task))] == 1
    assert got[("shoal_task_rounds_total", (("outcome", "caught_up"), task))] == 1
    assert got[("shoal_tasks", (("decision", "joined"),))] == 1
    assert got[("shoal_task_screened_total", (("reason", "empty"), task))] == 1
    assert got[("shoal_task_members_not_waited_for", (task,))] == 1
    assert got[("shoal_task_screened_applied_total", (("reason", "opposed"), task))] == 2
    assert got[("shoal_task_training_checks_total", (("outcome", "untrained"), task))] == 1
    assert got[("shoal_task_training_checks_total", (("outcome", "refuted"), task))] == 2
    assert got[("shoal_task_training_check_seconds_total", (task,))] == 1.5
    # Each node's announced share, by short peer id; a node that has not trained yet has no series.
    shares = {k[1]: v for k, v in got.items() if k[0] == "shoal_task_peer_training_share"}
    assert shares == {(("peer", "a" * 10), task): 0.9}


async def test_reachability_samples_show_the_port_mapping_state():
    from node.nat_status import start_nat_status
    from p2p.api import HostStatistics, Reachability

    reach = Reachability(status="public", port_mapping={"status": "mapped"})
    host = SimpleNamespace(reachability=lambda: reach, statistics=HostStatistics, connected_peers=lambda: [])
    node = SimpleNamespace(host=host, status_sources={}, metric_sources=[])
    await start_nat_status(node, None)
    got = {(s[0], tuple(s[3].items())): s[4] for s in node.metric_sources[0]()}
    assert got[("shoal_port_mapping", (("status", "mapped"),))] == 1
    assert got[("shoal_port_mapping", (("status", "unavailable"),))] == 0
    assert got[("shoal_reachability", (("status", "public"),))] == 1
    assert node.status_sources["reachability"]()["port_mapping"] == {"status": "mapped"}
    reach = Reachability(status="private")  # port mapping off: no series at all
    assert not any(s[0] == "shoal_port_mapping" for s in node.metric_sources[0]())
