"""The run plan as tables: stage order, token budget, data selection, refusals; the gate's judgment."""

import pathlib

import msgspec
import pytest

from contracts.manifest import Manifest
from domain.curriculum import LmPlan, PostPlan, curriculum_of
from training.recipes.evals import Check, describe, judge

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "manifests"
DATA = [
    {"name": "docs", "source": "builtin:pydoc_topics"},
    {"name": "arith", "source": "generated:arithmetic"},
    {"name": "needle", "source": "generated:needle"},
    {"name": "arith-eval", "source": "generated:arithmetic", "role": "eval"},
]


def manifest(stages=None, recipe=(), data=None, post=None, tokens=100_000) -> Manifest:
    doc = {
        "name": "t",
        "model": {"size": "tiny", "revision": "r"},
        "data": data or DATA,
        "target": {"tokens": tokens, "seq_len": 64, "batch_size": 16},
        "budget_cap_usd": 1.0,
        "post_training": {"recipe": list(recipe), **(post or {})},
    }
    if stages is not None:
        doc["stages"] = stages
    return msgspec.convert(doc, Manifest)


def test_without_stages_a_run_preps_its_data_and_pretrains_on_every_training_ref():
    plan = curriculum_of(manifest())
    assert plan.stage_names == ["data_prep", "pretrain"]  # there are eval refs to keep out of training
    [pre] = plan.stages
    assert pre.steps == 100_000 // (64 * 16) and pre.data == ("docs", "arith", "needle")
    assert (
        pre.decay == "cosine"
        and pre.rope_base is None
        and plan.eval_refs == {"arith-eval": "generated:arithmetic"}
    )


def test_tiny_example_does_the_data_prep_it_declares():
    """Declared means done: tiny.json declares 13-gram decontamination by ito-training data-prep."""
    tiny = msgspec.json.decode((EXAMPLES / "tiny.json").read_bytes(), type=Manifest)
    plan = curriculum_of(tiny)
    assert plan.stage_names == ["data_prep", "pretrain"] and plan.stages[0].steps == 400
    assert plan.data_prep.decontamination_ngram == 13


def test_no_declaration_and_no_eval_data_means_no_data_prep():
    plan = curriculum_of(manifest(data=[{"name": "docs", "source": "builtin:pydoc_topics"}]))
    assert plan.stage_names == ["pretrain"]


@pytest.mark.parametrize(
    "deco, why",
    [
        ({"method": "embedding-similarity", "provenance": "p"}, "cannot honour"),
        ({"method": "13-gram", "against": ["gsm8k"], "provenance": "p"}, "not eval refs"),
        ({"method": "8-gram", "provenance": "p"}, "cannot honour"),
    ],
)
def test_a_declaration_the_backend_cannot_honour_is_refused(deco, why):
    data = [{**DATA[0], "decontamination": deco}, *DATA[1:]]
    with pytest.raises(ValueError, match=why):
        curriculum_of(manifest(data=data))


def test_full_example_runs_every_stage_in_curriculum_order():
    full = msgspec.json.decode((EXAMPLES / "full.json").read_bytes(), type=Manifest)
    plan = curriculum_of(full)
    assert plan.stage_names == [
        "data_prep",
        "ladder",
        "pretrain",
        "midtrain",
        "long_context",
        "sft",
        "dpo",
        "rlvr",
    ]
    pre, mid, lc = plan.stages[:3]
    # target.tokens is the whole pre-training budget: midtrain and long_context are carved out of it
    assert pre.steps * 64 * 16 + mid.steps * 64 * 16 + lc.steps * 256 * 8 == full.target.tokens
    assert (mid.decay, mid.min_lr_ratio, mid.learning_rate) == ("linear", 0.0, pytest.approx(3e-4))
    assert lc.shape.max_seq_len == 256 and lc.rope_base == 500_000.0 and lc.short_seq_len == 64
    assert all(isinstance(p, PostPlan) and p.rope_base == 500_000.0 for p in plan.stages[3:])


def test_stage_data_defaults_and_selection():
    plan = curriculum_of(manifest(stages={"pretrain": {"data": ["docs"]}, "midtrain": {"tokens": 10_240}}))
    assert [p.data for p in plan.stages] == [("docs",), ("docs", "arith", "needle")]


def test_post_training_defaults_to_the_task_refs():
    plan = curriculum_of(manifest(recipe=["sft", "rlvr"]))
    assert [(p.name, p.data) for p in plan.stages] == [
        ("pretrain", ("docs", "arith", "needle")),
        ("sft", ("arith",)),
        ("rlvr", ("arith",)),
    ]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"stages": {"pretrain": {"data": ["nope"]}}}, "no training ref"),
        ({"stages": {"long_context": {"tokens": 1000, "seq_len": 64}}}, "must be longer"),
        ({"stages": {"long_context": {"tokens": 1000, "seq_len": 128, "rope_base": 5000.0}}}, "rope_base"),
        ({"stages": {"midtrain": {"tokens": 100_000}}}, "whole pre-training budget"),
        ({"stages": {"midtrain": {"tokens": 1000, "seq_len": 512}}}, "long_context stage"),
        ({"recipe": ["sft", "sft"]}, "at most once"),
        ({"recipe": ["ppo"]}, "at most once"),
        ({"recipe": ["sft"], "post": {"sft": {"data": ["docs"]}}}, "verifiable tasks"),
        (
            {
                "stages": {"pretrain": {"gate": {"min_task_accuracy": 0.5}}},
                "data": [{"name": "docs", "source": "builtin:pydoc_topics"}],
            },
            "no eval ref is a verifiable task",
        ),
        (
            {
                "recipe": ["dpo"],
                "post": {"dpo": {"gate": {"max_held_out_loss": 2.0}}},
                "data": [{"name": "arith", "source": "generated:arithmetic"}],
            },
            "no eval ref",
        ),
        (
            {
                "stages": {"ladder": {"max_budget_fraction": 0.001}, "pretrain": {}},
                "data": [*DATA, {"name": "mine", "source": "file:/tmp/mine.txt"}],
                "tokens": 20_000,
            },
            "allows no proxy step",
        ),
        ({"stages": {"data_prep": {"minhash_bands": 15}}}, "equal bands"),
        ({"stages": {"pretrain": None}}, "trains nothing"),
        ({"data": [*DATA, {"name": "docs", "source": "generated:reverse"}]}, "unique"),
    ],
)
def test_manifests_that_cannot_run_are_refused_before_training(kwargs, words):
    with pytest.raises(ValueError, match=words):
        curriculum_of(manifest(**kwargs))


def test_ladder_is_bounded_by_its_budget_fraction():
    data = [*DATA, {"name": "mine", "source": "file:/tmp/mine.txt"}]
    plan = curriculum_of(
        manifest(
            stages={"ladder": {"proxy_steps": 500, "max_budget_fraction": 0.1}, "pretrain": {}}, data=data
        )
    )
    pretrain_steps = plan.stages[0].steps  # 97
    assert plan.ladder.proxy_steps == int(0.1 * pretrain_steps) // 2 == 4
    assert plan.ladder.custom == ("mine",) and plan.ladder.reference == ("docs", "arith", "needle")
    skipped = curriculum_of(manifest(stages={"ladder": {}, "pretrain": {}}))
    assert skipped.ladder.custom == ()  # nothing to decide: the pipeline logs and skips it


@pytest.mark.parametrize(
    "checks, passed",
    [
        ([Check(name="held_out_loss", value=1.5, threshold=2.0, op="<=")], True),
        ([Check(name="held_out_loss", value=2.5, threshold=2.0, op="<=")], False),
        ([Check(name="task_accuracy", value=0.5, threshold=0.5, op=">=")], True),  # the bound itself passes
        ([Check(name="task_accuracy", value=0.49, threshold=0.5, op=">=")], False),
        (
            [Check(name="held_out_loss", value=9.0), Check(name="task_accuracy", value=None)],
            True,
        ),  # report only
        (
            [Check(name="a", value=1.0, threshold=2.0, op="<="), Check(name="b", value=0.1, threshold=0.2)],
            False,
        ),
    ],
)
def test_judge(checks, passed):
    metrics, ok = judge(checks)
    assert ok is passed
    assert [m.name for m in metrics] == [c.name for c in checks if c.value is not None]


def test_a_gated_check_that_cannot_be_measured_is_an_error_not_a_pass():
    with pytest.raises(ValueError, match="cannot be judged"):
        judge([Check(name="task_accuracy", value=None, threshold=0.1)])


def test_describe_states_the_numbers():
    metrics, _ = judge(
        [
            Check(name="held_out_loss", value=2.3125, threshold=1.0, op="<="),
            Check(name="task_accuracy", value=0.25),
        ]
    )
    assert describe("pretrain", metrics) == "pretrain gate failed: held_out_loss 2.3125 > 1.0000"
    metrics, _ = judge([Check(name="held_out_loss", value=0.5, threshold=1.0, op="<=")])
    assert describe("sft", metrics) == "sft gate passed: held_out_loss 0.5000 <= 1.0000"


def test_plans_are_lm_then_post():
    plan = curriculum_of(manifest(recipe=["dpo"]))
    assert [type(p) for p in plan.stages] == [LmPlan, PostPlan]
