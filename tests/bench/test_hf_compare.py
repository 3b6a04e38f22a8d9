"""The side-by-side rows against the Hugging Face stack (bench/hf_compare.py) in quick mode: they
run on the tiny HF-format model and chat rows, give finite figures, and both sides of each training
comparison train on the same token ids from the same weights. No timing is asserted (timing lives
in bench/)."""

import math

import pytest

from bench import hf_compare
from bench.report import HEADLINES, figure
from bench.run import quick


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return hf_compare.run_all(quick().hf)


@pytest.mark.timeout(400)
def test_quick_rows_have_finite_figures(results):
    assert set(results) == set(hf_compare.BENCHMARKS)
    for name, figures in results.items():
        for path, _ in HEADLINES[name]:
            assert is_number(figure(figures, path)), (name, path, figures)


def test_both_trainers_see_the_same_tokens_and_start_alike(results):
    for name in ("hf_sft", "hf_dpo"):
        figures = results[name]
        assert figures["same_tokens"], figures
        # Same starting weights (the base's HF directory) and the same first batch.
        assert figures["same_first_loss"], figures
    # DPO's first loss is log 2 on both sides (the policy is the reference).
    assert results["hf_dpo"]["ours_first_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert results["hf_dpo"]["trl_first_loss"] == pytest.approx(math.log(2), abs=1e-4)


def test_tokenization_counts_agree(results):
    assert results["hf_tokenize"]["same_token_count"], results["hf_tokenize"]
