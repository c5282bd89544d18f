"""Peers that start together with different models (collabopt.engine.model_records): the rule that names the swarm's
model (ties, a hostile minority), the records, and the check before a peer's first round."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hivemind.utils.timed_storage import ValueWithExpiration

from collabopt.engine.model_records import (
    ModelCheck,
    digest_of,
    first_difference,
    make_record,
    read_record,
    schema_of,
    swarm_model,
)
from collabopt.errors import ModelMismatchError

A = schema_of([torch.zeros(64, 16), torch.zeros(64), torch.zeros(4, 64), torch.zeros(4)])
B = schema_of([torch.zeros(48, 16), torch.zeros(48), torch.zeros(4, 48), torch.zeros(4)])


def test_the_model_most_peers_hold_is_the_swarms():
    a, b = digest_of(A), digest_of(B)
    assert swarm_model({"p1": (a, 5.0), "p2": (a, 6.0), "p3": (b, 1.0)}) == a  # (b came first: counts decide)
    assert swarm_model({"p1": (b, 1.0)}) == b and swarm_model({}) is None


def test_a_tie_goes_to_the_model_of_the_peer_that_started_first_then_to_the_smaller_digest():
    a, b = digest_of(A), digest_of(B)
    assert swarm_model({"p1": (a, 5.0), "p2": (b, 4.0)}) == b
    assert swarm_model({"p1": (a, 3.0), "p2": (b, 4.0), "p3": (a, 9.0), "p4": (b, 9.0)}) == a
    assert swarm_model({"p1": (a, 4.0), "p2": (b, 4.0)}) == min(a, b)
    # every peer computes the same, whatever the order it read the records in
    holders = {"p1": (a, 4.0), "p2": (b, 4.0), "p3": (b, 2.0), "p4": (a, 1.0)}
    assert swarm_model(dict(reversed(holders.items()))) == swarm_model(holders) == a


def test_one_hostile_record_does_not_outvote_an_honest_majority_even_with_the_earliest_start():
    a, hostile = digest_of(A), digest_of(["(1,) torch.float32"])
    assert swarm_model({"h": (hostile, 0.0), "p1": (a, 5.0), "p2": (a, 6.0)}) == a
    # what it can do: win a tie with a single honest peer by claiming an earlier start (docs/faults.md)
    assert swarm_model({"h": (hostile, 0.0), "p1": (a, 5.0)}) == hostile


def test_a_record_gives_back_its_schema_and_a_forged_or_malformed_one_is_ignored():
    record = make_record(A, 12.5)
    assert read_record(record) == (digest_of(A), 12.5, A, 4)
    assert read_record(dict(record, digest=digest_of(B))) is None  # the table does not give the digest
    assert read_record(dict(record, order=[0, 1, 2, 9])) is None  # an index out of the table
    assert read_record(dict(record, count=4.0)) is None  # (strict types, as the DHT's schema check)
    assert read_record(None) is None and read_record({"started": 1.0}) is None


def test_a_long_schema_is_cut_to_fit_a_record_and_its_digest_stays_the_whole_lists():
    schema = [f"({i}, 16) torch.float32" for i in range(1000)]  # 1000 distinct shapes
    record = make_record(schema, 1.0)
    digest, _, listed, count = read_record(record)
    assert digest == digest_of(schema) and count == 1000 and 0 < len(listed) < 1000 and listed == schema[:len(listed)]
    error = first_difference([*schema[:-1], "(7,) torch.float32"], listed, count, None, "the swarm")
    assert error.index == len(listed) and "not listed in its record" in str(error)


def test_the_error_names_the_first_differing_parameter_and_both_shapes():
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    error = first_difference(B, A, 4, names, "the model of 2 of the 3 peers")
    assert (error.index, error.name, error.local, error.swarm) == (0, "0.weight", B[0], A[0])
    assert "parameter 0 (0.weight) is (48, 16) torch.float32 here and (64, 16) torch.float32" in str(error)
    shorter = first_difference(A, A[:3], 3, names, "the swarm")
    assert (shorter.index, shorter.swarm) == (3, "none")
    half = schema_of([torch.zeros(64, 16, dtype=torch.float16)])
    assert "torch.float16 here and (64, 16) torch.float32" in str(first_difference(half, A, 4, None, "the swarm"))


def found(records: dict) -> ValueWithExpiration:
    return ValueWithExpiration({key: ValueWithExpiration(value, 99.0) for key, value in records.items()}, 99.0)


def check_for(schema_tensors: list[torch.Tensor], started: float = 10.0) -> ModelCheck:
    """A :class:`ModelCheck` over stand-ins of the loop's services (nothing is stored; stores are counted)."""
    check = object.__new__(ModelCheck)
    stores = []
    tracker = SimpleNamespace(local_public_key=b"me", metadata_expiration=60.0, training_progress_key="r_progress",
                              dht=SimpleNamespace(store=lambda **kwargs: stores.append(kwargs)))
    averager = SimpleNamespace(main_parameters=schema_tensors, model_names=None,
                               optimizer=SimpleNamespace(param_groups=[]))
    vars(check).update(loop=SimpleNamespace(state_averager=averager, local_epoch=0), tracker=tracker, key="r_models",
                       schema=schema_of(schema_tensors), started=started, done=False, first_epoch=0, stores=stores)
    check.digest = digest_of(check.schema)
    return check


MODEL_A = [torch.zeros(64, 16), torch.zeros(64), torch.zeros(4, 64), torch.zeros(4)]
MODEL_B = [torch.zeros(48, 16), torch.zeros(48), torch.zeros(4, 48), torch.zeros(4)]


def test_the_peer_of_the_minority_model_stops_and_the_majoritys_go_on():
    progress = found({b"me": {"epoch": 0}, b"a1": {"epoch": 0}, b"a2": {"epoch": 0}})
    models = found({b"a1": make_record(A, 11.0), b"a2": make_record(A, 12.0)})
    with pytest.raises(ModelMismatchError, match=r"parameter 0 is \(48, 16\) torch.float32 here and \(64, 16\)"):
        check_for(MODEL_B).judge(models, progress, last=False)
    majority = found({b"a1": make_record(A, 11.0), b"b": make_record(B, 1.0)})
    seen = found({b"me": {"epoch": 0}, b"a1": {"epoch": 0}, b"b": {"epoch": 0}})
    assert check_for(MODEL_A, started=12.0).judge(majority, seen, last=False) is True


def test_no_stop_where_everyone_runs_the_same_model_or_a_training_peers_record_is_missing():
    progress = found({b"me": {"epoch": 0}, b"a1": {"epoch": 0}})
    assert check_for(MODEL_A).judge(found({b"a1": make_record(A, 1.0)}), progress, last=False) is True
    # a1 trains but its model record is not there yet: nothing is decided before the last look
    assert check_for(MODEL_B, started=20.0).judge(found({}), progress, last=False) is False
    # records of peers that left (no progress record, or a goodbye) do not count
    gone = found({b"b1": make_record(B, 1.0), b"b2": make_record(B, 2.0)})
    left = found({b"me": {"epoch": 0}, b"b1": None})
    assert check_for(MODEL_A).judge(gone, left, last=True) is True
    # a record whose table does not give its digest is not counted
    forged = found({b"a1": dict(make_record(B, 1.0), digest=digest_of(A))})
    assert check_for(MODEL_A).judge(forged, progress, last=True) is True


def test_a_tie_of_two_peers_started_together_stops_the_later_one():
    progress = found({b"me": {"epoch": 0}, b"b": {"epoch": 0}})
    with pytest.raises(ModelMismatchError):
        check_for(MODEL_A, started=10.0).judge(found({b"b": make_record(B, 9.5)}), progress, last=True)
    assert check_for(MODEL_A, started=10.0).judge(found({b"b": make_record(B, 10.5)}), progress, last=True)


def test_the_check_ends_once_the_peer_took_part_in_a_round():
    check = check_for(MODEL_B)
    vars(check).update(_next_publish=float("inf"), _fetch=None, _next_poll=0.0)
    check.loop.local_epoch = 1  # a round (or a download) moved its epoch
    check.before_contribution()
    assert check.done
    check.judge = lambda *args, **kwargs: pytest.fail("a peer that took part in a round is checked again")
    check.before_contribution()
