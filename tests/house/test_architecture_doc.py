"""docs/architecture.md keeps up with the house (issue 44): it named `liveness.TIMERS` long after
the timers moved, claimed no service imported another while the desk imported telemetry, and its
Layout was one paragraph. Now its Layout has a row per top-level folder, and every module path it
names in backticks exists."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"


def top_level_packages() -> set[str]:
    return {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"}


def layout_rows(text: str) -> set[str]:
    layout = text[text.index("## Layout") :]
    return {m for row in re.findall(r"^\| (.+?) \|", layout, re.M) for m in re.findall(r"`(\w+)/`", row)}


def test_the_layout_has_a_row_for_every_top_level_package():
    assert top_level_packages() - layout_rows(DOC.read_text()) == set()


def test_every_python_path_the_page_names_exists():
    named = set(
        re.findall(
            r"\b((?:contracts|domain|runtime|training|services|ops|ecc|devstack|chaos)/[\w/]+\.py)",
            DOC.read_text(),
        )
    )
    assert named, "the page names no module: the check would pass on anything"
    assert sorted(p for p in named if not (REPO / p).is_file()) == []


def test_the_row_check_sees_a_missing_folder():
    assert layout_rows("## Layout\n| `domain/` | rules |\n| `ecc/`, `bench/` | x |\n") == {
        "domain",
        "ecc",
        "bench",
    }
