"""Task specs: TOML loading, strict validation with clear reasons, ids, sealing and the wire."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from protocol.codec import decode, encode
from protocol.envelope import open_sealed, seal
from protocol.errors import ConfigError, DecodeError, SignatureError
from protocol.keys import Keypair
from protocol.spec_toml import load_spec_toml
from protocol.task import (AggregateAnnounce, AggregationSpec, TaskJoin, TaskSpec, TrainingProof, UpdateAnnounce,
                           WeightsAnnounce, task_id)

SPEC_TOML = """
[task]
name = "unit"
inner_steps = 10
batch_size = 4
rounds = 3
round_deadline_s = 30
compression = "int8"
aggregate_compression = "int8"
[task.model]
n_layer = 1
n_head = 2
d_model = 32
seq_len = 32
[task.dataset]
kind = "stdlib-corpus"
max_bytes = 65536
sha256 = "%s"
num_shards = 4
""" % ("ab" * 32)


def test_a_toml_spec_that_names_no_compression_gets_int4_updates_and_aggregates():
    text = SPEC_TOML.replace('compression = "int8"\naggregate_compression = "int8"\n', "")
    spec = load_spec_toml(text)
    assert (spec.compression, spec.aggregate_compression) == ("int4", "int4")
    assert decode(encode(spec)) == spec and task_id(spec) != task_id(load_spec_toml(SPEC_TOML))


def test_a_top_k_spec_gets_no_outer_momentum_unless_it_names_one():
    """top-k's error feedback carries each update on: its outer defaults are (1.5, 0) (protocol.task.OUTER_DEFAULTS)."""
    text = SPEC_TOML.replace('compression = "int8"\n', 'compression = "topk"\n', 1)
    spec = load_spec_toml(text)
    assert spec.compression == "topk" and (spec.outer_lr, spec.outer_momentum) == (1.5, 0.0)
    named = load_spec_toml(text.replace('compression = "topk"\n', 'compression = "topk"\nouter_momentum = 0.5\n', 1))
    assert (named.outer_lr, named.outer_momentum) == (1.5, 0.5)
    assert decode(encode(spec)) == spec


def test_toml_defaults_and_id_are_stable():
    spec = load_spec_toml(SPEC_TOML)
    assert spec.recipe == "tiny-lm" and spec.outer_lr == 0.7 and spec.outer_momentum == 0.9
    assert spec.aggregators_per_shard == 2 and spec.adamw.beta2 == 0.95
    assert task_id(spec) == task_id(load_spec_toml(SPEC_TOML))
    assert len(task_id(spec)) == 64
    assert task_id(dataclasses.replace(spec, seed=1)) != task_id(spec)
    assert decode(encode(spec)) == spec


@pytest.mark.parametrize("patch, words", [
    ("rounds = 0", "rounds"),
    ("rounds = \"3\"", "rounds"),
    ("bogus = 1", "unknown key bogus"),
    ("outer_lr = 50.0", "outer_lr"),
    ("batch_size = 0", "batch_size"),
    ("time_budget_s = 100.0", "time_budget_s"),
    ("min_members = 5\nmax_members = 2", "min_members"),
])
def test_absurd_values_name_the_key(patch, words):
    keys = {line.split("=")[0].strip() for line in patch.splitlines()}
    kept = "\n".join(line for line in SPEC_TOML.splitlines() if line.split("=")[0].strip() not in keys)
    text = kept.replace("[task.model]", patch + "\n[task.model]")
    with pytest.raises(ConfigError) as info:
        load_spec_toml(text)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_nested_mistakes_name_the_key():
    with pytest.raises(ConfigError, match="model.d_model"):
        load_spec_toml(SPEC_TOML.replace("d_model = 32", "d_model = 33"))
    with pytest.raises(ConfigError, match="adamw.lr"):
        load_spec_toml(SPEC_TOML + "[task.adamw]\nlr = 5.0\n")
    with pytest.raises(ConfigError, match="shorter than one training window"):
        load_spec_toml(SPEC_TOML.replace("num_shards = 4", "num_shards = 65536"))
    with pytest.raises(ConfigError, match="dataset.sha256"):
        load_spec_toml(SPEC_TOML.replace("ab" * 32, "xyz"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_spec_toml("[task")


def test_a_model_that_would_not_fit_is_refused():
    with pytest.raises(ConfigError, match="too large|parameters"):
        load_spec_toml(SPEC_TOML.replace("d_model = 32", "d_model = 8192").replace("n_layer = 1", "n_layer = 64"))


def test_unknown_recipe_still_decodes_so_it_can_be_declined():
    spec = dataclasses.replace(load_spec_toml(SPEC_TOML), recipe="mystery")
    assert decode(encode(spec)).recipe == "mystery"


def test_sealed_spec_and_tampering():
    key = Keypair.from_label("initiator")
    spec = load_spec_toml(SPEC_TOML)
    sealed = seal(spec, key)
    opened = open_sealed(sealed, expect=TaskSpec)
    assert opened.signer == key.peer_id and opened.message == spec
    tampered = bytearray(sealed)
    tampered[-70] ^= 1
    with pytest.raises((SignatureError, DecodeError)):
        open_sealed(bytes(tampered), expect=TaskSpec)


def test_round_messages_validate():
    tid = "cd" * 32
    h = "ef" * 32
    TaskJoin(task_id=tid, peer_id="p", round=0)
    with pytest.raises(ValueError):
        TaskJoin(task_id="nothex", peer_id="p", round=0)
    with pytest.raises(ValueError):
        UpdateAnnounce(task_id=tid, round=0, producer="p", base_hash=h, samples=0, manifest_ids=(h,), losses=())
    with pytest.raises(ValueError, match="sorted"):
        AggregateAnnounce(task_id=tid, round=0, slice=0, aggregator="a", included=("b", "a"), inputs=(h, h),
                          manifest_id=h, result_hash=h)
    with pytest.raises(ValueError, match="inputs"):
        AggregateAnnounce(task_id=tid, round=0, slice=0, aggregator="a", included=("a", "b"), inputs=(h,),
                          manifest_id=h, result_hash=h)
    with pytest.raises(ValueError):
        WeightsAnnounce(task_id=tid, round=0, peer_id="p", weights_hash=h, state_hash=h, state_manifest="",
                        eval_loss=float("nan"), work=0)
    msg = UpdateAnnounce(task_id=tid, round=1, producer="p", base_hash=h, samples=5, manifest_ids=(h, h),
                         losses=(1.0, 2.0))
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("share", [-0.1, 1.5, float("inf"), float("nan")])
def test_a_training_share_outside_0_to_1_is_refused(share):
    h = "ef" * 32
    with pytest.raises(ValueError, match="train_share"):
        WeightsAnnounce(task_id="cd" * 32, round=0, peer_id="p", weights_hash=h, state_hash=h, state_manifest="",
                        eval_loss=1.0, work=0, train_share=share)


def test_the_training_share_is_an_optional_tail_of_weights_announcements():
    h = "ef" * 32
    fields = dict(task_id="cd" * 32, round=2, peer_id="p", weights_hash=h, state_hash=h, state_manifest="",
                  eval_loss=None, work=7)
    without, with_share = WeightsAnnounce(**fields), WeightsAnnounce(**fields, train_share=0.75)
    # Without a share it goes on the wire as before the field existed.
    assert len(msgpack.unpackb(encode(without))) == 2 + len(dataclasses.fields(WeightsAnnounce)) - 1
    assert decode(encode(without)) == without and decode(encode(with_share)) == with_share


def test_the_shards_an_update_trained_on_are_an_optional_tail():
    h = "ef" * 32
    fields = dict(task_id="cd" * 32, round=1, producer="p", base_hash=h, samples=5, manifest_ids=(h,), losses=(1.0,))
    without, with_shards = UpdateAnnounce(**fields), UpdateAnnounce(**fields, shards=(2, 5, 9))
    assert len(msgpack.unpackb(encode(without))) == 2 + len(dataclasses.fields(UpdateAnnounce)) - 1
    assert decode(encode(without)) == without and decode(encode(with_shards)) == with_shards
    for bad in ((5, 2), (2, 2), (-1,), tuple(range(2000))):
        with pytest.raises(ValueError, match="shards"):
            UpdateAnnounce(**fields, shards=bad)


def test_the_weights_a_joiner_holds_are_an_optional_tail_of_its_join():
    h = "ef" * 32
    without, with_base = TaskJoin(task_id="cd" * 32, peer_id="p", round=4), \
        TaskJoin(task_id="cd" * 32, peer_id="p", round=4, base_round=2, base_hash=h)
    # A first join names no weights and goes on the wire as before the fields existed.
    assert len(msgpack.unpackb(encode(without))) == 2 + len(dataclasses.fields(TaskJoin)) - 2
    assert decode(encode(without)) == without and decode(encode(with_base)) == with_base
    for bad in (dict(base_round=5, base_hash=h), dict(base_round=-1, base_hash=h), dict(base_round=2),
                dict(base_round=2, base_hash="nothex")):
        with pytest.raises(ValueError, match="base_"):
            TaskJoin(task_id="cd" * 32, peer_id="p", round=4, **bad)


def test_a_training_proof_carries_a_sealed_update_and_a_finite_gain():
    key = Keypair.from_label("checker")
    h = "ef" * 32
    update = seal(UpdateAnnounce(task_id="cd" * 32, round=1, producer="p", base_hash=h, samples=5, manifest_ids=(h,),
                                 losses=(), shards=(1,)), key)
    proof = TrainingProof(task_id="cd" * 32, accuser=key.peer_id, update=update, gain=-0.2)
    assert decode(encode(proof)) == proof
    for bad in (dict(update=b""), dict(gain=float("nan")), dict(update=b"x" * (61 * 1024))):
        with pytest.raises(ValueError):
            TrainingProof(**{**dict(task_id="cd" * 32, accuser=key.peer_id, update=update, gain=-0.2), **bad})


LEGACY = "[task.aggregation]\nrule = \"mean\"\nnorm_bound = 0\nspot_check = 0\nscreen = false\n"
LEGACY_ID = "b638cfee3a1f3361f696c7e8986bbd5de8d00557ff3c5c3c6896149506a6489c"
"""SPEC_TOML's task id before TaskSpec had an aggregation field (computed by that code)."""


def test_a_spec_from_before_the_aggregation_option_keeps_its_encoding_and_id():
    spec = load_spec_toml(SPEC_TOML + LEGACY)
    assert spec.aggregation == AggregationSpec() and task_id(spec) == LEGACY_ID
    wire = msgpack.unpackb(encode(spec))
    assert len(wire) == 2 + len(dataclasses.fields(TaskSpec)) - len(TaskSpec.OPTIONAL_TAIL)  # left off at defaults
    assert decode(encode(spec)) == spec


def test_the_aggregation_option_travels_and_changes_the_id():
    spec = load_spec_toml(SPEC_TOML + "[task.aggregation]\nrule = \"trimmed_mean\"\ntrim_fraction = 0.2\n"
                                      "norm_bound = 3\n")
    assert spec.aggregation == AggregationSpec(rule="trimmed_mean", trim_fraction=0.2, norm_bound=3.0, spot_check=0.05,
                                               screen=True)
    assert decode(encode(spec)) == spec and task_id(spec) != LEGACY_ID
    # trainers and every field after it: left off
    assert len(msgpack.unpackb(encode(spec))) == 2 + len(dataclasses.fields(TaskSpec)) - (len(TaskSpec.OPTIONAL_TAIL) - 1)


def test_spot_checks_travel_in_the_spec_and_an_aggregation_table_from_before_them_decodes():
    spec = load_spec_toml(SPEC_TOML + "[task.aggregation]\nspot_check = 0.25\n")
    assert spec.aggregation.spot_check == 0.25 and decode(encode(spec)) == spec
    wire = msgpack.unpackb(encode(spec))
    assert wire[-1][-2:] == [0.25, True]
    wire[-1] = wire[-1][:-2]  # the table as it went on the wire before spot checks (and the screen) existed
    assert decode(msgpack.packb(wire)).aggregation.spot_check == 0.0
    with pytest.raises(ConfigError, match="spot_check"):
        load_spec_toml(SPEC_TOML + "[task.aggregation]\nspot_check = 1.5\n")


def test_the_default_sent_explicitly_is_refused_so_each_spec_has_one_encoding():
    wire = msgpack.unpackb(encode(load_spec_toml(SPEC_TOML + LEGACY)))
    wire.append([AggregationSpec.TAG, "mean", 0.25, 1.0, 0.0])
    with pytest.raises(DecodeError, match="default"):
        decode(msgpack.packb(wire))
    wire[-1] = [AggregationSpec.TAG, "median", 0.25, 1.0, 0.0]
    assert decode(msgpack.packb(wire)).aggregation.rule == "median"
    wire.append(["12D3KooW" + "a" * 44])  # trainers
    assert decode(msgpack.packb(wire)).trainers == ("12D3KooW" + "a" * 44,)
    wire[-1] = []
    with pytest.raises(DecodeError, match="default"):  # an empty list is the default: left off, never sent
        decode(msgpack.packb(wire))
    wire[-1] = ["12D3KooW" + "a" * 44]
    wire.append(0.0)  # overlap at its default: left off, never sent
    with pytest.raises(DecodeError, match="default"):
        decode(msgpack.packb(wire))
    wire[-1] = 0.5
    assert decode(msgpack.packb(wire)).overlap == 0.5
    wire.append("int8")  # aggregate_compression at its default: left off, never sent
    with pytest.raises(DecodeError, match="default"):
        decode(msgpack.packb(wire))
    wire[-1] = "int2"
    assert decode(msgpack.packb(wire)).aggregate_compression == "int2"
    wire.append(1)  # fragments at its default: left off, never sent
    with pytest.raises(DecodeError, match="default"):
        decode(msgpack.packb(wire))
    wire[-1] = 4
    with pytest.raises(DecodeError, match="do not combine"):  # overlap is 0.5 here
        decode(msgpack.packb(wire))
    wire.append("one too many")
    with pytest.raises(DecodeError, match="fields"):
        decode(msgpack.packb(wire))


def test_a_toml_spec_without_the_table_gets_the_measured_default():
    from protocol.spec_toml import _DEFAULTS
    assert load_spec_toml(SPEC_TOML).aggregation == AggregationSpec(**_DEFAULTS["aggregation"])
    assert load_spec_toml(SPEC_TOML).aggregation != AggregationSpec()


def test_the_screen_travels_in_the_spec_and_an_aggregation_table_from_before_it_decodes_without_it():
    spec = load_spec_toml(SPEC_TOML + "[task.aggregation]\nspot_check = 0.25\n")
    assert spec.aggregation.screen is True
    wire = msgpack.unpackb(encode(spec))
    wire[-1] = wire[-1][:-1]  # the table as it went on the wire before the screen existed
    assert decode(msgpack.packb(wire)).aggregation == AggregationSpec(**{**_aggregation(spec), "screen": False})
    off = load_spec_toml(SPEC_TOML + "[task.aggregation]\nscreen = false\n")
    assert off.aggregation.screen is False and task_id(off) != task_id(spec)
    with pytest.raises(ConfigError, match="aggregation.screen must be true or false"):
        load_spec_toml(SPEC_TOML + "[task.aggregation]\nscreen = \"yes\"\n")


def _aggregation(spec) -> dict:
    return dataclasses.asdict(spec.aggregation)


@pytest.mark.parametrize("table, words", [
    ("rule = \"krum\"", "aggregation.rule 'krum' is not one of"),
    ("rule = 3", "aggregation.rule"),
    ("trim_fraction = 0.5", "aggregation.trim_fraction must be in (0, 0.5)"),
    ("clip_radius = 0", "aggregation.clip_radius"),
    ("norm_bound = 0.5", "aggregation.norm_bound must be 0 (no bound) or within 1..100"),
    ("norm_bound = inf", "aggregation.norm_bound"),
    ("bogus = 1", "unknown key aggregation.bogus"),
])
def test_aggregation_mistakes_name_the_key(table, words):
    with pytest.raises(ConfigError) as info:
        load_spec_toml(SPEC_TOML + "[task.aggregation]\n" + table + "\n")
    assert words in str(info.value) and "\n" not in str(info.value)


def test_listed_trainers_travel_in_the_spec_and_change_its_id():
    a, b = Keypair.from_label("trainer-a").peer_id, Keypair.from_label("trainer-b").peer_id
    spec = load_spec_toml(SPEC_TOML.replace("[task]\n", f'[task]\ntrainers = ["{a}", "{b}"]\n', 1))
    assert spec.trainers == (a, b) and decode(encode(spec)) == spec
    assert task_id(spec) != task_id(load_spec_toml(SPEC_TOML))


@pytest.mark.parametrize("trainers, match", [
    ('["not-a-peer-id"]', "distinct peer ids"),
    ('["{a}", "{a}"]', "distinct peer ids"),
    ('"{a}"', "list of strings"),
])
def test_a_bad_trainers_list_is_refused_with_the_key_named(trainers, match):
    a = Keypair.from_label("trainer-a").peer_id
    with pytest.raises(ConfigError, match=match):
        load_spec_toml(SPEC_TOML.replace("[task]\n", "[task]\ntrainers = " + trainers.replace("{a}", a) + "\n", 1))


def test_listed_trainers_must_be_able_to_reach_min_members():
    a = Keypair.from_label("trainer-a").peer_id
    with pytest.raises(ConfigError, match="min_members"):
        load_spec_toml(SPEC_TOML.replace("[task]\n", f'[task]\nmin_members = 2\ntrainers = ["{a}"]\n', 1))


def test_overlap_travels_in_the_spec_changes_its_id_and_is_left_off_at_zero():
    spec = load_spec_toml(SPEC_TOML.replace("[task]\n", "[task]\noverlap = 0.5\n", 1))
    assert spec.overlap == 0.5 and decode(encode(spec)) == spec
    plain = load_spec_toml(SPEC_TOML)
    assert task_id(spec) != task_id(plain) and plain.overlap == 0.0
    assert load_spec_toml(SPEC_TOML.replace("[task]\n", "[task]\noverlap = 0\n", 1)) == plain
    # One encoding per spec: with trainers empty and overlap 0, the tail is cut back to aggregation.
    assert len(msgpack.unpackb(encode(plain))) == len(msgpack.unpackb(encode(spec))) - 2


@pytest.mark.parametrize("value, match", [("1.5", "overlap must be within 0..1"), ("-0.1", "overlap must be"),
                                          ("true", "must be a number"), ('"half"', "must be a number")])
def test_a_bad_overlap_is_refused_with_the_key_named(value, match):
    with pytest.raises(ConfigError, match=match):
        load_spec_toml(SPEC_TOML.replace("[task]\n", f"[task]\noverlap = {value}\n", 1))


def test_aggregate_compression_travels_in_the_spec_and_is_left_off_at_int8():
    spec = load_spec_toml(SPEC_TOML.replace('aggregate_compression = "int8"', 'aggregate_compression = "int4"'))
    assert spec.aggregate_compression == "int4" and decode(encode(spec)) == spec
    plain = load_spec_toml(SPEC_TOML)
    assert task_id(spec) != task_id(plain) and plain.aggregate_compression == "int8"
    assert load_spec_toml(SPEC_TOML.replace('aggregate_compression = "int8"\n', '')) == \
        dataclasses.replace(plain, aggregate_compression="int4")  # a TOML spec that names none: int4
    # The fields before it in the tail go on the wire at their defaults; at int8 the tail is cut back.
    assert len(msgpack.unpackb(encode(plain))) == len(msgpack.unpackb(encode(spec))) - 3


@pytest.mark.parametrize("value", ['"topk"', '"int16"', '"fp32"'])
def test_an_aggregate_compression_aggregators_cannot_write_is_refused(value):
    with pytest.raises(ConfigError, match=r"aggregate_compression must be one of \['int8', 'int4', 'int2'\]"):
        load_spec_toml(SPEC_TOML.replace('aggregate_compression = "int8"', f"aggregate_compression = {value}"))
