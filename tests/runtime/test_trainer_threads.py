"""How many torch threads a trainer agent trains with: ITO_TRAINER_THREADS when set; else the
OMP_NUM_THREADS the process was given (torch's own setting, which the agent used to override with
every core of the machine); else the cores this process may run on."""

import pytest

from runtime.configuration.settings import trainer_threads


@pytest.mark.parametrize(
    ("environ", "cpus", "threads"),
    [
        ({}, 8, 8),
        ({"ITO_TRAINER_THREADS": "3"}, 8, 3),
        ({"OMP_NUM_THREADS": "1"}, 8, 1),
        ({"ITO_TRAINER_THREADS": "4", "OMP_NUM_THREADS": "1"}, 8, 4),  # ours is the more specific
        ({"ITO_TRAINER_THREADS": "", "OMP_NUM_THREADS": ""}, 2, 2),  # empty is unset
        ({"ITO_TRAINER_THREADS": "0"}, 2, 1),  # at least one
        ({}, 0, 1),
    ],
)
def test_threads(environ, cpus, threads):
    assert trainer_threads(environ, cpus) == threads


def test_a_value_that_is_not_a_count_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        trainer_threads({"OMP_NUM_THREADS": "many"}, 2)
