"""Streaming fragments (task option ``fragments``; Streaming DiLoCo, Douillard et al. 2025): a round syncs 1/F of
the model, so the same traffic goes in pieces F times smaller, F times as often.

The model's tensors, in sorted-name order, are cut into F contiguous fragments of about equal size
(node.train.diloco.fragments); round r syncs fragment r mod F. Between its syncs a fragment trains on in each
member's own model, which so drifts from the swarm's θ_r on the fragments not synced since: D = θ_r − local, per
tensor (none where the tensor was synced since it last trained, or the member is fresh). Round r trains from
θ_r − D; its update is D + Δ' on fragment r mod F (Δ' = what the trainer moved from that base), the whole progress
since that fragment's last sync, and the drift carried into round r + 1 is D + Δ' on every other tensor. The outer
step moves fragment r mod F of θ and of its momentum only (compute.apply_aggregates ``names``); every member still
holds all of θ and votes on its hash, and a joiner fetches it whole.

The drift lives in memory, for the next round only: a node that restarts, re-syncs or skips a round trains from
θ_r again, as a fresh member does (it loses its progress on the fragments not synced yet, nothing else).
"""

from __future__ import annotations

from pathlib import Path

from node.train.diloco import Named, fragments, load_named, local_weights, save_named, streaming_update
from protocol.errors import TaskRejected


def plan(weights: Named, count: int, slices: int) -> list[tuple[tuple[str, ...], int]]:
    """The model's ``count`` fragments, (tensor names, values), from its layout; TaskRejected when one would hold
    fewer values than the ``slices`` it is cut into (the same decision on every node: it depends on the spec)."""
    sizes = {n: weights[n].numel() for n in weights}
    split = [(names, sum(sizes[n] for n in names)) for names in fragments(sorted(sizes.items()), count)]
    smallest = min(n for _, n in split)
    if smallest < slices:
        raise TaskRejected(f"fragments = {count} leaves a fragment of {smallest} values, fewer than "
                           f"aggregation_shards ({slices}): use fewer of either")
    return split


class Drift:
    """One member's unsynced progress, for the round it applies to."""

    def __init__(self) -> None:
        self._round: int | None = None
        self._drift: Named = {}

    def held(self, round_: int) -> bool:
        """Whether a drift applies to round ``round_`` (the one after the round this node trained last)."""
        return self._round == round_ and bool(self._drift)

    def base(self, round_: int, weights: Named | None, weights_path: Path, out_path: Path) -> Path:
        """Where round ``round_`` trains from: ``weights_path`` (θ_r) itself when no drift applies, else θ_r less
        the drift, written to ``out_path``. ``weights``: θ_r as the node holds it (read from the file if None)."""
        if not self.held(round_):
            return weights_path
        theta = weights if weights is not None else load_named(weights_path)
        save_named(out_path, local_weights(theta, self._drift), durable=False)
        return out_path

    def trained(self, round_: int, delta_path: Path, names: tuple[str, ...]) -> None:
        """The trainer's Δ' from base(``round_``), in ``delta_path``, becomes the round's update of fragment
        ``names`` (drift + Δ' on those tensors), written back in its place; the rest is carried to the next round."""
        carried = self._drift if self._round == round_ else {}
        update, self._drift = streaming_update(load_named(delta_path), carried, names)
        save_named(delta_path, update)
        self._round = round_ + 1
