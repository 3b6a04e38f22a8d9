"""The README's "Your first run", exactly as written: every command of its shell block, in order,
from `make up` to `make down`, with nothing set but what the block itself exports. A person who
follows it reaches a downloaded model that transformers loads; if a command in the README stops
working (a renamed flag, a connection `ecc` cannot find, a verb that answers differently), this test
fails on that line.

The only substitutions are the ones the README asks the reader to make: the API key `accounts
create` printed goes into `ecc ito login`'s prompt, `REF` and `RUN` become the confirmation ref and
the run id the earlier steps printed, and `/tmp/` becomes this test's own directory (so two runs
never share files). HOME and the data directory point into the test's directory too, so the
connection file and credentials `up` and `login` write are this test's alone.
"""

import os
import pathlib
import re
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 300  # the longest step is `status --follow` over the tiny run
EXPORT_READY_S = 180


def first_run_commands(readme: str) -> list[str]:
    """The commands of the first ```sh block under "## Your first run", comments and blanks dropped."""
    section = readme.split("\n## Your first run", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_the_block_is_the_walkthrough_it_promises() -> None:
    """The block covers the whole first hour: up, account, login, booking, manifest, plan, confirm,
    train, follow, export, download, down (a README edit that drops a step fails here first)."""
    commands = first_run_commands((ROOT / "README.md").read_text())
    joined = "\n".join(commands)
    for step in (
        "make up",
        "ito-training accounts create",
        "ecc ito login",
        "simulate-booking",
        "ecc ito files upload",  # issue 39: a remote user's data goes up through the API
        "ecc ito validate",
        "ecc ito plan",
        "ecc ito confirm",
        "ecc ito train",
        "--follow",
        "ecc ito export",
        "ecc ito download",
        "make down",
    ):
        assert step in joined, step
    assert joined.index("make up") < joined.index("ecc ito train") < joined.index("make down")
    assert joined.index("ecc ito files upload") < joined.index("ecc ito plan")
    assert "file:" not in joined  # no path on the server is named: `file:` is the operator's option


def _run(line: str, env: dict[str, str], stdin: str | None, env_file: pathlib.Path) -> str:
    """One README line in bash, in the repository, with the environment the earlier lines left
    (an `export` persists, as it would in the reader's shell)."""
    script = f"{line}\nenv -0 > {env_file}\n"
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"README line failed (rc {done.returncode}): {line}\n{out[-4000:]}"
    env.clear()
    env.update(
        dict(item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)  # type: ignore[misc]
    )
    return out


@pytest.mark.timeout(900)
def test_a_new_user_following_the_readme_reaches_a_model_transformers_loads(tmp_path: pathlib.Path) -> None:
    commands = first_run_commands((ROOT / "README.md").read_text())
    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ITO_", "ECC_", "XDG_")) and k not in ("VIRTUAL_ENV",)
    }
    env.update(HOME=str(home), ITO_DATA_DIR=str(tmp_path / "ito"))
    env_file = tmp_path / "env"
    api_key = ref = run_id = None
    try:
        for raw in commands:
            line = raw.replace("/tmp/", f"{tmp_path}/")
            if ref is not None:
                line = re.sub(r"\bREF\b", ref, line)
            if run_id is not None:
                line = re.sub(r"\bRUN\b", run_id, line)
            stdin = api_key + "\n" if line.startswith("ecc ito login") and api_key else None
            if line.startswith("ecc ito export"):  # "ask again until it says ready"
                deadline = time.monotonic() + EXPORT_READY_S
                while "ready" not in (out := _run(line, env, stdin, env_file)):
                    assert "failed" not in out, out
                    assert time.monotonic() < deadline, f"export not ready in {EXPORT_READY_S} s: {out}"
                    time.sleep(1)
                continue
            out = _run(line, env, stdin, env_file)
            if "accounts create" in line:
                found = re.search(r"API key \(shown once\) (\S+)", out)
                assert found, out
                api_key = found.group(1)
            if line.startswith("ecc ito confirm"):
                found = re.search(r"confirmation_ref: (cf_\S+)", out)
                assert found, out
                ref = found.group(1)
            if line.startswith("ecc ito train"):
                found = re.search(r"\b(run_[0-9a-f]{8,})\b", out)
                assert found, out
                run_id = found.group(1)
            if "--follow" in line:
                assert "succeeded" in out, out[-3000:]
            if line.startswith("ecc ito runs"):
                assert run_id is not None and run_id in out, out
    finally:
        subprocess.run(
            [str(ROOT / ".venv/bin/ito-training"), "down"],
            cwd=ROOT,
            env={**env, "ITO_DATA_DIR": str(tmp_path / "ito")},
            capture_output=True,
            timeout=60,
        )
    model_dir = tmp_path / "my-model"
    assert (model_dir / "config.json").is_file()
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert model.num_parameters() > 0
