"""Paths that modules derive from their own file: right after the house's moves (issue 29).

The chaos harness's stack read the examples from one folder above the repository once it moved to
chaos/ (the cluster burst failed in CI), and the gang launcher started torchrun in services/
instead of the repository root."""

import pytest

from chaos import stack as chaos_stack
from tests.conftest import REPO
from training.launch import elastic


@pytest.mark.parametrize("root", [chaos_stack.REPO, elastic.REPO_ROOT], ids=["chaos", "gang launcher"])
def test_a_module_s_repository_root_is_the_repository(root):
    assert root == REPO and (root / "pyproject.toml").is_file()
