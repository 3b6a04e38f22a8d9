"""The suite is laid out by the area it tests (issue 29), not by kind: each folder under tests/ is
a package of ours (its tests beside each other), or one of the few cross-cutting areas named
here. A test file's name is unique across the suite (pytest imports them by path, and a reader
finds one by name)."""

import collections
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
CROSS_CUTTING = {
    "e2e": "whole flows through real CLIs against a real stack",
    "security": "attacks on a real stack",
    "distributed": "the trainer's ranks under torchrun",
    "house": "the house's own rules (imports, rooms, lint, the suite)",
}


def _packages() -> set[str]:
    roots = [REPO, REPO / "services"]
    return {p.name for root in roots for p in root.iterdir() if (p / "__init__.py").is_file()}


def test_every_test_folder_is_an_area_of_the_code_or_a_named_cross_cutting_one():
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    strays = folders - _packages() - set(CROSS_CUTTING)
    assert not strays, f"test folders named for no area: {sorted(strays)}"
    assert not {"unit", "services"} & folders  # sorted by kind no more


def test_no_test_lies_loose_at_the_top():
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []


def test_test_file_names_are_unique_across_the_suite():
    names = collections.Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []
