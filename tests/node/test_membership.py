"""Nodes over the fake network: they find each other through one bootstrap peer, and notice deaths and returns."""

import trio

from protocol.peers import PeerState
from tests.node.conftest import fast_config, start_node, wait_until


def states(node):
    return {p: r.state for p, r in node.membership.table.peers.items()}


async def two_nodes(nursery, network, tmp_path):
    """Node a, and node b bootstrapped from it."""
    a, _ = await start_node(nursery, fast_config(tmp_path / "a"), network.open_host)
    b, _ = await start_node(nursery, fast_config(tmp_path / "b", bootstrap=[a.host.listen_addrs()[0]]),
                            network.open_host)
    return a, b


async def test_three_nodes_see_each_other_through_one_bootstrap(network, tmp_path):
    async with trio.open_nursery() as nursery:
        first, _ = await start_node(nursery, fast_config(tmp_path / "a"), network.open_host)
        boot = first.host.listen_addrs()[0]
        others = [(await start_node(nursery, fast_config(tmp_path / n, bootstrap=[boot]), network.open_host))[0]
                  for n in ("b", "c")]
        nodes = [first, *others]
        ids = {n.keypair.peer_id for n in nodes}
        await wait_until(lambda: all(set(n.membership.table.alive()) == ids - {n.keypair.peer_id} for n in nodes))
        # Announced peers are dialled directly, so b and c end up connected to each other too.
        await wait_until(lambda: others[1].keypair.peer_id in others[0].host.connected_peers())
        nursery.cancel_scope.cancel()


async def test_a_killed_node_goes_suspect_then_dead_and_comes_back(network, tmp_path):
    async with trio.open_nursery() as nursery:
        a, b = await two_nodes(nursery, network, tmp_path)
        b_id = b.keypair.peer_id
        await wait_until(lambda: a.membership.table.alive() == [b_id])
        network.kill(b_id)
        killed_at = trio.current_time()
        await wait_until(lambda: states(a).get(b_id) is PeerState.DEAD)
        assert trio.current_time() - killed_at < a.config.dead_after_s + 1.0
        nursery.cancel_scope.cancel()


async def test_a_node_whose_connection_closes_is_suspect_at_once_and_its_listeners_hear_it(network, tmp_path):
    async with trio.open_nursery() as nursery:
        a, b = await two_nodes(nursery, network, tmp_path)
        b_id = b.keypair.peer_id
        heard: list[str] = []
        a.membership.gone_listeners.append(heard.append)
        await wait_until(lambda: a.membership.table.alive() == [b_id])
        network.kill(b_id)
        await wait_until(lambda: heard == [b_id], timeout_s=0.3)  # within suspect_after_s (0.6 s)
        assert states(a)[b_id] is PeerState.SUSPECT
        nursery.cancel_scope.cancel()


async def test_a_partitioned_node_is_dead_then_alive_again_after_heal(network, tmp_path):
    async with trio.open_nursery() as nursery:
        a, b = await two_nodes(nursery, network, tmp_path)
        a_id, b_id = a.keypair.peer_id, b.keypair.peer_id
        await wait_until(lambda: a.membership.table.alive() == [b_id])
        network.partition(a_id, b_id)
        await wait_until(lambda: states(a).get(b_id) is PeerState.DEAD)
        network.heal(a_id, b_id)
        await wait_until(lambda: states(a).get(b_id) is PeerState.ALIVE and states(b).get(a_id) is PeerState.ALIVE,
                         timeout_s=40)
        nursery.cancel_scope.cancel()


async def test_unreachable_bootstrap_does_not_block_start(network, tmp_path):
    ghost = "/memory/999/p2p/12D3KooWA4KGMCLRevVfmAd9RBe8Fkxo6yR5V6r4HZh7Mn7eu69x"
    async with trio.open_nursery() as nursery:
        with trio.fail_after(5):
            node, _ = await start_node(nursery, fast_config(tmp_path / "a", bootstrap=[ghost]), network.open_host)
        assert node.control_url.startswith("http://127.0.0.1:")
        nursery.cancel_scope.cancel()
