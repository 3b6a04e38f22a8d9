"""The CI subset of `make chaos`'s cluster section (chaos/cluster.py): an exactly-once
burst of train requests on `ito-training up --cluster` (control plane only) while the NATS node
leading the WORK stream is SIGKILLed and a Redis primary is failed over. Every key gets exactly
one run, found again by its key, with exactly one work item. The happy path and a NATS node lost
under a training run: tests/e2e/test_cluster_e2e.py."""

import time

import pytest

from chaos import cluster as chaos_cluster
from chaos import stack as chaos_stack

pytestmark = pytest.mark.e2e

BURST = chaos_cluster.Burst(requests=1_000, keys=100, clients=16, prefix="ci")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    stack = chaos_stack.Stack(
        tmp_path_factory.mktemp("cluster-chaos"), chaos_stack.CONTROL_PLANE, cluster=True
    )
    yield stack
    stack.down()


def test_burst_through_a_nats_node_kill_and_a_redis_failover_creates_each_run_once(cluster):
    began = time.monotonic()
    row = chaos_cluster.fault_row(cluster, BURST, ("nats", "redis"))
    print(row, f"{time.monotonic() - began:.1f} s")
    assert row["answered"] == BURST.requests, row  # every request answered ok, retried where it had to be
    assert row["runs"] == row["records"] == row["work_items"] == BURST.keys, row
    assert row["duplicate_runs"] == 0 and row["runs_lost"] == 0, row
    assert row["retried"] > 0 or row["detection_s"] is None, row  # a fault noticed was retried through
