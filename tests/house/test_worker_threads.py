"""The suite's processes train on their worker's share of the cores. Two xdist workers on two cores,
each with torch's default of one thread per core, ran four busy threads on two cores; OpenMP's
waiting threads spin, so the in-process trainer tests took a quarter longer side by side."""

import subprocess
import sys

from tests.support import THREADS


def test_a_process_a_test_starts_uses_the_workers_share_of_the_cores():
    """A stack's services, torchrun's ranks and the bench are started from here: they inherit it."""
    child = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert int(child.stdout) == THREADS
