"""CI fails on a lint, format or type error: `.ci/run` runs `make test`, which runs `make lint`
first, and each tool it calls refuses a file with such an error."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


def test_ci_runs_the_test_target_and_the_test_target_runs_lint_first():
    assert "make test" in (ROOT / ".ci/run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\blint\b", makefile, re.M)
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "ruff check" in lint and "ruff format --check" in lint and "mypy" in lint


def run(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_each_tool_refuses_what_it_should(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    bad_lint = tmp_path / "lint.py"
    bad_lint.write_text("import os\n")  # unused import
    assert run(str(BIN / "ruff"), "check", "lint.py", cwd=tmp_path).returncode == 1
    bad_format = tmp_path / "fmt.py"
    bad_format.write_text("x = {  'a':1 }\n")
    assert run(str(BIN / "ruff"), "format", "--check", "fmt.py", cwd=tmp_path).returncode == 1
    bad_types = tmp_path / "typed.py"
    bad_types.write_text("def f(x: int) -> str:\n    return x\n")
    proc = run(str(BIN / "mypy"), "typed.py", cwd=tmp_path)
    assert proc.returncode == 1 and "[return-value]" in proc.stdout, proc.stdout
