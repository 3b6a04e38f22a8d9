"""One home for settings (issue 44): every `ITO_*` environment variable's name is written once, in
runtime/configuration/settings.py, or in contracts/environment.py for the few the client (`ecc`,
which may import only contracts) reads too and settings takes over as its own. Anywhere else in the
product a name is imported, never spelled: a string that starts with "ITO_" elsewhere is a second
home for one fact, and the two drift (the trainer's model store once lost settings' `.absolute()`).

Docstrings and comments may name the variables (they explain them); the tests may spell them (they
check the public names). An f-string or a concatenation that builds a name counts where its start
is literal."""

import ast
import collections
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = (
    "contracts",
    "domain",
    "runtime",
    "training",
    "services",
    "ops",
    "ecc",
    "devstack",
    "chaos",
    "bench",
)
HOMES = (pathlib.Path("runtime/configuration/settings.py"), pathlib.Path("contracts/environment.py"))
PREFIX = "ITO_"


def head(node: ast.expr) -> tuple[str, bool]:
    """The literal text a string expression surely starts with, and whether that is all of it."""
    if isinstance(node, ast.Constant):
        return (node.value, True) if isinstance(node.value, str) else ("", False)
    if isinstance(node, ast.FormattedValue):  # f"{'ITO_'}X": a literal inside braces, nothing else
        if node.conversion == -1 and node.format_spec is None:
            return head(node.value)
        return "", False
    if isinstance(node, ast.JoinedStr):
        parts = [head(value) for value in node.values]
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        parts = [head(node.left), head(node.right)]
    else:
        return "", False
    text = ""
    for part, whole in parts:
        text += part
        if not whole:
            return text, False
    return text, True


def spelled(source: str) -> list[tuple[int, str]]:
    """(line, start of the name) of every `ITO_*` name `source` spells outside a docstring."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # a docstring (of a module, class, function or attribute): it explains, it sets nothing
        if isinstance(node, ast.Constant | ast.JoinedStr | ast.BinOp):
            text, _ = head(node)
            if text.startswith(PREFIX):
                found.append((node.lineno, text))
                return  # its parts would only say it again
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def offenders(root: pathlib.Path) -> list[str]:
    """`path:line: name` for each `ITO_*` name spelled in a product module outside its homes."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            if relative in HOMES:
                continue
            out += [f"{relative}:{line}: {text}" for line, text in spelled(path.read_text())]
    return out


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('ENV_DIR = "ITO_SUITE_TIMES_DIR"\n', [(1, "ITO_SUITE_TIMES_DIR")]),
        ('env = {"ITO_TRAINER_THREADS": "1"}\n', [(1, "ITO_TRAINER_THREADS")]),
        ('os.environ.get("ITO_MODEL_STORE") or "x"\n', [(1, "ITO_MODEL_STORE")]),
        ('name = f"ITO_{kind}_URL"\n', [(1, "ITO_")]),
        ('name = "ITO" + "_NATS_URL"\n', [(1, "ITO_NATS_URL")]),
        ('name = "ITO_" + suffix\n', [(1, "ITO_")]),
        ('name = "ITO_%s" % suffix\n', [(1, "ITO_%s")]),
        ("name = f\"{'ITO'}_NATS_CA\"\n", [(1, "ITO_NATS_CA")]),
        ('"""ITO_NATS_URL wins whole."""\n', []),
        ('def f():\n    """ITO_NATS_URL wins whole."""\n', []),
        ('class C:\n    x: int\n    """ITO_FILE_ROOT: where refs point."""\n', []),
        ("x = 1  # ITO_NATS_URL in a comment\n", []),
        ('message = f"set {ENV_NATS_URL} to the address"\n', []),
        ('message = "see ITO_NATS_CA"\n', []),  # a mention inside a sentence, not a name being set
        ("name = prefix + suffix\n", []),
    ],
    ids=[
        "constant",
        "dict-key",
        "call",
        "f-string",
        "concatenated",
        "concatenated-head",
        "percent",
        "braced-literal",
        "module-docstring",
        "function-docstring",
        "attribute-docstring",
        "comment",
        "f-string-of-a-constant",
        "mention",
        "no-literal",
    ],
)
def test_the_checker_sees_a_name_spelled(source, expected):
    assert spelled(source) == expected


def test_the_checker_catches_a_literal_in_a_product_file_and_only_there(tmp_path):
    files = {
        "services/trainer/restore.py": 'ENV_MODEL_STORE = "ITO_MODEL_STORE"\n',  # the one issue 44 found
        "ecc/connection.py": 'ENV_NATS_URL = "ITO_NATS_URL"\n',
        "runtime/configuration/settings.py": 'ENV_MODEL_STORE = "ITO_MODEL_STORE"\n',  # the home
        "contracts/environment.py": 'ENV_NATS_URL = "ITO_NATS_URL"\n',  # the client's share of it
        "tests/trainer/test_x.py": 'env = {"ITO_TRAINER_THREADS": "1"}\n',  # tests may spell names
    }
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    assert offenders(tmp_path) == [
        "services/trainer/restore.py:1: ITO_MODEL_STORE",
        "ecc/connection.py:1: ITO_NATS_URL",
    ]


def test_no_setting_name_is_spelled_outside_its_home():
    assert offenders(REPO) == []


def test_the_homes_spell_each_name_once():
    # the checker reads the homes too: a home it could not read would pass every module above
    names = [text for home in HOMES for _, text in spelled((REPO / home).read_text())]
    assert {"ITO_NATS_URL", "ITO_DATA_DIR", "ITO_MODEL_STORE", "ITO_GANG_MAX_REQUEUES"} <= set(names)
    assert [n for n, count in collections.Counter(names).items() if count > 1] == []
