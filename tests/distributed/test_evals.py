"""Held-out evaluation under a gang: each data-parallel rank evaluates its share of every batch's
windows and the sums are all-reduced, so every rank returns the one-process figure having run
about 1/dp of the forwards (tp ranks of one data-parallel rank evaluate the same rows).

Tolerance: the sharded mean sums per-rank token sums where one process takes one mean; they differ
by float32 rounding (seen: under 1e-6). EVAL_ATOL 1e-5 catches a wrong share (a window counted
twice or missed moves the tiny model's mean by more than 1e-3 here).
"""

import json
from pathlib import Path

import pytest

from tests.distributed import torchrun
from training.engine.distributed import eval_rows

pytestmark = pytest.mark.distributed

PROBE = Path(__file__).with_name("lm_loss_probe.py")
EVAL_ATOL = 1e-5
WINDOWS = 10  # batches of 4, 4 and 2 rows: the short last batch is split too


@pytest.mark.parametrize(
    ("batch", "dp_rank", "dp", "rows"),
    [
        (4, 0, 1, slice(0, 4)),
        (4, 0, 2, slice(0, 2)),
        (4, 1, 2, slice(2, 4)),
        (3, 0, 2, slice(0, 2)),
        (3, 1, 2, slice(2, 3)),
        (2, 2, 4, slice(2, 2)),  # more ranks than rows: this rank has none
        (2, 3, 4, slice(2, 2)),
    ],
)
def test_each_data_parallel_rank_evaluates_its_share(batch, dp_rank, dp, rows):
    assert eval_rows(batch, dp_rank, dp) == rows


def test_the_shares_cover_every_row_once():
    for batch in range(1, 9):
        for dp in range(1, 6):
            covered = [i for r in range(dp) for i in range(batch)[eval_rows(batch, r, dp)]]
            assert covered == list(range(batch))


def _probe(out: Path, ranks: int, strategy: str, degrees: dict[str, int]) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    result = torchrun.launch([str(PROBE), str(out), strategy, json.dumps(degrees), str(WINDOWS)], ranks)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize(
    ("strategy", "degrees", "ranks", "dp"),
    [
        ("fsdp2", {"dp_shard": 2}, 2, 2),
        ("fsdp2+tp", {"dp_shard": 1, "tp": 2}, 2, 1),  # both tp ranks evaluate every row
    ],
)
def test_a_gang_evaluates_each_window_once_and_agrees_with_one_process(
    tmp_path, strategy, degrees, ranks, dp
):
    (alone,) = _probe(tmp_path / "one", 1, "single", {})
    assert alone["rows"] == WINDOWS
    ranks_seen = _probe(tmp_path / "gang", ranks, strategy, degrees)
    for seen in ranks_seen:
        assert abs(seen["loss"] - alone["loss"]) <= EVAL_ATOL, (seen, alone)
    # Each data-parallel rank ran its share (a rank past the last row runs one row, weighted 0,
    # so the collectives of a sharded model stay in step).
    rows = [seen["rows"] for seen in ranks_seen]
    assert sum(rows) == WINDOWS * (ranks // dp), rows
