"""The trainer's house (issue 29): a few rooms on a few floors, every import pointing down.

services/trainer/ was one flat folder of 27 modules, 12 floors deep, whose async agent, rank launcher,
torch internals and recipes sat side by side. Now each module lives in the room of what it does, and
a room imports only from itself and from the floors below it (lazy imports count): the agent (the
service) on top; then how ranks start (`launch`) and a trained run's outputs (`outputs`); the
recipes; the engine every recipe uses; weights in and out, and data; the model at the bottom."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAINER = REPO / "services" / "trainer"
FLOORS = {
    "agent": 0,
    "launch": 1,
    "outputs": 1,
    "recipes": 2,
    "engine": 3,
    "weights": 4,
    "data": 4,
    "model": 5,
}


def room(module: str) -> str:
    """`services.trainer.<room>[.<name>]` -> its room (`model` is a room of one module)."""
    return module.split(".")[2]


def trainer_imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("services.trainer.")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "services.trainer":
                found |= {f"services.trainer.{a.name}" for a in node.names}
            elif node.module.startswith("services.trainer."):
                found.add(node.module)
    return found


def modules() -> dict[str, pathlib.Path]:
    return {
        ".".join(p.relative_to(REPO).with_suffix("").parts): p
        for p in TRAINER.rglob("*.py")
        if p.name != "__init__.py"
    }


def test_every_trainer_module_lives_in_a_room():
    loose = [m for m in modules() if room(m) not in FLOORS]
    assert loose == [], f"modules outside the trainer's rooms: {loose}"
    flat = [p.name for p in TRAINER.glob("*.py") if p.name not in ("__init__.py", "model.py")]
    assert flat == [], f"modules on the trainer's floor itself: {flat}"


def test_no_import_points_up_or_sideways_between_rooms_of_one_floor():
    upward = []
    for name, path in sorted(modules().items()):
        for target in sorted(trainer_imports(path)):
            mine, theirs = room(name), room(target)
            if theirs == mine:
                continue
            if FLOORS[theirs] <= FLOORS[mine]:
                upward.append(f"{name} -> {target}")
    assert upward == [], "imports that point up (or across a floor):\n" + "\n".join(upward)


def test_the_check_sees_an_arrow_back_up(tmp_path):
    # a test that cannot fail is a defect: an engine module importing a recipe is caught
    bad = tmp_path / "loop.py"
    bad.write_text("def f():\n    from services.trainer.recipes import pretrain\n")
    (target,) = trainer_imports(bad)
    assert FLOORS[room(target)] < FLOORS["engine"]
