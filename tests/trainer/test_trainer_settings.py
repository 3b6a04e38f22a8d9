"""The trainer agent's own settings (services/trainer/trainer_settings.py): read from the environment
once, when the service starts, by the public names and defaults settings holds; the worker's code
reads the settings it is handed, never the environment."""

import ast
import pathlib

import pytest

from runtime.configuration import faults
from services.trainer.trainer_settings import TrainerSettings, load

TRAINER = pathlib.Path(__file__).resolve().parents[2] / "services" / "trainer"
CPUS = 4


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, TrainerSettings(threads=CPUS, gang_max_requeues=2, fault_spike_step=60, fault_step_delay_s=1.0)),
        (
            {"ITO_TRAINER_THREADS": "1", "ITO_GANG_MAX_REQUEUES": "0"},
            TrainerSettings(threads=1, gang_max_requeues=0),
        ),
        ({"OMP_NUM_THREADS": "2"}, TrainerSettings(threads=2)),
        (
            {"ITO_FAULT_POINT": "trainer.loss_spike", "ITO_FAULT_SPIKE_STEP": "24"},
            TrainerSettings(threads=CPUS, fault_point="trainer.loss_spike", fault_spike_step=24),
        ),
        (
            {"ITO_FAULT_POINT": "trainer.slow_steps", "ITO_FAULT_STEP_DELAY_S": "0.5"},
            TrainerSettings(threads=CPUS, fault_point="trainer.slow_steps", fault_step_delay_s=0.5),
        ),
        # a fault's own variable counts only with its fault point planted, as when it was read there
        ({"ITO_FAULT_SPIKE_STEP": "soon", "ITO_FAULT_STEP_DELAY_S": "slow"}, TrainerSettings(threads=CPUS)),
        # issue 40: the operator's compile switch (auto: on for cuda, off on CPU)
        ({"ITO_TRAINER_COMPILE": "auto"}, TrainerSettings(threads=CPUS, compile=None)),
        ({"ITO_TRAINER_COMPILE": "on"}, TrainerSettings(threads=CPUS, compile=True)),
        ({"ITO_TRAINER_COMPILE": "Off"}, TrainerSettings(threads=CPUS, compile=False)),
    ],
    ids=[
        "defaults",
        "threads-and-requeues",
        "omp-threads",
        "loss-spike",
        "slow-steps",
        "unplanted",
        "compile-auto",
        "compile-on",
        "compile-off",
    ],
)
def test_the_environment_read_once(env, expected):
    assert load(env, CPUS) == expected


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"ITO_GANG_MAX_REQUEUES": "two"}, "ITO_GANG_MAX_REQUEUES"),
        ({"ITO_FAULT_POINT": "trainer.loss_spike", "ITO_FAULT_SPIKE_STEP": ""}, "ITO_FAULT_SPIKE_STEP"),
        ({"ITO_TRAINER_THREADS": "many"}, "ITO_TRAINER_THREADS"),
        ({"ITO_TRAINER_COMPILE": "yes"}, "ITO_TRAINER_COMPILE needs to be auto, on or off"),
    ],
)
def test_a_value_that_is_no_number_stops_the_start_naming_it(env, name):
    with pytest.raises(ValueError, match=name):
        load(env, CPUS)


def test_a_fault_point_is_planted_by_name():
    planted = TrainerSettings(threads=1, fault_point=faults.TRAINER_SHARE_FAILS)
    assert planted.fault(faults.TRAINER_SHARE_FAILS)
    assert not planted.fault(faults.TRAINER_LOSS_SPIKE)
    assert not TrainerSettings(threads=1).fault(faults.TRAINER_SHARE_FAILS)
    with pytest.raises(AssertionError, match="unknown fault point"):
        planted.fault("trainer.typo")


def reads_environment(source: str) -> list[int]:
    """Lines that read the process environment (`os.environ`, `os.getenv`, `from os import environ`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in ("environ", "getenv", "environb")]
    return lines


@pytest.mark.parametrize(
    ("source", "lines"),
    [
        ("import os\nx = os.environ.get('A')\n", [2]),
        ("import os\nx = os.getenv('A')\n", [2]),
        ("from os import environ\n", [1]),
        ("x = settings.threads\n", []),
    ],
)
def test_the_environment_check_sees_a_read(source, lines):
    assert reads_environment(source) == lines


def test_the_worker_reads_no_environment():
    # issue 44: the worker read ITO_* variables while training (threads, requeues, fault points);
    # only the entry point reads the environment now, once, and hands the settings down
    reading = {
        path.name: found
        for path in sorted(TRAINER.glob("*.py"))
        if path.name != "app.py" and (found := reads_environment(path.read_text()))
    }
    assert reading == {}
