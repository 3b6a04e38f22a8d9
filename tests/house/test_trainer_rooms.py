"""The training library's house (issues 29, 44): a few rooms on a few floors, every import pointing down.

The torch library lived inside the trainer service (services/trainer/, 12 floors deep in one flat
folder once, then rooms beside the agent). Now it is `training/`, a top-level package, and each
module lives in the room of what it does; a room imports only from itself and from the floors below
it (lazy imports count): how ranks start (`launch`); the recipes; the engine every recipe uses;
weights in and out, and data; the model at the bottom. The service (services/trainer) sits above
them all and is no room of the library."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAINING = REPO / "training"
FLOORS = {
    "launch": 1,
    "recipes": 2,
    "engine": 3,
    "weights": 4,
    "data": 4,
    "model": 5,
}


def room(module: str) -> str:
    """`training.<room>[.<name>]` -> its room (`model` is a room of one module)."""
    return module.split(".")[1]


def training_imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("training.")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "training":
                found |= {f"training.{a.name}" for a in node.names}
            elif node.module.startswith("training."):
                found.add(node.module)
    return found


def modules() -> dict[str, pathlib.Path]:
    return {
        ".".join(p.relative_to(REPO).with_suffix("").parts): p
        for p in TRAINING.rglob("*.py")
        if p.name != "__init__.py"
    }


def test_every_training_module_lives_in_a_room():
    loose = [m for m in modules() if room(m) not in FLOORS]
    assert loose == [], f"modules outside the library's rooms: {loose}"
    flat = [p.name for p in TRAINING.glob("*.py") if p.name not in ("__init__.py", "model.py")]
    assert flat == [], f"modules on the library's floor itself: {flat}"


def test_the_trainer_service_holds_no_room_of_the_library():
    # issue 44: the service is one flat room (app, worker, events, outputs); torch's rooms are in training/
    nested = sorted(
        p.name for p in (REPO / "services" / "trainer").iterdir() if p.is_dir() and p.name != "__pycache__"
    )
    assert nested == []


def test_no_import_points_up_or_sideways_between_rooms_of_one_floor():
    upward = []
    for name, path in sorted(modules().items()):
        for target in sorted(training_imports(path)):
            mine, theirs = room(name), room(target)
            if theirs == mine:
                continue
            if FLOORS[theirs] <= FLOORS[mine]:
                upward.append(f"{name} -> {target}")
    assert upward == [], "imports that point up (or across a floor):\n" + "\n".join(upward)


def test_the_check_sees_an_arrow_back_up(tmp_path):
    # a test that cannot fail is a defect: an engine module importing a recipe is caught
    bad = tmp_path / "loop.py"
    bad.write_text("def f():\n    from training.recipes import pretrain\n")
    (target,) = training_imports(bad)
    assert FLOORS[room(target)] < FLOORS["engine"]
