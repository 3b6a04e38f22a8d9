"""One validation, used twice: the scheduler's manifest gate refuses whatever the trainer's
`curriculum_of` would refuse, so `ecc ito plan` / `train` never accept a manifest that cannot run (and
never consume a confirmation or reserve a key for one)."""

import copy
import json
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.errors import ErrorCode
from domain.curriculum import curriculum_of
from runtime.messaging.codec import Refusal
from services.scheduler.manifests import digest_of, verify

TINY = json.loads(
    (pathlib.Path(__file__).resolve().parents[2] / "examples" / "manifests" / "tiny.json").read_text()
)


def checked(doc: dict):
    text = json.dumps(doc)
    return verify(text, digest_of(text.encode()))


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda d: d["post_training"].update(recipe=["sftt"]), "post_training.recipe"),
        (lambda d: d.setdefault("stages", {}).update(midtrain={"tokens": 10**9}), "target.tokens"),
        (lambda d: d["post_training"].update(recipe=["sft", "sft"]), "post_training.recipe"),
        (
            lambda d: d.setdefault("stages", {}).update(long_context={"tokens": 4096, "seq_len": 32}),
            "long_context seq_len",
        ),
    ],
)
def test_a_manifest_the_trainer_would_refuse_is_manifest_invalid_at_plan_time(change, where):
    doc = copy.deepcopy(TINY)
    change(doc)
    with pytest.raises(Refusal) as refused:
        checked(doc)
    assert refused.value.code is ErrorCode.manifest_invalid
    assert where in refused.value.message


RECIPES = st.lists(st.sampled_from(["sft", "dpo", "rlvr", "sftt", "ppo"]), max_size=4)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    recipe=RECIPES,
    target=st.integers(1, 10**6),
    mid=st.one_of(st.none(), st.integers(1, 10**6)),
    lc=st.one_of(st.none(), st.tuples(st.integers(1, 10**5), st.sampled_from([32, 64, 128, 256]))),
)
def test_whatever_the_plan_accepts_the_trainers_guard_accepts(recipe, target, mid, lc):
    doc = copy.deepcopy(TINY)
    doc["post_training"]["recipe"] = recipe
    doc["target"]["tokens"] = target
    stages = {}
    if mid is not None:
        stages["midtrain"] = {"tokens": mid}
    if lc is not None:
        stages["long_context"] = {"tokens": lc[0], "seq_len": lc[1]}
    if stages:
        doc["stages"] = stages
    try:
        manifest, _ = checked(doc)
    except Refusal as refusal:
        assert refusal.code is ErrorCode.manifest_invalid
        return
    curriculum_of(manifest)  # must not raise: accepted at plan time means runnable
