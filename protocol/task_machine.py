"""A node's part in one task as a sans-IO state machine: listen, sync, rounds, pause, done; events in, effects out.

The caller (node/tasks/runner.py, or a simulation) feeds every verified task message, the last
time each peer was heard, and the results of the work it was asked to do, each with an explicit
``now``; it acts on the effects returned and sleeps until ``next_deadline()`` or the next event.
Every rule that decides membership, closing, the chosen aggregate, catching up and re-syncing
lives here or in protocol/round.py, so honest nodes that saw the same messages decide the same.

Past 500 lines on purpose: the stage and phase tables, the membership window and the closing,
catch-up and re-sync rules read and write the same fields, and h11-style one-table machines are
kept in one file so every transition can be read beside the state it changes.

Two levels of phase, each moved only through its table (as h11 keeps its connection states):
the task's ``Stage`` and each round's ``Phase``. A round is its own record with its own phase,
so rounds can overlap and phases can be inserted (scoring before gathering) by adding rows.
"""

from __future__ import annotations

import enum
import heapq
import random
from collections import Counter
from dataclasses import dataclass, field

from protocol.audit import Accused, Audit, FalseAccusation, Forged, Input, Verified, Verify
from protocol.heard import HeardLog
from protocol.receipts import Credit, credits_for
from protocol.rendezvous import make_key, top
from protocol.round import Head, aggregators, best_head, choose_aggregate, round_work, vote
from protocol.task import AggregateAnnounce, TaskJoin, UpdateAnnounce, WeightsAnnounce


class Stage(enum.Enum):
    LISTENING = "listening"  # deciding where to start: a peer's weights, our checkpoint, or round 0
    SYNCING = "syncing"  # weights and outer state are being fetched (or θ_0 made)
    RUNNING = "running"  # a round is open
    PAUSED = "paused"  # fewer than min_members live members share our weights: no round is produced
    DONE = "done"  # every round ran; still serves, never waited for
    FAILED = "failed"


class Phase(enum.Enum):
    TRAINING = "training"
    COLLECTING = "collecting"
    GATHERING = "gathering"
    APPLYING = "applying"
    VOTING = "voting"
    CLOSED = "closed"


STAGES: dict[tuple[Stage, str], Stage] = {
    (Stage.LISTENING, "sync"): Stage.SYNCING,
    (Stage.LISTENING, "start"): Stage.RUNNING,
    (Stage.LISTENING, "pause"): Stage.PAUSED,
    (Stage.LISTENING, "finish"): Stage.DONE,
    (Stage.SYNCING, "synced"): Stage.RUNNING,
    (Stage.SYNCING, "sync_failed"): Stage.LISTENING,
    (Stage.RUNNING, "sync"): Stage.SYNCING,
    (Stage.RUNNING, "start"): Stage.RUNNING,
    (Stage.RUNNING, "pause"): Stage.PAUSED,
    (Stage.RUNNING, "finish"): Stage.DONE,
    (Stage.PAUSED, "start"): Stage.RUNNING,
    (Stage.PAUSED, "sync"): Stage.SYNCING,
    (Stage.PAUSED, "pause"): Stage.PAUSED,
    (Stage.DONE, "sync"): Stage.SYNCING,
    (Stage.DONE, "finish"): Stage.DONE,
}
"""(stage, trigger) -> next stage. "fail" leads to FAILED from anywhere."""

PHASES: dict[tuple[Phase | None, str], Phase] = {
    (None, "train"): Phase.TRAINING,
    (None, "follow"): Phase.COLLECTING,
    (Phase.TRAINING, "trained"): Phase.COLLECTING,
    (Phase.COLLECTING, "collected"): Phase.GATHERING,
    (Phase.GATHERING, "gathered"): Phase.APPLYING,
    (Phase.APPLYING, "applied"): Phase.VOTING,
    (Phase.VOTING, "voted"): Phase.CLOSED,
    (Phase.TRAINING, "abandon"): Phase.CLOSED,
    (Phase.COLLECTING, "abandon"): Phase.CLOSED,
    (Phase.GATHERING, "abandon"): Phase.CLOSED,
}
"""(round phase, trigger) -> next phase; a round starts from None."""

KEEP_ROUNDS = 4
"""Rounds of messages kept behind the current one."""
AHEAD_ROUNDS = 8
"""Messages up to this many rounds ahead are buffered (a faster peer), further ones dropped."""
JOIN_LEAD_ROUNDS = 2
"""A node that synced follows this many rounds before it produces, so every member counts it from
the same round (members that disagree on membership pick different aggregators)."""
JOIN_ANSWERS = 2
"""Members that answer a join from older weights with their own (chosen by rendezvous hash)."""
OUTVOTED_ROUNDS = 4
"""How many past rounds' outvoted weights are kept out of the heads a node would move to."""
CONFIRM_SHARE = 0.5
"""Past this share of the round deadline after collecting, an aggregate nobody confirmed is recomputed even while
the slice's other aggregators still owe theirs: aggregators stop fetching by then (node/tasks/exchange.py
AGGREGATE_FETCH_SHARE), and an aggregate is never applied unconfirmed and unchecked when the deadline comes."""
CONTRIBUTED_ROUNDS = 16
"""A member's weights vote, and its turn as an aggregator, count while an aggregate this node applied in the
last this-many rounds included its work; older contributors are forgotten, so the record stays bounded under
churn."""
NEWCOMER_WAIT_SHARE = 0.5
"""While a newcomer has lately let a round's wait pass without an update, members with no update in the round before
(joiners, restarted nodes) are waited for only this share of the time the others took, once those delivered: a
newcomer as fast as them gets in, and a crowd of fresh identities that never train costs each round this share at
most, not its deadline (_waiting)."""
SYNC_RETRY_S = 0.5
"""A weights fetch that failed is tried again after this long, doubling with each failure up to the quiet window: a
source just restarted or just redialled answers a moment later, and a head nobody serves costs a quiet window."""
SYNC_RETRIES = 3
"""Failed fetches a node keeps listening through before it resumes its own weights: a node restarted behind the swarm
that took up the round the others closed would follow it to its deadline, and the others would wait for it."""
MISSED_ROUNDS = 4 * CONTRIBUTED_ROUNDS
"""A member that was waited for to the deadline and sent nothing is not waited for in the next this-many rounds; its
updates still count when they come in time. Neither joining again nor a late update restores it: a join costs
nothing, and a late update no aggregate takes in costs nothing either (it is never screened)."""


# -- events the caller feeds in (besides the task messages themselves) ----------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Trained:
    """This node's update for ``round`` is stored: one manifest per slice."""

    round: int
    samples: int
    manifest_ids: tuple[str, ...]
    losses: tuple[float, ...]
    shards: tuple[int, ...] = ()
    """The data shards it trained on (UpdateAnnounce.shards)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Aggregated:
    round: int
    slice: int
    included: tuple[str, ...]
    inputs: tuple[str, ...]
    """The manifest of each included producer's slice that went in (AggregateAnnounce.inputs)."""
    manifest_id: str
    result_hash: str
    screened: tuple[str, ...] = ()
    """The producers the screen left out, sorted, with their slices' manifests and why (AggregateAnnounce)."""
    screened_inputs: tuple[str, ...] = ()
    screened_why: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Applied:
    """θ_{round+1} is this node's now (checkpointed), with its hashes and where peers can fetch it."""

    round: int
    weights_hash: str
    state_hash: str
    state_manifest: str
    eval_loss: float | None
    train_share: float | None = None
    """This node's training share so far, passed on in its WeightsAnnounce."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Synced:
    """The weights of a FetchState (or MakeInitial) are this node's now."""

    head: Head


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncFailed:
    head: Head
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkFailed:
    """The trainer failed for good: the task stops on this node."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerGone:
    """Every connection to the peer closed (a killed process closes its sockets at once)."""

    peer_id: str


Event = TaskJoin | UpdateAnnounce | AggregateAnnounce | WeightsAnnounce | Trained | Aggregated | Applied | Synced \
    | SyncFailed | WorkFailed | PeerGone | Verified | Accused


# -- effects the caller acts on --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Publish:
    """Sign and gossip this message (the machine has already taken it into account)."""

    message: TaskJoin | UpdateAnnounce | AggregateAnnounce | WeightsAnnounce


@dataclass(frozen=True, slots=True)
class Train:
    """Train from θ_round (hash ``base_hash``), store the update's slices, answer Trained."""

    round: int
    base_hash: str
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Aggregate:
    """Combine slice ``slice`` of these updates (sorted by producer), store it, answer Aggregated."""

    round: int
    slice: int
    updates: tuple[UpdateAnnounce, ...]


@dataclass(frozen=True, slots=True)
class Apply:
    """Fetch the chosen aggregates and apply the outer step (``chosen`` empty: keep θ_r), answer Applied.

    ``same`` lists, per slice, other aggregates with the chosen one's hash: alternative sources."""

    round: int
    chosen: tuple[AggregateAnnounce, ...]
    same: tuple[tuple[AggregateAnnounce, ...], ...] = ()
    reason: str = ""
    behind: bool = False
    """A round followed to catch up (the swarm holds later weights): no evaluation on the way."""


@dataclass(frozen=True, slots=True)
class FetchState:
    """Fetch θ_{head.round} and the outer state from ``sources``, verify both hashes, answer Synced."""

    head: Head
    sources: tuple[Head, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class MakeInitial:
    """Build θ_0 (seeded init or the spec's initial weights), answer Synced."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundClosed:
    round: int
    weights_hash: str
    agreed: bool
    num_agree: int
    num_disagree: int
    members: int
    work: int
    failed: bool = False
    """No aggregate for some slice: the round kept θ_r."""
    credits: tuple[Credit, ...] | None = None
    """The producers the round's weights were made of, when this node's weights are the vote's and it heard
    every update the applied aggregates list (protocol/receipts.py); None otherwise, and () for a failed round."""


@dataclass(frozen=True, slots=True)
class Dissent:
    """A peer announced weights that differ from the vote's winner (detected, not yet judged)."""

    round: int
    peer_id: str
    weights_hash: str


@dataclass(frozen=True, slots=True)
class Overdue:
    """A phase of round ``round`` ran to its deadline still waiting for these live peers (for operators)."""

    round: int
    phase: str
    peers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    round: int


@dataclass(frozen=True, slots=True)
class ScreenedOut:
    """The screen left these producers' slices out of slice ``slice``'s applied aggregate, which its aggregator
    computed here, another confirmed, or a recomputation did: every node that applies it charges them alike."""

    round: int
    slice: int
    producers: tuple[tuple[str, str], ...]
    """(producer, why) pairs, why one of protocol.task.SCREEN_REASONS."""


@dataclass(frozen=True, slots=True)
class Impossible:
    """``peer`` signed what no honest node can: an update claiming more samples than the task's inner steps
    draw (``inner_steps x batch_size``: a bid for more weight in the mean) or another number of slices, two
    updates of one round from the same weights, or two results for one aggregate. Every node that hears it
    decides alike: the peer is banned from the task and owed nothing from now on."""

    round: int
    peer_id: str
    reason: str


Effect = Publish | Train | Aggregate | Apply | FetchState | MakeInitial | RoundClosed | Dissent | Overdue | Finished \
    | Verify | Forged | FalseAccusation | ScreenedOut | Impossible


_WORK_EVENTS = (Trained, Aggregated, Applied, Synced, SyncFailed, Verified)
MAX_UPDATES_PER_PRODUCER = 4
"""Distinct updates kept per producer and round (a restarted producer signs a second one): inputs an aggregate may name."""


class LocalTransitionError(AssertionError):
    """A trigger the tables do not allow in the current phase: a bug in the machine, never the peer's."""


@dataclass
class RoundState:
    index: int
    base: Head | None = None
    phase: Phase | None = None
    started_at: float | None = None
    producing: bool = False
    updates: dict[str, UpdateAnnounce] = field(default_factory=dict)
    heard_updates: dict[str, list[UpdateAnnounce]] = field(default_factory=dict)
    """Per producer, its updates of this round (from its base) we heard, counted or too late to count:
    the updates an aggregate may list. Every node hears the same gossip, so every node ranks a
    slice's aggregates alike even where it closed collecting before a late joiner's update."""
    lacking: dict[tuple, int] = field(default_factory=dict)
    """Per aggregate key that lists a producer not heard here: how many producers were heard when it was found so
    (heard updates only grow within a round: it stays uncheckable until that count moves)."""
    unverifiable: set[tuple] = field(default_factory=set)
    """Keys of aggregates that needed a recomputation but list a producer never heard (or banned): never applied."""
    redo: bool = False
    """A slice's choice changed within a pass (an aggregate found unverifiable): decide again at once."""
    spot: dict[int, bool] = field(default_factory=dict)
    """Per slice, whether this node recomputes the chosen aggregate though its aggregators agree (drawn once)."""
    unknown_since: float | None = None
    """When an aggregate first listed a producer we have not heard: it is waited for a heartbeat window."""
    ranked: dict[int, tuple] = field(default_factory=dict)
    """Per slice: ((candidates, producers heard, bans, aggregates received, unverifiable), the aggregate chosen,
    whether one lists an unheard producer, whether the aggregates received disagree).
    Both only grow within a round, so equal counts mean the same inputs: a 1,000-member round ranks once."""
    aggregates: dict[int, dict[str, AggregateAnnounce]] = field(default_factory=dict)
    weights: dict[str, WeightsAnnounce] = field(default_factory=dict)
    members: tuple[str, ...] = ()
    member_set: frozenset[str] = frozenset()
    """``members`` as a set (both set where the round collects)."""
    aggregators: dict[int, tuple[str, ...]] = field(default_factory=dict)
    collected_at: float | None = None
    still_counted: tuple[tuple, set[str]] | None = None
    """(liveness changes, updates, away changes) when _check_gather last found the producers still counted, and
    them: updates only leave a round once it gathers, so equal counts mean the same producers."""
    chosen: tuple[AggregateAnnounce, ...] = ()
    applied_at: float | None = None
    mine: Head | None = None
    my_update: UpdateAnnounce | None = None
    republish_at: float | None = None
    waiting_votes: list[str] | None = None
    vote_checked: tuple[int, int] | None = None
    """(votes, bans) when the vote was last found undecided (TaskMachine._vote_decided)."""
    updated_of: list[str] | None = None
    updated: int = 0
    """How many of the members list ``updated_of``, from the first, have sent their update."""
    wait_of: list[str] | None = None
    """The members list ``waited`` and ``newcomers`` were drawn from (TaskMachine._waiting)."""
    waited: list[str] = field(default_factory=list)
    """Members waited for to the deadline, popped as they deliver."""
    newcomers: list[str] = field(default_factory=list)
    """Members waited for NEWCOMER_WAIT_SHARE of the others' time once ``waited`` is empty, popped likewise."""
    waited_in_at: float | None = None
    """When every member of ``waited`` had delivered: the newcomers' wait runs from here."""


@dataclass(kw_only=True)
class TaskMachine:
    task_id: str
    self_id: str
    rounds: int
    num_slices: int
    aggregators_per_slice: int
    round_deadline_s: float
    quiet_after_s: float
    """A peer not heard from for this long is not waited for (one heartbeat window)."""
    listen_s: float
    min_members: int
    max_members: int
    max_samples: int
    spot_check: float = 0.0
    """The chance that this node recomputes a slice's chosen aggregate although no other contradicts it."""
    rng: random.Random = field(default_factory=random.Random)
    """Draws the spot checks: unpredictable to an aggregator, so it cannot know which slices go unchecked."""
    audit: Audit = field(default_factory=Audit)
    trainers: frozenset[str] = frozenset()
    """The spec's listed trainers: when set, nothing anyone else says counts."""
    stage: Stage = Stage.LISTENING
    head: Head | None = None
    detail: str = ""
    position: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Per peer: the round it holds the weights of, and their hash ("" after a join, which says no hash)."""
    latest: dict[str, WeightsAnnounce] = field(default_factory=dict)
    heard: dict[str, float] = field(default_factory=dict)
    rounds_seen: dict[int, RoundState] = field(default_factory=dict)
    current: int = -1
    produce_from: int = 0
    dropped: Counter = field(default_factory=Counter)
    contributed: dict[str, int] = field(default_factory=dict)
    """Producer -> the last round an aggregate this node applied included it. Only the weights votes of those
    included within CONTRIBUTED_ROUNDS count, so a crowd of new identities that never contributed verified
    work cannot outvote the members who did (nor can identities that stopped contributing long ago)."""
    _listen_until: float = 0.0
    _joined_zero: bool = False
    _blocked: dict[str, float] = field(default_factory=dict)
    _sync_failures: dict[str, int] = field(default_factory=dict)
    _follow_after_sync: bool | None = True
    _members_cache: dict = field(default_factory=dict)
    """Per round: (members, as a set, the heartbeat and the liveness changes they were computed at); and per
    ("prospective", round, ...): (_prospective's count, None, the same two)."""
    _started: bool = False
    _best: Head | None = None
    _best_dirty: bool = True
    _best_seen: tuple[int, int] = (-1, -1)
    """The heartbeat and liveness changes ``_best`` was computed at."""
    _shared: HeardLog | None = None
    """Heartbeats kept once for many machines (share_heard); peers in it count from after ``_since``."""
    _since: float = float("-inf")
    _heard_at: list[tuple[float, str]] = field(default_factory=list)
    """(time, peer) for each update of ``heard``, a heap: when a peer heard only there goes quiet."""
    _own_changes: int = 0
    _heartbeats: int = 0
    """Calls of heard_again: a cache computed before the latest is checked against the liveness changes."""
    _held_seen: int = -1
    _held: tuple[Head, tuple[Head, ...]] | None = None
    """A finished node's last count of the final weights live peers hold (_held_more)."""
    _zero_joins: set[str] = field(default_factory=set)
    _gone_at: dict[str, float] = field(default_factory=dict)
    """Per peer, when its connections last all closed (PeerGone): shared heartbeats from before do not count."""
    _my_weights: WeightsAnnounce | None = None
    """Our latest WeightsAnnounce, told again to a node that joins from older weights."""
    _joined_at: dict[str, float] = field(default_factory=dict)
    """Per peer, when its latest TaskJoin arrived: a join after a round collected is a new incarnation
    (a restart) or a re-sync, which owes that round neither an aggregate nor a vote."""
    _away_changes: int = 0
    """Writes to ``_gone_at`` and ``_joined_at`` so far: equal counts at two times mean _away_since() answers alike."""
    _join_base: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Per peer whose last word was a join: the weights it said it holds (TaskJoin.base_round, base_hash)."""
    _trained: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Per peer, the newest round it announced an update of, and that update's base: a peer that trained the next
    round from our weights of a round holds them, and one two rounds on has left the round behind, so neither owes
    it anything more (a restarted node's join can be lost, sent before its gossip mesh formed, and it then re-syncs
    and trains on without ever voting on the round it died in). One that trained from other weights may yet vote."""
    _outvoted: dict[int, set[str]] = field(default_factory=dict)
    """Per round: weights hashes that lost our vote of it. A member that lost is not a history to move
    to, whatever work it claims (it claims more when its aggregate choice covered more producers)."""
    _sync_round: int = -1
    """The round of the weights being fetched: the message window follows it while syncing."""
    _now: float = float("-inf")
    """The latest ``now`` the caller passed in (next_deadline takes none)."""
    _resumed: bool = False
    """Started from its own checkpoint and has not opened a round since."""
    _declared: bool = False
    """``produce_from`` was announced in a TaskJoin (members count this node from it)."""
    _delivered: dict[str, int] = field(default_factory=dict)
    """Per peer, the last round it sent an update of from our weights, in time or not: waited for in the next one."""
    _let_pass: dict[str, int] = field(default_factory=dict)
    """Per peer, a round whose newcomer's wait it let pass without an update: not waited for until it sends one."""
    _missed: dict[str, int] = field(default_factory=dict)
    """Per peer, the last round it was waited for to the deadline and sent nothing: not waited for within
    MISSED_ROUNDS (_waiting)."""
    _newcomer_missed: int = -MISSED_ROUNDS - 1
    """The last round a member with no update on record let its wait pass: newcomers get a share of one since."""

    # -- the tables ------------------------------------------------------------------------------

    def _to(self, trigger: str) -> None:
        if trigger == "fail":
            self.stage = Stage.FAILED
            return
        nxt = STAGES.get((self.stage, trigger))
        if nxt is None:
            raise LocalTransitionError(f"task stage {self.stage.value} has no transition {trigger!r}")
        self.stage = nxt

    def _move(self, rec: RoundState, trigger: str) -> None:
        nxt = PHASES.get((rec.phase, trigger))
        if nxt is None:
            raise LocalTransitionError(f"round {rec.index} in {rec.phase} has no transition {trigger!r}")
        rec.phase = nxt

    # -- liveness and membership -----------------------------------------------------------------

    def live(self, peer: str, now: float) -> bool:
        if peer == self.self_id:
            return True
        t = self.heard.get(peer)
        if t is not None and now - t < self.quiet_after_s:
            return True
        if self._shared is None:
            return False
        t = self._shared.times.get(peer)
        return t is not None and t > self._since and now - t < self.quiet_after_s \
            and t > self._gone_at.get(peer, float("-inf"))

    def last_heard(self, peer: str) -> float | None:
        t = self.heard.get(peer)
        if self._shared is not None and (s := self._shared.times.get(peer)) is not None and s > self._since \
                and (t is None or s > t):
            return s
        return t

    def set_heard(self, last_heard: dict[str, float], now: float) -> list[Effect]:
        """When each peer was last heard (heartbeats); quiet members stop being waited for."""
        for peer, t in last_heard.items():
            if t > self.heard.get(peer, float("-inf")):
                self.heard[peer] = t
                heapq.heappush(self._heard_at, (t, peer))
        self._forget_liveness(now)
        return self.tick(now)

    def share_heard(self, log: HeardLog, now: float) -> None:
        """Read heartbeats from now on from ``log``, kept once for every machine that hears the same peers.

        The caller writes each heartbeat into the log and then calls heard_again() on each machine,
        which decides as set_heard() with those times would, without a dict of every peer per machine.
        What an earlier log said stays heard (a node moved across a partition heard its old side until now)."""
        assert log.quiet_after_s == self.quiet_after_s, "a log counts liveness with another quiet window"
        if self._shared is not None:
            for peer, t in self._shared.times.items():
                if t > self._since and t > self.heard.get(peer, float("-inf")):
                    self.heard[peer] = t
                    heapq.heappush(self._heard_at, (t, peer))
        self._shared, self._since = log, now
        log.count_from(now)
        self._forget_liveness(now)

    def heard_again(self, now: float) -> list[Effect]:
        """The shared log was written at ``now`` (a heartbeat): what set_heard() does, in the time of the
        peers whose liveness changed (results from before are kept where no peer's did)."""
        self._heartbeats += 1
        return self.tick(now)

    def _forget_liveness(self, now: float) -> None:
        self._members_cache.clear()
        self._best_dirty = True
        self._live_changes(now)

    def _live_changes(self, now: float) -> int:
        """How often some peer's liveness changed so far: equal counts at two times mean none did in between."""
        heap, heard, shared, quiet = self._heard_at, self.heard, self._shared, self.quiet_after_s
        while heap and now - heap[0][0] >= quiet:
            t, peer = heapq.heappop(heap)
            if heard.get(peer) == t:
                s = shared.times.get(peer) if shared is not None else None
                if s is None or s <= self._since or s < t:
                    self._own_changes += 1  # quiet here, and the shared log does not hear it later
        return self._own_changes + (shared.changes(now) if shared is not None else 0)

    def _heard_now(self, peer: str, now: float) -> None:
        t = self.heard.get(peer)
        if t is None or now > t:
            if (t is None or now - t >= self.quiet_after_s) and not self.live(peer, now):
                self._members_cache.clear()
                self._best_dirty = True
                self._own_changes += 1
            self.heard[peer] = now
            heapq.heappush(self._heard_at, (now, peer))

    def _on_history(self, peer: str, rec: RoundState) -> bool:
        """The peer holds θ_r of our history: it sent an update from our base, its last weights are our
        base, or its last word was a join at r. A peer behind, ahead, finished, restarted from an older
        checkpoint or on another side of a partition is not, so it is never waited for."""
        if peer in rec.updates:
            return True
        pos = self.position.get(peer)
        if pos is None or pos[0] != rec.index:
            return False
        if pos[1]:
            return rec.base is not None and pos[1] == rec.base.weights_hash
        return self._joined_from_ours(peer, rec)

    def _joined_from_ours(self, peer: str, rec: RoundState) -> bool:
        """A join at round r counts where the weights the joiner holds are ours at their round, or where we cannot
        tell (it said none, or that round is no longer kept here): one that synced to another history at the same
        round index never trains from our weights, and waiting for it would cost every round its deadline."""
        said = self._join_base.get(peer)
        if said is None:
            return True
        at = rec if said[0] == rec.index else self.rounds_seen.get(said[0])
        return at is None or at.base is None or at.base.weights_hash == said[1]

    def members(self, rec: RoundState, now: float) -> list[str]:
        """Live peers on our history for round r (and this node if it produces), at most max_members."""
        cached = self._members_cache.get(rec.index)
        if cached is not None:
            if cached[2] == self._heartbeats:
                return cached[0]
            if cached[3] == self._live_changes(now):
                self._members_cache[rec.index] = (cached[0], cached[1], self._heartbeats, cached[3])
                return cached[0]
        seen = self._live_changes(now)
        peers = set(self.position) | set(rec.updates)
        out = {p for p in peers if p != self.self_id and self.live(p, now) and self._on_history(p, rec)}
        out -= self.audit.banned
        if rec.producing:
            out.add(self.self_id)
        ordered = sorted(out)[: self.max_members]
        self._members_cache[rec.index] = (ordered, set(ordered), self._heartbeats, seen)
        return ordered

    def _prospective(self, r: int, base: Head, now: float) -> int:
        """How many live nodes (this one included) would be members of round r from ``base``: those whose
        last word puts them there, and those already seen training it from ``base`` (a restarted node
        hears their updates again before anyone re-announces weights)."""
        seen = self.rounds_seen.get(r)
        # Kept as members() keeps its lists (cleared with them), for the round as it was seen: a paused node is
        # asked on every message it hears, and counting anew each time made a 1,000-member swarm cubic.
        key = ("prospective", r, base.weights_hash, self.current, id(seen), len(seen.updates) if seen else -1)
        cached = self._members_cache.get(key)
        if cached is not None:
            if cached[2] == self._heartbeats:
                return cached[0]
            if cached[3] == self._live_changes(now):
                self._members_cache[key] = (cached[0], None, self._heartbeats, cached[3])
                return cached[0]
        live_changes = self._live_changes(now)
        rec = RoundState(index=r, base=base, updates={} if seen is None else {
            p: u for p, u in seen.updates.items() if u.base_hash == base.weights_hash})
        peers = set(self.position) | set(rec.updates)
        count = 1 + sum(1 for p in peers if p != self.self_id and self.live(p, now) and self._on_history(p, rec)
                        and p not in self.audit.banned)
        self._members_cache[key] = (count, None, self._heartbeats, live_changes)
        return count

    # -- the round window ------------------------------------------------------------------------

    def _round(self, r: int) -> RoundState | None:
        anchor = self.current if self.current >= 0 else (self.head.round if self.head else -1)
        if self.stage is Stage.SYNCING and self._sync_round > anchor:
            # The swarm's messages for the rounds after the fetched weights arrive during the fetch:
            # dropping them as "ahead" of the abandoned round would leave nothing to follow with.
            anchor = self._sync_round
        if anchor >= 0 and not anchor - KEEP_ROUNDS <= r <= anchor + AHEAD_ROUNDS:
            return None
        rec = self.rounds_seen.get(r)
        if rec is None:
            rec = self.rounds_seen[r] = RoundState(index=r)
            while len(self.rounds_seen) > KEEP_ROUNDS + AHEAD_ROUNDS + 1:
                oldest = min(self.rounds_seen)
                del self.rounds_seen[oldest]
                self._members_cache.pop(oldest, None)
                if oldest == r:
                    return None
        return rec

    def _forget_before(self, r: int) -> None:
        for old in [i for i in self.rounds_seen if i < r - KEEP_ROUNDS or (i > r + AHEAD_ROUNDS)]:
            del self.rounds_seen[old]
        for record in (self._delivered, self._let_pass, self._missed):
            for peer in [p for p, at in record.items() if at <= r - MISSED_ROUNDS]:
                del record[peer]
        self._members_cache.clear()
        self.audit.forget_before(r - KEEP_ROUNDS)

    # -- events ----------------------------------------------------------------------------------

    def start(self, saved: Head | None, now: float) -> list[Effect]:
        """The task begins on this node, from its checkpoint (``saved``) or from nothing."""
        self.head = saved
        assert not self._started, "start() twice"
        self._started = True
        self._listen_until = now + self.listen_s
        self._now = now
        self.detail = "listening for the swarm's weights"
        if saved is None:
            return self._begin(now)
        self._resumed = self._declared = True
        # Counted from the round it resumes: peers stop waiting for an older incarnation's update.
        return [Publish(self._join(saved.round)), *self._begin(now)]

    def handle(self, event: Event, now: float) -> list[Effect]:
        self._now = max(self._now, now)
        if self.stage is Stage.FAILED or (not self._started and type(event) in _WORK_EVENTS):
            return []
        sender = _SENDER.get(type(event))
        if sender is not None:
            who = getattr(event, sender)
            if who in self.audit.banned:
                self.dropped["banned"] += 1
                return []
            if self.trainers and who not in self.trainers:
                self.dropped["not_listed"] += 1
                return []
        return _HANDLERS[type(event)](self, event, now)

    def tick(self, now: float) -> list[Effect]:
        self._now = max(self._now, now)
        if self.stage is Stage.FAILED or not self._started:
            return []
        effects: list[Effect] = []
        if self._blocked:
            for until in [h for h, t in self._blocked.items() if t <= now]:
                del self._blocked[until]
                self._best_dirty = True
        rec = self.rounds_seen.get(self.current)
        if self.stage is Stage.RUNNING and rec is not None:
            # A round stuck below min_members past its deadline gives way to a better head by time
            # too: a swarm that finished or stalled sends no new weights that would trigger it.
            effects += self._overtaken(rec, now) or self._advance(rec, now)
        elif self.stage in (Stage.LISTENING, Stage.PAUSED, Stage.DONE):
            effects += self._begin(now)
        return effects

    def next_deadline(self) -> float | None:
        """When tick() next has something to decide by time alone (None: only events will)."""
        times = list(self._blocked.values())
        if self.stage is Stage.LISTENING:
            times.append(self._listen_until)
        rec = self.rounds_seen.get(self.current)
        if self.stage is Stage.RUNNING and rec is not None and rec.started_at is not None:
            waited: list[str] = []
            if rec.phase is Phase.COLLECTING:
                times.append(rec.started_at + self.round_deadline_s)
                if rec.waited_in_at is not None:
                    times.append(self._newcomers_until(rec))
                if rec.republish_at is not None:
                    times.append(rec.republish_at)
                cached = self._members_cache.get(rec.index)
                # One from before the latest heartbeat is as set_heard would have left it: cleared.
                fresh = cached is not None and cached[2] == self._heartbeats
                waited = [p for p in cached[0] if p not in rec.updates] if fresh else []
            elif rec.phase is Phase.GATHERING:
                times.append(rec.collected_at + self.round_deadline_s)
                times.append(rec.collected_at + CONFIRM_SHARE * self.round_deadline_s)
                times.append(rec.collected_at + self.quiet_after_s)
                if rec.unknown_since is not None:
                    times.append(rec.unknown_since + self.quiet_after_s)
                if rec.republish_at is not None:
                    times.append(rec.republish_at)
                waited = sorted({a for s in rec.aggregators.values() for a in s})
            elif rec.phase is Phase.VOTING:
                times += [rec.applied_at + self.quiet_after_s, rec.applied_at + self.round_deadline_s]
                waited = [p for p in rec.members if p not in rec.weights]
            # Only members still live count: one already quiet is no longer waited for.
            times += [t + self.quiet_after_s for p in waited if p != self.self_id
                      and (t := self.last_heard(p)) is not None and t + self.quiet_after_s > self._now]
        # A time already passed was decided by the tick at it (a round stuck below min_members waits
        # for events, not for its deadline again).
        return min((t for t in times if t > self._now), default=None)

    def _on_TaskJoin(self, msg: TaskJoin, now: float) -> list[Effect]:
        if msg.task_id != self.task_id or msg.peer_id == self.self_id:
            return []
        # A join always replaces what we knew: a restarted node may declare an older round than the
        # weights its previous incarnation announced, and from then on it is counted from there.
        base = (msg.base_round, msg.base_hash) if msg.base_hash else None
        if self.position.get(msg.peer_id) != (msg.round, "") or self._join_base.get(msg.peer_id) != base:
            self.position[msg.peer_id] = (msg.round, "")
            if base is None:
                self._join_base.pop(msg.peer_id, None)
            else:
                self._join_base[msg.peer_id] = base
            self._members_cache.clear()
            if msg.round == 0:
                self._zero_joins.add(msg.peer_id)
            else:
                self._zero_joins.discard(msg.peer_id)
        self._heard_now(msg.peer_id, now)
        self._joined_at[msg.peer_id] = now
        self._away_changes += 1
        rec = self.rounds_seen.get(msg.round)
        if msg.round == self.current and rec is not None and rec.phase is Phase.COLLECTING \
                and rec.my_update is not None:
            # A node (re)started into the round we collect missed the updates gossiped before it came
            # back: without them it can never close the round, and every member would wait out the
            # vote for it. Ours again, once per join, lets it close the round with us.
            return [Publish(rec.my_update), *self.tick(now)]
        mine = self._my_weights
        if mine is not None and msg.round <= mine.round and self._answers_join(msg, now):
            # A node restarted from older weights would open a round the swarm has closed, train it for
            # nothing and only then fetch ours: told now, it fetches at once. Two members answer each join.
            return [Publish(mine), *self.tick(now)]
        return self.tick(now)

    def _join(self, r: int) -> TaskJoin:
        """Our join at round r, with the weights we hold (none before θ_0)."""
        held = self.head if self.head is not None and self.head.round <= r else None
        return TaskJoin(task_id=self.task_id, peer_id=self.self_id, round=r,
                        **({} if held is None else {"base_round": held.round, "base_hash": held.weights_hash}))

    def _answers_join(self, msg: TaskJoin, now: float) -> bool:
        holders = [p for p, w in self.latest.items() if p != msg.peer_id and self.live(p, now)
                   and w.weights_hash == self._my_weights.weights_hash]
        return self.self_id in top(make_key("join", self.task_id, msg.peer_id, msg.round), [self.self_id, *holders],
                                   JOIN_ANSWERS)

    def _on_UpdateAnnounce(self, msg: UpdateAnnounce, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if msg.task_id == self.task_id and msg.round > self._trained.get(msg.producer, (-1, ""))[0]:
            self._trained[msg.producer] = (msg.round, msg.base_hash)
            cur = self.rounds_seen.get(self.current)
            if self.stage is Stage.RUNNING and cur is not None and cur.index < msg.round \
                    and cur.phase in (Phase.GATHERING, Phase.VOTING):
                effects = self._advance(cur, now)  # it owes the current round no aggregate or vote (_owes)
        return effects + self._update(msg, now)

    def _update(self, msg: UpdateAnnounce, now: float) -> list[Effect]:
        rec = self._round(msg.round) if msg.task_id == self.task_id else None
        liveness = self._own_changes
        self._heard_now(msg.producer, now)
        if rec is not None and liveness == self._own_changes and msg in rec.heard_updates.get(msg.producer, ()):
            # A copy of an update heard before (a round that waits sends its update again every quiet window, to
            # every member): it says its producer is live, which it was, and nothing else. What time alone moves
            # is decided at next_deadline().
            return []
        if rec is not None and msg.producer != self.self_id and msg.producer not in self.audit.banned \
                and any(u.base_hash == msg.base_hash and u != msg for u in rec.heard_updates.get(msg.producer, ())):
            return self._two_updates(rec, msg, now)
        if rec is None or rec.phase in (Phase.VOTING, Phase.CLOSED):
            self.dropped["late_update"] += 1
            return []
        if len(msg.manifest_ids) != self.num_slices or msg.samples > self.max_samples:
            self.dropped["bad_update"] += 1
            if msg.producer == self.self_id or msg.producer in self.audit.banned:
                return []
            # Signed and impossible: banned here as on every node that hears it, and never waited for again
            # (a member whose every update is refused used to hold each round to its deadline).
            why = (f"claimed {msg.samples} samples, more than the {self.max_samples} a round's inner steps draw"
                   if msg.samples > self.max_samples else
                   f"sent {len(msg.manifest_ids)} slices where the task has {self.num_slices}")
            return [*self._ban(Impossible(msg.round, msg.producer, why)),
                    *(self._advance(rec, now) if rec.index == self.current else [])]
        if rec.base is not None and msg.base_hash != rec.base.weights_hash:
            self.dropped["wrong_base"] += 1
            return []
        self._hear_update(rec, msg)
        if rec.base is not None:  # it trained from our weights, if only too late: waited for next round
            self._delivered[msg.producer] = max(rec.index, self._delivered.get(msg.producer, -1))
            self._let_pass.pop(msg.producer, None)
        if rec.phase is not None and rec.phase not in (Phase.TRAINING, Phase.COLLECTING):
            # Too late to count, but an aggregate may list it: the slice's choice may have been waiting on it.
            self.dropped["late_update"] += 1
            return self._advance(rec, now) if rec.index == self.current and rec.phase is Phase.GATHERING else []
        if msg.producer not in rec.updates:
            rec.updates[msg.producer] = msg
            cached = self._members_cache.get(rec.index)
            if cached is not None and msg.producer not in cached[1]:
                del self._members_cache[rec.index]
        return self._advance(rec, now) if rec.index == self.current else []

    def _two_updates(self, rec: RoundState, msg: UpdateAnnounce, now: float) -> list[Effect]:
        """A producer signed two updates of one round from the same weights: an equivocator sending each peer its
        own, which splits the aggregators' inputs. An honest node never does (a restarted one announces the update
        it signed before, node/tasks/produced.py). Banned; its update leaves this round's collection, and what was
        heard of it stays, so aggregates already made over either version are still ranked and recomputed alike."""
        self._hear_update(rec, msg)
        rec.updates.pop(msg.producer, None)
        rec.updated_of = None
        self._members_cache.pop(rec.index, None)
        effects = self._ban(Impossible(msg.round, msg.producer, f"signed two updates of round {msg.round} from the "
                                                                f"same weights"))
        return effects + (self._advance(rec, now) if rec.index == self.current else [])

    @staticmethod
    def _hear_update(rec: RoundState, msg: UpdateAnnounce) -> None:
        heard = rec.heard_updates.setdefault(msg.producer, [])
        if msg in heard or len(heard) >= MAX_UPDATES_PER_PRODUCER:
            return
        heard.append(msg)

    @staticmethod
    def _keep_heard_from(rec: RoundState, base_hash: str) -> None:
        """Only updates trained from ``base_hash`` are inputs an aggregate of this round may name."""
        heard = {p: [u for u in us if u.base_hash == base_hash] for p, us in rec.heard_updates.items()}
        rec.heard_updates = {p: us for p, us in heard.items() if us}
        rec.lacking.clear()

    @staticmethod
    def _inputs_of(rec: RoundState, a: AggregateAnnounce) -> tuple[tuple[Input, ...], tuple] | None:
        """What recomputing ``a`` takes (the included inputs, and the screened ones with why), or None when it
        lists a producer we have not heard this round (or one banned). A listed manifest we did not hear (a
        producer restarted mid-round signs a second update; a restarted node never hears its old self's) is
        still checkable: its producer's signature and its label are checked where it is fetched. Only its
        samples are then unknown."""
        out = []
        for p, mid in (*zip(a.included, a.inputs), *zip(a.screened, a.screened_inputs)):
            heard = rec.heard_updates.get(p)
            if not heard:
                return None
            exact = next((u for u in heard if u.manifest_ids[a.slice] == mid), None)
            out.append(Input(p, mid, exact.samples if exact is not None else None))
        n = len(a.included)
        return tuple(out[:n]), tuple(zip(out[n:], a.screened_why))

    def _ban(self, proof: Impossible) -> list[Effect]:
        """Ban the signer of something no honest node signs from the task; like a forgery, it changes the
        members, the votes and the heads to move to."""
        self.audit.banned.add(proof.peer_id)
        self._members_cache.clear()
        self._best_dirty = True
        return [proof]

    def _judged(self, effects: list[Effect]) -> list[Effect]:
        """A ban changes the members, the votes and the heads to move to."""
        if any(isinstance(e, Forged) for e in effects):
            self._members_cache.clear()
            self._best_dirty = True
        return effects

    def _on_AggregateAnnounce(self, msg: AggregateAnnounce, now: float) -> list[Effect]:
        rec = self._round(msg.round) if msg.task_id == self.task_id else None
        self._heard_now(msg.aggregator, now)
        old = rec.aggregates.get(msg.slice, {}).get(msg.aggregator) if rec is not None else None
        effects: list[Effect] = []
        if old is not None and old != msg:
            # Judged even once the slice was chosen: a second version may arrive after this node moved on.
            effects += self._two_aggregates(rec, old, msg)
        if rec is None or rec.phase in (Phase.APPLYING, Phase.VOTING, Phase.CLOSED) \
                or not 0 <= msg.slice < self.num_slices:
            self.dropped["late_aggregate"] += 1
            return effects
        if old is None:
            rec.aggregates.setdefault(msg.slice, {})[msg.aggregator] = msg
        # A key we recomputed (or aggregated ourselves) judges a new aggregate at once.
        effects += self._judged(self.audit.judge(msg))
        return effects + (self._advance(rec, now) if rec.index == self.current else [])

    def _two_aggregates(self, rec: RoundState, old: AggregateAnnounce, new: AggregateAnnounce) -> list[Effect]:
        """One aggregator signed two aggregates of one slice. The same inputs with two results is a lie on
        its face (aggregation is deterministic): banned at once. Other inputs (an equivocator sending each
        peer its own version, or a process restarted mid-round that aggregated again) keep one of the two
        by a rule every node applies alike, so nodes that heard them in another order still rank alike."""
        who = new.aggregator
        if who == self.self_id:
            if self.audit.verdict(new.key()) == (True, new.result_hash):
                rec.aggregates[new.slice][who] = new  # ours, made now: not an old process's, heard again
                rec.ranked.pop(new.slice, None)
            return []
        self.dropped["two_aggregates"] += 1
        if old.key() == new.key() and old.result_hash != new.result_hash:
            if who in self.audit.banned:
                return []
            return self._ban(Impossible(new.round, who, f"signed two results for one aggregate of slice {new.slice} "
                                                        f"({old.result_hash[:16]} and {new.result_hash[:16]})"))
        keep = min(old, new, key=lambda m: (m.result_hash, m.manifest_id, repr(m.key())))
        if keep is new:
            rec.aggregates[new.slice][who] = new
            rec.ranked.pop(new.slice, None)
        return []

    def _on_Verified(self, ev: Verified, now: float) -> list[Effect]:
        waiting = self.audit.answer(ev)
        r, slice_index = ev.key[0], ev.key[1]
        rec = self.rounds_seen.get(r)
        effects: list[Effect] = []
        if rec is not None:
            for a in list(rec.aggregates.get(slice_index, {}).values()):
                if a.key() == ev.key:
                    effects += self.audit.judge(a)
        for accuser, a in waiting:
            effects += self.audit.judge(a, accuser=accuser)
        self._judged(effects)
        cur = self.rounds_seen.get(self.current)
        if self.stage is Stage.RUNNING and cur is not None:
            effects += self._advance(cur, now)
        return effects

    def _on_Accused(self, ev: Accused, now: float) -> list[Effect]:
        """A proof from a peer: judged by our own recomputation from the inputs we hold, never on its word."""
        a = ev.aggregate
        if a.task_id != self.task_id or a.aggregator in self.audit.banned or ev.accuser == self.self_id \
                or not 0 <= a.slice < self.num_slices:
            return []
        if self.audit.verdict(a.key())[0]:
            return self._judged(self.audit.judge(a, accuser=ev.accuser))
        rec = self._round(a.round)
        inputs = self._inputs_of(rec, a) if rec is not None else None
        if inputs is None:
            self.dropped["unjudged_proof"] += 1  # not our round, or we lack its inputs: nobody is charged
            return []
        self.audit.accuse(ev.accuser, a)
        return list(self.audit.ask(a, *inputs))

    def _on_WeightsAnnounce(self, msg: WeightsAnnounce, now: float) -> list[Effect]:
        if msg.task_id != self.task_id or msg.peer_id == self.self_id:
            return []
        liveness = self._own_changes
        self._heard_now(msg.peer_id, now)
        old = self.latest.get(msg.peer_id)
        same = old is msg or (old is not None and old == msg)  # the same object: a simulation's broadcast
        if same and (self.stage is Stage.RUNNING or liveness == self._own_changes):
            return []  # a re-announcement of a peer that was live: nothing new
        if old is None or msg.round >= old.round:
            self.latest[msg.peer_id] = msg
            best = self._best
            if best is not None and best.peer_id == msg.peer_id:
                self._best_dirty = True  # the best peer moved: maybe to something worse
            elif not self._best_stale(now) and self._usable(msg, now) and (
                    best is None or (-msg.work, -(msg.round + 1), msg.weights_hash) < best.rank()):
                self._best = Head.of(msg)  # Head.rank() of it, without building the Head for every vote
        pos = self.position.get(msg.peer_id)
        # Weights only move a peer forward (a joiner announces the rounds it follows before the one it
        # joins at), and a re-announcement of weights seen before never undoes a later join.
        if not same and (pos is None or msg.round + 1 >= pos[0]):
            if pos != (msg.round + 1, msg.weights_hash):
                self.position[msg.peer_id] = (msg.round + 1, msg.weights_hash)
                self._join_base.pop(msg.peer_id, None)
                self._members_cache.clear()
                self._zero_joins.discard(msg.peer_id)
        rec = self._round(msg.round)
        if rec is not None and rec.phase is not Phase.CLOSED:
            rec.weights[msg.peer_id] = msg
        if self.stage is Stage.RUNNING:
            cur = self.rounds_seen.get(self.current)
            if cur is not None:
                return self._overtaken(cur, now) or (self._advance(cur, now) if cur is rec else [])
            return []
        return self.tick(now)

    def _on_Trained(self, ev: Trained, now: float) -> list[Effect]:
        rec = self.rounds_seen.get(ev.round)
        if rec is None or rec.phase is not Phase.TRAINING or ev.round != self.current:
            return []  # abandoned while training
        self._move(rec, "trained")
        msg = UpdateAnnounce(task_id=self.task_id, round=ev.round, producer=self.self_id,
                             base_hash=rec.base.weights_hash, samples=ev.samples, manifest_ids=ev.manifest_ids,
                             losses=ev.losses, shards=ev.shards)
        rec.updates[self.self_id] = rec.my_update = msg
        self._hear_update(rec, msg)
        return [Publish(msg), *self._advance(rec, now)]

    def _on_Aggregated(self, ev: Aggregated, now: float) -> list[Effect]:
        if ev.round not in self.rounds_seen:
            return []
        msg = AggregateAnnounce(task_id=self.task_id, round=ev.round, slice=ev.slice, aggregator=self.self_id,
                                included=ev.included, inputs=ev.inputs, manifest_id=ev.manifest_id,
                                result_hash=ev.result_hash, screened=ev.screened,
                                screened_inputs=ev.screened_inputs, screened_why=ev.screened_why)
        self.audit.own(msg)
        # Aggregates of the same key heard before ours was made are judged by it now, as a recomputation's
        # verdict judges them: a forger that announced first would otherwise stay unjudged and, ranked first,
        # be applied (our verdict being known, nobody recomputes it).
        rec = self.rounds_seen[ev.round]
        judged = [e for a in list(rec.aggregates.get(ev.slice, {}).values()) if a.key() == msg.key()
                  for e in self.audit.judge(a)]
        return [Publish(msg), *self._judged(judged), *self._on_AggregateAnnounce(msg, now)]

    def _on_Applied(self, ev: Applied, now: float) -> list[Effect]:
        rec = self.rounds_seen.get(ev.round)
        assert rec is not None and rec.phase is Phase.APPLYING and ev.round == self.current, "Applied unasked"
        self._move(rec, "applied")
        rec.applied_at = now
        rec.mine = self.head = Head(round=ev.round + 1, weights_hash=ev.weights_hash, state_hash=ev.state_hash,
                                    work=rec.base.work + round_work(rec.chosen), peer_id=self.self_id,
                                    state_manifest=ev.state_manifest)
        msg = self._my_weights = WeightsAnnounce(
            task_id=self.task_id, round=ev.round, peer_id=self.self_id, weights_hash=ev.weights_hash,
            state_hash=ev.state_hash, state_manifest=ev.state_manifest, eval_loss=ev.eval_loss, work=self.head.work,
            train_share=ev.train_share)
        return [Publish(msg), *self._advance(rec, now)]

    def _on_Synced(self, ev: Synced, now: float) -> list[Effect]:
        assert self.stage is Stage.SYNCING, "Synced unasked"
        self._to("synced")
        self.head = ev.head
        self._sync_failures.pop(ev.head.weights_hash, None)
        self._my_weights = None  # what we announced last is no longer what we hold
        effects: list[Effect] = []
        if ev.head.round > 0:
            # Into a running swarm a node follows JOIN_LEAD_ROUNDS first; into a paused one (a healed
            # partition) it is counted at once, or no side would ever reach min_members again. A node
            # re-synced by a vote says so too: its last announced weights are not the ones it holds.
            if self._follow_after_sync and ev.head.round <= self.produce_from:
                # A joiner overtaken while it followed: the members still count it from the round it
                # declared (and wait for it there), so it keeps that round rather than declare a later
                # one, which a follower slower than the swarm's rounds would never reach.
                pass
            else:
                if self._follow_after_sync:
                    lead = JOIN_LEAD_ROUNDS
                else:
                    # At once only while the round cannot have closed anywhere: members that already
                    # gathered it without us would pick other aggregators than we do.
                    lead = 1 if self._closing(ev.head.round) else 0
                self.produce_from, self._declared = ev.head.round + lead, True
                effects.append(Publish(self._join(self.produce_from)))
        self._forget_before(ev.head.round)
        return effects + self._begin(now)

    def _closing(self, r: int) -> bool:
        """Round r (from the weights we hold) may be closing somewhere: min_members updates, or an aggregate, seen."""
        rec = self.rounds_seen.get(r)
        return rec is not None and (bool(rec.aggregates) or self._underway(r) >= self.min_members)

    def _on_SyncFailed(self, ev: SyncFailed, now: float) -> list[Effect]:
        assert self.stage is Stage.SYNCING, "SyncFailed unasked"
        failures = self._sync_failures[ev.head.weights_hash] = self._sync_failures.get(ev.head.weights_hash, 0) + 1
        if len(self._sync_failures) > 64:
            self._sync_failures = {ev.head.weights_hash: failures}
        until = self._blocked[ev.head.weights_hash] = now + min(self.quiet_after_s, SYNC_RETRY_S * 2 ** (failures - 1))
        if failures <= SYNC_RETRIES:
            self._listen_until = max(self._listen_until, until)
        self._best_dirty = True
        self._to("sync_failed")
        self.detail = f"weights {ev.head.weights_hash[:16]} not fetched: {ev.reason}"
        return self._begin(now)

    def _on_PeerGone(self, ev: PeerGone, now: float) -> list[Effect]:
        """Quiet from now rather than a heartbeat window after its last word: a member killed mid-round is
        not waited for. Its next message or heartbeat makes it live again (one reached through other peers
        is back within a heartbeat), and so does a later heartbeat in a shared log (share_heard)."""
        peer = ev.peer_id
        if peer != self.self_id and self.live(peer, now):
            self._gone_at[peer] = now
            self._away_changes += 1
            self.heard[peer] = now - self.quiet_after_s
            self._own_changes += 1
            self._members_cache.clear()
            self._best_dirty = True
        return self.tick(now)

    def _on_WorkFailed(self, ev: WorkFailed, now: float) -> list[Effect]:
        self._to("fail")
        self.detail = ev.reason
        return []

    # -- deciding what to do next ----------------------------------------------------------------

    def _usable(self, w: WeightsAnnounce, now: float) -> bool:
        return bool(w.state_manifest) and w.weights_hash not in self._blocked and self.live(w.peer_id, now) \
            and w.weights_hash not in self._outvoted.get(w.round, ()) and w.peer_id not in self.audit.banned

    def _best_stale(self, now: float) -> bool:
        if not self._best_dirty and self._best_seen[0] != self._heartbeats:
            if self._best_seen[1] == self._live_changes(now):
                self._best_seen = (self._heartbeats, self._best_seen[1])
            else:
                self._best_dirty = True
        return self._best_dirty

    def _best_known(self, now: float) -> Head | None:
        """The best live peer's head, kept between calls: recomputed only when liveness or a best peer changed."""
        if self._best_stale(now):
            seen = self._live_changes(now)
            self._best = best_head(Head.of(w) for w in self.latest.values() if self._usable(w, now))
            self._best_dirty = False
            self._best_seen = (self._heartbeats, seen)
        elif self._best is not None and not self.live(self._best.peer_id, now):
            self._best_dirty = True
            return self._best_known(now)
        return self._best

    def _better_head(self, now: float) -> tuple[Head, tuple[Head, ...] | None] | None:
        """A live peer's weights this node should hold instead of its own, and every source of them (None: every live
        peer that announced them, found by _sources() only where the node fetches them)."""
        best = self._best_known(now) if self.head is not None else self._most_held(now)
        if best is None or (self.head is not None and (best.same_weights(self.head)
                                                        or best.rank() >= self.head.rank())):
            return self._held_more(now)
        if self.head is not None and (best.work, best.round) == (self.head.work, self.head.round) \
                and self._holders(best, now) < self._holders(self.head, now) + 1:
            # Equal work at the same round: the hash alone must not overrule a round's vote (a dissenter
            # whose outer step went wrong would win on a smaller hash); the weights more live nodes hold
            # win, and only between equal groups (a healed 2-2 split) the smaller hash.
            return None
        if self.head is not None and best.round <= self.head.round \
                and self._holders(best, now) < self._holders(self.head, now) + 1:
            # Claimed work is the claimant's word: it never pulls a node back from weights that more live
            # nodes hold, this one counted (to a group banned elsewhere for forging, whose own history claims
            # more work; or to a node's own outvoted weights, announced after it lost a vote the others
            # closed before its weights reached them, when only one other node is heard yet after a heal).
            return None
        return best, None

    def _sources(self, better: tuple[Head, tuple[Head, ...] | None], now: float) -> tuple[Head, tuple[Head, ...]]:
        """_better_head()'s answer with its sources found."""
        best, sources = better
        if sources is not None:
            return best, sources
        return best, tuple(Head.of(w) for w in self.latest.values()
                           if self._usable(w, now) and Head.of(w).same_weights(best))

    def _held_more(self, now: float) -> tuple[Head, tuple[Head, ...]] | None:
        """A finished node's weights against the final weights that more live nodes hold. Claimed work decides
        between histories while rounds run, and a vote corrects a node that took the wrong one; after the last
        round no vote comes, so one peer's claim (a forger that everyone else banned, heard by nodes that were
        cut off when the proof went round) must not keep the nodes it pulled on its weights. Only a larger group
        moves a node (its own counted), so two groups never trade places. Counted once a heartbeat."""
        if self.stage is not Stage.DONE or self.head is None:
            return None
        if self._held_seen == self._heartbeats:
            return self._held
        self._held_seen, self._held = self._heartbeats, None
        # Holders count as voters do: peers whose work went into the weights lately (a crowd of fresh identities
        # announcing one head buys nothing), everyone where this node has applied nothing lately.
        recent = self._recent_contributors(self.head.round)
        groups: dict[tuple[str, str], list[WeightsAnnounce]] = {}
        final = self.head.round - 1
        for p, w in self.latest.items():
            if w.round == final and (not recent or p in recent) and self._usable(w, now):
                groups.setdefault((w.weights_hash, w.state_hash), []).append(w)
        mine = len(groups.get((self.head.weights_hash, self.head.state_hash), ())) + 1
        # Head.rank() of each announcement, without building the Heads of every group.
        most = min(groups.values(), default=(),
                   key=lambda ws: (-len(ws), min((-w.work, -(w.round + 1), w.weights_hash) for w in ws)))
        if len(most) > mine:
            heads = tuple(Head.of(w) for w in most)
            self._held = (min(heads, key=Head.rank), heads)
        return self._held

    def _most_held(self, now: float) -> Head | None:
        """A joiner's first weights: those the most live peers hold, then the best ranked. A joiner has no
        history to weigh against a peer's claimed work, and one peer's claim (a member banned by everyone
        else for forging, whose history diverged) must not outweigh what the many hold."""
        groups: dict[tuple[int, str, str], list[Head]] = {}
        for w in self.latest.values():
            if self._usable(w, now):
                head = Head.of(w)
                groups.setdefault((head.round, head.weights_hash, head.state_hash), []).append(head)
        if not groups:
            return None
        return min((min(heads, key=Head.rank) for heads in groups.values()),
                   key=lambda h: (-len(groups[(h.round, h.weights_hash, h.state_hash)]), h.rank()))

    def _holders(self, head: Head, now: float) -> int:
        """Live peers whose latest announcement is ``head``'s weights, counted as voters are: those whose work went
        into our weights lately (everyone where this node has applied nothing lately), so identities buy nothing."""
        recent = self._recent_contributors(self.head.round) if self.head is not None else set()
        return sum(1 for p, w in self.latest.items() if self.live(p, now) and (not recent or p in recent)
                   and Head.of(w).same_weights(head))

    def _sync(self, best: Head, sources: tuple[Head, ...], reason: str, *, follow: bool | None) -> list[Effect]:
        """``follow``: join JOIN_LEAD_ROUNDS ahead (True), or as soon as the round allows (False, or None
        after a vote or θ_0, which says the node stays a member as it was)."""
        self._to("sync")
        self._sync_round = best.round
        self._follow_after_sync = follow
        self.detail = f"fetching the weights of round {best.round} ({reason})"
        return [FetchState(best, sources, reason)]

    def _begin(self, now: float) -> list[Effect]:
        """Between rounds (or before the first): sync, pause, finish or open the next round."""
        if self.stage in (Stage.SYNCING, Stage.FAILED):
            return []
        better = self._better_head(now)
        following = better is not None and self._can_follow(better[0])
        if following:
            better = None
        if better is not None:
            reason = "joining" if self.head is None else "the swarm's history has more work"
            # A joiner (still before the round it declared) keeps following; a member that paused,
            # finished or resumed its own checkpoint is counted at once where it can be.
            pending_join = self.head is None or self.head.round < self.produce_from
            return self._sync(*self._sources(better, now), reason, follow=pending_join)
        if self.head is None:
            return self._begin_fresh(now)
        if self.head.round >= self.rounds:
            was = self.stage
            self._to("finish")
            self.detail = f"{self.rounds} rounds"
            return [] if was is Stage.DONE else [Finished(self.head.round)]
        if following:
            # The swarm closed this round already: follow it now. The members are counted in the rounds
            # they hold, ahead of us, so the min_members count from our weights would pause us here.
            return self._open(self.head.round, now)
        effects: list[Effect] = []
        if self.stage is Stage.LISTENING:
            if any(t > now and self._sync_failures.get(w, 0) <= SYNC_RETRIES for w, t in self._blocked.items()):
                return []  # weights that failed to come are asked for again in a moment: the round may be closed
            peers_agree = any(Head.of(w).same_weights(self.head) for p, w in self.latest.items()
                              if self.live(p, now)) or self._underway(self.head.round) >= self.min_members
            if now < self._listen_until and not peers_agree:
                return []  # a restarted node listens for a better history before it resumes its own
        r = self.head.round
        count = self._prospective(r, self.head, now)
        if count < self.min_members:
            if self.stage is not Stage.PAUSED:
                self._to("pause")
            self.detail = f"waiting for members ({count}/{self.min_members} hold these weights)"
            return effects
        return effects + self._open(r, now)

    def _can_follow(self, best: Head) -> bool:
        """A joiner a few rounds behind that holds those rounds' messages catches up by applying them, which
        is quicker than fetching the weights again: by the time a fetch that outlasts a round ends, the
        swarm is ahead once more, and a joiner that fetched again would chase it and never train."""
        if self.stage not in (Stage.RUNNING, Stage.PAUSED) or self.head is None or self.head.round > self.produce_from \
                or not 1 <= best.round - self.head.round <= AHEAD_ROUNDS:
            return False
        rec = self.rounds_seen.get(self.head.round)
        if rec is None or not any(u.base_hash == self.head.weights_hash for u in rec.updates.values()):
            return False
        # Each later round's updates were seen too (their base is checked when the round opens).
        return all(self.rounds_seen.get(r) is not None and self.rounds_seen[r].updates
                   for r in range(self.head.round + 1, best.round))

    def _begin_fresh(self, now: float) -> list[Effect]:
        if self.stage is not Stage.LISTENING:
            return []
        effects: list[Effect] = []
        fresh = bool(self._zero_joins)
        if not (fresh or now >= self._listen_until):
            return []
        if not self._joined_zero:
            self._joined_zero = self._declared = True
            effects.append(Publish(self._join(0)))
        # Counting live joiners only once enough have joined keeps a 1,000-node start linear.
        count = 1 + len(self._zero_joins)
        if count >= self.min_members:
            count = 1 + sum(1 for p in self._zero_joins if self.live(p, now))
        self.detail = f"waiting for members ({count}/{self.min_members})"
        if count >= self.min_members:
            self._to("sync")
            self._follow_after_sync = None
            effects.append(MakeInitial())
        return effects

    def _open(self, r: int, now: float) -> list[Effect]:
        self._to("start")
        self.current = r
        self._forget_before(r)
        rec = self._round(r)
        assert rec is not None
        if rec.phase is not None:
            # Round r again, from other weights: this node abandoned it for a history with more work at
            # the same round. The messages stay; what this node did from its old weights does not.
            updates = {p: u for p, u in rec.updates.items() if u.base_hash == self.head.weights_hash}
            aggregates = {s: {a: m for a, m in got.items() if set(m.included) <= set(updates)}
                          for s, got in rec.aggregates.items()}
            rec = self.rounds_seen[r] = RoundState(index=r, updates=updates,
                                                   heard_updates={p: [u] for p, u in updates.items()},
                                                   aggregates=aggregates, weights=dict(rec.weights))
            self._members_cache.pop(r, None)
        rec.base, rec.started_at = self.head, now
        rec.producing = r >= self.produce_from
        for producer in [p for p, u in rec.updates.items() if u.base_hash != self.head.weights_hash]:
            del rec.updates[producer]
            self.dropped["wrong_base"] += 1
        self._keep_heard_from(rec, self.head.weights_hash)
        rec.updated_of = None
        self._members_cache.pop(r, None)
        self.detail = ""
        effects: list[Effect] = []
        if self._resumed and rec.producing and self._underway(r) >= self.min_members:
            # Restarted into a round the others have already trained (they closed it without us or
            # would wait for our whole retraining): follow it and produce from the next one. Counted
            # from the round we actually resume, nobody waits for us; below min_members they need us.
            self.produce_from, rec.producing, self._declared = r + 1, False, True
            effects.append(Publish(self._join(r + 1)))
        self._resumed = False
        if rec.producing and r == self.produce_from and not effects:
            effects = self._first_round(rec)
        if rec.producing:
            self._move(rec, "train")
            return [*effects, Train(r, self.head.weights_hash, tuple(self.members(rec, now))), *self._advance(rec, now)]
        self._move(rec, "follow")
        return effects + self._advance(rec, now)

    def _first_round(self, rec: RoundState) -> list[Effect]:
        """A joiner at the round it produces from: train it, unless the swarm trained it without us."""
        r = rec.index
        if self._declared:
            # Members count us from the declared round and wait for our update there; only a round
            # they already closed (aggregates or weights of it seen) went on without us.
            late = bool(rec.aggregates) or bool(rec.weights)
        else:
            late = self._closing(r)
        if late:
            # Follow this round too, and declare the next one when it opens: a join declared now for
            # a round still behind the swarm would count us where nobody waits any more.
            self.produce_from, self._declared, rec.producing = r + 1, False, False
            return []
        if self._declared:
            return []
        self._declared = True
        return [Publish(self._join(r))]

    def _underway(self, r: int) -> int:
        """Peers' updates for round r from our weights already seen: the round is trained without us."""
        rec = self.rounds_seen.get(r)
        if rec is None or self.head is None:
            return 0
        return sum(1 for p, u in rec.updates.items() if p != self.self_id and u.base_hash == self.head.weights_hash)

    def _overtaken(self, rec: RoundState, now: float) -> list[Effect]:
        """The swarm closed this round without us (we were slow, cut off or restarted): take its weights."""
        if rec.phase not in (Phase.TRAINING, Phase.COLLECTING, Phase.GATHERING):
            return []
        better = self._better_head(now)
        # A peer one round ahead is normal (it applied first); two rounds ahead means the round closed
        # without us. A round stuck below min_members gives way to any history with more work.
        stuck = rec.phase is Phase.COLLECTING and now >= rec.started_at + self.round_deadline_s
        # A node following a round (restarted into it, or catching up) whose aggregates went out before it
        # could hear them: nobody sends them again once the round closed, so the swarm's weights are the way on.
        lost = not rec.producing and rec.phase is Phase.GATHERING and now >= rec.collected_at + self.quiet_after_s \
            and any(not rec.aggregates.get(s) for s in range(self.num_slices))
        if better is None or (not (stuck or lost) and better[0].round <= rec.index + 1):
            return []
        if not rec.producing and not (stuck or lost) and self._can_follow(better[0]):
            return []  # a joiner catching up on the rounds it holds the messages of
        self._move(rec, "abandon")
        why = f"round {rec.index}'s aggregates never reached us" if lost and better[0].round <= rec.index + 1 else \
            f"the swarm finished round {rec.index} without us"
        return self._sync(*self._sources(better, now), why, follow=not stuck)

    # -- closing rules ---------------------------------------------------------------------------

    def _advance(self, rec: RoundState, now: float) -> list[Effect]:
        if rec.phase is Phase.COLLECTING:
            return self._check_collect(rec, now)
        if rec.phase is Phase.GATHERING:
            return self._check_gather(rec, now)
        if rec.phase is Phase.VOTING:
            return self._check_vote(rec, now)
        return []

    def _check_collect(self, rec: RoundState, now: float) -> list[Effect]:
        members = self.members(rec, now)
        # The length test first, and the scan resumed where it last stopped (updates are only added),
        # keep a 1,000-member round linear in its messages.
        everyone = len(rec.updates) >= len(members) and self._updated_count(rec, members) == len(members)
        expired = now >= rec.started_at + self.round_deadline_s
        if not everyone and not expired and self._waiting(rec, members, now):
            # A gossip message lost on a loaded link would leave a live member waiting out the
            # deadline for an update that was sent: while we wait, ours goes out again every quiet window.
            return self._regossip(rec, now)
        if len(rec.updates) < self.min_members:
            # Below min_members this side of a partition produces no round: it waits, and keeps its
            # update in the air so the round can close the moment the others are back.
            self.detail = f"round {rec.index}: {len(rec.updates)}/{self.min_members} updates, waiting for members"
            return self._regossip(rec, now)
        late = () if everyone else tuple(p for p in members if p not in rec.updates and self.live(p, now))
        self._move(rec, "collected")
        self.detail = ""
        rec.collected_at = now
        self._record_misses(rec, late)
        rec.member_set = frozenset(members) | rec.updates.keys()
        rec.members = tuple(sorted(rec.member_set))
        pool = [p for p in members if self.live(p, now)]
        # Aggregators are drawn from the members whose work went into the weights lately: new identities
        # that never contributed are not handed slices to aggregate (two of them agreeing on a lie would
        # confirm each other). With too few such members, or no record yet (round 0), every live member is.
        recent = self._recent_contributors(rec.index)
        proven = [p for p in pool if p in recent]
        if len(proven) >= self.aggregators_per_slice:
            pool = proven
        updates = tuple(rec.updates[p] for p in sorted(rec.updates))
        effects: list[Effect] = [Overdue(rec.index, "collecting", late)] if late and expired else []
        for s in range(self.num_slices):
            rec.aggregators[s] = aggregators(self.task_id, rec.index, s, pool, self.aggregators_per_slice)
            if self.self_id in rec.aggregators[s]:
                effects.append(Aggregate(rec.index, s, updates))
        return effects + self._check_gather(rec, now)

    def _newcomer(self, peer: str, r: int) -> bool:
        """No update of round r−1 (or later) from ``peer`` on record here: a joiner, or a restarted node."""
        return self._delivered.get(peer, -2) < r - 1

    def _wait_kind(self, peer: str, r: int) -> str:
        """How long collecting round r waits for ``peer``: "deadline"; "share", a newcomer while newcomers lately let
        waits pass (NEWCOMER_WAIT_SHARE of the others' time); "none", one that let a deadline pass within
        MISSED_ROUNDS, or a newcomer's share and has sent no update since."""
        if peer == self.self_id:
            return "deadline"
        if self._missed.get(peer, -MISSED_ROUNDS - 1) > r - MISSED_ROUNDS or peer in self._let_pass:
            return "none"
        if not self._newcomer(peer, r) or self._newcomer_missed <= r - MISSED_ROUNDS:
            return "deadline"
        return "share"

    def _waiting(self, rec: RoundState, members: list[str], now: float) -> bool:
        """Whether collecting still waits for a member's update (_wait_kind): until the deadline; for a newcomer
        while newcomers lately wasted waits, until NEWCOMER_WAIT_SHARE of the time the others took has passed since
        they delivered; for a member that wasted one, not at all. A node with nobody else to wait for to the deadline
        (a node just started, with no record) waits so for every member but those. The lists are popped as members
        deliver, so a 1,000-member round stays linear in its messages."""
        if rec.wait_of is not members:
            kinds = [(p, self._wait_kind(p, rec.index)) for p in reversed(members)]
            rec.waited = [p for p, k in kinds if k == "deadline"]
            rec.newcomers = [p for p, k in kinds if k == "share"]
            if all(p == self.self_id for p in rec.waited):
                rec.waited, rec.newcomers = rec.waited + rec.newcomers, []
            rec.wait_of, rec.waited_in_at = members, None
        for waiting in (rec.waited, rec.newcomers):
            while waiting and waiting[-1] in rec.updates:
                waiting.pop()
        if rec.waited:
            rec.waited_in_at = None
            return True
        if not rec.newcomers:
            return False
        if rec.waited_in_at is None:
            rec.waited_in_at = now
        return now < self._newcomers_until(rec)

    @staticmethod
    def _newcomers_until(rec: RoundState) -> float:
        return rec.waited_in_at + NEWCOMER_WAIT_SHARE * max(0.0, rec.waited_in_at - rec.started_at)

    def _record_misses(self, rec: RoundState, late: tuple[str, ...]) -> None:
        """The live members this round's collection closed without: one waited for to the deadline is not waited for
        again within MISSED_ROUNDS; one whose newcomer's share passed, until it sends an update (_wait_kind)."""
        for p in late:
            kind = self._wait_kind(p, rec.index)
            if kind == "none":
                continue
            if self._newcomer(p, rec.index):
                self._newcomer_missed = rec.index
            if kind == "deadline":
                self._missed[p] = rec.index
            else:
                self._let_pass[p] = rec.index

    def _regossip(self, rec: RoundState, now: float) -> list[Effect]:
        """Our update (and our aggregates) again, a quiet window after the update first went out and every window after."""
        if rec.my_update is None or (rec.republish_at is not None and now < rec.republish_at):
            return []
        first = rec.republish_at is None
        rec.republish_at = now + self.quiet_after_s
        if first:
            return []
        mine = [a[self.self_id] for _, a in sorted(rec.aggregates.items()) if self.self_id in a]
        return [Publish(rec.my_update), *(Publish(m) for m in mine)]

    def _owes(self, peer: str, rec: RoundState, now: float) -> bool:
        """A member counted when the round collected still owes its aggregate or vote: it is live, has not
        joined again since (a restarted process or a re-synced node never sends the old one's), and has
        not said it holds a later round's weights (in a weights announcement, or in an update: _trained)."""
        if not self.live(peer, now) or self._joined_at.get(peer, float("-inf")) > rec.collected_at \
                or peer in self.audit.banned or self._trained_past(peer, rec):
            return False
        pos = self.position.get(peer)
        return pos is None or pos[0] <= rec.index + 1

    def _trained_past(self, peer: str, rec: RoundState) -> bool:
        """Whether an update of a later round says ``peer`` is done with ``rec``: its aggregates were made before it
        applied the round; its vote counts for nothing new if it trained from our weights, or two rounds on."""
        trained, base = self._trained.get(peer, (-1, ""))
        if rec.mine is None:  # gathering: what is owed is an aggregate
            return trained > rec.index
        return trained > rec.index + 1 or (trained == rec.index + 1 and base == rec.mine.weights_hash)

    @staticmethod
    def _updated_count(rec: RoundState, members: list[str]) -> int:
        i = rec.updated if rec.updated_of is members else 0
        while i < len(members) and members[i] in rec.updates:
            i += 1
        rec.updated_of, rec.updated = members, i
        return i

    def _check_gather(self, rec: RoundState, now: float) -> list[Effect]:
        # A producer gone since the round started served its slices to nobody for a while: aggregators that fetched
        # then left it out, and no aggregate still to come need account for it, even once it is back (a restarted
        # process), so the slice does not wait for one. An aggregator whose draw left the dead producer out would
        # otherwise wait for a co-aggregator that, by its own draw, has no slice to make, and that one for the other.
        collected = None
        """Producers still counted (computed at most once a call, and only after the quiet window)."""
        heard = rec.heard_updates
        eligible = rec.member_set
        banned = self.audit.banned
        chosen, complete, unknown = [], True, False
        charged: list[ScreenedOut] = []
        checks: list[Effect] = []
        unverified: list[int] = []
        """Slices whose chosen aggregate waits for a recomputation: at the deadline they count as missing."""
        for s in range(self.num_slices):
            expected = rec.aggregators.get(s, ())
            got = {a: m for a, m in rec.aggregates.get(s, {}).items()
                   if (a in expected or a in eligible) and a not in banned}
            if not got:
                complete = False
                continue
            key = (len(got), len(heard), len(banned), len(rec.aggregates[s]), len(rec.unverifiable))
            cached = rec.ranked.get(s)
            if cached is None or cached[0] != key:
                cands = [m for m in got.values() if m.key() not in rec.unverifiable] or list(got.values())
                cached = rec.ranked[s] = (
                    key, choose_aggregate(cands, heard),
                    any(p not in heard for m in got.values() for p in m.accounted()),
                    # Banned aggregators' results count here: a slice that had a forgery is checked to the end.
                    len({m.result_hash for m in rec.aggregates[s].values()}) > 1)
            best = cached[1]
            unknown = unknown or cached[2]
            # Aggregation and the screen are deterministic: one aggregate that decided on every update we hold
            # cannot be bettered, so after a heartbeat window (for updates of peers we did not count, which
            # other aggregators list) the slice need not wait for the other aggregators.
            settled = now >= rec.collected_at + self.quiet_after_s
            if settled:
                if collected is None:
                    collected = self._still_counted(rec, now)
                settled = collected <= best.accounted()
            waiting = not settled and any(a not in got and self._owes(a, rec, now) for a in expected)
            # An aggregate is applied as it is when we made it or two of the aggregators this round handed the
            # slice to vouch for it (the same inputs, the same result): any member may announce an aggregate,
            # and a newcomer's copy of a lie is no second opinion. Aggregators that disagree, an aggregate
            # nobody confirms (by CONFIRM_SHARE of the deadline at the latest), or a spot check: it is
            # recomputed from its inputs and applied only if it matches.
            confirmed = best.aggregator == self.self_id or len({
                m.aggregator for m in got.values()
                if m.aggregator in expected and m.result_hash == best.result_hash and m.key() == best.key()}) >= 2
            overdue_s = rec.collected_at + CONFIRM_SHARE * self.round_deadline_s
            # A round the swarm voted past is followed without recomputing what its aggregators agree on (the vote
            # checks it); aggregates that disagree are recomputed even then: ranked unchecked, the one listing the
            # most producers (a forger's, padded) would be applied, and cost a lost vote and a fetch of the weights.
            check = cached[3] or ((not confirmed and (not waiting or now >= overdue_s))
                                  or (rec.producing and self._spot(rec, s))) and not self._voted_past(rec, now)
            if check and best.aggregator != self.self_id and not self.audit.verdict(best.key())[0]:
                complete = False
                key = best.key()
                if key in self.audit.asked:
                    unverified.append(s)  # under way: its inputs are not built again on every message
                    continue
                inputs = None if rec.lacking.get(key) == len(heard) else self._inputs_of(rec, best)
                if inputs is not None:
                    checks += self.audit.ask(best, *inputs)
                else:
                    rec.lacking[key] = len(heard)
                    if rec.unknown_since is not None and now >= rec.unknown_since + self.quiet_after_s:
                        # It lists a producer never heard (or banned), so it cannot be recomputed: the slice takes
                        # the best aggregate that can be (or none, and the round fails), on the next pass.
                        rec.unverifiable.add(key)
                        if all(m.key() in rec.unverifiable for m in got.values()):
                            continue
                        rec.redo = True
                unverified.append(s)
                continue
            chosen.append(best)
            if best.screened and (confirmed or self.audit.verdict(best.key()) == (True, best.result_hash)):
                charged.append(ScreenedOut(rec.index, s, tuple(zip(best.screened, best.screened_why))))
            if waiting:
                complete = False
        if rec.redo:
            rec.redo = False
            return checks + self._check_gather(rec, now)
        if unknown:
            # An aggregate lists an update we have not heard: gossip brings an honest one within a
            # heartbeat window, and until then another node could rank this slice's aggregates otherwise.
            rec.unknown_since = now if rec.unknown_since is None else rec.unknown_since
            complete = complete and now >= rec.unknown_since + self.quiet_after_s
        if not complete and now < rec.collected_at + self.round_deadline_s:
            # An aggregator still collecting may have lost our update, and a member our aggregate.
            return checks + self._regossip(rec, now)
        self._move(rec, "gathered")
        late = tuple(sorted({a for s in range(self.num_slices) for a in rec.aggregators.get(s, ())
                             if a not in rec.aggregates.get(s, {}) and self._owes(a, rec, now)}))
        overdue = [*checks, *([Overdue(rec.index, "gathering", late)] if not complete and late else [])]
        if len(chosen) < self.num_slices:
            rec.chosen = ()
            missing = self.num_slices - len(chosen)
            why = f"{len(unverified)} slice(s) not recomputed in time" if unverified else \
                f"{missing} slice(s) got no aggregate in time"
            return [*overdue, Apply(rec.index, (), (), why)]
        rec.chosen = tuple(chosen)
        for a in chosen:
            self.contributed.update(dict.fromkeys(a.included, rec.index))
        oldest = rec.index - CONTRIBUTED_ROUNDS
        if len(self.contributed) > 2 * len(rec.members) + 16:  # prune now and then: linear in the record
            self.contributed = {p: r for p, r in self.contributed.items() if r > oldest}
        overdue += charged
        same = tuple(tuple(m for m in rec.aggregates[c.slice].values() if m.result_hash == c.result_hash and m is not c)
                     for c in chosen)
        best = self._best_known(now) if not rec.producing else None
        return [*overdue, Apply(rec.index, rec.chosen, same, behind=best is not None and best.round > rec.index + 1)]

    def _still_counted(self, rec: RoundState, now: float) -> set[str]:
        """The round's producers live now and not away since it started, kept while nothing they depend on moved."""
        key = (self._live_changes(now), len(rec.updates), self._away_changes)
        if rec.still_counted is None or rec.still_counted[0] != key:
            rec.still_counted = (key, {p for p in rec.updates
                                       if self.live(p, now) and not self._away_since(p, rec.started_at)})
        return rec.still_counted[1]

    def _away_since(self, peer: str, t: float) -> bool:
        """Whether ``peer``'s connections all closed, or it joined again (a new process), after ``t``."""
        return max(self._gone_at.get(peer, float("-inf")), self._joined_at.get(peer, float("-inf"))) > t

    def _voted_past(self, rec: RoundState, now: float) -> bool:
        """A round followed to catch up that the swarm has since voted on: its aggregates are not recomputed. The
        vote that closes it here checks them (weights other than the members' lose it, and the members' are
        fetched instead), and their inputs may be released already: a recomputation would wait out its fetches."""
        if rec.producing:
            return False
        best = self._best_known(now)
        return best is not None and best.round > rec.index + 1

    def _recent_contributors(self, r: int) -> set[str]:
        """Producers an aggregate this node applied included within CONTRIBUTED_ROUNDS before round ``r``."""
        return {p for p, last in self.contributed.items() if last > r - CONTRIBUTED_ROUNDS}

    def _spot(self, rec: RoundState, s: int) -> bool:
        drawn = rec.spot.get(s)
        if drawn is None:
            drawn = rec.spot[s] = self.spot_check > 0 and self.rng.random() < self.spot_check
        return drawn

    def _counted_voters(self, rec: RoundState) -> set[str]:
        """Whose weights are a vote on round r. Only the round's members vote: weights from a node that was not
        counted in the round (a joiner that counted itself early, a node on another history) are no vote on it.
        A member's vote counts while an aggregate this node applied in the last CONTRIBUTED_ROUNDS rounds included
        its work; a node that has applied none (a fresh joiner's first round) counts every member."""
        counted = set(rec.members)
        recent = self._recent_contributors(rec.index)
        if recent:
            counted &= recent
        return counted - self.audit.banned

    def _vote_decided(self, rec: RoundState, now: float) -> bool:
        """After a heartbeat window for every member's vote, whether one weights hash already holds more than half
        of the votes that could still be cast (ours included): no vote to come can change the winner, so a member
        that applies the round late, or not at all, no longer holds it open until its deadline. Evaluated again
        only when a vote or a ban came in since (a 1,000-member round stays linear)."""
        if now < rec.applied_at + self.quiet_after_s:
            return False
        key = (len(rec.weights), len(self.audit.banned))
        if rec.vote_checked == key:
            return False
        rec.vote_checked = key
        counted = self._counted_voters(rec)
        counted.discard(self.self_id)
        votes = Counter(w.weights_hash for p, w in rec.weights.items() if p in counted)
        votes[rec.mine.weights_hash] += 1
        return 2 * max(votes.values()) > len(counted) + 1

    def _check_vote(self, rec: RoundState, now: float) -> list[Effect]:
        voters = rec.weights
        if rec.waiting_votes is None:
            # Only votes that count are waited for: a member whose work went into no recent aggregate (a joiner
            # that never trains) would hold every round's vote open for nothing.
            counted = self._counted_voters(rec)
            rec.waiting_votes = [p for p in reversed(rec.members) if p != self.self_id and p in counted]
        # Members still to vote, popped as they vote: a 1,000-member round stays linear in its messages.
        while rec.waiting_votes and rec.waiting_votes[-1] in voters:
            rec.waiting_votes.pop()
        if now < rec.applied_at + self.round_deadline_s and any(
                p not in voters and self._owes(p, rec, now) for p in reversed(rec.waiting_votes)) \
                and not self._vote_decided(rec, now):
            return []
        # Overdue only where the vote ran to its deadline (a decided vote closes before it, as intended).
        late = tuple(p for p in rec.waiting_votes if p not in voters and self._owes(p, rec, now)) \
            if now >= rec.applied_at + self.round_deadline_s else ()
        self._move(rec, "voted")
        counted = self._counted_voters(rec)
        voters = {p: w for p, w in voters.items() if p in counted}
        winner, num_for, num_against = vote(rec.mine, voters)
        effects: list[Effect] = [Overdue(rec.index, "voting", late)] if late else []
        effects += [Dissent(rec.index, p, w.weights_hash) for p, w in sorted(voters.items()) if w.weights_hash != winner]
        closed = RoundClosed(round=rec.index, weights_hash=winner, agreed=winner == rec.mine.weights_hash,
                             num_agree=num_for, num_disagree=num_against, members=len(rec.members),
                             work=rec.mine.work, failed=not rec.chosen,
                             credits=None if winner != rec.mine.weights_hash
                             else credits_for(rec.chosen, rec.heard_updates) if rec.chosen else ())
        effects.append(closed)
        lost = ({w.weights_hash for w in voters.values()} | {rec.mine.weights_hash}) - {winner}
        if lost:
            self._outvoted[rec.index] = lost
            for old in [r for r in self._outvoted if r < rec.index - OUTVOTED_ROUNDS]:
                del self._outvoted[old]
            self._best_dirty = True
        if closed.agreed:
            return effects + self._begin(now)
        states = Counter(w.state_hash for w in voters.values() if w.weights_hash == winner)
        state = min(states, key=lambda s: (-states[s], s))
        sources = tuple(Head.of(w) for _, w in sorted(voters.items())
                        if w.weights_hash == winner and w.state_hash == state and w.state_manifest)
        if not sources:
            return effects + self._begin(now)
        return effects + self._sync(sources[0], sources, "our weights are not the vote's", follow=None)

    # -- status ----------------------------------------------------------------------------------

    def statistics(self, now: float) -> dict:
        rec = self.rounds_seen.get(self.current)
        return {"stage": self.stage.value, "round": self.current,
                "phase": rec.phase.value if rec and rec.phase else None, "detail": self.detail,
                "head": self.head.round if self.head else None, "work": self.head.work if self.head else 0,
                "members": self.members(rec, now) if rec is not None and rec.base is not None else [],
                "updates": len(rec.updates) if rec else 0, "dropped": dict(self.dropped),
                "banned": sorted(self.audit.banned),
                "not_waited": self.not_waited(),
                "announced": self.announced()}

    def not_waited(self, limit: int = 64) -> dict[str, int]:
        """Peers a round no longer waits for, each with the round it let a wait pass in (_wait_kind), latest first."""
        r = max(self.current, 0)
        missed = {**self._let_pass, **self._missed}
        out = sorted(((at, p) for p, at in missed.items() if self._wait_kind(p, r) == "none"), reverse=True)
        return {p: at for at, p in out[:limit]}

    def announced(self, limit: int = 64) -> dict[str, dict]:
        """What each peer last said of itself in its WeightsAnnounce (round, held-out loss, training share),
        for operators: at most ``limit`` peers, the most advanced first."""
        latest = sorted(self.latest.values(), key=lambda w: (-w.round, w.peer_id))[:limit]
        return {w.peer_id: {"round": w.round, "eval_loss": w.eval_loss, "train_share": w.train_share}
                for w in latest}


_HANDLERS = {kind: getattr(TaskMachine, f"_on_{kind.__name__}")
             for kind in (TaskJoin, UpdateAnnounce, AggregateAnnounce, WeightsAnnounce, Trained, Aggregated, Applied,
                          Synced, SyncFailed, WorkFailed, PeerGone, Verified, Accused)}
_SENDER = {TaskJoin: "peer_id", UpdateAnnounce: "producer", AggregateAnnounce: "aggregator", WeightsAnnounce: "peer_id",
           Accused: "accuser"}
"""The field naming a message's signer: nothing a banned peer says counts."""
