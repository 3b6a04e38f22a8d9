"""The `sample` against transformers' `generate` rows (bench/sample_compare.py) in quick mode: both
shapes run, give finite figures, and both sides generate the same greedy tokens from the same
weights. No timing is asserted (timing lives in bench/)."""

import math

import pytest

from bench import sample_compare
from bench.report import HEADLINES, figure
from bench.run import quick


@pytest.mark.timeout(300)
def test_quick_rows_have_finite_figures_and_the_same_tokens():
    results = sample_compare.run_all(quick().sample)
    assert set(results) == set(sample_compare.BENCHMARKS)
    for name, figures in results.items():
        for path, _ in HEADLINES[name]:
            value = figure(figures, path)
            assert isinstance(value, int | float) and math.isfinite(value), (name, path, figures)
        assert figures["same_tokens"], figures
        assert figures["torch_threads"] == 1, figures
