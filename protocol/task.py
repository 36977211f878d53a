"""Task specs and the per-round task messages (tags 20-39): strict validation and task ids (TOML and plain
maps are read by protocol/spec_toml.py).

Past 500 lines: the spec and the messages share the validators and wire tags, and splitting them would put
the tag table in two files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

from protocol.codec import encode, message

KNOWN_RECIPES = ("tiny-lm", "hf-causal-lm", "hf-dpo")
HF_RECIPES = ("hf-causal-lm", "hf-dpo")
"""Recipes that build a ``transformers`` causal LM from a model directory published over SHARDCAST."""
KNOWN_DATASETS = ("stdlib-corpus", "published")
KNOWN_METHODS = ("full", "lora")
MAX_TARGET_MODULES = 32
MAX_PIN_CHARS = 64
KNOWN_COMPRESSIONS = ("int8", "int4", "int2", "topk")
AGGREGATE_COMPRESSIONS = ("int8", "int4", "int2")
"""How aggregators may encode a slice's aggregate (block-wise; a mean of several producers is dense)."""
DEFAULT_OUTER = (0.7, 0.9)
"""The outer (learning rate, Nesterov momentum) a spec gets when it names neither: DiLoCo's."""
OUTER_DEFAULTS = {"topk": (1.5, 0.0)}
"""Compressions whose outer defaults differ. Top-k's error feedback already carries most of each update into
later rounds, and SparseLoCo uses no outer momentum with it: with 0.9, top-k diverged from scratch (held-out
loss 3.8-3.9 after 3 rounds, 4.6-9.3 after 12, in node.train.simulate); with 0 it kept falling, and an outer
lr of 1.5 was the best of those tried (README "Compression")."""


def outer_defaults(compression: str) -> tuple[float, float]:
    """(outer_lr, outer_momentum) for an update ``compression`` (KNOWN_COMPRESSIONS)."""
    return OUTER_DEFAULTS.get(compression, DEFAULT_OUTER)


KNOWN_DEVICES = ("cpu", "cuda", "any")
AGGREGATION_RULES = ("mean", "trimmed_mean", "median", "centered_clip")
SCREEN_REASONS = ("empty", "duplicate", "opposed", "outsized", "one_sided")
"""Why the screen left a producer's slice out of an aggregate (node/tasks/robust.py ``screen``)."""
MAX_NORM_BOUND = 100.0

MAX_NAME_CHARS = 128
MAX_ROUNDS = 1_000_000
MAX_INNER_STEPS = 1_000_000
MAX_MEMBERS = 10_000
MAX_SLICES = 256
MAX_FRAGMENTS = 16
"""Streaming fragments a task may cut its model into: TinyLM has at least 17 tensors."""
MAX_DATASET_BYTES = 1 << 34
MAX_DATASET_SHARDS = 1 << 16
MAX_PARAMS = 2_000_000_000
MAX_BATCH = 65_536
MAX_ID_CHARS = 128
HEX_HASH_CHARS = 64
MAX_LOSSES = 64
DEFAULT_TASK_SPEC_BYTES = 16 * 1024
MAX_TRAINERS = 200
MAX_PROOF_BYTES = 60 * 1024
"""A sealed aggregate (or update) inside a proof: the proof must still fit a task message (64 KiB)."""
MAX_CLAIMED_SHARDS = 1024
"""Data shards an update names as the ones it trained on; a producer given more names none (not checkable)."""

SPECS_TOPIC = "shoal/tasks/1"


def task_topic(task_id: str) -> str:
    return f"shoal/task/1/{task_id}"


def _need(ok: bool, text: str) -> None:
    if not ok:
        raise ValueError(text)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _is_hex_hash(text: str) -> bool:
    return len(text) == HEX_HASH_CHARS and all(c in "0123456789abcdef" for c in text)


@message(tag=20)
@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "seq_len"):
            _need(getattr(self, name) >= 1, f"model.{name} must be >= 1")
        _need(self.n_layer <= 64 and self.d_model <= 8192 and self.seq_len <= 65536,
              "model too large: n_layer <= 64, d_model <= 8192, seq_len <= 65536")
        _need(self.d_model % self.n_head == 0, f"model.d_model ({self.d_model}) must be divisible by "
                                               f"model.n_head ({self.n_head})")
        _need(self.num_params() <= MAX_PARAMS, f"model has {self.num_params()} parameters, over {MAX_PARAMS}")

    def num_params(self) -> int:
        """TinyLM's parameter count: embeddings, blocks, final norm and head (node/train/model.py)."""
        d = self.d_model
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return 256 * d + self.seq_len * d + self.n_layer * block + 2 * d + 256 * d


@message(tag=21)
@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetSpec:
    kind: str
    max_bytes: int
    sha256: str
    num_shards: int
    manifest: str = ""
    """For kind "published": the SHARDCAST manifest id of the records file (``shoal dataset publish``)."""
    heldout_fraction: float = 0.05
    """The held-out split: this fraction of the records (the last ones), never trained on."""

    def __post_init__(self) -> None:
        _need(self.kind in KNOWN_DATASETS, f"dataset.kind {self.kind!r} is not one of {list(KNOWN_DATASETS)}")
        _need(1024 <= self.max_bytes <= MAX_DATASET_BYTES, f"dataset.max_bytes must be within 1024..{MAX_DATASET_BYTES}")
        _need(_is_hex_hash(self.sha256), "dataset.sha256 must be 64 lowercase hex characters")
        _need(1 <= self.num_shards <= MAX_DATASET_SHARDS, f"dataset.num_shards must be within 1..{MAX_DATASET_SHARDS}")
        _need(_finite(self.heldout_fraction) and 0 < self.heldout_fraction < 0.5,
              "dataset.heldout_fraction must be in (0, 0.5)")
        if self.kind == "published":
            _need(_is_hex_hash(self.manifest), "a published dataset needs dataset.manifest: the id that "
                                               "`shoal dataset publish` printed")
        else:
            _need(self.manifest == "", f"dataset.manifest is only for published datasets, not {self.kind!r}")


@message(tag=22)
@dataclass(frozen=True, slots=True, kw_only=True)
class AdamWSpec:
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    warmup_steps: int

    def __post_init__(self) -> None:
        _need(_finite(self.lr) and 0 < self.lr <= 1.0, f"adamw.lr must be in (0, 1], got {self.lr}")
        _need(_finite(self.weight_decay) and 0 <= self.weight_decay <= 1.0, "adamw.weight_decay must be in [0, 1]")
        _need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "adamw.beta1 and adamw.beta2 must be in [0, 1)")
        _need(0 <= self.warmup_steps <= MAX_INNER_STEPS, "adamw.warmup_steps must be >= 0")


@message(tag=23)
@dataclass(frozen=True, slots=True, kw_only=True)
class Requirements:
    min_memory_bytes: int
    device: str
    torch_version: str = ""
    """If set, only nodes whose trainer runs exactly this torch version join (e.g. "2.13.0+cpu")."""

    def __post_init__(self) -> None:
        _need(0 <= self.min_memory_bytes < 1 << 50, "requirements.min_memory_bytes must be >= 0")
        _need(self.device in KNOWN_DEVICES, f"requirements.device must be one of {list(KNOWN_DEVICES)}")
        _need(len(self.torch_version) <= MAX_PIN_CHARS and all(c.isalnum() or c in ".+-_" for c in self.torch_version),
              "requirements.torch_version must be a version string such as \"2.13.0+cpu\"")


@message(tag=30)
@dataclass(frozen=True, slots=True, kw_only=True)
class HFSpec:
    """A ``transformers`` causal LM: the model directory by manifest id, and what of it is trained."""

    model_manifest: str
    """SHARDCAST manifest id of the model bundle (``shoal model publish DIR``): config, tokenizer, safetensors."""
    method: str = "lora"
    """"lora": only adapter weights are trained, exchanged and aggregated; "full": every parameter."""
    seq_len: int = 128
    lora_r: int = 8
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] = ()
    """Module names LoRA wraps; empty takes peft's default for the architecture."""
    dpo_beta: float = 0.1

    def __post_init__(self) -> None:
        _need(_is_hex_hash(self.model_manifest), "hf.model_manifest must be the id `shoal model publish` printed "
                                                 "(64 lowercase hex characters)")
        _need(self.method in KNOWN_METHODS, f"hf.method must be one of {list(KNOWN_METHODS)}")
        _need(2 <= self.seq_len <= 65536, "hf.seq_len must be within 2..65536")
        _need(1 <= self.lora_r <= 1024, "hf.lora_r must be within 1..1024")
        _need(_finite(self.lora_alpha) and 0 < self.lora_alpha <= 4096, "hf.lora_alpha must be in (0, 4096]")
        _need(len(self.target_modules) <= MAX_TARGET_MODULES and
              all(0 < len(m) <= MAX_NAME_CHARS and m.replace("_", "").replace(".", "").isalnum()
                  for m in self.target_modules),
              "hf.target_modules must be up to 32 module names (letters, digits, _ and .)")
        _need(_finite(self.dpo_beta) and 0 < self.dpo_beta <= 100, "hf.dpo_beta must be in (0, 100]")


@message(tag=32, optional_tail=("spot_check", "screen"))
@dataclass(frozen=True, slots=True, kw_only=True)
class AggregationSpec:
    """How an aggregator combines the producers' copies of one slice (node/tasks/robust.py).

    The defaults are the weighted mean with no bound: what a spec without this table has always
    meant on the wire. A TOML spec that leaves the table out gets the measured default instead
    (``_DEFAULTS``, README "Robust aggregation")."""

    rule: str = "mean"
    """"mean": weighted by samples; "trimmed_mean", "median": per coordinate, unweighted;
    "centered_clip": one step of centered clipping around the coordinate-wise median, unweighted."""
    trim_fraction: float = 0.25
    """trimmed_mean: the share of producers dropped at each end of every coordinate (rounded down)."""
    clip_radius: float = 1.0
    """centered_clip: the radius, as a multiple of the median distance of the producers to the center."""
    norm_bound: float = 0.0
    """Before any rule, each producer's slice is scaled down to at most norm_bound x the median of that
    slice's producer norms; 0 leaves the slices as they are."""
    spot_check: float = 0.0
    """The chance that a member recomputes a slice's chosen aggregate from its inputs although no other
    aggregate contradicts it (one that contradicts another is always recomputed): what keeps a slice's
    only aggregator honest."""
    screen: bool = False
    """Before any rule, leave out the producers whose slice is no contribution: next to nothing (a norm at
    most 1% of the slice's median producer norm: zeros), a near copy of another producer's (cosine 0.99
    or more), or pointing against the median of the others (a sign flip); node/tasks/robust.py ``screen``.
    An aggregate that lists such a slice is then forged."""

    def __post_init__(self) -> None:
        _need(isinstance(self.screen, bool), "aggregation.screen must be true or false")
        _need(self.rule in AGGREGATION_RULES, f"aggregation.rule {self.rule!r} is not one of {list(AGGREGATION_RULES)}")
        _need(_finite(self.trim_fraction) and 0 < self.trim_fraction < 0.5, "aggregation.trim_fraction must be in (0, 0.5)")
        _need(_finite(self.clip_radius) and 0 < self.clip_radius <= MAX_NORM_BOUND,
              f"aggregation.clip_radius must be in (0, {MAX_NORM_BOUND:g}]")
        _need(_finite(self.norm_bound) and (self.norm_bound == 0 or 1 <= self.norm_bound <= MAX_NORM_BOUND),
              f"aggregation.norm_bound must be 0 (no bound) or within 1..{MAX_NORM_BOUND:g} (a multiple of the "
              "median producer norm; below 1 it would shrink most honest updates)")
        _need(_finite(self.spot_check) and 0 <= self.spot_check <= 1, "aggregation.spot_check must be within 0..1")


@message(tag=24, optional_tail=("aggregation", "trainers", "overlap", "aggregate_compression", "fragments"))
@dataclass(frozen=True, slots=True, kw_only=True)
class TaskSpec:
    """What to train and how; its hash is the task id, the initiator's signature is on the envelope."""

    name: str
    recipe: str
    model: ModelSpec | None = None
    """TinyLM's shape (recipe "tiny-lm"); None for the hf-* recipes, whose model is ``hf``."""
    dataset: DatasetSpec
    inner_steps: int
    time_budget_s: float
    batch_size: int
    adamw: AdamWSpec
    outer_lr: float
    outer_momentum: float
    compression: str
    aggregation_shards: int
    aggregators_per_shard: int
    rounds: int
    round_deadline_s: float
    min_members: int
    max_members: int
    requirements: Requirements
    seed: int
    created_ms: int
    init_manifest: str
    """SHARDCAST manifest id (hex) of the starting weights as named tensors; "" starts from ``seed``."""
    hf: HFSpec | None = None
    """The model of the hf-* recipes."""
    aggregation: AggregationSpec = AggregationSpec()
    """The aggregation rule and the norm bound; left off the wire at its default, so specs from before
    it existed keep their encoding and their task id."""
    trainers: tuple[str, ...] = ()
    """Peer ids of the only nodes that may take part (train, aggregate, vote); empty: open to anyone.
    A listed task keeps identities nobody vouched for out of its votes and its aggregation."""
    overlap: float = 0.0
    """The most of a round's inner steps a member takes while the round's updates and aggregates are exchanged,
    as a share of ``inner_steps`` (0: none). Those steps are moved onto the round's new weights and counted in
    the member's next update, which trains only the rest (tiny-lm, one trainer process)."""
    aggregate_compression: str = "int8"
    """How aggregators encode each slice's aggregate (AGGREGATE_COMPRESSIONS): every node downloads every
    aggregate, so this sets most of a round's bytes. No error feedback: the aggregate is recomputed by
    whoever checks it, from the signed updates alone."""
    fragments: int = 1
    """Streaming DiLoCo: the model's tensors cut into this many fragments of about equal size, round r syncing
    fragment r mod ``fragments`` only, each member training on from its own weights in between (1: every round
    syncs the whole model). A fragment is synced every ``fragments`` rounds: the traffic of rounds that many times
    longer, in pieces that many times smaller (tiny-lm, without overlap)."""

    def __post_init__(self) -> None:
        # The recipe is not checked here: a well-formed spec naming an unknown recipe must still
        # decode, so a node can decline it with a reason instead of dropping it as garbage.
        _need(0 < len(self.name) <= MAX_NAME_CHARS, f"name must have 1..{MAX_NAME_CHARS} characters")
        _need(0 < len(self.recipe) <= MAX_NAME_CHARS, "recipe must be named")
        _need(1 <= self.inner_steps <= MAX_INNER_STEPS, f"inner_steps must be within 1..{MAX_INNER_STEPS}")
        _need(_finite(self.time_budget_s) and 0 <= self.time_budget_s <= 86_400,
              "time_budget_s must be within 0..86400 (0 = no budget)")
        _need(1 <= self.batch_size <= MAX_BATCH, f"batch_size must be within 1..{MAX_BATCH}")
        _need(_finite(self.outer_lr) and 0 < self.outer_lr <= 10, f"outer_lr must be in (0, 10], got {self.outer_lr}")
        _need(_finite(self.outer_momentum) and 0 <= self.outer_momentum < 1, "outer_momentum must be in [0, 1)")
        _need(self.compression in KNOWN_COMPRESSIONS, f"compression must be one of {list(KNOWN_COMPRESSIONS)}")
        _need(self.aggregate_compression in AGGREGATE_COMPRESSIONS,
              f"aggregate_compression must be one of {list(AGGREGATE_COMPRESSIONS)}")
        _need(1 <= self.aggregation_shards <= MAX_SLICES, f"aggregation_shards must be within 1..{MAX_SLICES}")
        _need(1 <= self.aggregators_per_shard <= 16, "aggregators_per_shard must be within 1..16")
        _need(1 <= self.rounds <= MAX_ROUNDS, f"rounds must be within 1..{MAX_ROUNDS}")
        _need(_finite(self.round_deadline_s) and 1 <= self.round_deadline_s <= 86_400,
              "round_deadline_s must be within 1..86400")
        _need(self.time_budget_s < self.round_deadline_s, "time_budget_s must be shorter than round_deadline_s")
        _need(_finite(self.overlap) and 0 <= self.overlap <= 1,
              "overlap must be within 0..1: the share of a round's inner steps taken while its exchange runs")
        _need(1 <= self.fragments <= MAX_FRAGMENTS,
              f"fragments must be within 1..{MAX_FRAGMENTS} (1: every round syncs the whole model)")
        _need(self.fragments == 1 or self.overlap == 0, "fragments and overlap do not combine yet: set one of them")
        _need(1 <= self.min_members <= self.max_members <= MAX_MEMBERS,
              f"need 1 <= min_members <= max_members <= {MAX_MEMBERS}")
        _need(0 <= self.seed < 2**63 and 0 <= self.created_ms < 2**63, "seed and created_ms must fit in 63 bits")
        _need(len(self.trainers) <= MAX_TRAINERS, f"trainers may list at most {MAX_TRAINERS} peer ids (a spec must fit "
                                                  f"{DEFAULT_TASK_SPEC_BYTES // 1024} KiB)")
        _need(len(set(self.trainers)) == len(self.trainers)
              and all(isinstance(t, str) and _is_peer_id(t) for t in self.trainers),
              "trainers must list distinct peer ids (as `shoal status` prints them), or be empty for an open task")
        _need(not self.trainers or self.min_members <= len(self.trainers),
              f"min_members ({self.min_members}) exceeds the {len(self.trainers)} listed trainers")
        if self.recipe in HF_RECIPES:
            self._check_hf()
            return
        _need(self.hf is None, f"the hf table is only for the recipes {list(HF_RECIPES)}")
        _need(self.model is not None, "missing table model (n_layer, n_head, d_model, seq_len)")
        _need(self.dataset.kind != "published", "a published dataset needs one of the recipes "
                                                f"{list(HF_RECIPES)}, which tokenize it")
        _need(self.aggregation_shards <= self.model.num_params(), "aggregation_shards exceeds the parameter count")
        _need(self.aggregation_shards * self.fragments <= self.model.num_params(),
              "aggregation_shards x fragments exceeds the parameter count: every fragment is cut into that many slices")
        _need(self.init_manifest == "" or _is_hex_hash(self.init_manifest),
              "init_manifest must be a SHARDCAST manifest id (64 lowercase hex characters) or \"\"")
        window = self.model.seq_len + 1
        shard_bytes = self.dataset.max_bytes * 0.95 / self.dataset.num_shards
        _need(shard_bytes >= window, f"dataset shards of ~{int(shard_bytes)} bytes are shorter than one "
                                     f"training window of {window} bytes: use fewer shards or more bytes")
        _need(self.dataset.max_bytes * 0.05 >= window, f"the held-out 5% of dataset.max_bytes is shorter than one "
                                                       f"window of {window} bytes: raise dataset.max_bytes")

    def _check_hf(self) -> None:
        _need(self.hf is not None, f"recipe {self.recipe!r} needs an hf table (model_manifest, method, ...)")
        _need(self.model is None, f"recipe {self.recipe!r} takes its model from hf.model_manifest: drop the model table")
        _need(self.dataset.kind == "published", f"recipe {self.recipe!r} trains on a dataset published with "
                                                "`shoal dataset publish` (dataset.kind = \"published\")")
        _need(self.init_manifest == "", "init_manifest is for tiny-lm; an hf-* task starts from its model directory")
        _need(self.overlap == 0, f"overlap is not offered for recipe {self.recipe!r} yet (tiny-lm only): "
                                "leave it out or set it to 0")
        _need(self.fragments == 1, f"fragments is not offered for recipe {self.recipe!r} yet (tiny-lm only): "
                                   "leave it out or set it to 1")
        _need(self.recipe != "hf-dpo" or self.hf.method == "lora",
              "hf-dpo needs hf.method = \"lora\": its reference model is the base with the adapter off")

    def memory_estimate_bytes(self) -> int:
        """A rough peak for one trainer: weights, grads, AdamW moments, outer state, activations.

        0 for the hf-* recipes: their size is known only once the model directory is at hand, where
        the node checks it (node/train/recipes.py)."""
        if self.model is None:
            return 0
        params = self.model.num_params()
        activations = self.batch_size * self.model.seq_len * self.model.d_model * self.model.n_layer * 16 * 4
        return 8 * 4 * params + activations


def task_id(spec: TaskSpec) -> str:
    """The task's id: hex sha256 of the spec's canonical encoding."""
    return hashlib.sha256(encode(spec)).hexdigest()


def _is_peer_id(text: str) -> bool:
    """A libp2p peer id as Shoal's keys print it (base58btc of an identity multihash of an Ed25519 key)."""
    return 40 <= len(text) <= MAX_ID_CHARS and text.startswith("12D3KooW") and all(c in _BASE58 for c in text)


_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


def _check_id(value: str, what: str) -> None:
    _need(0 < len(value) <= MAX_ID_CHARS, f"{what} must have 1..{MAX_ID_CHARS} characters")


def _check_task(value: str) -> None:
    _need(_is_hex_hash(value), "task_id must be 64 lowercase hex characters")


@message(tag=25, optional_tail=("base_round", "base_hash"))
@dataclass(frozen=True, slots=True, kw_only=True)
class TaskJoin:
    """The signer takes part from ``round`` on (it will hold that round's starting weights).

    ``base_round`` and ``base_hash``: the weights it holds now, which ``round`` follows from (the starting weights
    of ``base_round``, at most ``round``); -1 and "" where it holds none yet (a first join at round 0). A member
    counts a joiner into its round only where this is its own history: a node that synced to another history at
    the same round index would otherwise be waited for, and it never sends an update from the member's weights."""

    task_id: str
    peer_id: str
    round: int
    base_round: int = -1
    base_hash: str = ""

    def __post_init__(self) -> None:
        _check_task(self.task_id)
        _check_id(self.peer_id, "peer_id")
        _need(0 <= self.round < MAX_ROUNDS, "round out of range")
        if self.base_hash:
            _need(_is_hex_hash(self.base_hash), "base_hash must be 64 lowercase hex characters")
            _need(0 <= self.base_round <= self.round, "base_round must be within 0..round")
        else:
            _need(self.base_round == -1, "base_round without base_hash")


@message(tag=26, optional_tail=("shards",))
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateAnnounce:
    """A producer's compressed pseudo-gradient for one round, one SHARDCAST manifest per slice.

    ``shards``: the data shards it trained on (its rendezvous assignment), sorted, the order it read them in, so
    a checker judges it on the batches it drew from them (node/tasks/training_check.py); empty: never judged."""

    task_id: str
    round: int
    producer: str
    base_hash: str
    samples: int
    manifest_ids: tuple[str, ...]
    losses: tuple[float, ...]
    shards: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_task(self.task_id)
        _check_id(self.producer, "producer")
        _need(0 <= self.round < MAX_ROUNDS, "round out of range")
        _need(_is_hex_hash(self.base_hash), "base_hash must be a hex sha256")
        _need(1 <= self.samples < 2**40, "samples must be positive")
        _need(1 <= len(self.manifest_ids) <= MAX_SLICES and all(_is_hex_hash(m) for m in self.manifest_ids),
              "manifest_ids must be 1..256 hex sha256 ids")
        _need(len(self.losses) <= MAX_LOSSES and all(_finite(x) for x in self.losses), "losses must be finite")
        _need(len(self.shards) <= MAX_CLAIMED_SHARDS and list(self.shards) == sorted(set(self.shards))
              and all(0 <= i < MAX_DATASET_SHARDS for i in self.shards),
              f"shards must be at most {MAX_CLAIMED_SHARDS} distinct shard indices, sorted")


@message(tag=27, optional_tail=("screened", "screened_inputs", "screened_why"))
@dataclass(frozen=True, slots=True, kw_only=True)
class AggregateAnnounce:
    """An aggregator's combination of one slice over ``included`` producers (sorted ids).

    ``inputs[i]`` is the manifest of producer ``included[i]``'s slice that went into it, as that
    producer's signed UpdateAnnounce names it: aggregation is deterministic, so anyone holding those
    updates can recompute ``result_hash``, and a signed aggregate that does not match them is proof.

    ``screened`` (sorted, none of them included) are the producers whose slices ``screened_inputs`` the
    screen left out, for ``screened_why``: the screen is deterministic too, so the claim is checked with
    the result. Every node charges them alike once the aggregate is confirmed, and a node that holds
    nothing beyond included and screened knows no aggregate of the slice can cover more."""

    task_id: str
    round: int
    slice: int
    aggregator: str
    included: tuple[str, ...]
    inputs: tuple[str, ...]
    manifest_id: str
    result_hash: str
    screened: tuple[str, ...] = ()
    screened_inputs: tuple[str, ...] = ()
    screened_why: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_task(self.task_id)
        _check_id(self.aggregator, "aggregator")
        _need(0 <= self.round < MAX_ROUNDS and 0 <= self.slice < MAX_SLICES, "round or slice out of range")
        _need(1 <= len(self.included) <= MAX_MEMBERS, "included must name 1..10000 producers")
        _need(list(self.included) == sorted(set(self.included)), "included must be sorted and distinct")
        _need(len(self.inputs) == len(self.included) and all(_is_hex_hash(m) for m in self.inputs),
              "inputs must name one hex manifest id per included producer")
        _need(_is_hex_hash(self.manifest_id) and _is_hex_hash(self.result_hash), "ids must be hex sha256")
        _need(len(self.included) + len(self.screened) <= MAX_MEMBERS, "included and screened name at most 10000")
        _need(list(self.screened) == sorted(set(self.screened)) and not set(self.screened) & set(self.included),
              "screened must be sorted, distinct and none of them included")
        _need(len(self.screened_inputs) == len(self.screened) and all(_is_hex_hash(m) for m in self.screened_inputs),
              "screened_inputs must name one hex manifest id per screened producer")
        _need(len(self.screened_why) == len(self.screened) and all(w in SCREEN_REASONS for w in self.screened_why),
              f"screened_why must give one of {list(SCREEN_REASONS)} per screened producer")

    def key(self) -> tuple:
        """What the aggregate is a function of: aggregates with equal keys must have equal results."""
        return self.round, self.slice, self.included, self.inputs, self.screened, self.screened_inputs, \
            self.screened_why

    def accounted(self) -> set[str]:
        """The producers this aggregate decided on: those it combined and those the screen left out."""
        return {*self.included, *self.screened}


@message(tag=33)
@dataclass(frozen=True, slots=True, kw_only=True)
class AggregateProof:
    """``accuser`` recomputed an aggregate from the updates it lists and got another result.

    ``aggregate`` is the accused AggregateAnnounce as its aggregator sealed it (signature included), so
    the claim is the aggregator's own; anyone holding the listed updates can recompute and judge it."""

    task_id: str
    accuser: str
    aggregate: bytes
    result_hash: str
    """What the accuser's recomputation gave."""

    def __post_init__(self) -> None:
        _check_task(self.task_id)
        _check_id(self.accuser, "accuser")
        _need(0 < len(self.aggregate) <= MAX_PROOF_BYTES, "aggregate must be a sealed envelope")
        _need(_is_hex_hash(self.result_hash), "result_hash must be a hex sha256")


@message(tag=35, optional_tail=("original", "advantage"))
@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingProof:
    """``accuser`` applied an update to its round's weights and found that it did not train on the batches its
    producer says it trained on (node/tasks/training_check.py): it raises their loss, or, with ``original``, it
    fits another producer's batches better than its own, beyond what the round's applied mean shows of the two
    sets (a copy of that producer's update, which the screen left out with it as near copies).

    ``update`` (and ``original``) are UpdateAnnounces as their producers sealed them (signatures included), so
    the claim is the producers' own; anyone holding the round's weights can fetch the updates and measure
    again."""

    task_id: str
    accuser: str
    update: bytes
    gain: float
    """What the accuser measured: loss before minus loss after on the producer's own batches, nats."""
    original: bytes = b""
    """A copy's original: the sealed UpdateAnnounce of the producer whose batches the update fits better."""
    advantage: float = 0.0
    """With ``original``: training_check.own_advantage of the update over the original, as the accuser measured
    it (negative: it fits the original's batches better)."""

    def __post_init__(self) -> None:
        _check_task(self.task_id)
        _check_id(self.accuser, "accuser")
        _need(0 < len(self.update) and len(self.update) + len(self.original) <= MAX_PROOF_BYTES,
              "update must be a sealed envelope (with original, both within the proof size)")
        _need(_finite(self.gain) and _finite(self.advantage), "gain and advantage must be finite")


@message(tag=28, optional_tail=("train_share",))
@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsAnnounce:
    """The weights after ``round`` (θ_{round+1}): their hash, the outer state's, and where to fetch both."""

    task_id: str
    round: int
    peer_id: str
    weights_hash: str
    state_hash: str
    state_manifest: str
    eval_loss: float | None
    """Held-out loss of these weights; None from a node that applied the round only to catch up."""
    work: int
    """Contributions applied in the history behind these weights (producers summed over rounds):
    after a partition heals, the history with more work wins."""
    train_share: float | None = None
    """The announcer's share of its rounds' wall time that its trainer trained, so far (0..1); None
    before it trained. Shown to operators only: no decision depends on it."""

    def __post_init__(self) -> None:
        _check_task(self.task_id)
        _check_id(self.peer_id, "peer_id")
        _need(0 <= self.round < MAX_ROUNDS, "round out of range")
        _need(0 <= self.work < 2**53, "work out of range")
        _need(_is_hex_hash(self.weights_hash) and _is_hex_hash(self.state_hash), "hashes must be hex sha256")
        _need(self.state_manifest == "" or _is_hex_hash(self.state_manifest), "state_manifest must be a hex id")
        _need(self.eval_loss is None or _finite(self.eval_loss), "eval_loss must be finite")
        _need(self.train_share is None or (_finite(self.train_share) and 0.0 <= self.train_share <= 1.0),
              "train_share must be within 0..1")


@message(tag=29)
@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetOffer:
    """The signer serves the task's dataset bytes (sha256 ``sha256``) as a SHARDCAST file manifest."""

    task_id: str
    sha256: str
    manifest_id: str

    def __post_init__(self) -> None:
        _check_task(self.task_id)
        _need(_is_hex_hash(self.sha256) and _is_hex_hash(self.manifest_id), "ids must be hex sha256")


@message(tag=31)
@dataclass(frozen=True, slots=True, kw_only=True)
class TaskCancel:
    """Ends ``task_id`` on every node; honoured only when signed by the key that signed the task's spec."""

    task_id: str
    reason: str

    def __post_init__(self) -> None:
        _check_task(self.task_id)
        _need(len(self.reason) <= 256, "reason must have at most 256 characters")


TASK_MESSAGES = (TaskJoin, UpdateAnnounce, AggregateAnnounce, WeightsAnnounce, DatasetOffer, AggregateProof,
                 TrainingProof)
