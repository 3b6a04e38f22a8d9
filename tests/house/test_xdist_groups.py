"""The suite's xdist groups hold (issue 29): a group's tests run on one worker, so a module's
expensive fixture is made once and the timing-sensitive multi-process tests run one at a time.
With pytest 9 and pytest-xdist 3.8 a plain `xdist_group` mark is ignored (xdist writes the group
into `_nodeid`, which pytest 9 no longer reads): the quick bench's 80 s fixture ran on both workers,
and the serial group was never serial. A tiny suite under `-n 2 --dist loadgroup` shows both."""

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

MODULE = textwrap.dedent(
    """
    import os
    import pytest

    @pytest.fixture(scope="module")
    def made():
        with open(os.environ["SETUPS"], "a") as f:
            f.write(f"{os.getpid()}\\n")

    @pytest.mark.parametrize("n", range(6))
    def test_uses_it(made, n):
        pass
    """
)
OTHER = "\n".join(f"def test_other_{n}():\n    pass\n" for n in range(20))
CONFTEST = textwrap.dedent(
    """
    import pytest
    from tests.conftest import grouped

    def pytest_collection_modifyitems(config, items):
        for item in items:
            if "test_module" in item.nodeid:
                if {plain}:
                    item.add_marker(pytest.mark.xdist_group("module"))
                elif config.getvalue("loadgroup"):
                    grouped(item, "module")
    """
)


def workers_that_made_the_fixture(tmp_path, plain: bool) -> int:
    suite = tmp_path / ("plain" if plain else "grouped")
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST.format(plain=plain))
    (suite / "test_module.py").write_text(MODULE)
    (suite / "test_other.py").write_text(OTHER)
    setups = suite / "setups"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"],
        cwd=suite,
        env={"SETUPS": str(setups), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return len(setups.read_text().split())


def test_a_group_runs_on_one_worker_and_its_module_fixture_is_made_once(tmp_path):
    assert workers_that_made_the_fixture(tmp_path, plain=False) == 1
